"""What an attention backend can run: the typed declaration on each backend class, and the one check
that the policy (``attnzoo/policy/resolve.py``) and the backend itself both call.

A backend states every limit once, as ``capabilities = BackendCapabilities(...)`` on its class, next to
its code. The policy reads the declarations through the registry (``attnzoo.attention.backends``); a
backend's constructor and its layers call ``require_pool`` / ``require_layer``, which run the same
``check``. Nothing here imports a kernel library, and backend modules import theirs lazily, so every
declaration reads on a machine without FlashInfer, Triton or a GPU. Kernels and the GPU classes they run
on are declared in ``gpus.py``.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from attnzoo.attention.backends.gpus import GPUS, Kernel, gpu_label
from attnzoo.attention.kv_cache import KV_CACHE_DTYPES, MAX_PAGE_SIZE
from attnzoo.errors import BackendError

ATTENTION_KINDS: tuple[str, ...] = ("mha", "mla", "nsa", "dsv4")  # dsv4: DeepSeek-V4 compressed
PHASES: tuple[str, ...] = ("prefill", "decode")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
FP8_KV = frozenset(KV_CACHE_DTYPES) - {"auto"}  # kv_cache_dtype values that store fp8
HALF = frozenset({"bfloat16", "float16"})
ALL_DTYPES = frozenset(DTYPES)


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
    dtypes: frozenset[str] = ALL_DTYPES  # model/activation dtypes
    # What the KV pool may store for it: the model dtypes ("auto") and the kv_cache_dtype values it reads.
    kv_dtypes: frozenset[str] = ALL_DTYPES
    sliding_window: bool = False
    logit_softcap: bool = False
    attention_sinks: bool = False
    module: str | None = None  # importable module the backend needs; None: nothing beyond torch
    extra: str | None = None  # pip extra that installs it: pip install "attnzoo[<extra>]"
    cuda_graph: bool = False
    # Decode reads a prefix shared by the whole batch once per step (cascade attention; eager steps, or
    # CUDA graphs where the backend class sets supports_cascade_graph).
    cascade: bool = False
    kv_layout: str = "HND"  # the KV layout it reads (kv_cache.KVPool writes HND)
    # MLA/NSA caches: the entry layout it reads (attnzoo.attention.kv_layout.KVLayout values). The pool
    # holds "bf16" (model-dtype) entries; a backend reading another layout keeps a converted copy.
    mla_kv_layout: str = "bf16"
    # Block tables padded so that columns * page_size is a multiple of this (trtllm_mla: 128).
    block_table_pad_tokens: int | None = None
    notes: tuple[str, ...] = ()
    # require_layer's answers, per (phase, layer shape, GPU, KV dtype): layers run every step.
    _layer_checks: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

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

    def kernel_on(self, phase: str, gpu: str) -> Kernel | None:
        """The first kernel of ``phase`` that runs on ``gpu`` (whatever the layer), or None."""
        return next((k for k in self.kernels(phase) if gpu in k.gpus), None)

    def gpus_text(self, phase: str) -> str:
        """Where ``phase`` runs, for messages: "SM100/SM103 (trtllm-gen) and SM120/SM121 (XQA-MLA)"."""
        return " and ".join(
            "/".join(gpu_label(g) for g in sorted(k.gpus, key=GPUS.index)) + f" ({k.label or k.name})"
            for k in self.kernels(phase)
        )

    def check(self, phase: str, shape: "Shape | None", *, gpu: str, dtype: str | None = None,
              kv_cache_dtype: str = "auto") -> "Check":
        """Every constraint but the page size and the package, for one phase on ``gpu``.

        ``shape`` is the model (a ``ModelProfile``) or one layer (``Shape.of_layer``); None checks only
        what the pool decides (GPU, environment, dtypes), as a backend's constructor does.
        """
        chk = Check(self.name, phase)
        bad, good = chk.violations, chk.passed
        kind = shape.kind if shape is not None else None
        if kind is not None:
            if kind not in self.kinds:
                bad.append(f"does not run {kind.upper()} attention (supports: {', '.join(sorted(self.kinds)).upper()})")
            else:
                good.append(f"runs {kind.upper()} attention")

        kernels = self.kernels(phase)
        if not kernels:
            other = [p for p in self.phases()]
            bad.append(f"has no {phase} path ({' and '.join(other)} only)")
        else:
            on_gpu = [k for k in kernels if gpu in k.gpus]
            if not on_gpu:
                bad.append(
                    f"{phase} does not run on {gpu} (runs on: {', '.join(sorted(self.gpus(phase), key=GPUS.index))})"
                )
            else:
                runnable = [k for k in on_gpu if k.env_ok()]
                if not runnable:
                    var, val = on_gpu[0].requires_env  # type: ignore[misc]
                    bad.append(f"{phase} on {gpu} needs {var}={val} in the environment ({on_gpu[0].note})")
                else:
                    self._pick_kernel(chk, phase, runnable, shape, gpu, kv_cache_dtype)

        if shape is not None:
            dims_bad = _head_dim_violation(self, kind, shape.head_dims, shape.v_head_dims)
            if dims_bad:
                bad.append(dims_bad)
            else:
                good.append(f"head dims q/k {_fmt(shape.head_dims)} v {_fmt(shape.v_head_dims)} supported")
            num_heads = shape.num_heads
            if self.excluded_num_heads and num_heads is not None:
                lo, hi = self.excluded_num_heads
                if lo <= num_heads <= hi:
                    bad.append(f"does not run {num_heads} query heads (not {lo}..{hi})")
            if shape.uses_sliding_window and not self.sliding_window:
                bad.append("does not support sliding-window attention, which this model uses")
            if shape.uses_softcap and not self.logit_softcap:
                bad.append("does not support attention logit soft-capping, which this model uses")
            if shape.uses_sinks and not self.attention_sinks:
                bad.append(f"does not support attention sinks, which this model uses (backends that do: "
                           f"{', '.join(sinks_backends(kind))})")
        if kv_cache_dtype != "auto":
            if kind is not None and kind != "mha":
                bad.append(f"{kind.upper()} caches keep their explicit layouts (kv_layout); kv_cache_dtype "
                           f"{kv_cache_dtype} is for MHA/GQA models")
            elif kv_cache_dtype not in self.kv_dtypes:
                bad.append(f"does not read a {kv_cache_dtype} KV cache (reads: {', '.join(sorted(self.kv_dtypes))})")
            elif kind is not None:
                good.append(f"reads a {kv_cache_dtype} KV cache")
        if dtype is not None:
            if dtype in self.dtypes:
                good.append(f"dtype {dtype} supported")
            else:
                bad.append(f"does not run dtype {dtype} (supports: {', '.join(sorted(self.dtypes))})")
        return chk

    def _pick_kernel(self, chk: "Check", phase: str, runnable: list[Kernel], shape, gpu: str, kv_cache_dtype: str):
        """The first runnable kernel that fits the shape and the KV dtype, or the reason none does."""
        bad, good = chk.violations, chk.passed
        head_dims = shape.head_dims if shape is not None else frozenset()
        num_heads = shape.num_heads if shape is not None else None
        num_kv_heads = shape.num_kv_heads if shape is not None else frozenset()
        fitting = [k for k in runnable if not (head_dims & k.excluded_head_dims)]
        heads_bad = [k for k in fitting if k.num_heads and num_heads is not None and num_heads not in k.num_heads]
        fitting = [k for k in fitting if k not in heads_bad]
        uses_sinks = shape is not None and shape.uses_sinks
        # A backend without sinks fails as a whole (check); one with them, where the kernel here takes none.
        no_sinks = [k for k in fitting if uses_sinks and self.attention_sinks and k.sinks is False]
        fitting = [k for k in fitting if k not in no_sinks]
        fp8_refused = []
        if kv_cache_dtype != "auto":
            fp8_refused = [k for k in fitting if gpu in k.no_fp8_kv_gpus]
            fitting = [k for k in fitting if k not in fp8_refused]
        # A model's profile does not pair head dims with KV head counts: assume the largest group.
        group = num_heads // min(num_kv_heads) if num_heads and num_kv_heads else None
        too_grouped = [k for k in fitting if k.max_group_above and group is not None
                       and max(head_dims) > k.max_group_above[0] and group > k.max_group_above[1]]
        fitting = [k for k in fitting if k not in too_grouped]
        if not fitting and no_sinks:
            bad.append(f"{no_sinks[0].name} on {gpu} does not take attention sinks, which this model uses")
        elif not fitting and heads_bad:
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

    def require_pool(self, *, gpu: str, dtype: str, page_size: int, kv_cache_dtype: str = "auto",
                     fix: str) -> None:
        """A backend's constructor: raise a BackendError unless every phase it has runs on ``gpu`` over a
        pool of this dtype, page size and KV dtype. ``fix`` names what to choose instead."""
        for phase in reversed(self.phases()):  # decode first: its kernels say where the backend runs
            if not any(gpu in k.gpus for k in self.kernels(phase)):
                raise BackendError(f"{self.name} {phase} runs on {self.gpus_text(phase)}; this GPU is {gpu}", fix=fix)
        if dtype not in self.dtypes:
            names = ", ".join(d for d in DTYPES[::-1] if d in self.dtypes)
            raise BackendError(f"the {self.name!r} backend runs {names} KV caches, not {dtype}",
                               fix=f"load the model with dtype={names.split(', ')[0]}, or {fix}")
        if not self.page_size_ok(page_size, gpu):
            sizes = ", ".join(map(str, sorted(self.page_sizes_on(gpu) or ())))
            raise BackendError(f"{self.name} on {gpu} needs page size {sizes}; the KV pool has {page_size}",
                               fix=f"load the model with page_size one of {sizes}")
        for phase in self.phases():
            chk = self.check(phase, None, gpu=gpu, kv_cache_dtype=kv_cache_dtype)
            if not chk.ok:
                raise BackendError(f"{self.name}: {'; '.join(chk.violations)}", fix=fix)

    def require_layer(self, phase: str, layer, *, gpu: str, kv_cache_dtype: str = "auto", fix: str) -> Kernel:
        """A backend's layer: the kernel that serves ``layer`` in ``phase``, or a BackendError naming every
        violated constraint. Answers are remembered per layer shape."""
        key = (phase, Shape.of_layer(layer), gpu, kv_cache_dtype)
        chk = self._layer_checks.get(key)
        if chk is None:
            chk = self._layer_checks[key] = self.check(phase, key[1], gpu=gpu, kv_cache_dtype=kv_cache_dtype)
        if not chk.ok:
            raise BackendError(f"{self.name} (layer {layer.layer_id}): {'; '.join(chk.violations)}", fix=fix)
        return chk.kernel  # type: ignore[return-value]

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
            if k.sinks is not None:
                d["sinks"] = k.sinks
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


def sinks_backends(kind: str | None = None) -> list[str]:
    """The registered backends that declare attention sinks for attention of ``kind`` (any kind: None; some
    of their kernels may not take them: ``Kernel.sinks``), for messages."""
    from attnzoo.attention.backends import all_capabilities

    return [name for name, caps in all_capabilities().items()
            if caps.attention_sinks and (kind is None or kind in caps.kinds)]


def _fmt(values) -> str:
    return "{" + ", ".join(str(v) for v in sorted(values)) + "}"


def module_available(module: str | None) -> bool:
    """Whether the backend's package can be imported here (checked without importing it)."""
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class Shape:
    """What a check needs to know about the attention it serves: a model (the policy passes its
    ``ModelProfile``, which has these fields) or one layer (``of_layer``)."""

    kind: str  # "mha", "mla" or "nsa"
    head_dims: frozenset[int]  # q/k
    v_head_dims: frozenset[int]
    num_heads: int | None = None
    num_kv_heads: frozenset[int] = frozenset()
    uses_sliding_window: bool = False
    uses_softcap: bool = False
    uses_sinks: bool = False

    @classmethod
    def of_layer(cls, layer) -> "Shape":
        """An ``attnzoo.attention.layer.Attention`` as the checks see it (an indexer makes MLA sparse)."""
        kind = "nsa" if getattr(layer, "sparse", False) or getattr(layer, "index_head_dim", 0) \
            else getattr(layer, "kind", "mha")
        return cls(kind=kind, head_dims=frozenset({layer.head_dim}), v_head_dims=frozenset({layer.v_head_dim}),
                   num_heads=layer.num_heads, num_kv_heads=frozenset({layer.num_kv_heads}),
                   uses_sliding_window=bool(layer.sliding_window), uses_softcap=bool(layer.logit_softcap),
                   uses_sinks=getattr(layer, "sinks", None) is not None)


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


def check_backend(caps: BackendCapabilities, phase: str, shape, *, gpu: str, dtype: str | None = None,
                  kv_cache_dtype: str = "auto", assume_installed: frozenset[str] = frozenset(),
                  page_size: int | None = None) -> Check:
    """The policy's check of a registered backend for one phase: its package, ``caps.check`` (the one the
    backend runs on its own layers), and the page size if given."""
    chk = Check(caps.name, phase, passed=["registered in this build"])
    if caps.module is not None and caps.module in assume_installed:
        chk.passed.append(f"package {caps.module!r} assumed installed (hypothetical)")
    elif caps.module is None or module_available(caps.module):
        chk.passed.append(f"package {caps.module!r} importable" if caps.module else "needs no extra package")
    else:
        fix = f'pip install "attnzoo[{caps.extra}]"' if caps.extra else f"install {caps.module}"
        chk.violations.append(f"needs the Python package {caps.module!r}, which is not installed ({fix})")
    inner = caps.check(phase, shape, gpu=gpu, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    chk.violations += inner.violations
    chk.passed += inner.passed
    chk.kernel = inner.kernel
    if page_size is not None and not caps.page_size_ok(page_size, gpu):
        chk.violations.append(f"page size {page_size} unsupported (supports {caps.page_sizes_text(gpu)})")
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
