"""Reliability (issue 18): nothing lost on a failed report write, generate safe under threads, every bad input named
before any work, saved-report settings checked, non-finite logits stopped, per-request seeds (first contact:
test_first_contact.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import attnzoo
from attnzoo.errors import BackendError, EvalError, ModelLoadError, NumericsError, RequestError, WeightError
from helpers import random_prompts, save_checkpoint
from reliability_helpers import hf_model, llm, tiny_dir  # noqa: F401  (fixtures: used by name)

REPO = Path(__file__).resolve().parents[1]


def _copy(tiny_dir, tmp_path) -> Path:
    d = tmp_path / "ck"
    shutil.copytree(tiny_dir, d)
    return d


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if any weight is read: the error had to come first."""
    from attnzoo.models import loader

    def trap(*a, **k):
        raise AssertionError("weights were read before the input was validated")

    monkeypatch.setattr(loader, "iter_weights", trap)


# ------------------------------------------------------------------------------ 1. run_eval --output


def _report(n: int = 3) -> dict:
    return {"format": 1, "run": {"tasks": {"gsm8k": {"per_question": [{"doc_id": i} for i in range(n)]}}}}


def test_report_write_failure_keeps_the_previous_report(tmp_path, monkeypatch):
    from attnzoo.evals import run_eval

    out = tmp_path / "report.json"
    run_eval.write_report(out, _report(1))
    good = out.read_text()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "rescue"))
    (tmp_path / "rescue").mkdir()
    monkeypatch.setattr(run_eval.tempfile, "tempdir", None)  # re-read TMPDIR

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(EvalError) as e:
        run_eval.write_report(out, _report(5))
    msg = str(e.value)
    assert "No space left on device" in msg and "previous report there is unchanged" in msg and "Fix:" in msg
    assert out.read_text() == good  # the earlier report survives
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "rescue"]  # no temp file left
    (rescued,) = (tmp_path / "rescue").iterdir()
    assert str(rescued) in msg and json.loads(rescued.read_text()) == _report(5)  # the run is not lost
    monkeypatch.undo()
    run_eval.write_report(out, _report(5))
    assert json.loads(out.read_text()) == _report(5) and oct(out.stat().st_mode & 0o777) == oct(0o644)


def test_report_write_into_a_directory_that_cannot_take_the_file(tmp_path):
    """A file-size limit (RLIMIT_FSIZE, as a full small filesystem) makes every write past 4 KiB fail."""
    out = tmp_path / "report.json"
    out.write_text('{"previous": true}')
    script = textwrap.dedent(f"""
        import resource, signal
        from pathlib import Path
        from attnzoo.errors import EvalError
        from attnzoo.evals.run_eval import write_report
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            write_report(Path({str(out)!r}), {{"big": "x" * 100000}})
        except EvalError as e:
            print(e)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "cannot write the report" in res.stdout and "Fix:" in res.stdout
    assert out.read_text() == '{"previous": true}'
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_report_folder_removed_mid_run_is_rescued(tmp_path):
    from attnzoo.evals import run_eval

    out = tmp_path / "gone" / "r.json"
    out.parent.mkdir()
    checked = run_eval.check_output_path(str(out))
    out.parent.rmdir()  # the folder disappears while the evaluation runs
    with pytest.raises(EvalError, match="the report was saved to") as e:
        run_eval.write_report(checked, _report(2))
    rescued = Path(str(e.value).split("saved to ")[1].split(". Fix")[0])
    assert json.loads(rescued.read_text()) == _report(2)
    rescued.unlink()


def test_main_prints_the_summary_before_writing(tmp_path, monkeypatch, capsys):
    from attnzoo.evals import report as report_mod
    from attnzoo.evals import run_eval

    calls = []
    monkeypatch.setattr(run_eval, "run", lambda args, write=True: calls.append(write) or _report())
    monkeypatch.setattr(report_mod, "render", lambda rep, per_question_rows=False: "SUMMARY")

    def failing(path, rep):
        raise EvalError("cannot write the report to X", fix="free space")

    monkeypatch.setattr(run_eval, "write_report", failing)
    assert run_eval.main(["gsm8k", "--output", str(tmp_path / "r.json")]) == 2
    captured = capsys.readouterr()
    assert calls == [False] and "SUMMARY" in captured.out and "cannot write the report" in captured.err


# ------------------------------------------------------------------------------ 2. threads


def test_generate_from_several_threads_equals_one_at_a_time(tiny_dir):
    # A small KV cache and shared prefixes: unguarded concurrent calls over-commit the cache
    # (KVCacheFullError) or wait on prefix pages another call owns ("a step with no work").
    llm = attnzoo.load_model(tiny_dir, backend="torch", dtype="float32", page_size=4, kv_cache_tokens=96)
    prefix = random_prompts(160, [13], seed=20)[0]
    jobs = [[prefix + t for t in random_prompts(160, [2, 5, 3], seed=21 + k)] for k in range(4)]
    want = [[c.token_ids for c in llm.generate([p], max_new_tokens=6, ignore_eos=True)] for job in jobs for p in job]
    got: dict[int, list] = {}
    errors = []
    start = threading.Barrier(len(jobs))

    def work(k):
        try:
            start.wait()
            got[k] = [c.token_ids for c in llm.generate(jobs[k], max_new_tokens=6, ignore_eos=True)]
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [tok for k in range(len(jobs)) for tok in got[k]] == [w[0] for w in want]
    assert llm.engine.allocator.num_free + llm.engine.prefix_cache.evictable() == llm.engine.allocator.capacity


# ------------------------------------------------------------------------------ 3. named errors


def test_truncated_safetensors(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightError) as e:
        attnzoo.load_model(d)
    assert "model.safetensors" in str(e.value) and "truncated" in str(e.value) and "re-download" in str(e.value)


def test_malformed_safetensors_index(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    (d / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model.safetens')
    with pytest.raises(WeightError) as e:
        attnzoo.load_model(d)
    assert "model.safetensors.index.json" in str(e.value) and "Fix:" in str(e.value)


def test_truncated_gguf(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_context_length, 64), (w.add_embedding_length, 32), (w.add_block_count, 1),
                   (w.add_feed_forward_length, 64), (w.add_head_count, 2), (w.add_head_count_kv, 1),
                   (w.add_rope_dimension_count, 16), (w.add_layer_norm_rms_eps, 1e-5)):
        add(v)
    w.add_tensor("token_embd.weight", np.zeros((100, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightError) as e:
        attnzoo.load_model(path)
    assert "tiny.gguf" in str(e.value) and "truncated" in str(e.value) and "re-download" in str(e.value)


def test_zero_kv_heads_in_config(tiny_dir, tmp_path, no_weights):
    d = _copy(tiny_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_key_value_heads"] = 0
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="num_key_value_heads must be a positive integer, got 0"):
        attnzoo.load_model(d)
    cfg["num_key_value_heads"] = 3  # 4 heads: not a multiple
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="not a multiple of num_key_value_heads=3"):
        attnzoo.load_model(d)


@pytest.mark.parametrize("device", ["tpu9", "mps", 3.5])
def test_bad_device(tiny_dir, no_weights, device):
    with pytest.raises(ModelLoadError) as e:
        attnzoo.load_model(tiny_dir, device=device)
    assert repr(device) in str(e.value) and "device='cpu'" in str(e.value)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(seed="abc"), "seed"), (dict(seed=1.5), "seed"), (dict(seed=2**70), "seed"), (dict(seed=True), "seed"),
    (dict(seed=-1), "seed"), (dict(stop=123), "stop"), (dict(stop=[""]), "stop"), (dict(temperature="0.5"), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(max_new_tokens=True), "max_new_tokens"), (dict(top_k=True), "top_k"), (dict(top_p="1"), "top_p"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_new_tokens=-1), "min_new_tokens"),
    (dict(do_sample="yes"), "do_sample"), (dict(num_beams=4), "num_beams"),
    (dict(max_length=10, max_new_tokens=5), "max_length"), (dict(max_length=2), "max_length"),
    (dict(stop="a", stop_strings="b"), "stop_strings"), (dict(seed=[1, 2, 3]), "seed"),
    (dict(num_return_sequences=2), "num_return_sequences"), (dict(num_return_sequences=0), "num_return_sequences"),
])
def test_bad_generate_arguments_are_named_before_work(llm, monkeypatch, kwargs, needle):
    monkeypatch.setattr(llm.engine, "generate", lambda *a, **k: pytest.fail("work started"))
    with pytest.raises(RequestError) as e:
        llm.generate([[5, 6, 7], [8, 9]], **kwargs)
    assert needle in str(e.value) and "Fix:" in str(e.value)


@pytest.mark.parametrize("prompts", [None, 42, [[5, True]], [True, 5], [[]], [""]])
def test_bad_prompts(llm, prompts):
    with pytest.raises(RequestError) as e:
        llm.generate(prompts, max_new_tokens=2)
    assert "Fix:" in str(e.value)


@pytest.mark.parametrize("prompt, bad", [([5, -1, 6], -1), ((5, 6, 10**9), 10**9), ([2**70], 2**70)])
def test_token_ids_outside_the_vocabulary_are_named(llm, prompt, bad):
    with pytest.raises(RequestError, match=f"token id {bad} is outside the vocabulary") as e:
        llm.generate([[5, 6], prompt], max_new_tokens=2)
    assert "Fix:" in str(e.value)


def test_chat_messages_need_role_and_content(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", "{% for m in messages %}{{ m['content'] }} {% endfor %}",
                        raising=False)
    for bad in ([{"content": "w5"}], [{"role": "user"}], [{"role": "user", "content": 5}]):
        with pytest.raises(RequestError, match="chat message 0") as e:
            llm.generate([bad], max_new_tokens=2)
        assert "'role'" in str(e.value) and "Fix:" in str(e.value)
    assert len(llm.generate([[{"role": "user", "content": "w5 w6"}]], max_new_tokens=2)[0].token_ids) >= 1


@pytest.mark.parametrize("kwargs", [dict(max_running=True), dict(kv_cache_tokens=True), dict(seed="x"),
                                    dict(cuda_graph="yes")])
def test_bad_load_arguments(tiny_dir, no_weights, kwargs):
    with pytest.raises(ModelLoadError, match=next(iter(kwargs))):
        attnzoo.load_model(tiny_dir, **kwargs)


# ------------------------------------------------------------------------------ 4. --compare-to a saved report


@pytest.fixture(scope="module")
def eval_setup(tiny_dir, tmp_path_factory):
    pytest.importorskip("lm_eval")
    d = tmp_path_factory.mktemp("gsm8k_rel")
    for name in ("train", "test"):
        docs = [{"question": f"w{5 + i} w{6 + i}?", "answer": f"w{7 + i} #### {i}"} for i in range(4)]
        (d / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    return str(tiny_dir), str(d)


_DECISION = {"prefill_backend": "torch", "decode_backend": "torch", "page_size": 16}


def _record(doc_id: int) -> dict:
    """One question's record as run_eval --output saves it."""
    return {"doc_id": doc_id, "prompt_hash": "ab", "target": "1", "answers": {"strict-match": "1"},
            "correct": {"strict-match": True}, "response": "w5 #### 1", "output_token_ids": [5, 6]}


def _saved(tmp_path, model, **settings) -> Path:
    base = {"task": "gsm8k", "limit": 2, "num_fewshot": 1, "apply_chat_template": False, "max_new_tokens": 8}
    base.update(settings)
    rep = {"format": 1, "run": {"model": model, "settings": base, "decision": _DECISION,
                                "tasks": {"gsm8k": {"per_question": [_record(0), _record(1)]}}}}
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(rep))
    return path


@pytest.mark.parametrize("change, needle", [
    (dict(model="other/model"), "model"), (dict(limit=3), "limit"), (dict(num_fewshot=5), "--num-fewshot"),
    (dict(max_new_tokens=16), "--max-new-tokens"), (dict(apply_chat_template=True), "--apply-chat-template"),
])
def test_compare_to_a_report_with_other_settings_is_refused(eval_setup, tmp_path, monkeypatch, change, needle):
    from attnzoo.evals import run_eval

    model, data = eval_setup
    monkeypatch.setattr(attnzoo, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    argv = ["gsm8k", "--model", model, "--data-dir", data, "--limit", "2", "--num-fewshot", "1",
            "--max-new-tokens", "8", "--device", "cpu"]
    saved = _saved(tmp_path, change.pop("model", model), **change)
    with pytest.raises(EvalError) as e:
        run_eval.run(run_eval.build_parser().parse_args(argv + ["--compare-to", str(saved)]))
    assert needle in str(e.value) and "Fix:" in str(e.value)


def test_compare_to_a_matching_report_gets_past_validation(eval_setup, tmp_path, monkeypatch):
    from attnzoo.evals import run_eval

    model, data = eval_setup

    def reached(*a, **k):
        raise RuntimeError("validation passed")

    monkeypatch.setattr(attnzoo, "load_model", reached)
    argv = ["gsm8k", "--model", model, "--data-dir", data, "--limit", "2", "--num-fewshot", "1",
            "--max-new-tokens", "8", "--device", "cpu", "--compare-to", str(_saved(tmp_path, model))]
    with pytest.raises(RuntimeError, match="validation passed"):
        run_eval.run(run_eval.build_parser().parse_args(argv))


# ------------------------------------------------------------------------------ 5. stop strings without a tokenizer


def test_stop_strings_without_tokenizer_fail_before_work(hf_model, tmp_path, monkeypatch):
    d = save_checkpoint(hf_model, tmp_path / "notok", with_tokenizer=False)
    llm = attnzoo.load_model(d, backend="torch", page_size=4)
    monkeypatch.setattr(llm.engine.runner, "launch", lambda *a, **k: pytest.fail("a step ran"))
    for kw in (dict(stop=["w5"]), dict(stop_strings="w5")):
        with pytest.raises(RequestError, match="no tokenizer|has none"):
            llm.generate([[5, 6, 7]], max_new_tokens=4, **kw)


# ------------------------------------------------------------------------------ 6. early validation


def test_cli_generate_checks_flags_before_loading(monkeypatch, capsys):
    from attnzoo import cli

    monkeypatch.setattr(attnzoo, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert cli.main(["generate", "--max-new-tokens", "0", "hi"]) == 2
    assert "max_new_tokens must be an integer >= 1" in capsys.readouterr().err
    assert cli.main(["generate", "--temperature", "inf", "hi"]) == 2


def test_run_eval_max_new_tokens_beyond_context(eval_setup, monkeypatch):
    from attnzoo.evals import run_eval

    model, data = eval_setup
    monkeypatch.setattr(attnzoo, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(EvalError, match="context of 512 tokens"):
        run_eval.run(run_eval.build_parser().parse_args(["gsm8k", "--model", model, "--data-dir", data,
                                                         "--max-new-tokens", "512"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("kwargs, needle", [(dict(cuda_graph=True), "CUDA graphs"),
                                            (dict(cascade=True, backend="torch"), "cascade"),
                                            (dict(cascade=True, backend="triton", prefix_caching=False), "prefix caching")])
def test_graphs_and_cascade_refused_before_weights(tiny_dir, no_weights, kwargs, needle):
    with pytest.raises(BackendError, match=needle) as e:
        attnzoo.load_model(tiny_dir, device="cpu", **kwargs)
    assert "Fix:" in str(e.value)


# ------------------------------------------------------------------------------ 7. seeds


def test_seed_list_and_the_position_rule(llm):
    prompts = random_prompts(160, [4, 7, 5], seed=30)
    kw = dict(max_new_tokens=6, temperature=1.0, ignore_eos=True)
    alone = {s: llm.generate([p], seed=s, **kw)[0].token_ids for p, s in zip(prompts, (11, 99, 5))}
    listed = llm.generate(prompts, seed=[11, 99, 5], **kw)
    assert [c.token_ids for c in listed] == list(alone.values())
    by_int = llm.generate(prompts, seed=40, **kw)  # prompt i uses 40 + i
    assert [c.token_ids for c in by_int] == [llm.generate([p], seed=40 + i, **kw)[0].token_ids for i, p in enumerate(prompts)]


# ------------------------------------------------------------------------------ 8. non-finite logits


def test_nan_weights_stop_with_a_clear_error(tiny_dir):
    llm = attnzoo.load_model(tiny_dir, backend="torch", dtype="float32", page_size=4)
    prompts = random_prompts(160, [6, 9], seed=31)
    ref = llm.generate(prompts, max_new_tokens=4, ignore_eos=True)
    w = llm.model.model.layers[1].mlp.down_proj.weight
    saved = w.detach().clone()
    with torch.no_grad():
        w[0, 0] = float("nan")
    with pytest.raises(NumericsError, match="non-finite logits") as e:
        llm.generate(prompts, max_new_tokens=4, ignore_eos=True)
    assert "Fix:" in str(e.value) and "output token 0" in str(e.value)
    assert llm.engine.allocator.num_free + llm.engine.prefix_cache.evictable() == llm.engine.allocator.capacity
    with torch.no_grad():
        w.copy_(saved)
    llm.engine.prefix_cache.evict(llm.engine.prefix_cache.evictable())  # its pages hold NaN k/v now
    assert [c.token_ids for c in llm.generate(prompts, max_new_tokens=4, ignore_eos=True)] == [c.token_ids for c in ref]


@pytest.mark.parametrize("bad, temperature", [(float("nan"), 0.0), (float("inf"), 1.0), (float("nan"), 1.0)])
def test_one_non_finite_logit_in_a_row_is_caught(llm, monkeypatch, bad, temperature):
    real = llm.model.compute_logits

    def poisoned(hidden):
        out = real(hidden)
        if out.shape[0] == 2:  # both requests sample here: poison one logit of the second row
            out[1, 17] = bad
        return out

    monkeypatch.setattr(llm.model, "compute_logits", poisoned)
    with pytest.raises(NumericsError, match="for prompt 1 at output token 0"):
        llm.generate(random_prompts(160, [6, 9], seed=32), max_new_tokens=4, ignore_eos=True, temperature=temperature)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nan_logits_caught_on_gpu(tiny_dir):
    """argmax on CUDA lets NaN win as on CPU, so the O(rows) check sees it (eager and CUDA-graph decode)."""
    for backend in ("torch", "triton"):
        llm = attnzoo.load_model(tiny_dir, backend=backend, device="cuda", dtype="bfloat16", page_size=16)
        with torch.no_grad():
            llm.model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
        with pytest.raises(NumericsError, match="non-finite logits"):
            llm.generate(random_prompts(160, [6, 9], seed=31), max_new_tokens=4, ignore_eos=True)
