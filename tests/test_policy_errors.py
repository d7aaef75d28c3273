"""The policy's refusals: every rejection reason of a backend choice, and policy-file errors named by file, key and line."""
from __future__ import annotations

import re

import pytest

from attnzoo.attention import backends as backend_registry
from attnzoo.attention.backends.base import AttentionBackend
from attnzoo.policy import Overrides, resolve
from attnzoo.policy.resolve import gpu_class
from attnzoo.errors import BackendError, PolicyError
from policy_helpers import (  # noqa: F401  (fixtures: used by name)
    SMALL_TABLE, _no_user_policy, flashinfer_installed, flashinfer_missing, line_of, pretend_modules, profile, write,
)


# -------------------------------------------------------------------------------- rejections


def _reject(exc, match, model="LlamaForCausalLM", gpu="sm90", **ov):
    with pytest.raises(exc) as e:
        resolve(model, gpu=gpu, overrides=Overrides(**ov))
    msg = str(e.value)
    assert re.search(match, msg), msg
    return msg


def test_reject_unknown_backend():
    msg = _reject(BackendError, "unknown attention backend 'flashattn'", backend="flashattn")
    assert "torch" in msg and "triton" in msg  # the valid choices


class _Undeclared(AttentionBackend):  # states no capabilities
    name = "undeclared"

    def extend(self, layer, q, meta):
        raise AssertionError("never run")

    decode = extend


def test_reject_registered_backend_without_declaration(monkeypatch):
    # A backend is one file and one registry line; its class must carry the declaration.
    monkeypatch.setitem(backend_registry._REGISTRY, "undeclared", f"{__name__}:_Undeclared")
    msg = _reject(BackendError, "'undeclared' .* declares no capabilities", backend="torch", gpu="cpu")
    assert "capabilities = BackendCapabilities" in msg


def test_reject_missing_package(monkeypatch, flashinfer_missing):
    msg = _reject(BackendError, r"needs the Python package 'flashinfer'", gpu="sm100", decode_backend="trtllm_mha")
    assert 'pip install "attnzoo[flashinfer]"' in msg and "Fix: valid decode backends" in msg
    pretend_modules(monkeypatch, triton=False)
    msg = _reject(BackendError, r"needs the Python package 'triton'", backend="triton")
    assert 'pip install "attnzoo[triton]"' in msg and "Fix: valid prefill backends" in msg and "torch" in msg


def test_reject_gpu(monkeypatch, flashinfer_installed):
    _reject(BackendError, r"decode does not run on sm80 \(runs on: sm90, sm100, sm103, sm120\)",
            gpu="sm80", decode_backend="trtllm_mha")
    _reject(BackendError, r"does not run on sm90 \(runs on: sm100, sm103, sm120\)",
            model="DeepseekV3ForCausalLM", decode_backend="trtllm_mla")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _reject(BackendError, "needs TRITON_INTERPRET=1", gpu="cpu", backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    d = resolve("LlamaForCausalLM", gpu="cpu", overrides=Overrides(backend="triton"))
    assert d.decode_backend == "triton" and any("interpreter" in n for n in d.notes)


def test_reject_head_dim(flashinfer_installed):
    _reject(BackendError, r"q/k head dim\(s\) \{32\} unsupported \(supports \{64, 128, 256, 512\}\)",
            model=profile(dims=(32,)), gpu="sm100", decode_backend="trtllm_mha")
    _reject(BackendError, r"head dim\(s\) \{2048\} unsupported \(supports any up to 1024\)",
            model=profile(dims=(2048,)), backend="torch")
    # FA3 prefill does not build for head dim 512: flashinfer prefill on sm90 runs FA2 and says so.
    gemma = profile("Gemma4ForConditionalGeneration", "gemma4", dims=(256, 512), uses_sliding_window=True)
    d = resolve(gemma, gpu="sm90", overrides=Overrides(prefill_backend="flashinfer"))
    assert d.kernels["prefill"] == "FlashInfer FA2 prefill"
    pre = next(c for c in d.candidates if c.chosen and c.phase == "prefill")
    assert any("FA3 prefill skipped" in r and "head dim 512" in r for r in pre.reasons)
    d = resolve(profile(dims=(128,)), gpu="sm90", overrides=Overrides(prefill_backend="flashinfer"))
    assert d.kernels["prefill"] == "FlashInfer FA3 prefill"


def test_reject_page_size(flashinfer_installed):
    _reject(PolicyError, r"page size 8 \(from keyword page_size=8\) is not supported: .*trtllm_mha needs \{16, 32, 64\}",
            gpu="sm100", backend="trtllm_mha", page_size=8)
    for bad in (0, 129, "16"):
        _reject(PolicyError, "not an integer in 1..128", page_size=bad)


def test_explicit_page_size_restricts_the_automatic_backend(tmp_path, flashinfer_installed):
    table = write(tmp_path, SMALL_TABLE)
    # The row's automatic trtllm_mha cannot take the explicit page size 8: the backend adjusts, the page size not.
    d = resolve("LlamaForCausalLM", gpu="sm100", overrides=Overrides(page_size=8), table=table)
    assert (d.prefill_backend, d.decode_backend, d.page_size) == ("triton", "triton", 8)
    assert all("page size 8 unsupported" in a for a in d.adjustments) and len(d.adjustments) == 2


def test_reject_attention_kind_and_phase(flashinfer_installed):
    _reject(BackendError, "does not run MHA attention", gpu="sm100", decode_backend="trtllm_mla")
    _reject(BackendError, "does not run MHA attention", backend="flashinfer_mla")
    _reject(BackendError, "does not run MLA attention", model="DeepseekV3ForCausalLM", gpu="sm100",
            decode_backend="trtllm_mha")
    msg = _reject(BackendError, r"prefill backend 'trtllm_mla' .* has no prefill path \(decode only\)",
                  model="DeepseekV3ForCausalLM", gpu="sm100", backend="trtllm_mla")
    assert "valid prefill backends" in msg


def test_reject_features_and_dtype(flashinfer_installed):
    _reject(BackendError, "does not support attention logit soft-capping",
            model=profile(uses_softcap=True), gpu="sm100", backend="trtllm_mha")
    _reject(BackendError, r"does not run dtype float32 \(supports: bfloat16, float16\)",
            gpu="sm100", backend="trtllm_mha", dtype="float32")
    assert resolve("LlamaForCausalLM", gpu="sm100",
                   overrides=Overrides(backend="trtllm_mha", dtype="torch.bfloat16")).decode_backend == "trtllm_mha"
    _reject(BackendError, "does not run NSA attention", model="DeepseekV32ForCausalLM", backend="triton")


def test_explicit_choice_in_user_file_is_never_replaced(tmp_path, flashinfer_installed):
    path = write(tmp_path, '[family.llama.gpu.sm80]\ndecode = "trtllm_mha"\n')
    msg = _reject(BackendError, "decode does not run on sm80", gpu="sm80", policy_file=path)
    assert str(path) in msg and "family.llama.gpu.sm80" in msg


def test_reject_unknown_architecture_and_gpu():
    with pytest.raises(PolicyError, match="MistralForCausalLM.*not in the policy table") as e:
        resolve("MistralForCausalLM", gpu="cpu")
    assert "LlamaForCausalLM" in str(e.value)
    with pytest.raises(PolicyError, match="GPU 'sm75' is not one the policy knows"):
        resolve("LlamaForCausalLM", gpu="sm75")
    assert gpu_class("sm_86") == "sm80" and gpu_class("SM121") == "sm120"
    d = resolve("LlamaForCausalLM", gpu="sm86")
    assert d.gpu == "sm80" and d.device_gpu == "sm86" and any("sm86 uses the sm80 rows" in n for n in d.notes)


def test_xqa_group_limit_for_large_head_dims(flashinfer_installed):
    # XQA (trtllm_mha decode on sm90) serves head dims above 256 only with <= 16 query heads per KV head.
    wide = profile(dims=(512,), num_heads=32, num_kv_heads=frozenset({1}))
    _reject(BackendError, r"at most 16 query heads per KV head; this model has head dim 512 and up to 32",
            model=wide, decode_backend="trtllm_mha")
    ok = profile(dims=(512,), num_heads=32, num_kv_heads=frozenset({4}))
    assert resolve(ok, gpu="sm90", overrides=Overrides(decode_backend="trtllm_mha")).decode_backend == "trtllm_mha"


# ------------------------------------------------------------------------- policy file errors


BAD_FILES = [
    # (file text, the offending key, the text on the offending line)
    ('[family.llama.gpu.sm90]\nprefill = "torch"\ndecoder = "torch"\n', "family.llama.gpu.sm90.decoder", "decoder ="),
    ('schema = 1\nbackends = ["torch"]\n', "backends", "backends ="),
    ('[family.llama]\n\n[family.mistral.gpu.sm90]\nbackend = "torch"\n', "family.mistral", "[family.mistral"),
    ('[family.llama.arch.MistralForCausalLM]\ndecode = "torch"\n', "family.llama.arch.MistralForCausalLM",
     "[family.llama.arch.Mistral"),
    ('[family.llama.gpu.sm75]\ndecode = "torch"\n', "family.llama.gpu.sm75", "[family.llama.gpu.sm75"),
    ('[models."meta-llama/*".gpu.sm90]\n# comment\ndecode = "flashattn"\n', 'models."meta-llama/*".gpu.sm90.decode',
     'decode = "flashattn"'),
    ('[family.llama.gpu.sm90]\npage_size = "16"\n', "family.llama.gpu.sm90.page_size", "page_size ="),
    ('[family.llama]\n\nprofile = { kind = "mha" }\n', "family.llama.profile", "profile ="),
    ('[family.llama]\ngpu.sm90.decode = "torch"\ngpu.sm90.speed = "fast"\n', "family.llama.gpu.sm90.speed",
     "speed"),
    # The fallback order is the automatic policy's; a user file's choices are explicit.
    ('[family.llama]\nfallback = ["torch"]\n', "family.llama.fallback", "fallback ="),
]


@pytest.mark.parametrize("text,key,needle", BAD_FILES)
def test_bad_policy_file_names_file_key_and_line(tmp_path, text, key, needle):
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as e:
        resolve("LlamaForCausalLM", gpu="sm90", overrides=Overrides(policy_file=path))
    msg = str(e.value)
    assert f"{path}:{line_of(text, needle)}:" in msg, msg
    assert repr(key) in msg or key in msg, msg
    assert "Fix:" in msg


def test_bad_shipped_table_names_file_key_and_line(tmp_path):
    # The same checks guard the shipped table; keys of inline tables get their line too.
    text = SMALL_TABLE.replace('profile = { kind = "mha", head_dims = [128]', 'profile = { kind = "mha", head_dim = [128]')
    path = write(tmp_path, text, "table.toml")
    with pytest.raises(PolicyError, match=re.escape(f"{path}:{line_of(text, 'profile =')}: key 'family.llama.profile.head_dim'")):
        resolve("LlamaForCausalLM", gpu="sm90", table=path)


def test_malformed_toml_names_file_and_line(tmp_path):
    text = '[family.llama.gpu.sm90]\nprefill = "torch"\ndecode = \n'
    path = write(tmp_path, text)
    with pytest.raises(PolicyError, match=re.escape(f"{path}:3: malformed TOML")):
        resolve("LlamaForCausalLM", gpu="sm90", overrides=Overrides(policy_file=path))
