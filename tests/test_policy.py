"""The attention-backend policy: the shipped table cell by cell and the precedence of overrides (its refusals and
policy-file errors: test_policy_errors.py; the Decision's JSON and `attnzoo policy`: test_policy_cli.py).

Everything runs on CPU: GPUs are named explicitly (gpu="sm100"). Whether the FlashInfer package is
installed is set per test (``flashinfer_installed`` / ``flashinfer_missing``) so that results do not
depend on the machine.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from attnzoo.attention.backends import all_capabilities, backend_names, get_backend_class
from attnzoo.policy import GPUS, Overrides, resolve
from attnzoo.policy.profile import profile_from_config
from attnzoo.cli import table_cells
from attnzoo.policy.table import SHIPPED_POLICY, load_table
from attnzoo.errors import PolicyError
from policy_helpers import (  # noqa: F401  (fixtures: used by name)
    ARCHS, SMALL_TABLE, USER_POLICY, _no_user_policy, flashinfer_installed, flashinfer_missing, line_of,
    pretend_modules, profile, tiny_configs, write,
)

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
# Mistral 4's 256-wide latent: trtllm_mla (576 / 512 only) cannot decode it, its Blackwell rows say flashinfer_mla.
_MISTRAL4 = {**EXPECTED["deepseek_mla"], **dict.fromkeys(("sm100", "sm103"), ("flashinfer_mla", "flashinfer_mla", 64))}
EXPECTED.update(Mistral4ForCausalLM=_MISTRAL4, Mistral3ForConditionalGeneration=_MISTRAL4)


def expected(arch: str, gpu: str) -> tuple:
    return EXPECTED.get(arch, EXPECTED[ARCHS[arch]])[gpu]


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


def test_profiles_from_hf_configs():
    cfgs = tiny_configs()
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
    for arch, cfg in tiny_configs().items():
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
    cfgs = tiny_configs()
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
    pretend_modules(monkeypatch, flashinfer=False)
    d = resolve("LlamaForCausalLM", gpu="sm100", table=table)
    assert (d.prefill_backend, d.decode_backend) == ("triton", "triton")
    assert len(d.adjustments) == 2 and all("needs the Python package 'flashinfer'" in a and "triton" in a
                                           for a in d.adjustments)
    assert d.sources["decode_backend"].level == "fallback"
    assert "adjustments made by the automatic policy" in d.explain()
    rejected = [c for c in d.candidates if c.name == "trtllm_mha"]
    assert rejected and not any(c.accepted for c in rejected)
    # Installed, trtllm_mha runs, and the table's page size 8 is raised to what it needs.
    pretend_modules(monkeypatch, flashinfer=True)
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
