"""The policy against the field (issue 19): every row's SGLang/vLLM choice and what justifies a difference,
`policy explain --assume-installed`, the capability corrections (trtllm_mla XQA-MLA on sm120, XQA page
128, FlashInfer's FA3 decode variant) in both the declarations and the backends' own runtime checks (FlashInfer
stubbed), and `attnzoo tune` on CPU.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.layer import Attention
from attnzoo.attention.metadata import build_metadata
from attnzoo.policy import GPUS, ModelProfile, Overrides, resolve
from attnzoo.attention.backends import capabilities as caps_mod
from attnzoo.cli import main as policy_main
from attnzoo.policy.table import SHIPPED_POLICY, load_table
from attnzoo.errors import BackendError, PolicyError

ROOT = Path(__file__).parents[1]
# SGLang's backend names that are also attnzoo backends (MLA models: SGLang's "flashinfer" is FlashInfer MLA).
SGLANG_AS_ATTNZOO = {"triton": "triton", "trtllm_mha": "trtllm_mha", "trtllm_mla": "trtllm_mla",
                     "flashinfer": "flashinfer", "fa3": None, "fa4": None, "dsa:": None}


@pytest.fixture(autouse=True)
def _no_user_policy(monkeypatch):
    monkeypatch.delenv("ATTNZOO_POLICY", raising=False)


def _modules(monkeypatch, **present):
    real = caps_mod.module_available
    monkeypatch.setattr(caps_mod, "module_available", lambda m: present.get(m, real(m)) if m else True)


def _shipped_rows():
    for fam in load_table(SHIPPED_POLICY, shipped=True).families.values():
        for gpu, row in fam.entry.gpus.items():
            yield fam.name, gpu, row


# ------------------------------------------------------------------------------ the field, per row


def test_every_gpu_row_records_the_field_and_justifies_differences():
    for fam, gpu, row in _shipped_rows():
        if gpu == "cpu":
            assert row.field is None, row.where  # the field's defaults are GPU defaults
            continue
        f = row.field
        assert f is not None, f"{row.where} does not record the field's choice"
        assert "SGLang 0.5.23" in f["read"] and "vLLM 0.33.0" in f["read"], row.where
        if not f["agrees"]:
            assert row.measured_in, f"{row.where} differs from the field without measured_in (a file or 'unmeasured')"
            if row.measured_in != "unmeasured":
                assert (ROOT / row.measured_in).is_file(), row.measured_in
        # A row that says it agrees must run what SGLang names, where SGLang's name is an attnzoo backend.
        first = f["sglang"].split()[0].rstrip(";,")
        ours = SGLANG_AS_ATTNZOO.get(first, "unknown")
        if fam == "deepseek_mla" and ours == "flashinfer":
            ours = "flashinfer_mla"
        if f["agrees"]:
            assert ours == row.decode == row.prefill, f"{row.where}: agrees but SGLang runs {f['sglang']!r}"


def test_gemma4_sm90_and_deepseek_sm100_rows_say_what_the_field_does():
    rows = {(fam, gpu): row for fam, gpu, row in _shipped_rows()}
    gemma = rows["gemma4", "sm90"]
    assert "refuses flashinfer" in gemma.field["sglang"] and "refuses flashinfer" in gemma.reason
    for gpu in ("sm100", "sm103"):
        ds = rows["deepseek_mla", gpu]
        assert "no prefill kernel" not in ds.reason and "trtllm_ragged_attention_deepseek" in ds.reason


def test_explain_shows_the_field_and_the_justification(capsys):
    d = resolve("LlamaForCausalLM", gpu="sm90")
    assert d.field_choice["sglang"] == "fa3" and d.field_choice["differs"]
    assert d.field_choice["justified_by"] == "benchmarks/results/attention_nvidia_h100_80gb_hbm3_quick.json"
    text = d.explain()
    assert "field: SGLang fa3; vLLM FLASH_ATTN (FA3)" in text
    assert "differs from the field: measured in benchmarks/results/" in text
    assert "differs from the field: unmeasured" in resolve("LlamaForCausalLM", gpu="sm80").explain()
    assert "agrees with the field" in resolve("Gemma4ForCausalLM", gpu="sm120").explain()
    assert policy_main(["policy", "explain", "LlamaForCausalLM", "--gpu", "sm120", "--json"]) == 0
    field = json.loads(capsys.readouterr().out)["field"]
    assert field["differs"] and field["justified_by"] == "unmeasured" and "FLASH_ATTN" in field["vllm"]
    assert policy_main(["policy", "show", "--gpu", "sm90"]) == 0
    out = capsys.readouterr().out
    assert "vs field" in out.splitlines()[0] and "differs, unmeasured" in out and "differs, measured" in out


def test_field_in_a_policy_file_is_validated(tmp_path):
    text = '[family.llama.gpu.sm90]\ndecode = "torch"\nfield = { sglang = "fa3", vllm = "FLASH_ATTN" }\n'
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(PolicyError, match=rf"{path}:3: key 'family.llama.gpu.sm90.field': missing 'agrees'"):
        resolve("LlamaForCausalLM", gpu="sm90", overrides=Overrides(policy_file=path))
    path.write_text(text.replace('vllm = "FLASH_ATTN"', 'vllm = "FLASH_ATTN", agrees = "no"'))
    with pytest.raises(PolicyError, match="field.agrees'"):
        resolve("LlamaForCausalLM", gpu="sm90", overrides=Overrides(policy_file=path))


# ------------------------------------------------------------------- explain --assume-installed


def test_assume_installed_answers_for_another_machine(monkeypatch, capsys):
    _modules(monkeypatch, flashinfer=False)
    assert resolve("LlamaForCausalLM", gpu="sm100").decode_backend == "triton"  # what would run HERE
    assert policy_main(["policy", "explain", "LlamaForCausalLM", "--gpu", "sm100", "--assume-installed"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("HYPOTHETICAL: assumes flashinfer, triton installed")
    assert out[1].startswith("LlamaForCausalLM on sm100: prefill trtllm_mha, decode trtllm_mha")
    assert policy_main(["policy", "explain", "DeepseekV3ForCausalLM", "--gpu", "sm100", "--json",
                        "--assume-installed", "flashinfer"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["prefill_backend"], data["decode_backend"]) == ("flashinfer_mla", "trtllm_mla")
    assert data["hypothetical"]["assumed_installed"] == ["flashinfer"] and not data["adjustments"]
    assert resolve("LlamaForCausalLM", gpu="sm100").to_dict()["hypothetical"] is None
    assert policy_main(["policy", "explain", "LlamaForCausalLM", "--assume-installed", "vllm"]) == 2
    assert "unknown package(s) vllm" in capsys.readouterr().err


# -------------------------------------------------------------------- capabilities (declared)


def _mla(heads=128) -> ModelProfile:
    return ModelProfile(architecture="DeepseekV3ForCausalLM", family="deepseek_mla", kind="mla",
                        head_dims=frozenset({576}), v_head_dims=frozenset({512}), num_heads=heads,
                        num_kv_heads=frozenset({1}))


def test_trtllm_mla_declared_on_sm120_via_xqa_mla(monkeypatch):
    _modules(monkeypatch, flashinfer=True)
    d = resolve(_mla(), gpu="sm120", overrides=Overrides(decode_backend="trtllm_mla"))
    assert d.decode_backend == "trtllm_mla" and d.kernels["decode"] == "XQA-MLA decode"
    assert d.page_size == 64 and any("multiple of 2 columns" in n for n in d.notes)
    d = resolve(_mla(), gpu="sm120", overrides=Overrides(decode_backend="trtllm_mla", page_size=16))
    assert d.page_size == 16 and any("multiple of 8 columns" in n for n in d.notes)  # XQA-MLA builds page 16; sm100 trtllm-gen does not
    with pytest.raises(PolicyError, match=r"trtllm_mla needs \{32, 64\}"):
        resolve(_mla(), gpu="sm100", overrides=Overrides(decode_backend="trtllm_mla", page_size=16))
    with pytest.raises(BackendError, match=r"XQA-MLA decode on sm120 runs \{128\} query heads; this model has 16"):
        resolve(_mla(16), gpu="sm120", overrides=Overrides(decode_backend="trtllm_mla"))
    assert resolve(_mla(16), gpu="sm100", overrides=Overrides(decode_backend="trtllm_mla")).decode_backend == "trtllm_mla"
    assert resolve(_mla(), gpu="sm120").decode_backend == "triton"  # the row follows the field (unmeasured XQA-MLA)


def test_xqa_takes_page_128_and_sinks_where_its_kernels_do(monkeypatch):
    _modules(monkeypatch, flashinfer=True)
    d = resolve("LlamaForCausalLM", gpu="sm90", overrides=Overrides(backend="trtllm_mha", page_size=128))
    assert d.page_size == 128 and d.kernels["decode"].startswith("XQA")
    with pytest.raises(PolicyError, match=r"page size 128 .* trtllm_mha needs \{16, 32, 64\}"):
        resolve("LlamaForCausalLM", gpu="sm100", overrides=Overrides(backend="trtllm_mha", page_size=128))
    sinks = ModelProfile(architecture="LlamaForCausalLM", family="llama", kind="mha", head_dims=frozenset({128}),
                         v_head_dims=frozenset({128}), uses_sinks=True, num_heads=32, num_kv_heads=frozenset({8}))
    # XQA decode takes sinks; the FlashInfer prefill trtllm_mha runs as on Hopper does not.
    assert resolve(sinks, gpu="sm90", overrides=Overrides(decode_backend="trtllm_mha")).decode_backend == "trtllm_mha"
    with pytest.raises(BackendError, match="FlashInfer FA3 prefill on sm90 does not take attention sinks"):
        resolve(sinks, gpu="sm90", overrides=Overrides(backend="trtllm_mha"))
    with pytest.raises(BackendError, match=r"does not support attention sinks.*\(backends that do: torch, triton, trtllm_mha\)"):
        resolve(sinks, gpu="sm90", overrides=Overrides(backend="flashinfer"))


# ---------------------------------------------------------- the backends' runtime checks (stubbed)


class _Recorder:
    def __init__(self, out_dim=None):
        self.calls, self.out_dim = [], out_dim

    def __call__(self, **kw):
        self.calls.append(kw)
        q = kw["query"]
        return torch.zeros(*q.shape[:-1], self.out_dim or q.shape[-1], dtype=q.dtype)


class _Wrapper:
    def __init__(self, **kw):
        self.kwargs, self.plans = kw, []

    def plan(self, **kw):
        self.plans.append(kw)

    def run(self, *, q, paged_kv_cache, return_lse=False):
        return torch.zeros_like(q)


def _stub(monkeypatch, name, cc, **fns):
    from attnzoo.attention.backends import flashinfer as fi_backend
    from attnzoo.attention.backends import get_backend_class

    fake = SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_Wrapper, BatchDecodeWithPagedKVCacheWrapper=_Wrapper,
                           **fns)
    cls = get_backend_class(name)
    for mod in {sys.modules[cls.__module__], fi_backend}:
        monkeypatch.setattr(mod, "load_flashinfer", lambda n: fake)
        monkeypatch.setattr(mod, "compute_capability", lambda n, device: cc)
    return cls


def _decode_meta(page_size, seq=(20, 33)):
    tables = [[1, 2, 3], [4, 5, 6]][: len(seq)]
    return build_metadata(prefix_lens=[s - 1 for s in seq], q_lens=[1] * len(seq),
                          block_tables=[t[: -(-s // page_size)] for t, s in zip(tables, seq)],
                          page_size=page_size, device="cpu")


@pytest.mark.parametrize("heads,cc,page,fails_at,error", [
    (128, (12, 0), 16, None, None), (128, (12, 1), 128, None, None),
    (16, (12, 0), 16, "decode", r"XQA-MLA decode on sm120 runs \{128\} query heads"),
    (128, (10, 0), 16, "init", "needs page size 32, 64"), (128, (9, 0), 32, "init", r"SM120/SM121 \(XQA-MLA\)"),
])
def test_trtllm_mla_runtime_xqa_mla_on_sm120(monkeypatch, heads, cc, page, fails_at, error):
    rec = _Recorder(out_dim=512)
    cls = _stub(monkeypatch, "trtllm_mla", cc, trtllm_batch_decode_with_kv_cache_mla=rec)
    layer = Attention(0, heads, 1, 576, v_head_dim=512, kind="mla")
    pool = KVPool([layer.kv_cache_spec()], num_pages=8, page_size=page, dtype=torch.bfloat16, device="cpu")
    q = torch.zeros(2, heads, 576, dtype=torch.bfloat16)
    if fails_at == "init":
        with pytest.raises(BackendError, match=error):
            cls(pool)
        return
    be = cls(pool)
    meta = _decode_meta(page)
    plan = be.prepare(meta)
    if fails_at == "decode":
        with pytest.raises(BackendError, match=error):
            be.decode(layer, q, meta, plan)
        return
    assert be.decode(layer, q, meta, plan).shape == (2, heads, 512)
    call = rec.calls[-1]
    assert call["backend"] == "xqa" and call["block_tables"].shape[1] % (128 // page) == 0
    assert be.kernels_for(layer)["decode"].startswith("xqa MLA decode")


@pytest.mark.parametrize("cc,ok", [((9, 0), True), ((12, 0), True), ((10, 0), False)])
def test_trtllm_mha_runtime_page_128_on_xqa_only(monkeypatch, cc, ok):
    rec = _Recorder()
    cls = _stub(monkeypatch, "trtllm_mha", cc, trtllm_batch_decode_with_kv_cache=rec)
    layer = Attention(0, 8, 2, 64)
    pool = KVPool([layer.kv_cache_spec()], num_pages=4, page_size=128, dtype=torch.bfloat16, device="cpu")
    if not ok:
        with pytest.raises(BackendError, match="trtllm_mha on sm100 needs page size 16, 32, 64"):
            cls(pool)
        return
    be = cls(pool)
    meta = _decode_meta(128, seq=(130, 200))
    be.decode(layer, torch.zeros(2, 8, 64, dtype=torch.bfloat16), meta, be.prepare(meta))
    assert rec.calls[-1]["backend"] == "xqa" and rec.calls[-1]["block_tables"].shape == (2, 2)


def test_flashinfer_fa3_decode_variant(monkeypatch):
    cls = _stub(monkeypatch, "flashinfer", (9, 0))
    layer = Attention(0, 8, 8, 128)  # group 1: FA2 would use the CUDA-core kernel; FA3 is the tensor-core path
    pool = KVPool([layer.kv_cache_spec()], num_pages=8, page_size=16, dtype=torch.bfloat16, device="cpu")
    be = cls(pool, decode_variant="fa3")
    meta = _decode_meta(16)
    be.decode(layer, torch.zeros(2, 8, 128, dtype=torch.bfloat16), meta, be.prepare(meta))
    wrapper = next(iter(be._decode_wrappers.values()))
    assert wrapper.kwargs["backend"] == "fa3" and wrapper.kwargs["use_tensor_cores"]
    assert "fa3 paged kernel" in be.kernels_for(layer)["decode"]
    assert "fa2 decode (CUDA cores)" in cls(pool).kernels_for(layer)["decode"]  # the default is unchanged
    big = Attention(0, 8, 2, 512)
    with pytest.raises(BackendError, match="do not build for head dim 512"):
        be.kernels_for(big)
    monkeypatch.setattr(sys.modules[cls.__module__], "compute_capability", lambda n, device: (8, 0))
    with pytest.raises(BackendError, match="SM90 only"):
        cls(pool, decode_variant="fa3")


# --------------------------------------------------------------------------------- attnzoo tune


def test_tune_on_cpu_writes_a_policy_file_load_model_uses(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    import attnzoo
    from attnzoo.tune import format_table, tune

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64)
    cfg.architectures = ["LlamaForCausalLM"]
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "tuned.toml"
    # Only triton is timed (the interpreter on CPU), so the file must change the shipped CPU choice (torch).
    r = tune(str(tmp_path / "ckpt"), device="cpu", backends=["triton", "flashinfer"], output=out,
             points={"decode": ((1, 8), (2, 16)), "prefill": ((1, 8),)}, warmup=0, iters=1, progress=False)
    assert (r["prefill"], r["decode"], r["gpu"]) == ("triton", "triton", "cpu")
    assert {(x["phase"], x["batch"], x["context"]) for x in r["rows"]} == {("decode", 1, 8), ("decode", 2, 16),
                                                                         ("prefill", 1, 8)}
    assert {s["backend"] for s in r["skipped"]} == {"flashinfer"}
    assert r["layer_shapes"] == {"mha 2/1 heads, q/k 16 v 16": 2}
    table = format_table(r)
    assert "*triton" in table and "skipped flashinfer" in table
    text = out.read_text()
    assert "[family.llama.arch.LlamaForCausalLM.gpu.cpu]" in text and "[measured]" in text
    llm = attnzoo.load_model(str(tmp_path / "ckpt"), policy_file=str(out), device="cpu")
    assert (llm.decision.prefill_backend, llm.decision.decode_backend) == ("triton", "triton")
    assert llm.decision.sources["decode_backend"].level == "user_policy"
    with pytest.raises(PolicyError, match="unknown backend"):
        tune(str(tmp_path / "ckpt"), device="cpu", backends=["fa3"], output=out, progress=False)


def test_field_page_is_generated_from_the_table():
    # docs/policy_field.md is the table's field comparison; a row edit without regenerating it fails here.
    import importlib.util

    spec = importlib.util.spec_from_file_location("policy_field_doc", ROOT / "scripts" / "policy_field_doc.py")
    doc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(doc)
    text = doc.render()
    assert (ROOT / "docs" / "policy_field.md").read_text(encoding="utf-8") == text, \
        "docs/policy_field.md is stale: run python scripts/policy_field_doc.py"
    for fam, gpu, row in _shipped_rows():  # every GPU row with a field choice is on the page
        if row.field:
            assert row.field["vllm"].replace("|", "\\|") in text, row.where
