"""An architecture missing from the policy table resolves by its attention kind (issue 31/36); an unknown
architecture with Llama's layers loads through the Llama model and matches transformers; policy-file and
`attnzoo tune --output` faults are named before work is done (issue 34); tune's and show's lines stay short
(issue 38)."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from attnzoo.attention.backends import capabilities as caps_mod
from attnzoo.cli import main as cli_main
from attnzoo.errors import BackendError, PolicyError, UnsupportedArchitectureError
from attnzoo.policy import ModelProfile, Overrides, profile_from_config, resolve


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    monkeypatch.delenv("ATTNZOO_POLICY", raising=False)
    real = caps_mod.module_available  # FlashInfer "installed": the answers do not depend on the machine
    monkeypatch.setattr(caps_mod, "module_available", lambda m: True if m == "flashinfer" else real(m) if m else True)


def _unlisted(kind="mha", dims=(128,), vdims=None, **kw) -> ModelProfile:
    return ModelProfile(architecture="AcmeForCausalLM", family=None, kind=kind, head_dims=frozenset(dims),
                        v_head_dims=frozenset(vdims or dims), num_heads=32, **kw)


# (profile, the family whose rows it must take): every kind the table serves, on the GPU whose rows differ most
KINDS = [
    (_unlisted(num_kv_heads=frozenset({8})), "mha", "LlamaForCausalLM"),
    (_unlisted(dims=(256,), num_kv_heads=frozenset({8}), uses_sliding_window=True), "mha_window", "Gemma4ForCausalLM"),
    (_unlisted(dims=(64,), num_kv_heads=frozenset({8}), uses_sliding_window=True, uses_sinks=True), "mha_sinks",
     "GptOssForCausalLM"),
    (_unlisted("mla", (576,), (512,), num_kv_heads=frozenset({1})), "mla", "DeepseekV3ForCausalLM"),
    (_unlisted("nsa", (576,), (512,), num_kv_heads=frozenset({1})), "nsa", "DeepseekV32ForCausalLM"),
]


@pytest.mark.parametrize("gpu", ["cpu", "sm90", "sm100"])
@pytest.mark.parametrize("profile,kind,listed", KINDS, ids=[k for _, k, _ in KINDS])
def test_unlisted_architecture_takes_its_kinds_family_rows(profile, kind, listed, gpu):
    d = resolve(profile, gpu=gpu)
    # The same cell as a listed architecture of that kind, read from the table's rows (not from this code).
    ref = resolve(listed, gpu=gpu)
    assert (d.prefill_backend, d.decode_backend, d.page_size) == (ref.prefill_backend, ref.decode_backend,
                                                                  ref.page_size)
    assert d.profile.attention_kind == kind and d.sources["decode_backend"].level == "family_default"
    assert any(f"resolved by its attention kind {kind} to the {ref.profile.family} family" in n for n in d.notes)
    assert f"attention kind {kind}" in d.explain()


def test_shipped_rows_win_and_unserved_kinds_are_named():
    # A listed architecture keeps its rows, whatever its layers look like.
    d = resolve(ModelProfile("Gemma4ForCausalLM", None, "mha", frozenset({128}), frozenset({128})), gpu="sm100")
    assert d.profile.family == "gemma4" and not any("attention kind" in n for n in d.notes)
    # A kind that no family lists and that has no base kind is named.
    with pytest.raises(PolicyError, match="no family serves its attention kind 'linear'") as e:
        resolve(_unlisted(declared_kind="linear"), gpu="cpu")
    assert "kinds" in str(e.value) and "Fix:" in str(e.value)


def test_unlisted_config_kind_from_its_keys():
    # No model class registered: kv_lora_rank -> MLA, index_topk -> sparse MLA, layer_types -> windowed.
    base = {"architectures": ["AcmeMoeForCausalLM"], "model_type": "acme", "num_attention_heads": 16,
            "hidden_size": 1024, "num_experts": 8}
    mla = dict(base, kv_lora_rank=512, qk_rope_head_dim=64)
    cases = [(mla, "mla", {576}), (dict(mla, index_topk=2048), "nsa", {576}),
             (dict(base, layer_types=["sliding_attention", "full_attention"], sliding_window=512), "mha_window", {64}),
             (dict(base, head_dim=128), "mha", {128})]
    for cfg, kind, dims in cases:
        p = profile_from_config(cfg)
        assert (p.attention_kind, p.head_dims, p.family) == (kind, dims, None), kind
        assert "config's keys" in p.source
        assert resolve(cfg, gpu="cpu").profile.attention_kind == kind


def test_model_class_declares_its_kind(monkeypatch):
    # A declared attribute on the model class names a kind; the table needs no edit for a new family.
    from attnzoo.models.llama import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "attention_kind", "mha_sinks", raising=False)
    cfg = {"architectures": ["AcmeForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 64}
    d = resolve(cfg, gpu="cpu")
    assert d.profile.attention_kind == "mha_sinks" and "attention kind mha_sinks" in d.explain()


def _acme_checkpoint(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import save_checkpoint

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    path = save_checkpoint(hf, tmp_path / "acme")
    data = json.loads((path / "config.json").read_text())
    data.update(architectures=["AcmeLMForCausalLM"], model_type="acme_lm")  # a family transformers does not know
    (path / "config.json").write_text(json.dumps(data))
    return path, hf


def test_unknown_llama_shaped_architecture_loads_resolves_and_runs(tmp_path, caplog, capsys):
    import attnzoo
    from helpers import assert_matches_hf, random_prompts

    path, hf = _acme_checkpoint(tmp_path)
    with caplog.at_level(logging.INFO):
        llm = attnzoo.load_model(str(path), device="cpu", dtype="float32")
    assert any("AcmeLMForCausalLM" in r.message and "Llama-shaped" in r.message for r in caplog.records)
    assert llm.decision.profile.attention_kind == "mha" and llm.decision.decode_backend == "torch"
    assert_matches_hf(llm, hf, random_prompts(96, [5, 9]), steps=4)  # transformers' Llama is the oracle
    assert cli_main(["policy", "explain", str(path), "--gpu", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "AcmeLMForCausalLM" in out and "attention kind mha to the llama family" in out
    # Layers Llama's model would not run (experts) are refused, not silently loaded.
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(data, num_local_experts=4)))
    with pytest.raises(UnsupportedArchitectureError, match="AcmeLMForCausalLM"):
        attnzoo.load_model(str(path), device="cpu")


def test_explain_an_unknown_family_by_its_config_keys(tmp_path, capsys):
    # A sparse-MLA family neither attnzoo nor transformers knows: no policy edit, no model class needed to explain.
    ckpt = tmp_path / "acme-dsa"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "architectures": ["AcmeDsaForCausalLM"], "model_type": "acme_dsa", "hidden_size": 2048, "num_attention_heads": 16,
        "num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_topk": 2048, "vocab_size": 1000}))
    assert cli_main(["policy", "explain", str(ckpt), "--gpu", "sm90", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    ref = resolve("DeepseekV32ForCausalLM", gpu="sm90")
    assert (data["prefill_backend"], data["decode_backend"]) == (ref.prefill_backend, ref.decode_backend)
    assert data["profile"]["attention_kind"] == "nsa" and data["profile"]["head_dims"] == [576]
    assert any("attention kind nsa to the deepseek_nsa family" in n for n in data["notes"])
    import attnzoo  # loading it is refused by name: no model class runs these layers

    with pytest.raises(UnsupportedArchitectureError, match="acme_dsa"):
        attnzoo.load_model(str(ckpt), device="cpu")


# --------------------------------------------------------------------------- issue 34: named errors


def test_bad_policy_files_and_arguments_are_named(tmp_path):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('[family.llama.gpu.sm90]\nreason = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(PolicyError, match="not UTF-8") as e:
        resolve("LlamaForCausalLM", gpu="sm90", overrides=Overrides(policy_file=bad))
    assert "save the file as UTF-8" in str(e.value)
    deep = tmp_path / "deep.toml"
    deep.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(PolicyError, match="nests arrays or tables too deeply"):
        resolve("LlamaForCausalLM", gpu="sm90", overrides=Overrides(policy_file=deep))
    for wrong in (123, ["a.toml"], {"family": {}}):
        with pytest.raises(PolicyError, match=f"policy_file must be a path .* got {type(wrong).__name__}"):
            resolve("LlamaForCausalLM", gpu="sm90", overrides=Overrides(policy_file=wrong))


@pytest.fixture
def tiny_llama_dir(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64)
    cfg.architectures = ["LlamaForCausalLM"]
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_tune_output_is_checked_before_any_timing(tmp_path, tiny_llama_dir, monkeypatch):
    import attnzoo.tune as tune_mod

    def no_timing(*a, **k):
        raise AssertionError("timed before the output path was checked")

    monkeypatch.setattr(tune_mod, "time_ms", no_timing)
    monkeypatch.setattr(tune_mod, "_check", no_timing)
    cases = [(tmp_path / "missing" / "p.toml", "does not exist"), (tmp_path, "is a directory")]
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        cases.append((ro / "p.toml", "not writable"))
    for out, why in cases:
        with pytest.raises(PolicyError, match=why) as e:
            tune_mod.tune(str(tiny_llama_dir), device="cpu", backends=["torch"], output=out, progress=False)
        assert "--output" in str(e.value) and "Fix:" in str(e.value)
    assert cli_main(["tune", str(tiny_llama_dir), "--device", "cpu", "--output", str(tmp_path / "no" / "x.toml")]) == 2


def test_tune_writes_atomically(tmp_path, monkeypatch):
    import attnzoo.tune as tune_mod

    path = tmp_path / "policy.toml"
    path.write_text("schema = 1\n")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tune_mod.os, "fsync", full_disk)
    with pytest.raises(PolicyError, match="No space left on device"):
        tune_mod.write_atomic(path, "schema = 1\n# a new, longer file\n" * 100)
    assert path.read_text() == "schema = 1\n" and sorted(os.listdir(tmp_path)) == ["policy.toml"]
    monkeypatch.undo()
    tune_mod.write_atomic(path, "schema = 1\n# new\n")
    assert path.read_text() == "schema = 1\n# new\n" and sorted(os.listdir(tmp_path)) == ["policy.toml"]


# --------------------------------------------------------------------------- issue 38: short lines


def test_tune_skip_lines_are_short_with_the_full_reason_in_json():
    from attnzoo.tune import format_table

    why = ("decode backend 'flashinfer_mla' (from keyword decode_backend='flashinfer_mla') cannot run "
           "LlamaForCausalLM on sm90: does not run MHA attention (supports: MLA); head dims q/k {128} v {128} "
           "unsupported (supports (576, 512) and more); " + "x" * 300)
    r = {"architecture": "LlamaForCausalLM", "device": "cpu", "gpu": "cpu", "dtype": "float32", "prefill": "torch",
         "decode": "torch", "page_size": 16, "file": "p.toml", "rows": [],
         "skipped": [{"backend": "flashinfer_mla", "phase": "decode", "why": why}]}
    lines = format_table(r).splitlines()
    skip = next(l for l in lines if l.startswith("skipped"))
    assert skip == "skipped flashinfer_mla (decode): does not run MHA attention (supports: MLA)"
    assert max(map(len, lines)) <= 120 and "--json" in lines[-1]
