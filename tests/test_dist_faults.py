"""Tensor-parallel faults (issue #34): a rank that dies at start, at import or mid-run fails the caller within
seconds naming the rank, its exit code and its last error; SIGINT on rank 0 during generate stops the call at a
step boundary and the group goes on; every call on a broken or closed group raises DistributedError. CPU, gloo;
every test bounded in time (nothing may wait for a 600 s rendezvous)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import attnzoo
import dist_fault_ranks
from attnzoo.engine import tensor_parallel
from attnzoo.engine.ranks import LocalRanks
from attnzoo.errors import DistributedError
from helpers import random_prompts, save_checkpoint

REPO = Path(__file__).resolve().parents[1]
VOCAB = 160
PROMPTS = random_prompts(VOCAB, [5, 9, 13], seed=4)
START_S = 30  # a spawned rank's imports take seconds; a dead one must fail the caller well before this


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return save_checkpoint(LlamaForCausalLM(cfg).eval(), tmp_path_factory.mktemp("llama"))


def _run_bounded(argv: list, timeout: float, stdin: str | None = None) -> tuple[int, str]:
    """(exit code, stdout + stderr) of a command; it and every process it started are killed at ``timeout``."""
    job = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else None, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=REPO, start_new_session=True,
                           env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    try:
        text, _ = job.communicate(stdin, timeout=timeout)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return job.returncode, text


def _load(path, **kw):
    return attnzoo.load_model(path, device="cpu", backend="torch", page_size=4, kv_cache_tokens=512, **kw)


def _tokens(llm, n=24):
    return [o.token_ids for o in llm.generate(PROMPTS, max_new_tokens=n, ignore_eos=True)]


def _on_step(llm, k: int, action) -> None:
    """Run ``action`` on rank 0 just before its k-th step goes out (a step boundary, deterministic)."""
    channel, seen = llm.tp.channel, [0]
    broadcast = channel.broadcast

    def hooked(message):
        if message[1] == "step":
            seen[0] += 1
            if seen[0] == k:
                action()
        return broadcast(message)

    channel.broadcast = hooked


# ---------------------------------------------------------------------------------------- start


def test_store_listens_on_loopback_only():
    ranks = LocalRanks(1, None, ())  # no other ranks: the store alone
    try:
        assert ranks._listener.getsockname()[0] == "127.0.0.1"
    finally:
        ranks.terminate()


@pytest.mark.parametrize("target, want", [
    (dist_fault_ranks.die_at_start, r"rank 1 \(pid \d+\) was killed by SIGKILL"),
    (dist_fault_ranks.raise_at_start, r"rank 1 \(pid \d+\) exited with code 1; its last error: ValueError: rank 1 "
                                      r"fails on purpose"),
])
def test_rank_dying_at_start_fails_fast(target, want):
    t0 = time.monotonic()
    ranks = LocalRanks(2, target, ())
    try:
        with pytest.raises(DistributedError, match=want) as e:
            ranks.wait_joined(timeout=START_S)
    finally:
        ranks.terminate()
    assert e.value.rank == 1 and time.monotonic() - t0 < START_S


def test_rank_failing_to_import_fails_fast(monkeypatch):
    monkeypatch.setenv("ATTNZOO_TEST_FAIL_IMPORT", "1")  # spawned ranks inherit it; this process imported already
    ranks = LocalRanks(2, dist_fault_ranks.check_in, ())
    try:
        with pytest.raises(DistributedError, match="exited with code 1; its last error: ImportError: "
                                                   "dist_fault_ranks: this import fails on purpose"):
            ranks.wait_joined(timeout=START_S)
    finally:
        ranks.terminate()


@pytest.mark.parametrize("how, want", [
    ("stdin", "exited with code 1; its last error: FileNotFoundError: [Errno 2] No such file or directory: "),
    ("no guard", "exited with code 1; its last error: attnzoo.errors.ModelLoadError: this spawned rank ran the main "
                 "script's load_model while importing it (the script has no `if __name__ == '__main__':` guard)"),
])
def test_script_whose_ranks_cannot_start_fails_fast_naming_the_rank(llama, tmp_path, how, want):
    """`python - < script.py` (a spawned rank cannot import the main module, <stdin>), or a script without
    the `__main__` guard (each spawned rank would start ranks of its own)."""
    script = textwrap.dedent(f"""
        import attnzoo
        attnzoo.load_model({str(llama)!r}, device="cpu", backend="torch", tensor_parallel_size=2)
        """)
    (tmp_path / "script.py").write_text(script)
    t0 = time.monotonic()
    argv = [sys.executable, "-"] if how == "stdin" else [sys.executable, str(tmp_path / "script.py")]
    code, text = _run_bounded(argv, 60, stdin=script if how == "stdin" else None)
    assert code != 0 and time.monotonic() - t0 < 60
    last = text.strip().splitlines()[-1]
    assert last.startswith("attnzoo.errors.DistributedError: tensor-parallel rank 1"), text[-2000:]
    assert want in last


# ---------------------------------------------------------------------------------------- running


def test_interrupt_stops_at_a_step_and_the_group_goes_on(llama):
    llm = _load(llama, tensor_parallel_size=2)
    try:
        ref = _tokens(llm)
        free = llm.engine.allocator.num_free
        # A terminal's Ctrl-C reaches every process of the group: the spawned rank ignores it, rank 0 stops.
        _on_step(llm, 3, lambda: [os.kill(pid, signal.SIGINT) for pid in (llm.tp.workers[0].pid, os.getpid())])
        with pytest.raises(KeyboardInterrupt):
            _tokens(llm)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert llm.engine.allocator.num_free == free  # the abandoned requests' KV pages are back
        assert _tokens(llm) == ref  # rank 1 dropped the abandoned step's tables too
        # A second interrupt stops the step at once: the group is closed, with a named error.
        _on_step(llm, 2, lambda: (os.kill(os.getpid(), signal.SIGINT), os.kill(os.getpid(), signal.SIGINT)))
        with pytest.raises(KeyboardInterrupt):
            _tokens(llm)
        with pytest.raises(DistributedError, match="second interrupt"):
            _tokens(llm)
        assert all(not p.is_alive() for p in llm.tp.workers)
    finally:
        llm.close()
    with pytest.raises(DistributedError, match="closed"):
        llm.logits(PROMPTS[0])


def test_rank_killed_mid_run_fails_fast_and_every_later_call(llama):
    llm = _load(llama, tensor_parallel_size=2)
    try:
        worker = llm.tp.workers[0]
        _on_step(llm, 2, lambda: os.kill(worker.pid, signal.SIGKILL))
        t0 = time.monotonic()
        with pytest.raises(DistributedError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL") as e:
            _tokens(llm)
        assert e.value.rank == 1 and e.value.exitcode == -signal.SIGKILL and time.monotonic() - t0 < 10
        for call in (lambda: _tokens(llm), lambda: llm.logits(PROMPTS[0])):
            with pytest.raises(DistributedError, match="killed by SIGKILL.*; the group is closed"):
                call()
    finally:
        llm.close()
    # The group was torn down: a new one starts in this process.
    again = _load(llama, tensor_parallel_size=2)
    try:
        assert len(_tokens(again, 4)) == len(PROMPTS)
    finally:
        again.close()
    with pytest.raises(DistributedError, match=r"closed \(llm.close\(\)\)"):
        again.generate(PROMPTS[0])


# ---------------------------------------------------------------------------------------- torchrun


def test_torchrun_rank_killed_mid_run_fails_the_job_naming_it(llama, tmp_path):
    """Every rank runs the script; rank 1 dies after the first call: rank 0's next call fails with a
    DistributedError, unless torchrun stopped it first (it stops the others when one fails), and torchrun
    exits non-zero naming rank 1; nothing hangs."""
    script = tmp_path / "tp.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal
        import attnzoo
        from attnzoo.errors import DistributedError

        if __name__ == "__main__":
            llm = attnzoo.load_model({str(llama)!r}, device="cpu", backend="torch", page_size=4, kv_cache_tokens=512)
            llm.generate([[5, 6, 7]], max_new_tokens=2)
            if os.environ["RANK"] == "1":
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                llm.generate([[5, 6, 7]], max_new_tokens=64, ignore_eos=True)
            except DistributedError as e:
                print("rank 0 named error:", e, flush=True)
                raise SystemExit(3)
        """))
    t0 = time.monotonic()
    code, text = _run_bounded([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                               str(script)], 90)
    assert code != 0, text[-3000:]
    assert "local_rank: 1" in text and "exitcode  : -9" in text, text[-3000:]
    assert time.monotonic() - t0 < 90
