"""The attention-backend policy: the shipped table cell by cell, override precedence, every rejection
reason, policy-file errors with file:line, the Decision's JSON, and `attnzoo policy` on the CLI.

Everything runs on CPU: GPUs are named explicitly (gpu="sm100"). Whether the FlashInfer package is
installed is set per test (``flashinfer_installed`` / ``flashinfer_missing``) so that results do not
depend on the machine.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from attnzoo.attention import backends as backend_registry
from attnzoo.attention.backends import all_capabilities, backend_names, get_backend_class
from attnzoo.attention.backends import capabilities as caps_mod
from attnzoo.attention.backends.base import AttentionBackend
from attnzoo.policy import GPUS, Overrides, ModelProfile, resolve
from attnzoo.cli import main as policy_main
from attnzoo.policy.profile import profile_from_config
from attnzoo.cli import table_cells
from attnzoo.policy.resolve import gpu_class
from attnzoo.policy.table import SHIPPED_POLICY, load_table
from attnzoo.errors import BackendError, PolicyError

CAPABILITIES = all_capabilities()  # the backend classes' declarations, by name

# The shipped table, written out: (prefill, decode, page size) per family and GPU. A change to
# policy.toml must be made here too, on purpose.
_BLACKWELL = ("sm100", "sm103")
_MHA = {g: ("trtllm_mha", "trtllm_mha", 64) if g in _BLACKWELL else ("triton", "triton", 16) for g in GPUS}
_MHA["sm90"] = ("flashinfer", "flashinfer", 16)  # measured: benchmarks/results/attention_nvidia_h100_80gb_hbm3_quick.json
_MLA = {g: ("flashinfer_mla", "trtllm_mla", 64) if g in _BLACKWELL else ("triton", "triton", 64) for g in GPUS}
_MLA["sm90"] = ("flashinfer_mla", "flashinfer_mla", 64)  # measured: benchmarks/results/mla_decode_nvidia_h200.json
EXPECTED = {
    "llama": {**_MHA, "cpu": ("torch", "torch", 16)},
    "gemma4": {**_MHA, "cpu": ("torch", "torch", 16)},
    "gemma3": {**_MHA, "cpu": ("torch", "torch", 16)},
    "deepseek_mla": {**_MLA, "cpu": ("torch", "torch", 16)},
    "deepseek_nsa": {g: ("torch", "torch", 64) if g == "cpu" else ("nsa_triton", "nsa_triton", 64) for g in GPUS},
    # sinks: triton on Hopper (no FA3 with sinks here), trtllm-gen on Blackwell
    "gpt_oss": {**_MHA, "sm90": ("triton", "triton", 16), "cpu": ("torch", "torch", 16)},
    "deepseek_v4": {g: ("torch", "torch", 64) if g == "cpu" else ("compressed_triton", "compressed_triton", 64)
                    for g in GPUS},
}
ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
    "DeepseekV2ForCausalLM": "deepseek_mla",
    "DeepseekV3ForCausalLM": "deepseek_mla",
    "DeepseekV32ForCausalLM": "deepseek_nsa",
    "Kimi_K25ForConditionalGeneration": "deepseek_mla",
    "KimiK25ForConditionalGeneration": "deepseek_mla",
    "Mistral4ForCausalLM": "deepseek_mla",
    "Mistral3ForConditionalGeneration": "deepseek_mla",
    "GlmMoeDsaForCausalLM": "deepseek_nsa",
    "MistralLarge4ForConditionalGeneration": "deepseek_nsa",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV4ForCausalLM": "deepseek_v4",
}
# Mistral 4's 256-wide latent: trtllm_mla (576 / 512 only) cannot decode it, its Blackwell rows say flashinfer_mla.
_MISTRAL4 = {**EXPECTED["deepseek_mla"], **dict.fromkeys(("sm100", "sm103"), ("flashinfer_mla", "flashinfer_mla", 64))}
EXPECTED.update(Mistral4ForCausalLM=_MISTRAL4, Mistral3ForConditionalGeneration=_MISTRAL4)


def expected(arch: str, gpu: str) -> tuple:
    return EXPECTED.get(arch, EXPECTED[ARCHS[arch]])[gpu]


@pytest.fixture(autouse=True)
def _no_user_policy(monkeypatch):
    monkeypatch.delenv("ATTNZOO_POLICY", raising=False)


def _pretend_modules(monkeypatch, **present: bool):
    real = caps_mod.module_available
    monkeypatch.setattr(caps_mod, "module_available", lambda m: present.get(m, real(m)) if m else True)


@pytest.fixture
def flashinfer_installed(monkeypatch):
    _pretend_modules(monkeypatch, flashinfer=True)


@pytest.fixture
def flashinfer_missing(monkeypatch):
    _pretend_modules(monkeypatch, flashinfer=False)


def write(tmp_path: Path, text: str, name: str = "policy.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def line_of(text: str, needle: str) -> int:
    return next(i for i, l in enumerate(text.splitlines(), 1) if needle in l)


def profile(arch="LlamaForCausalLM", family="llama", kind="mha", dims=(128,), vdims=None, **kw) -> ModelProfile:
    return ModelProfile(architecture=arch, family=family, kind=kind, head_dims=frozenset(dims),
                        v_head_dims=frozenset(vdims or dims), **kw)


# ------------------------------------------------------------------------------ the shipped table


def test_every_table_cell_names_registered_backends():
    registered = set(backend_names())
    table = load_table(SHIPPED_POLICY, shipped=True)
    cells = table_cells()
    assert len(cells) == len(ARCHS) * len(GPUS)
    for c in cells:
        for key in ("prefill_backend", "decode_backend"):
            assert c[key] in registered, f"{c['architecture']} {c['gpu']}: {c[key]} is not registered"
    for fam in table.families.values():
        assert set(fam.fallback) <= registered, fam.name
        # Raw rows too: a row that a more specific row hides must still name registered backends.
        for entry in [fam.entry, *fam.archs.values()]:
            for row in [entry.all_gpus, *entry.gpus.values()]:
                assert {row.prefill, row.decode} - {None} <= registered, row.where


def test_registry_and_capabilities_agree():
    for name in backend_names():
        assert name in CAPABILITIES, f"registered backend {name} declares no capabilities"
        # The declaration and the class agree on CUDA-graph support (the engine reads the class).
        assert CAPABILITIES[name].cuda_graph == get_backend_class(name).supports_cuda_graph, name
        assert CAPABILITIES[name].cascade == get_backend_class(name).supports_cascade, name


def test_shipped_table_is_complete_and_follows_the_field_on_blackwell():
    table = load_table(SHIPPED_POLICY, shipped=True)
    assert {a: table.family_of(a) for a in ARCHS} == ARCHS
    for fam in table.families.values():
        assert set(fam.entry.gpus) == set(GPUS), fam.name  # every GPU has a family default row
        for gpu, row in fam.entry.gpus.items():
            assert row.prefill and row.decode and row.page_size and row.reason, row.where
            if row.measured_in and row.measured_in != "unmeasured":
                assert row.measured_in.startswith("benchmarks/results/")
                assert (Path(__file__).parents[1] / row.measured_in).is_file(), row.measured_in
    cells = {(c["architecture"], c["gpu"]): c for c in table_cells()}
    for arch in ("LlamaForCausalLM", "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"):
        assert cells[arch, "sm100"]["decode_backend"] == "trtllm_mha"
    for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        assert cells[arch, "sm100"]["decode_backend"] == "trtllm_mla"
    # V3.2's sparse prefill + trtllm decode is not implemented yet: the row says so.
    v32 = cells["DeepseekV32ForCausalLM", "sm100"]
    assert v32["decode_backend"] == "nsa_triton" and "sparse" in v32["planned"] and "trtllm" in v32["planned"]


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_cell_resolves(arch, gpu, flashinfer_installed):
    d = resolve(arch, gpu=gpu)
    assert (d.prefill_backend, d.decode_backend, d.page_size) == expected(arch, gpu)
    assert d.gpu == gpu and d.architecture == arch
    assert d.adjustments == []
    assert {s.level for s in d.sources.values()} <= {"shipped_arch", "family_default"}
    chosen = [c for c in d.candidates if c.chosen]
    assert sorted(c.phase for c in chosen) == ["decode", "prefill"] and all(c.accepted for c in chosen)
    # The table's reason is what explains the choice.
    assert d.sources["decode_backend"].reason and d.sources["decode_backend"].reason in d.explain()


def _tiny_configs():
    from transformers import (DeepseekV2Config, DeepseekV3Config, DeepseekV32Config, Gemma3Config,
                              Gemma3TextConfig, Gemma4Config, Gemma4TextConfig, LlamaConfig, Qwen3Config,
                              Qwen3MoeConfig)

    gemma_text = dict(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, global_head_dim=64, attention_k_eq_v=True, num_global_key_value_heads=1,
                      sliding_window=16, vocab_size=128, vocab_size_per_layer_input=128)
    mla = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
               qk_nope_head_dim=16, v_head_dim=16, vocab_size=128)
    qwen = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32, num_hidden_layers=2,
                vocab_size=128)
    gemma3 = dict(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  sliding_window=16, vocab_size=128)
    cfgs = {
        "LlamaForCausalLM": LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, vocab_size=128),
        "Qwen3ForCausalLM": Qwen3Config(**qwen),
        "Qwen3MoeForCausalLM": Qwen3MoeConfig(**qwen, num_experts=4, moe_intermediate_size=32),
        "Gemma3ForCausalLM": Gemma3TextConfig(**gemma3),
        "Gemma3ForConditionalGeneration": Gemma3Config(text_config=gemma3),
        "Gemma4ForCausalLM": Gemma4TextConfig(**gemma_text),
        "Gemma4ForConditionalGeneration": Gemma4Config(text_config=gemma_text),
        "DeepseekV2ForCausalLM": DeepseekV2Config(**mla),
        "DeepseekV3ForCausalLM": DeepseekV3Config(**mla),
        "DeepseekV32ForCausalLM": DeepseekV32Config(**mla, index_topk=8, index_head_dim=16, index_n_heads=2),
    }
    for arch, c in cfgs.items():
        c.architectures = [arch]
    return cfgs


def test_profiles_from_hf_configs():
    cfgs = _tiny_configs()
    p = {a: profile_from_config(c) for a, c in cfgs.items()}
    assert (p["LlamaForCausalLM"].kind, p["LlamaForCausalLM"].head_dims, p["LlamaForCausalLM"].num_kv_heads) == (
        "mha", {16}, {1})
    for arch in ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"):
        g = p[arch]
        assert (g.head_dims, g.v_head_dims, g.num_kv_heads) == ({32, 64}, {32, 64}, {1, 2}), arch
        assert g.uses_sliding_window and not g.uses_softcap and resolve(cfgs[arch], gpu="cpu").profile.family == "gemma4"
    for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        assert (p[arch].kind, p[arch].head_dims, p[arch].v_head_dims) == ("mla", {48}, {32})
    assert p["DeepseekV32ForCausalLM"].kind == "nsa"
    for arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert (p[arch].head_dims, p[arch].num_kv_heads, p[arch].uses_sliding_window) == ({32}, {1}, False), arch
        assert resolve(cfgs[arch], gpu="cpu").profile.family == "llama", arch
    for arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        g = p[arch]
        assert (g.head_dims, g.num_kv_heads, g.uses_sliding_window) == ({32}, {2}, True), arch
        assert resolve(cfgs[arch], gpu="cpu").profile.family == "gemma3", arch
    # A config.json as the released Gemma 4 checkpoints write it (global_head_dim, nested text_config).
    released = {"architectures": ["Gemma4ForConditionalGeneration"], "dtype": "bfloat16", "text_config": {
        "model_type": "gemma4_text", "head_dim": 256, "global_head_dim": 512, "num_attention_heads": 32,
        "num_key_value_heads": 16, "num_global_key_value_heads": 4, "attention_k_eq_v": True,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "sliding_window": 1024,
        "final_logit_softcapping": 30.0, "num_hidden_layers": 6}}
    g = profile_from_config(released)
    assert (g.head_dims, g.num_kv_heads, g.dtype, g.final_logit_softcap) == ({256, 512}, {4, 16}, "bfloat16", 30.0)
    assert not g.uses_softcap  # the final-logit cap is not an attention soft-cap
    assert profile_from_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                                "num_attention_heads": 32}).head_dims == {128}


@pytest.mark.parametrize("gpu", ["cpu", "sm80"])
def test_config_resolves_like_its_cell(gpu):
    for arch, cfg in _tiny_configs().items():
        d = resolve(cfg, gpu=gpu)
        assert (d.prefill_backend, d.decode_backend, d.page_size) == expected(arch, gpu), arch
        assert d.profile.source == "config" and not d.adjustments


def test_blackwell_without_flashinfer_falls_back_and_says_so(flashinfer_missing):
    for arch in ("LlamaForCausalLM", "Gemma4ForConditionalGeneration", "DeepseekV3ForCausalLM"):
        d = resolve(arch, gpu="sm100")
        assert (d.prefill_backend, d.decode_backend, d.page_size) == ("triton", "triton", 64), arch
        assert len(d.adjustments) == 2
        assert all('pip install "attnzoo[flashinfer]"' in a and "using triton" in a for a in d.adjustments)
        assert d.sources["decode_backend"].level == "fallback"
        assert "adjustments made by the automatic policy" in d.explain()


def test_blackwell_tiny_models_fall_back_on_shape(flashinfer_installed):
    # The tiny test shapes are outside what the TRT-LLM kernels serve; the reason is in the Decision.
    cfgs = _tiny_configs()
    d = resolve(cfgs["LlamaForCausalLM"], gpu="sm100")
    assert d.decode_backend == "triton" and any("head dim(s) {16}" in a for a in d.adjustments)
    d = resolve(cfgs["DeepseekV3ForCausalLM"], gpu="sm100")
    assert (d.prefill_backend, d.decode_backend) == ("triton", "triton")
    assert any("head dims q/k {48} v {32} unsupported" in a for a in d.adjustments)


# ------------------------------------------------------------------------------------- overrides


def test_keyword_overrides_and_their_precedence():
    d = resolve("LlamaForCausalLM", gpu="sm80", overrides=Overrides(backend="torch"))
    assert (d.prefill_backend, d.decode_backend) == ("torch", "torch")
    assert d.sources["prefill_backend"].level == "override" and "backend='torch'" in d.sources["decode_backend"].detail
    assert d.sources["page_size"].level == "family_default"
    # A phase-specific keyword beats backend=.
    d = resolve("LlamaForCausalLM", gpu="sm80", overrides=Overrides(backend="torch", decode_backend="triton"))
    assert (d.prefill_backend, d.decode_backend) == ("torch", "triton")
    assert "decode_backend='triton'" in d.sources["decode_backend"].detail
    d = resolve("LlamaForCausalLM", gpu="sm80", overrides=Overrides(page_size=1))
    assert d.page_size == 1 and d.sources["page_size"].level == "override" and not d.adjustments


USER_POLICY = """\
schema = 1

[family.gemma4.gpu.sm90]
page_size = 32
reason = "family entry, GPU row"

[family.gemma4.arch.Gemma4ForConditionalGeneration]
decode = "torch"
reason = "arch entry, all GPUs"

[models."google/gemma-4-*"]
prefill = "torch"

[models."google/gemma-4-31B-*".gpu.sm90]
page_size = 8
"""


def test_user_policy_file_levels(tmp_path, flashinfer_installed):
    path = write(tmp_path, USER_POLICY)
    ov = Overrides(policy_file=path)
    arch = "Gemma4ForConditionalGeneration"
    # No model id: the arch entry and the family GPU row apply, the shipped table fills the rest.
    d = resolve(arch, gpu="sm90", overrides=ov)
    assert (d.prefill_backend, d.decode_backend, d.page_size) == ("flashinfer", "torch", 32)
    assert d.sources["decode_backend"].level == "user_policy"
    assert d.sources["decode_backend"].line == line_of(USER_POLICY, "[family.gemma4.arch.")
    assert d.sources["page_size"].where == "family.gemma4.gpu.sm90"
    assert d.sources["prefill_backend"].level == "family_default"
    # The arch entry is for Gemma4ForConditionalGeneration only.
    assert resolve("Gemma4ForCausalLM", gpu="sm90", overrides=ov).decode_backend == "flashinfer"
    # A model-id pattern beats the arch entry; the more literal pattern beats the shorter one.
    d = resolve(arch, gpu="sm90", overrides=ov, model_id="google/gemma-4-31B-it")
    assert (d.prefill_backend, d.decode_backend, d.page_size) == ("torch", "torch", 8)
    assert d.sources["page_size"].pattern == "google/gemma-4-31B-*"
    assert d.sources["prefill_backend"].pattern == "google/gemma-4-*"
    assert "google/gemma-4-31B-*" in d.explain() and str(path) in d.explain()
    # A GPU row applies on its GPU only.
    assert resolve(arch, gpu="sm100", overrides=ov, model_id="google/gemma-4-31B-it").page_size == 64
    # Keywords beat the file.
    d = resolve(arch, gpu="sm90", overrides=Overrides(policy_file=path, backend="triton", page_size=16),
                model_id="google/gemma-4-31B-it")
    assert (d.prefill_backend, d.decode_backend, d.page_size) == ("triton", "triton", 16)


def test_policy_env_var_and_file_precedence(tmp_path, monkeypatch):
    env_file = write(tmp_path, '[family.llama.gpu.sm90]\nbackend = "torch"\n', "env.toml")
    arg_file = write(tmp_path, '[family.llama.gpu.sm90]\npage_size = 4\n', "arg.toml")
    monkeypatch.setenv("ATTNZOO_POLICY", str(env_file))
    d = resolve("LlamaForCausalLM", gpu="sm90")
    assert (d.prefill_backend, d.decode_backend) == ("torch", "torch") and str(env_file) in d.policy_files
    d = resolve("LlamaForCausalLM", gpu="sm90", overrides=Overrides(policy_file=arg_file))
    assert (d.decode_backend, d.page_size) == ("triton", 4)  # the given file replaces the env one
    assert any("ATTNZOO_POLICY" in n and "ignored" in n for n in d.notes)
    monkeypatch.setenv("ATTNZOO_POLICY", str(tmp_path / "missing.toml"))
    with pytest.raises(PolicyError, match="missing.toml"):
        resolve("LlamaForCausalLM", gpu="sm90")


SMALL_TABLE = """\
schema = 1
[family.llama]
fallback = ["triton", "torch"]
profile = { kind = "mha", head_dims = [128], num_kv_heads = [8] }
[family.llama.gpu.sm90]
prefill = "triton"
decode = "triton"
page_size = 16
reason = "family default"
[family.llama.arch.LlamaForCausalLM.gpu.sm90]
decode = "torch"
reason = "arch entry"
[family.llama.arch.LlamaForCausalLM.gpu.sm100]
backend = "trtllm_mha"
page_size = 8
reason = "arch entry naming trtllm_mha with a page size it cannot take"
"""


def test_shipped_arch_entry_beats_family_default(tmp_path):
    table = write(tmp_path, SMALL_TABLE)
    d = resolve("LlamaForCausalLM", gpu="sm90", table=table)
    assert (d.prefill_backend, d.decode_backend, d.page_size) == ("triton", "torch", 16)
    assert d.sources["decode_backend"].level == "shipped_arch" and d.sources["decode_backend"].reason == "arch entry"
    assert d.sources["prefill_backend"].level == "family_default"


def test_automatic_policy_falls_back_and_says_so(tmp_path, monkeypatch, flashinfer_installed):
    table = write(tmp_path, SMALL_TABLE)
    # The row names trtllm_mha; were it unable to run here (FlashInfer missing), the automatic policy
    # walks the family's fallback list and records it.
    _pretend_modules(monkeypatch, flashinfer=False)
    d = resolve("LlamaForCausalLM", gpu="sm100", table=table)
    assert (d.prefill_backend, d.decode_backend) == ("triton", "triton")
    assert len(d.adjustments) == 2 and all("needs the Python package 'flashinfer'" in a and "triton" in a
                                           for a in d.adjustments)
    assert d.sources["decode_backend"].level == "fallback"
    assert "adjustments made by the automatic policy" in d.explain()
    rejected = [c for c in d.candidates if c.name == "trtllm_mha"]
    assert rejected and not any(c.accepted for c in rejected)
    # Installed, trtllm_mha runs, and the table's page size 8 is raised to what it needs.
    _pretend_modules(monkeypatch, flashinfer=True)
    d = resolve("LlamaForCausalLM", gpu="sm100", table=table)
    assert (d.prefill_backend, d.decode_backend, d.page_size) == ("trtllm_mha", "trtllm_mha", 16)
    assert any("page size raised from 8" in a and "{16, 32, 64}" in a for a in d.adjustments)
    assert d.sources["page_size"].level == "fallback"
    assert "page size raised from 8" in d.explain()
    # A model trtllm_mha cannot run (head dim 32) falls back too, with the reason.
    d = resolve(profile(dims=(32,)), gpu="sm100", table=table)
    assert d.decode_backend == "triton" and any("head dim(s) {32}" in a for a in d.adjustments)


def test_page_size_raised_for_trtllm_mla_and_block_table_padding(tmp_path, flashinfer_installed):
    mla = profile("DeepseekV3ForCausalLM", "deepseek_mla", "mla", (576,), (512,), num_heads=128)
    d = resolve(mla, gpu="sm100", overrides=Overrides(prefill_backend="triton"))
    assert (d.prefill_backend, d.decode_backend, d.page_size) == ("triton", "trtllm_mla", 64)
    assert any("trtllm_mla: block tables padded to a multiple of 2 columns" in n for n in d.notes)
    table = write(tmp_path, """\
[family.deepseek_mla]
fallback = ["triton", "torch"]
[family.deepseek_mla.arch.DeepseekV3ForCausalLM]
[family.deepseek_mla.gpu.sm100]
prefill = "torch"
decode = "torch"
page_size = 1
""", "table.toml")
    d = resolve(mla, gpu="sm100", overrides=Overrides(decode_backend="trtllm_mla"), table=table)
    assert (d.prefill_backend, d.page_size) == ("torch", 32) and any("multiple of 4 columns" in n for n in d.notes)
    assert any("raised from 1" in a and "trtllm_mla needs {32, 64}" in a for a in d.adjustments)


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
    _pretend_modules(monkeypatch, triton=False)
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

    cfg = _tiny_configs()["Gemma4ForConditionalGeneration"]
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
    _tiny_configs()["LlamaForCausalLM"].save_pretrained(local)
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


def test_xqa_group_limit_for_large_head_dims(flashinfer_installed):
    # XQA (trtllm_mha decode on sm90) serves head dims above 256 only with <= 16 query heads per KV head.
    wide = profile(dims=(512,), num_heads=32, num_kv_heads=frozenset({1}))
    _reject(BackendError, r"at most 16 query heads per KV head; this model has head dim 512 and up to 32",
            model=wide, decode_backend="trtllm_mha")
    ok = profile(dims=(512,), num_heads=32, num_kv_heads=frozenset({4}))
    assert resolve(ok, gpu="sm90", overrides=Overrides(decode_backend="trtllm_mha")).decode_backend == "trtllm_mha"
