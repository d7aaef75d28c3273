"""First contact (issue 18): progress lines, `python -m attnzoo`, the offline or gated hub named in one line,
transformers' generate spellings, and a missing optional package named rather than reported as a broken file."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import attnzoo
from attnzoo.errors import EvalError, ModelLoadError
from helpers import random_prompts
from reliability_helpers import hf_model, llm, tiny_dir  # noqa: F401  (fixtures: used by name)

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ 9. first contact


def test_progress_lines(tiny_dir, capsys):
    llm = attnzoo.load_model(tiny_dir, backend="torch", page_size=4, progress=True)
    llm.generate([[5, 6, 7]], max_new_tokens=3, ignore_eos=True)
    err = capsys.readouterr().err
    for needle in ("attnzoo: loading", "KV cache", "ready in", "generating 1 sequence", "generated 3 tokens"):
        assert needle in err
    quiet = attnzoo.load_model(tiny_dir, backend="torch", page_size=4)  # stderr is not a terminal under pytest
    quiet.generate([[5, 6, 7]], max_new_tokens=3)
    assert capsys.readouterr().err == ""


def test_python_dash_m_attnzoo():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "attnzoo", "generate", "--max-new-tokens", "0", "hi"],
                         capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert res.returncode == 2 and "error: max_new_tokens" in res.stderr


def test_hub_unreachable_fails_fast_in_one_line(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from attnzoo.models import loader

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def snapshot(repo_id, local_files_only=False, **kw):
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        pytest.fail("a download was tried without a network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    monkeypatch.setattr(loader, "reachable", lambda host, timeout=3.0: False)
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError) as e:
        attnzoo.load_model("someorg/some-model")
    assert time.perf_counter() - t0 < 5
    msg = str(e.value)
    assert "\n" not in msg and "huggingface.co cannot be reached" in msg and "Fix:" in msg


def test_gated_hub_model_names_hf_auth_login(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError

    from attnzoo.models import loader

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def snapshot(repo_id, local_files_only=False, **kw):
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        e = GatedRepoError.__new__(GatedRepoError)
        Exception.__init__(e, "gated")
        raise e

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    monkeypatch.setattr(loader, "reachable", lambda host, timeout=3.0: True)
    with pytest.raises(ModelLoadError, match="gated") as e:
        attnzoo.load_model("someorg/gated-model")
    assert "`hf auth login`" in str(e.value)
    assert not [p for p in (REPO / "attnzoo").rglob("*.py") if "huggingface-cli" in p.read_text()]


# ------------------------------------------------------------------------------ 10. transformers spellings


def test_do_sample_stop_strings_and_max_length(llm):
    prompt = random_prompts(160, [5], seed=40)[0]
    greedy = llm.generate([prompt], max_new_tokens=6, ignore_eos=True)[0]
    assert llm.generate([prompt], max_new_tokens=6, ignore_eos=True, temperature=0.7, do_sample=False)[0].token_ids == greedy.token_ids
    sampled = llm.generate([prompt], max_new_tokens=6, ignore_eos=True, do_sample=True, seed=3)[0]
    assert sampled.token_ids == llm.generate([prompt], max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=3)[0].token_ids
    assert len(llm.generate([prompt], max_length=9, ignore_eos=True)[0].token_ids) == 4  # 5 prompt + 4 new
    word = greedy.text.split()[2]
    a = llm.generate([prompt], max_new_tokens=6, ignore_eos=True, stop=[word])[0]
    b = llm.generate([prompt], max_new_tokens=6, ignore_eos=True, stop_strings=word)[0]
    assert a.text == b.text and a.finish_reason == b.finish_reason == "stop" and word not in a.text


def test_min_new_tokens_masks_eos(llm, monkeypatch):
    prompt = random_prompts(160, [5], seed=41)[0]
    first = llm.generate([prompt], max_new_tokens=1)[0].token_ids[0]
    monkeypatch.setattr(llm.engine, "eos", {first})  # the greedy first token becomes EOS
    assert llm.generate([prompt], max_new_tokens=6)[0].token_ids == [first]
    out = llm.generate([prompt], max_new_tokens=6, min_new_tokens=3)[0]
    assert len(out.token_ids) >= 3 and first not in out.token_ids[:3]


def test_repetition_penalty_matches_transformers(llm, hf_model):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from attnzoo.engine.sampling import SamplingParams, process_logits

    class Req:
        def __init__(self, prompt, out, penalty):
            self.prompt, self.out, self.params = prompt, out, SamplingParams(repetition_penalty=penalty)

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    reqs = [Req([1, 4, 4], [7], 1.3), Req([2], [], 1.0), Req([9, 3], [3, 3, 0], 0.7)]
    got = process_logits(logits, reqs, set())
    assert torch.equal(got[1], logits[1])
    for i in (0, 2):
        ids = torch.tensor([reqs[i].prompt + reqs[i].out])
        want = RepetitionPenaltyLogitsProcessor(reqs[i].params.repetition_penalty)(ids, logits[i : i + 1].clone())
        assert torch.allclose(got[i], want[0])
    prompt = random_prompts(160, [6], seed=42)[0]
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, repetition_penalty=1.5)
    ours = llm.generate([prompt], max_new_tokens=8, ignore_eos=True, repetition_penalty=1.5)[0]
    assert ours.token_ids == ref[0, len(prompt):].tolist()


def test_num_return_sequences(llm):
    prompts = random_prompts(160, [4, 6], seed=43)
    kw = dict(max_new_tokens=6, temperature=1.0, ignore_eos=True, seed=7)
    outs = llm.generate(prompts, num_return_sequences=3, **kw)
    assert [o.prompt_token_ids for o in outs] == [prompts[0]] * 3 + [prompts[1]] * 3
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate([p for p in prompts for _ in range(3)], **kw)]
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1  # distinct seeds, distinct samples


def _without_package(monkeypatch, package: str) -> None:
    """Make ``import package`` (and its submodules) fail, as on a machine without it installed."""
    import builtins

    real_import = builtins.__import__

    def guarded(name, *a, **k):
        if name == package or name.startswith(package + "."):
            raise ImportError(f"No module named {package!r}")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", guarded)


def test_missing_gguf_package_is_named(monkeypatch, tmp_path):
    """Without the gguf package a GGUF load says so, instead of calling the file corrupt."""
    from attnzoo.models import loader

    _without_package(monkeypatch, "gguf")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    src = loader.CheckpointSource(name="m.gguf", directory=tmp_path, gguf_file="m.gguf")
    with pytest.raises(ModelLoadError) as e:
        loader.load_config(src)
    assert "gguf" in str(e.value) and "not installed" in str(e.value) and "corrupt" not in str(e.value)


def test_missing_lm_eval_is_named(monkeypatch):
    """run_eval without lm-eval names the extra to install before it loads any model."""
    from attnzoo.evals.tasks import require_lm_eval

    _without_package(monkeypatch, "lm_eval")
    with pytest.raises(EvalError) as e:
        require_lm_eval()
    assert "lm-eval" in str(e.value) and "[evals]" in str(e.value)
