"""The policy's Decision as JSON and text, and `attnzoo policy` (explain, show, backends) on the CLI."""
from __future__ import annotations

import json

from attnzoo.attention.backends import all_capabilities
from attnzoo.policy import GPUS, resolve
from attnzoo.cli import main as policy_main
from attnzoo.policy.table import SHIPPED_POLICY
from policy_helpers import (  # noqa: F401  (fixtures: used by name)
    ARCHS, USER_POLICY, _no_user_policy, flashinfer_installed, flashinfer_missing, line_of, tiny_configs, write,
)

CAPABILITIES = all_capabilities()  # the backend classes' declarations, by name


# ------------------------------------------------------------------------- Decision as JSON / text


def test_decision_json_and_explain(flashinfer_missing):
    d = resolve("Gemma4ForConditionalGeneration", gpu="sm90", model_id="google/gemma-4-31B-it")
    data = json.loads(json.dumps(d.to_dict()))
    assert (data["prefill_backend"], data["decode_backend"], data["page_size"]) == ("triton", "triton", 16)
    assert data["gpu"] == "sm90" and data["architecture"] == "Gemma4ForConditionalGeneration"
    assert set(data["sources"]) == {"prefill_backend", "decode_backend", "page_size"}
    assert data["sources"]["page_size"]["line"] == line_of(SHIPPED_POLICY.read_text(), "[family.gemma4.gpu.sm90]")
    names = {(c["name"], c["phase"]) for c in data["candidates"]}
    assert names == {(n, p) for n in CAPABILITIES for p in ("prefill", "decode")}
    for c in data["candidates"]:
        assert {"name", "accepted", "reasons"} <= set(c) and c["reasons"]
    trt = next(c for c in data["candidates"] if c["name"] == "trtllm_mha" and c["phase"] == "decode")
    assert not trt["accepted"] and any("attnzoo[flashinfer]" in r for r in trt["reasons"])
    text = d.explain()
    assert text.splitlines()[0] == ("Gemma4ForConditionalGeneration (google/gemma-4-31B-it) on sm90: "
                                    "prefill triton, decode triton, page size 16")
    assert "FA3 does not build for 512" in text  # the row's reason
    assert 'pip install "attnzoo[flashinfer]"' in text and "using triton" in text  # the fallback, stated
    assert "trtllm_mha" in text and "rejected" in text


# ------------------------------------------------------------------------------------------- CLI


def test_cli_explain_by_hub_id_without_weights(capsys, tmp_path, monkeypatch, flashinfer_installed):
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    rc = policy_main(["policy", "explain", "some-org/some-model", "--gpu", "sm100", "--json",
                      "--arch", "Gemma4ForConditionalGeneration"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["prefill_backend"], data["decode_backend"], data["page_size"]) == ("trtllm_mha", "trtllm_mha", 64)
    assert data["model_id"] == "some-org/some-model" and data["kernels"]["decode"].startswith("trtllm-gen")
    assert all({"name", "accepted", "reasons"} <= set(c) for c in data["candidates"])
    # Not cached, not a flagship and no --arch: a clear error suggesting --arch.
    rc = policy_main(["policy", "explain", "some-org/some-model", "--gpu", "sm100"])
    err = capsys.readouterr().err
    assert rc == 2 and "--arch" in err and "Hugging Face cache" in err


def test_cli_explain_flagship_offline_for_another_gpu(capsys, tmp_path, monkeypatch, flashinfer_missing):
    # Issue 38: the README's command, offline, on a CPU machine without FlashInfer: what would run on sm100.
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert policy_main(["policy", "explain", "google/gemma-4-31B-it", "--gpu", "sm100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["architecture"], data["prefill_backend"], data["decode_backend"], data["page_size"]) == (
        "Gemma4ForConditionalGeneration", "trtllm_mha", "trtllm_mha", 64)
    assert data["hypothetical"]["assumed_installed"] == ["flashinfer", "triton"] and not data["adjustments"]
    assert any("flagship table" in n for n in data["notes"]) and any("not this machine" in n for n in data["notes"])
    assert data["profile"]["head_dims"] == [256, 512]
    # The local GPU, or an explicit empty --assume-installed, checks this machine's packages.
    assert policy_main(["policy", "explain", "google/gemma-4-31B-it", "--gpu", "sm100", "--assume-installed", ""]) == 0
    assert capsys.readouterr().out.startswith("Gemma4ForConditionalGeneration (google/gemma-4-31B-it) on sm100: "
                                              "prefill triton, decode triton")
    assert policy_main(["policy", "explain", "deepseek-ai/DeepSeek-V3", "--gpu", "cpu"]) == 0
    assert "HYPOTHETICAL" not in capsys.readouterr().out


def test_cli_explain_takes_the_kv_cache_dtype(capsys):
    # The decision depends on what the cache stores, as load_model's kv_cache_dtype does.
    assert policy_main(["policy", "explain", "LlamaForCausalLM", "--gpu", "sm90", "--json", "--assume-installed"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert policy_main(["policy", "explain", "LlamaForCausalLM", "--gpu", "sm90", "--json", "--assume-installed",
                        "--kv-cache-dtype", "fp8_e4m3"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert (plain["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("auto", "fp8_e4m3")
    assert "FA3" in plain["kernels"]["prefill"] and "FA3" not in fp8["kernels"]["prefill"]
    assert policy_main(["policy", "explain", "DeepseekV2ForCausalLM", "--gpu", "sm90",
                        "--kv-cache-dtype", "fp8_e4m3"]) == 2
    assert "kv_cache_dtype='auto'" in capsys.readouterr().err


def test_cli_explain_reads_cached_and_local_configs(capsys, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    cfg = tiny_configs()["Gemma4ForConditionalGeneration"]
    # A hub id whose config.json sits in the local HF cache (the cache's on-disk layout).
    cache = tmp_path / "hub"
    snap = cache / "models--google--gemma-4-31B-it" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (cache / "models--google--gemma-4-31B-it" / "refs").mkdir()
    (cache / "models--google--gemma-4-31B-it" / "refs" / "main").write_text("0" * 40)
    cfg.save_pretrained(snap)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    assert policy_main(["policy", "explain", "google/gemma-4-31B-it", "--gpu", "sm90", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["profile"]["source"] == "config" and data["profile"]["head_dims"] == [32, 64]
    assert data["architecture"] == "Gemma4ForConditionalGeneration"
    # A local checkpoint directory, with overrides and a user policy file.
    local = tmp_path / "ckpt"
    tiny_configs()["LlamaForCausalLM"].save_pretrained(local)
    pol = write(tmp_path, '[models."*ckpt"]\ndecode = "torch"\n')
    assert policy_main(["policy", "explain", str(local), "--gpu", "sm90", "--policy", str(pol),
                        "--prefill-backend", "torch", "--page-size", "32"]) == 0
    out = capsys.readouterr().out.splitlines()  # sm90 is not this machine: a hypothetical answer, said first
    assert out[0].startswith("HYPOTHETICAL") and "prefill torch, decode torch, page size 32" in out[1]
    out = "\n".join(out)
    assert "keyword prefill_backend='torch'" in out and "model pattern '*ckpt'" in out
    # An explicit choice that cannot run: exit 2 and the reason.
    assert policy_main(["policy", "explain", "DeepseekV3ForCausalLM", "--gpu", "sm90", "--backend", "trtllm_mla"]) == 2
    assert "trtllm_mla" in capsys.readouterr().err


def test_cli_show_and_backends(capsys, tmp_path):
    assert policy_main(["policy", "show", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert len(shown["cells"]) == len(ARCHS) * len(GPUS) and shown["model_patterns"] == []
    assert policy_main(["policy", "show", "--gpu", "sm100"]) == 0
    out = capsys.readouterr().out.splitlines()  # a table: header, rule, one line per architecture
    assert len(out) == 2 + len(ARCHS) and all(" sm100 " in l for l in out[2:])
    assert max(map(len, out)) < 200 and set(out[1]) <= {"-", " "}
    # A user policy file is merged in, its model-id patterns listed.
    pol = write(tmp_path, USER_POLICY)
    assert policy_main(["policy", "show", "--gpu", "sm90", "--policy", str(pol), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    cell = next(c for c in shown["cells"] if c["architecture"] == "Gemma4ForConditionalGeneration")
    assert (cell["decode_backend"], cell["page_size"]) == ("torch", 32) and str(pol) in cell["decode_backend_from"]
    assert [(p["pattern"], p["gpu"]) for p in shown["model_patterns"]] == [
        ("google/gemma-4-*", "*"), ("google/gemma-4-31B-*", "sm90")]
    assert policy_main(["policy", "backends", "--json"]) == 0
    data = {d["name"]: d for d in json.loads(capsys.readouterr().out)}
    assert set(data) == set(CAPABILITIES) and data["torch"]["registered"]
    assert data["trtllm_mla"]["page_sizes"] == "{32, 64} (trtllm-gen MLA decode); {16, 32, 64, 128} (XQA-MLA decode)"
    assert data["trtllm_mla"]["prefill"] == [] and data["trtllm_mla"]["decode"][1]["num_heads"] == [128]


def test_attnzoo_entry_point_mounts_policy(capsys):
    from attnzoo.cli import main

    assert main(["policy", "explain", "LlamaForCausalLM", "--gpu", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["decode_backend"] == "torch"
