"""What each attention backend can run, declared as data and checked in one place.

A declaration may exist before its backend does (the FlashInfer family is declared ahead of its
implementation): resolution only ever picks backends registered in
``attnzoo.attention.backends._REGISTRY``, and naming a declared-but-unregistered one is an error that says
so. Checking never imports a backend module: it must be cheap and work on a machine without CUDA.

GPU classes are compute capabilities as the policy table names them: "sm80" (A100), "sm89" (L40S/4090),
"sm90" (H100/H200), "sm100" (B200/GB200), "sm103" (B300/GB300), "sm120" (RTX PRO 6000 / 5090), and "cpu".
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

GPUS: tuple[str, ...] = ("cpu", "sm80", "sm89", "sm90", "sm100", "sm103", "sm120")
CUDA_GPUS = frozenset(GPUS) - {"cpu"}
ATTENTION_KINDS: tuple[str, ...] = ("mha", "mla", "nsa")
PHASES: tuple[str, ...] = ("prefill", "decode")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
# kv_cache_dtype values: "auto" stores the model's dtype; the others name what the pool stores.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3")
_FP8 = frozenset({"fp8_e4m3"})
MAX_PAGE_SIZE = 128  # the KV pool's own limit (kv_cache.KVPool)
_HALF = frozenset({"bfloat16", "float16"})
_ALL_DTYPES = frozenset(DTYPES)


@dataclass(frozen=True)
class Kernel:
    """One kernel family a backend uses for a phase, and where it runs.

    A phase lists its kernels in order of preference; the first whose GPUs and head dims fit the model
    serves it. ``runs_as`` names the backend whose kernel actually runs (trtllm_mha prefill off
    Blackwell runs FlashInfer's prefill), so the Decision can say so.
    """

    name: str
    gpus: frozenset[str]
    excluded_head_dims: frozenset[int] = frozenset()
    runs_as: str | None = None
    # (variable, value) that must be set in the environment for this kernel to run (Triton on CPU).
    requires_env: tuple[str, str] | None = None
    # (head dim d, group g): layers with head dim above d need at most g query heads per KV head (XQA).
    max_group_above: tuple[int, int] | None = None
    # KV page sizes this kernel takes; None: what the backend's page_sizes say.
    page_sizes: frozenset[int] | None = None
    # Query-head counts it runs; None: any the backend allows (XQA-MLA builds for 128 heads only).
    num_heads: frozenset[int] | None = None
    # GPUs where this kernel does not read an fp8 KV cache (the backend's kv_dtypes say whether any does).
    no_fp8_kv_gpus: frozenset[str] = frozenset()
    note: str = ""

    def env_ok(self) -> bool:
        return self.requires_env is None or os.environ.get(self.requires_env[0]) == self.requires_env[1]


@dataclass(frozen=True)
class BackendCapabilities:
    name: str
    description: str
    kinds: frozenset[str]  # subset of ATTENTION_KINDS
    prefill: tuple[Kernel, ...]  # empty: the backend has no prefill path
    decode: tuple[Kernel, ...]  # empty: the backend has no decode path
    # q/k head dims: an explicit set, or None for any dim in 1..max_head_dim.
    head_dims: frozenset[int] | None = None
    max_head_dim: int = 1024
    # v head dims: as head_dims; None with head_dims None means "any up to max_head_dim".
    v_head_dims: frozenset[int] | None = None
    # MLA/NSA: the (q/k, v) head dims of the absorbed form it serves; None = anything head dims allow.
    mla_dims: frozenset[tuple[int, int]] | None = None
    # MLA/NSA alternative to mla_dims: (m, r) = latent width a multiple of m, rope width a positive multiple of r.
    mla_multiples: tuple[int, int] | None = None
    same_qk_v_head_dim: bool = False  # q/k and v head dims must be equal
    excluded_num_heads: tuple[int, int] | None = None  # query-head counts lo..hi it does not run
    page_sizes: frozenset[int] | None = None  # None: any of 1..MAX_PAGE_SIZE
    dtypes: frozenset[str] = _ALL_DTYPES  # model/activation dtypes
    # What the KV pool may store for it: the model dtypes ("auto") and the kv_cache_dtype values it reads.
    kv_dtypes: frozenset[str] = _ALL_DTYPES
    sliding_window: bool = False
    logit_softcap: bool = False
    attention_sinks: bool = False
    module: str | None = None  # importable module the backend needs; None: nothing beyond torch
    extra: str | None = None  # pip extra that installs it: pip install "attnzoo[<extra>]"
    cuda_graph: bool = False
    # Decode reads a prefix shared by the whole batch once per step (cascade attention; eager steps).
    cascade: bool = False
    kv_layout: str = "HND"  # the KV layout it reads (kv_cache.KVPool writes HND)
    # MLA/NSA caches: the entry layout it reads (attnzoo.attention.kv_layout.KVLayout values). The pool
    # holds "bf16" (model-dtype) entries; a backend reading another layout keeps a converted copy.
    mla_kv_layout: str = "bf16"
    # Block tables padded so that columns * page_size is a multiple of this (trtllm_mla: 128).
    block_table_pad_tokens: int | None = None
    notes: tuple[str, ...] = ()

    def layout_for(self, kind: str) -> str:
        """The cache layout it reads for a model of this attention kind."""
        return self.kv_layout if kind == "mha" else self.mla_kv_layout

    def kernels(self, phase: str) -> tuple[Kernel, ...]:
        return self.prefill if phase == "prefill" else self.decode

    def gpus(self, phase: str) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for k in self.kernels(phase):
            out |= k.gpus
        return out

    def phases(self) -> tuple[str, ...]:
        return tuple(p for p in PHASES if self.kernels(p))

    def block_table_columns_multiple(self, page_size: int) -> int:
        """Block-table column count must be a multiple of this (1 = no padding needed)."""
        if not self.block_table_pad_tokens:
            return 1
        return max(1, self.block_table_pad_tokens // page_size)

    def page_sizes_on(self, gpu: str | None) -> frozenset[int] | None:
        """Page sizes the backend takes on ``gpu`` (None: any). One pool serves both phases: a phase takes
        the union of its kernels' sets there, the backend the intersection over its phases."""
        here = {p: [k for k in self.kernels(p) if gpu in k.gpus] for p in self.phases()} if gpu else {}
        if not any(here.values()):
            return self.page_sizes
        out: frozenset[int] | None = None
        for kernels in here.values():
            sets = [k.page_sizes if k.page_sizes is not None else self.page_sizes for k in kernels]
            if not sets or any(s is None for s in sets):
                continue  # this phase does not run here, or one of its kernels takes any page size
            phase_set = frozenset().union(*sets)
            out = phase_set if out is None else out & phase_set
        return out

    def page_size_ok(self, page_size: int, gpu: str | None = None) -> bool:
        allowed = self.page_sizes_on(gpu)
        if allowed is None:
            return 1 <= page_size <= MAX_PAGE_SIZE
        return page_size in allowed

    def page_sizes_text(self, gpu: str | None = None) -> str:
        allowed = self.page_sizes_on(gpu)
        if gpu is None and any(k.page_sizes for p in self.phases() for k in self.kernels(p)):
            per = [f"{_fmt(k.page_sizes)} ({k.name})" for p in self.phases() for k in self.kernels(p) if k.page_sizes]
            return "; ".join(dict.fromkeys(per))
        return f"1..{MAX_PAGE_SIZE}" if allowed is None else _fmt(allowed)

    def head_dims_text(self) -> str:
        if self.mla_multiples is not None:
            m, r = self.mla_multiples
            return f"latent a multiple of {m}, rope a positive multiple of {r} (q/k = latent + rope, v = latent)"
        if self.mla_dims is not None:
            return " or ".join(f"(q/k {q}, v {v})" for q, v in sorted(self.mla_dims))
        if self.head_dims is None:
            return f"any up to {self.max_head_dim}"
        return _fmt(self.head_dims)

    def to_dict(self) -> dict:
        def kern(k: Kernel) -> dict:
            d = {"kernel": k.name, "gpus": sorted(k.gpus, key=GPUS.index)}
            if k.excluded_head_dims:
                d["excluded_head_dims"] = sorted(k.excluded_head_dims)
            if k.runs_as:
                d["runs_as"] = k.runs_as
            if k.no_fp8_kv_gpus:
                d["no_fp8_kv_gpus"] = sorted(k.no_fp8_kv_gpus, key=GPUS.index)
            if k.requires_env:
                d["requires_env"] = f"{k.requires_env[0]}={k.requires_env[1]}"
            if k.page_sizes:
                d["page_sizes"] = sorted(k.page_sizes)
            if k.num_heads:
                d["num_heads"] = sorted(k.num_heads)
            if k.note:
                d["note"] = k.note
            return d

        return {
            "name": self.name,
            "description": self.description,
            "kinds": sorted(self.kinds),
            "prefill": [kern(k) for k in self.prefill],
            "decode": [kern(k) for k in self.decode],
            "head_dims": self.head_dims_text(),
            "page_sizes": self.page_sizes_text(),
            "dtypes": sorted(self.dtypes),
            "kv_dtypes": sorted(self.kv_dtypes),
            "sliding_window": self.sliding_window,
            "logit_softcap": self.logit_softcap,
            "attention_sinks": self.attention_sinks,
            "module": self.module,
            "extra": self.extra,
            "cuda_graph": self.cuda_graph,
            "cascade": self.cascade,
            "kv_layout": self.kv_layout,
            "mla_kv_layout": self.mla_kv_layout,
            "block_table_pad_tokens": self.block_table_pad_tokens,
            "notes": list(self.notes),
        }


POOL_MLA_LAYOUT = "bf16"  # what KVPool holds for MLA/NSA layers: model-dtype [latent | rope] entries


def kv_layout_notes(prefill: BackendCapabilities, decode: BackendCapabilities, kind: str) -> list[str]:
    """What the Decision says about KV layouts: a mismatch between the phases, and every conversion."""
    pre, dec = prefill.layout_for(kind), decode.layout_for(kind)
    notes = []
    if pre != dec:
        notes.append(f"prefill ({prefill.name}) reads KV layout {pre} and decode ({decode.name}) reads {dec}: "
                     "the cache is converted between them")
    if kind == "mha":
        return notes
    phases = {"prefill and decode": prefill} if prefill.name == decode.name else {"prefill": prefill, "decode": decode}
    for phase, caps in phases.items():
        if caps.mla_kv_layout != POOL_MLA_LAYOUT:
            notes.append(
                f"{phase} backend {caps.name} reads KV layout {caps.mla_kv_layout}: the pool keeps "
                f"{POOL_MLA_LAYOUT} (model dtype) entries and a Triton kernel (attnzoo/attention/kernels/kv_layout.py) "
                f"converts each token once, when its layer stores it, into {caps.name}'s {caps.mla_kv_layout} copy"
            )
    return notes


def _fmt(values) -> str:
    return "{" + ", ".join(str(v) for v in sorted(values)) + "}"


def _gpus(*names: str) -> frozenset[str]:
    unknown = set(names) - set(GPUS)
    assert not unknown, unknown
    return frozenset(names)


_NSA_TRITON = (
    Kernel("triton indexer + sparse MLA", frozenset(CUDA_GPUS)),
    Kernel("triton indexer + sparse MLA (interpreter)", frozenset({"cpu"}), requires_env=("TRITON_INTERPRET", "1"),
           note="CPU runs the Triton interpreter: for tests only, very slow"),
)
_MLA_DS = frozenset({(576, 512)})
_TRTLLM_GEN_PAGES = frozenset({16, 32, 64})  # DeepSeek absorbed MLA: kv_lora_rank 512 + rope 64, values 512
_ANY_CUDA = frozenset(CUDA_GPUS)

CAPABILITIES: dict[str, BackendCapabilities] = {
    c.name: c
    for c in (
        BackendCapabilities(
            name="torch",
            description="exact float32-accumulating reference over gathered pages; the correctness oracle",
            kinds=frozenset({"mha", "mla", "nsa"}),
            prefill=(Kernel("torch reference", frozenset(GPUS)),),
            decode=(Kernel("torch reference", frozenset(GPUS)),),
            max_head_dim=1024,
            kv_dtypes=_ALL_DTYPES | _FP8,
            sliding_window=True,
            logit_softcap=True,
            module="torch",
            notes=("fp8_e4m3 KV cache: quantize-dequantize in float32 (per-tensor scales)",),
        ),
        BackendCapabilities(
            name="triton",
            description="attnzoo's own Triton paged extend/decode kernels (split-K decode)",
            kinds=frozenset({"mha", "mla"}),
            prefill=(
                Kernel("triton extend", _ANY_CUDA, no_fp8_kv_gpus=_gpus("sm80"),
                       note="Triton has no fp8 e4m3 conversions before SM89"),
                Kernel("triton extend (interpreter)", _gpus("cpu"), requires_env=("TRITON_INTERPRET", "1"),
                       note="CPU runs the Triton interpreter: for tests only, very slow"),
            ),
            decode=(
                Kernel("triton split-K decode", _ANY_CUDA, no_fp8_kv_gpus=_gpus("sm80"),
                       note="Triton has no fp8 e4m3 conversions before SM89"),
                Kernel("triton split-K decode (interpreter)", _gpus("cpu"), requires_env=("TRITON_INTERPRET", "1"),
                       note="CPU runs the Triton interpreter: for tests only, very slow"),
            ),
            # The kernels tile any width up to 1024 (attention/kernels/common.py MAX_HEAD_DIM); tuned
            # for 64..512 and MLA's 576/512.
            max_head_dim=1024,
            kv_dtypes=_ALL_DTYPES | _FP8,
            sliding_window=True,
            logit_softcap=True,
            module="triton",
            extra="triton",
            cuda_graph=True,
            cascade=True,
            notes=("tuned for head dims 64..512 (MHA) and 576/512 (MLA); smaller dims run padded",),
        ),
        BackendCapabilities(
            name="flashinfer",
            description="FlashInfer paged prefill/decode wrappers (FA2 everywhere, FA3 prefill on SM90)",
            kinds=frozenset({"mha"}),
            prefill=(
                Kernel("FlashInfer FA3 prefill", _gpus("sm90"), excluded_head_dims=frozenset({512}),
                       no_fp8_kv_gpus=_gpus("sm90"),
                       note="FA3 prefill does not build for head dim 512, nor for an fp8 KV cache with bf16/fp16 queries"),
                Kernel("FlashInfer FA2 prefill", _ANY_CUDA, no_fp8_kv_gpus=_gpus("sm80"),
                       note="fp8 KV cache declared for SM89+ only"),
            ),
            decode=(Kernel("FlashInfer FA2 decode", _ANY_CUDA, no_fp8_kv_gpus=_gpus("sm80"),
                           note="fp8 KV cache declared for SM89+ only"),),
            head_dims=frozenset({64, 128, 256, 512}),
            v_head_dims=frozenset({64, 128, 256, 512}),
            dtypes=_HALF,
            kv_dtypes=_HALF | _FP8,
            sliding_window=True,
            logit_softcap=True,
            module="flashinfer",
            extra="flashinfer",
            cuda_graph=True,
            cascade=True,
            notes=("decode layers whose v head dim differs from q/k run through the prefill wrapper",
                   "cascade decode: the shared prefix through the prefill wrapper (all queries, not causal), "
                   "the rest through the decode wrapper, merged by log-sum-exp (merge_state)"),
        ),
        BackendCapabilities(
            name="trtllm_mha",
            description="TRT-LLM attention through FlashInfer: trtllm-gen on SM100/SM103, XQA decode on SM90/SM120",
            kinds=frozenset({"mha"}),
            prefill=(
                Kernel("trtllm-gen context (trtllm_batch_context_with_kv_cache)", _gpus("sm100", "sm103"),
                       page_sizes=_TRTLLM_GEN_PAGES, no_fp8_kv_gpus=_gpus("sm100", "sm103"),
                       note="not wired for an fp8 KV cache with bf16/fp16 queries"),
                Kernel("FlashInfer FA3 prefill", _gpus("sm90"), excluded_head_dims=frozenset({512}),
                       runs_as="flashinfer", no_fp8_kv_gpus=_gpus("sm90"),
                       note="trtllm-gen context kernels are SM100/SM103 only; FA3 takes no fp8 KV with bf16 queries"),
                Kernel("FlashInfer FA2 prefill", _gpus("sm90", "sm120"), runs_as="flashinfer",
                       note="trtllm-gen context kernels are SM100/SM103 only"),
            ),
            decode=(
                Kernel("trtllm-gen decode (trtllm_batch_decode_with_kv_cache)", _gpus("sm100", "sm103"),
                       page_sizes=_TRTLLM_GEN_PAGES, no_fp8_kv_gpus=_gpus("sm100", "sm103"),
                       note="not wired for an fp8 KV cache with bf16/fp16 queries"),
                # FlashInfer 0.7.2 jit/xqa.py builds XQA for 16, 32, 64 and 128 tokens per page.
                Kernel("XQA decode (trtllm_batch_decode_with_kv_cache)", _gpus("sm90", "sm120"),
                       max_group_above=(256, 16), page_sizes=frozenset({16, 32, 64, 128})),
            ),
            head_dims=frozenset({64, 128, 256, 512}),
            v_head_dims=frozenset({64, 128, 256, 512}),
            same_qk_v_head_dim=True,
            dtypes=_HALF,
            kv_dtypes=_HALF | _FP8,
            sliding_window=True,
            logit_softcap=False,  # the trtllm kernels take no soft-cap argument
            # trtllm-gen and XQA take per-head sinks (`sinks=`), but the shared Attention layer carries no
            # sink parameter and no model here (Llama, Gemma 4, DeepSeek) has one, and the torch oracle does
            # not implement them: a pass-through could not be tested, so sinks stay undeclared.
            attention_sinks=False,
            module="flashinfer",
            extra="flashinfer",
            cuda_graph=True,
            notes=("MHA/GQA models only",
                   "trtllm-gen also has page-128 kernels for GQA (SGLang 0.5.23 allows page 128 for trtllm_mha); "
                   "not declared on SM100/SM103: unverified here"),
        ),
        BackendCapabilities(
            name="flashinfer_mla",
            description="FlashInfer BatchMLAPagedAttentionWrapper over the absorbed latent cache",
            kinds=frozenset({"mla"}),
            prefill=(
                Kernel("FlashInfer MLA FA3", _gpus("sm90")),
                Kernel("FlashInfer MLA FA2", _gpus("sm80", "sm89", "sm100", "sm103", "sm120")),
            ),
            decode=(
                Kernel("FlashInfer MLA FA3", _gpus("sm90")),
                Kernel("FlashInfer MLA FA2", _gpus("sm80", "sm89", "sm100", "sm103", "sm120")),
            ),
            mla_multiples=(128, 64),
            dtypes=_HALF,
            kv_dtypes=_HALF,
            module="flashinfer",
            extra="flashinfer",
            cuda_graph=True,
            notes=("dense MLA only: sparse (NSA) layers need an NSA backend",),
        ),
        BackendCapabilities(
            name="trtllm_mla",
            description="TRT-LLM MLA decode through FlashInfer (trtllm_batch_decode_with_kv_cache_mla): "
                        "trtllm-gen on SM100/SM103, XQA-MLA on SM120",
            kinds=frozenset({"mla"}),  # dense decode; the V3.2 sparse decode is planned
            prefill=(),
            decode=(
                Kernel("trtllm-gen MLA decode", _gpus("sm100", "sm103"), page_sizes=frozenset({32, 64})),
                Kernel("XQA-MLA decode", _gpus("sm120"), page_sizes=frozenset({16, 32, 64, 128}),
                       num_heads=frozenset({128}), note="XQA-MLA builds for 128 query heads only"),
            ),
            mla_dims=_MLA_DS,
            excluded_num_heads=(65, 127),
            dtypes=frozenset({"bfloat16"}),  # FlashInfer allocates and checks a bfloat16 output
            kv_dtypes=frozenset({"bfloat16"}),
            module="flashinfer",
            extra="flashinfer",
            cuda_graph=True,
            block_table_pad_tokens=128,
            notes=(
                "decode only: pair it with an MLA prefill backend",
                "block table column count padded to a multiple of 128/page_size",
                # Kernel capabilities we do not use, and why (FlashInfer 0.7.2 mla/_core.py):
                "unused: the kernel also takes MLA dims 320/256 (latent 256 + rope 64) and 512/512 (latent 512, "
                "no rope), and fp8 KV (trtllm-gen; XQA-MLA fp8 q and KV); attnzoo's MLA models (DeepSeek-V2/V3) "
                "are 576/512 and the pool holds model-dtype (bf16) entries, so only that is declared",
                "unused: sinks (trtllm-gen MLA only; XQA-MLA refuses them): no model here has them",
            ),
        ),
        BackendCapabilities(
            name="nsa_triton",
            description="attnzoo's Triton NSA kernels: indexer scores over the paged indexer cache, top-k, "
                        "sparse MLA over the selected tokens (prefill and decode)",
            kinds=frozenset({"nsa"}),
            prefill=_NSA_TRITON,
            decode=_NSA_TRITON,
            max_head_dim=1024,
            module="triton",
            extra="triton",
            cuda_graph=True,
            mla_kv_layout="bf16",
            notes=("sparse (NSA) layers only: DeepSeek-V3.2",),
        ),
        BackendCapabilities(
            name="nsa_triton_fp8",
            description="nsa_triton's kernels reading the FlashMLA sparse layout: fp8 latent with one scale per "
                        "128 values, bf16 rope (656 bytes per token for DeepSeek)",
            kinds=frozenset({"nsa"}),
            prefill=_NSA_TRITON,
            decode=_NSA_TRITON,
            mla_multiples=(128, 2),
            module="triton",
            extra="triton",
            cuda_graph=True,
            mla_kv_layout="fp8_nope_scaled_bf16_rope",
            notes=(
                "sparse (NSA) layers only: DeepSeek-V3.2",
                "keeps an fp8 copy of the MLA cache beside the pool's model-dtype entries (memory on top of the "
                "KV budget); attention reads fp8 values: expect fp8-level differences from the bf16 backends",
            ),
        ),
    )
}


def module_available(module: str | None) -> bool:
    """Whether the backend's package can be imported here (checked without importing it)."""
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@dataclass
class Check:
    """The outcome of checking one backend for one phase: every constraint, passed or violated."""

    backend: str
    phase: str
    violations: list[str] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)
    kernel: Kernel | None = None

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def reasons(self) -> list[str]:
        return self.violations if self.violations else self.passed


def check_backend(
    name: str,
    phase: str,
    *,
    gpu: str,
    kind: str,
    head_dims: frozenset[int],
    v_head_dims: frozenset[int],
    uses_sliding_window: bool = False,
    uses_softcap: bool = False,
    uses_sinks: bool = False,
    dtype: str | None = None,
    registered: frozenset[str] | set[str] = frozenset(),
    num_heads: int | None = None,
    num_kv_heads: frozenset[int] = frozenset(),
    assume_installed: frozenset[str] = frozenset(),
    kv_cache_dtype: str = "auto",
) -> Check:
    """Check everything but the page size (the policy may still adjust that) for one phase."""
    chk = Check(name, phase)
    caps = CAPABILITIES.get(name)
    if caps is None:
        chk.violations.append(
            "registered but declares no capabilities in attnzoo/defaults/capabilities.py" if name in registered
            else f"unknown backend (declared: {', '.join(sorted(CAPABILITIES))})"
        )
        return chk
    bad, good = chk.violations, chk.passed

    if name in registered:
        good.append("registered in this build")
    else:
        bad.append(
            f"not implemented yet in this build (registered backends: {', '.join(sorted(registered)) or 'none'})"
        )
    if caps.module is not None and caps.module in assume_installed:
        good.append(f"package {caps.module!r} assumed installed (hypothetical)")
    elif caps.module is None or module_available(caps.module):
        good.append(f"package {caps.module!r} importable" if caps.module else "needs no extra package")
    else:
        fix = f'pip install "attnzoo[{caps.extra}]"' if caps.extra else f"install {caps.module}"
        bad.append(f"needs the Python package {caps.module!r}, which is not installed ({fix})")

    if kind not in caps.kinds:
        bad.append(f"does not run {kind.upper()} attention (supports: {', '.join(sorted(caps.kinds)).upper()})")
    else:
        good.append(f"runs {kind.upper()} attention")

    kernels = caps.kernels(phase)
    if not kernels:
        other = [p for p in caps.phases()]
        bad.append(f"has no {phase} path ({' and '.join(other)} only)")
    else:
        on_gpu = [k for k in kernels if gpu in k.gpus]
        if not on_gpu:
            bad.append(
                f"{phase} does not run on {gpu} (runs on: {', '.join(sorted(caps.gpus(phase), key=GPUS.index))})"
            )
        else:
            runnable = [k for k in on_gpu if k.env_ok()]
            if not runnable:
                var, val = on_gpu[0].requires_env  # type: ignore[misc]
                bad.append(f"{phase} on {gpu} needs {var}={val} in the environment ({on_gpu[0].note})")
            else:
                fitting = [k for k in runnable if not (head_dims & k.excluded_head_dims)]
                heads_bad = [k for k in fitting if k.num_heads and num_heads is not None and num_heads not in k.num_heads]
                fitting = [k for k in fitting if k not in heads_bad]
                fp8_refused = []
                if kv_cache_dtype != "auto":
                    fp8_refused = [k for k in fitting if gpu in k.no_fp8_kv_gpus]
                    fitting = [k for k in fitting if k not in fp8_refused]
                # The profile does not pair head dims with KV head counts: assume the largest group.
                group = num_heads // min(num_kv_heads) if num_heads and num_kv_heads else None
                too_grouped = [k for k in fitting if k.max_group_above and group is not None
                               and max(head_dims) > k.max_group_above[0] and group > k.max_group_above[1]]
                fitting = [k for k in fitting if k not in too_grouped]
                if not fitting and heads_bad:
                    k = heads_bad[0]
                    bad.append(f"{k.name} on {gpu} runs {_fmt(k.num_heads)} query heads; this model has {num_heads}")
                elif not fitting and fp8_refused:
                    bad.append(f"{fp8_refused[0].name} on {gpu} does not read a {kv_cache_dtype} KV cache "
                               f"({fp8_refused[0].note})")
                elif not fitting and too_grouped:
                    d, g = too_grouped[0].max_group_above  # type: ignore[misc]
                    bad.append(f"{too_grouped[0].name} on {gpu} serves head dims above {d} with at most {g} "
                               f"query heads per KV head; this model has head dim {max(head_dims)} and up to {group}")
                elif not fitting:
                    k = runnable[0]
                    bad.append(f"{k.name} on {gpu} does not support head dim(s) "
                               f"{_fmt(head_dims & k.excluded_head_dims)} ({k.note})")
                else:
                    chk.kernel = fitting[0]
                    skipped = [k for k in runnable if k not in fitting]
                    extra = f"; {skipped[0].name} skipped: {skipped[0].note}" if skipped else ""
                    good.append(f"{phase} runs on {gpu} via {fitting[0].name}{extra}")

    dims_bad = _head_dim_violation(caps, kind, head_dims, v_head_dims)
    if dims_bad:
        bad.append(dims_bad)
    else:
        good.append(f"head dims q/k {_fmt(head_dims)} v {_fmt(v_head_dims)} supported")

    if caps.excluded_num_heads and num_heads is not None:
        lo, hi = caps.excluded_num_heads
        if lo <= num_heads <= hi:
            bad.append(f"does not run {num_heads} query heads (not {lo}..{hi})")
    if uses_sliding_window and not caps.sliding_window:
        bad.append("does not support sliding-window attention, which this model uses")
    if uses_softcap and not caps.logit_softcap:
        bad.append("does not support attention logit soft-capping, which this model uses")
    if uses_sinks and not caps.attention_sinks:
        bad.append("does not support attention sinks, which this model uses")
    if kv_cache_dtype != "auto":
        if kind != "mha":
            bad.append(f"{kind.upper()} caches keep their explicit layouts (kv_layout); kv_cache_dtype "
                       f"{kv_cache_dtype} is for MHA/GQA models")
        elif kv_cache_dtype not in caps.kv_dtypes:
            bad.append(f"does not read a {kv_cache_dtype} KV cache (reads: {', '.join(sorted(caps.kv_dtypes))})")
        else:
            good.append(f"reads a {kv_cache_dtype} KV cache")
    if dtype is not None:
        if dtype in caps.dtypes:
            good.append(f"dtype {dtype} supported")
        else:
            bad.append(f"does not run dtype {dtype} (supports: {', '.join(sorted(caps.dtypes))})")
    return chk


def _head_dim_violation(caps: BackendCapabilities, kind: str, qk: frozenset[int], v: frozenset[int]) -> str | None:
    if caps.mla_multiples is not None:
        m, r = caps.mla_multiples
        if kind == "mha" or any(l % m or q - l <= 0 or (q - l) % r for q in qk for l in v):
            return f"head dims q/k {_fmt(qk)} v {_fmt(v)} unsupported (supports {caps.head_dims_text()})"
        return None
    if caps.same_qk_v_head_dim and qk != v:
        return f"needs equal q/k and v head dims, the model has q/k {_fmt(qk)} v {_fmt(v)}"
    if caps.mla_dims is not None:
        pairs = {(q, vv) for q in qk for vv in v}
        if len(qk) != 1 or len(v) != 1 or not pairs <= caps.mla_dims:
            return (f"head dims q/k {_fmt(qk)} v {_fmt(v)} unsupported "
                    f"(supports {caps.head_dims_text()})")
        return None
    for label, dims, allowed in (("q/k", qk, caps.head_dims), ("v", v, caps.v_head_dims)):
        if allowed is None:
            over = {d for d in dims if not 1 <= d <= caps.max_head_dim}
            if over:
                return f"{label} head dim(s) {_fmt(over)} unsupported (supports any up to {caps.max_head_dim})"
        else:
            missing = set(dims) - allowed
            if missing:
                return f"{label} head dim(s) {_fmt(missing)} unsupported (supports {_fmt(allowed)})"
    return None
