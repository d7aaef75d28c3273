"""Each backend states its limits once, on its class: the policy's view of a backend and the backend's
own checks are the same declaration, and reading the declarations needs no kernel library.

The grid test builds every registered backend over a CPU pool (FlashInfer and the GPU query stubbed),
asks it to serve a layer, and compares the answer with the policy's for the same model shape, GPU,
page size, dtype and KV dtype.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from attnzoo.attention.backends import all_capabilities, backend_names, base, get_backend_class
from attnzoo.attention.backends.capabilities import GPUS, check_backend
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.layer import Attention
from attnzoo.policy.profile import ModelProfile
from attnzoo.errors import AttnzooError, BackendError

_CC = {"sm80": (8, 0), "sm89": (8, 9), "sm90": (9, 0), "sm100": (10, 0), "sm103": (10, 3), "sm120": (12, 0)}
_FI_MODULES = ("flashinfer", "flashinfer_mla", "trtllm_mha", "trtllm_mla")

# (id, layer arguments): MHA/GQA with the limits that differ between backends (head dims, groups,
# soft-cap, window, unequal v), MLA head counts (XQA-MLA's 128, trtllm-gen's 65..127 gap), a small
# MLA latent, and a sparse (NSA) layer.
LAYERS = [
    ("gqa-d128", dict(num_heads=8, num_kv_heads=2, head_dim=128)),
    ("mha-d64-softcap", dict(num_heads=4, num_kv_heads=4, head_dim=64, logit_softcap=30.0)),
    ("gqa32-d512-window", dict(num_heads=32, num_kv_heads=1, head_dim=512, sliding_window=64)),
    ("gqa-d256-v128", dict(num_heads=4, num_kv_heads=2, head_dim=256, v_head_dim=128)),
    ("mqa-d32", dict(num_heads=4, num_kv_heads=1, head_dim=32)),
    ("mla-128h", dict(num_heads=128, num_kv_heads=1, head_dim=576, v_head_dim=512, kind="mla")),
    ("mla-16h", dict(num_heads=16, num_kv_heads=1, head_dim=576, v_head_dim=512, kind="mla")),
    ("mla-100h", dict(num_heads=100, num_kv_heads=1, head_dim=576, v_head_dim=512, kind="mla")),
    ("mla-small", dict(num_heads=4, num_kv_heads=1, head_dim=48, v_head_dim=32, kind="mla")),
    ("nsa-16h", dict(num_heads=16, num_kv_heads=1, head_dim=576, v_head_dim=512, kind="mla", index_head_dim=128)),
]


def _profile(args: dict) -> ModelProfile:
    """The policy's description of a one-layer model with these layer arguments, written out by hand."""
    kind = "nsa" if args.get("index_head_dim") else args.get("kind", "mha")
    return ModelProfile(
        architecture="X", family="x", kind=kind, head_dims=frozenset({args["head_dim"]}),
        v_head_dims=frozenset({args.get("v_head_dim", args["head_dim"])}), num_heads=args["num_heads"],
        num_kv_heads=frozenset({args["num_kv_heads"]}), uses_sliding_window=bool(args.get("sliding_window")),
        uses_softcap=bool(args.get("logit_softcap")),
    )


@pytest.fixture
def stubbed(monkeypatch):
    """Backends built on CPU pools as if on GPU class ``gpu``: FlashInfer stubbed, the GPU query answered."""
    from importlib import import_module

    from attnzoo.attention.backends.fi_common import compute_capability

    fake = SimpleNamespace()  # constructors only keep it; no test here runs a kernel
    modules = [import_module(f"attnzoo.attention.backends.{m}") for m in _FI_MODULES]

    def on(gpu: str):
        monkeypatch.setattr(base, "device_gpu", lambda device: gpu)
        for mod in modules:
            monkeypatch.setattr(mod, "load_flashinfer", lambda name: fake)
            # "cpu": the real query, which refuses a CPU pool as FlashInfer backends do off CUDA.
            query = compute_capability if gpu == "cpu" else (lambda name, device, cc=_CC[gpu]: cc)
            monkeypatch.setattr(mod, "compute_capability", query)

    return on


def _runtime_accepts(name: str, layer: Attention, phase: str, page: int, dtype, kv: str) -> tuple[bool, str]:
    pool = KVPool([layer.kv_cache_spec()], num_pages=2, page_size=page, dtype=dtype, device="cpu",
                  kv_cache_dtype=kv)
    try:
        backend = get_backend_class(name)(pool)
        backend.check_layer(phase, layer)
    except BackendError as e:
        return False, str(e)
    return True, ""


def test_policy_and_backend_checks_agree_on_a_grid(stubbed):
    caps = all_capabilities()
    assume = frozenset({"flashinfer", "triton"})
    disagree, compared = [], 0
    for gpu in GPUS:
        stubbed(gpu)
        for layer_id, args in LAYERS:
            layer = Attention(0, **args)
            profile = _profile(args)
            for name in backend_names():
                for page in (1, 16, 32, 64, 128):
                    for dtype in (torch.bfloat16, torch.float32):
                        for kv in ("auto", "fp8_e4m3"):
                            for phase in ("prefill", "decode"):
                                policy = check_backend(caps[name], phase, profile, gpu=gpu,
                                                       dtype=str(dtype).removeprefix("torch."), kv_cache_dtype=kv,
                                                       assume_installed=assume, page_size=page)
                                ok, why = _runtime_accepts(name, layer, phase, page, dtype, kv)
                                compared += 1
                                if ok != policy.ok:
                                    disagree.append(f"{name} {phase} {layer_id} {gpu} page {page} {dtype} kv {kv}: "
                                                    f"policy {policy.violations or 'accepts'}; backend {why or 'accepts'}")
    assert compared == len(GPUS) * len(LAYERS) * len(backend_names()) * 5 * 2 * 2 * 2
    assert not disagree, f"{len(disagree)} of {compared} disagree, e.g.:\n" + "\n".join(disagree[:10])


def test_registry_line_is_the_whole_registration():
    """name and the engine's flags come from the declaration; NSA backends' layout too."""
    for name, c in all_capabilities().items():
        cls = get_backend_class(name)
        assert c is cls.capabilities and cls.name == c.name == name
        assert (cls.supports_cuda_graph, cls.supports_cascade) == (c.cuda_graph, c.cascade)
        if "nsa" in c.kinds:
            assert cls.mla_kv_layout.value == c.mla_kv_layout


def test_declarations_read_without_kernel_libraries():
    """The policy imports every backend module for its declaration: none may import Triton or FlashInfer."""
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # as if not installed: importing it raises
        sys.modules["flashinfer"] = None
        from attnzoo.attention.backends import all_capabilities
        from attnzoo.policy import Overrides, resolve
        assert len(all_capabilities()) >= 8
        d = resolve("DeepseekV3ForCausalLM", gpu="sm100", overrides=Overrides(assume_installed=("flashinfer", "triton")))
        assert d.decode_backend == "trtllm_mla", d.decode_backend
        loaded = sorted(m for m in sys.modules if m.startswith("attnzoo.attention.kernels."))
        assert not loaded, loaded
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_runtime_errors_name_the_constraint(stubbed):
    """A backend's own refusal carries the declaration's wording (one statement per constraint)."""
    stubbed("sm100")
    layer = Attention(0, 8, 2, 128, logit_softcap=20.0)
    ok, why = _runtime_accepts("trtllm_mha", layer, "decode", 16, torch.bfloat16, "auto")
    assert not ok and "trtllm_mha (layer 0): does not support attention logit soft-capping" in why
    ok, why = _runtime_accepts("trtllm_mha", Attention(0, 8, 2, 128), "decode", 8, torch.bfloat16, "auto")
    assert not ok and "trtllm_mha on sm100 needs page size 16, 32, 64; the KV pool has 8" in why
    ok, why = _runtime_accepts("trtllm_mha", Attention(0, 8, 2, 128), "decode", 16, torch.bfloat16, "fp8_e4m3")
    assert not ok and "not wired for an fp8 KV cache" in why
    stubbed("sm89")
    ok, why = _runtime_accepts("trtllm_mla", Attention(0, 128, 1, 576, v_head_dim=512, kind="mla"), "decode", 64,
                               torch.bfloat16, "auto")
    assert not ok and "SM100/SM103 (trtllm-gen) and SM120/SM121 (XQA-MLA); this GPU is sm89" in why
    with pytest.raises(AttnzooError):
        get_backend_class("flashinfer")(KVPool([Attention(0, 8, 2, 128).kv_cache_spec()], num_pages=2,
                                               page_size=16, dtype=torch.float32, device="cpu"))


# Facts about the kernels, written out from their libraries' documentation and sources (not read from the
# declarations): the grid above only shows that the policy and the backends read one declaration the same way;
# these show that the declaration says what the kernels do. (backend, phase, layer id, gpu, page, dtype, kv, runs)
FACTS = [
    ("torch", "decode", "gqa32-d512-window", "cpu", 1, torch.float32, "auto", True),
    ("torch", "prefill", "nsa-16h", "cpu", 64, torch.float32, "auto", True),
    ("trtllm_mha", "decode", "gqa-d128", "sm100", 16, torch.bfloat16, "auto", True),
    ("trtllm_mha", "decode", "gqa-d128", "sm100", 8, torch.bfloat16, "auto", False),  # trtllm-gen: 16/32/64
    ("trtllm_mha", "decode", "gqa-d128", "sm100", 128, torch.bfloat16, "auto", False),
    ("trtllm_mha", "decode", "gqa-d128", "sm90", 128, torch.bfloat16, "auto", True),  # XQA takes 128
    ("trtllm_mha", "decode", "gqa-d128", "sm80", 16, torch.bfloat16, "auto", False),  # XQA is SM90+
    ("trtllm_mha", "decode", "gqa-d128", "sm100", 16, torch.float32, "auto", False),  # bf16/fp16 kernels only
    ("trtllm_mha", "decode", "mha-d64-softcap", "sm100", 16, torch.bfloat16, "auto", False),
    ("trtllm_mha", "decode", "mla-128h", "sm100", 64, torch.bfloat16, "auto", False),
    ("trtllm_mla", "decode", "mla-128h", "sm100", 64, torch.bfloat16, "auto", True),
    ("trtllm_mla", "decode", "mla-128h", "sm100", 16, torch.bfloat16, "auto", False),  # trtllm-gen MLA: 32/64
    ("trtllm_mla", "decode", "mla-128h", "sm120", 16, torch.bfloat16, "auto", True),  # XQA-MLA builds 16
    ("trtllm_mla", "decode", "mla-16h", "sm120", 64, torch.bfloat16, "auto", False),  # XQA-MLA: 128 heads
    ("trtllm_mla", "decode", "mla-128h", "sm89", 64, torch.bfloat16, "auto", False),
    ("trtllm_mla", "prefill", "mla-128h", "sm100", 64, torch.bfloat16, "auto", False),  # decode only
    ("flashinfer", "prefill", "gqa32-d512-window", "sm90", 16, torch.bfloat16, "auto", True),  # FA2 for d512
    ("flashinfer_mla", "decode", "gqa-d128", "sm90", 64, torch.bfloat16, "auto", False),
    ("triton", "decode", "nsa-16h", "sm90", 64, torch.bfloat16, "auto", False),  # no sparse selection
    ("nsa_triton", "decode", "nsa-16h", "sm90", 64, torch.bfloat16, "auto", True),
    ("nsa_triton", "decode", "gqa-d128", "sm90", 64, torch.bfloat16, "auto", False),
]


@pytest.mark.parametrize("name,phase,layer_id,gpu,page,dtype,kv,runs", FACTS)
def test_declarations_state_the_kernels_facts(stubbed, name, phase, layer_id, gpu, page, dtype, kv, runs):
    args = dict(LAYERS)[layer_id]
    stubbed(gpu)
    policy = check_backend(all_capabilities()[name], phase, _profile(args), gpu=gpu,
                           dtype=str(dtype).removeprefix("torch."), kv_cache_dtype=kv,
                           assume_installed=frozenset({"flashinfer", "triton"}), page_size=page)
    ok, why = _runtime_accepts(name, Attention(0, **args), phase, page, dtype, kv)
    assert (policy.ok, ok) == (runs, runs), (policy.violations, why)
