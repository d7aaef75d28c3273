"""The backend contract: what every attention backend implements, and nothing more.

Per step ``HybridBackend`` (``backends/hybrid.py``) picks the step's backend (the prefill backend for
EXTEND steps, the decode backend for DECODE steps) and calls its ``prepare(meta)`` once (plan kernels,
build index arrays), which returns the step's plan: a ``StepPlan`` subclass of the backend's own, whose
fields say what lives on the host and what on the device. Every attention layer then calls ``extend``
(EXTEND steps) or ``decode`` (DECODE steps) with that plan. By the time either runs, the layer has
already stored this step's k/v in the pool, so a backend only reads the cache.

What a backend can run is its class's ``capabilities`` (``backends/capabilities.py``), stated once: the
policy reads it through the registry, the backend's own checks call it, and ``name``,
``supports_cuda_graph``, ``supports_cascade`` (and an NSA backend's ``mla_kv_layout``) follow from it.
A backend that serves sparse (NSA) layers derives from ``NSABackend``, whose hooks ``NSAAttention``
calls (``attention/nsa.py``).

CUDA-graph hooks: a backend that can run inside a captured decode graph declares ``cuda_graph=True`` and
implements ``init_graph_state`` (static buffers for the largest batch) and ``prepare_graph(meta,
capturing)`` (refill those buffers in place for a replay; it returns the step's plan, built outside the
graph). That ``meta`` covers the batch-size bucket: its device tensors are the graph's static buffers,
its host lists (``seq_lens_cpu``, ``q_lens_cpu``) the real step's padded to the bucket (padding rows: one
token in page 0); at capture they are the worst case (every row at the graph's longest context).

Cascade graphs: a backend whose cascade decode steps can be captured too declares
``supports_cascade_graph`` and implements ``cascade_graph_key(meta)``: what such a graph bakes in beyond
its bucket (launch arguments that vary with the step, e.g. a sliding layer's window), hashable; steps of
equal bucket and key replay one graph. Its ``prepare_graph`` then also takes metas with
``shared_prefix_len`` > 0, whose padding rows hold one token after the shared prefix (its pages, then the
token in page 0). Such a graph is captured on the first step of its key, with that step's host lists.

Cascade attention: a backend that reads a prefix shared by every request of a DECODE step once for the
whole batch (``meta.shared_prefix_len``) declares ``cascade=True``; others ignore the field and
read every request's pages as usual, which gives the same result. ``supports_cascade_extend``: the
same for EXTEND steps (every new token of the step comes after the shared pages), set per instance where it
depends on the pool's layers; ``cascade_extend_scope`` says which layers and steps, where not all;
``cascade_shared_pass`` which kernels read a decode step's shared prefix, where they depend on the step.

Mixed steps: a backend that declares ``splits_mixed_steps`` serves the two parts ``HybridBackend`` splits an
EXTEND step into (its leading decode rows as a DECODE step, the prompt chunks as an EXTEND step, each with the
metadata of its own requests and its own plan, both in the same step), in models whose every attention is the
shared layer's call over its rows. A backend whose two plans could not live in one step leaves it off.
``captures_mixed_steps``: a mixed step can be captured whole at a token bucket (``engine.mixed_graphs``): its
decode (under ``prepare_graph``) and extend plans, made once at the bucket's static metadata, launch from the
metadata's device tensors only, so they serve every replay; its decode takes every row of the step (a row that is not
a decode row has length 0: no key, its output 0), and its extend takes ``out=`` and reads and writes only the
rows ``q_indptr`` gives each request (offsets into q that need not start at 0; the other rows of ``out`` are left as
they are). Its graph state (``init_graph_state``) comes from the decode graphs' largest batch, and the decode part runs
at up to the largest token bucket, which may be more rows: state sized by the batch must not bound it.

Overlap: the engine may prepare step N+1 while step N still runs on the GPU. A backend whose plan
stages data in host buffers it reuses, copied to the GPU asynchronously (FlashInfer's wrappers and
their pinned page lists), must not rewrite them before the last plan's copies left: it keeps a
``PlanFence`` and waits on it before planning.
"""
from __future__ import annotations

import importlib
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from attnzoo.attention.backends.capabilities import BackendCapabilities
from attnzoo.attention.backends.gpus import GPU_CLASSES, GPUS, gpu_of
from attnzoo.attention.kv_cache import KVLayout, KVPool
from attnzoo.attention.kv_layout import LayoutCache
from attnzoo.attention.metadata import BatchMetadata
from attnzoo.attention.reference import NSAStepCache
from attnzoo.errors import BackendError, PolicyError


@dataclass
class StepPlan:
    """One step's plan: what a backend's ``prepare`` (or ``prepare_graph``) computed once for the step,
    handed back to the ``extend`` / ``decode`` (and NSA hooks) of every layer of that step. Each backend
    that plans returns a subclass with its own fields; this base, holding nothing, is the plan of a
    backend with nothing to plan."""


@dataclass
class NSAPlan(StepPlan):
    """The plan of a backend serving sparse (NSA) layers."""

    # [num_tokens] int64, device: the request of each row of the flat batch (graph steps: rows of a
    # static buffer, row i is request i); None: computed from the step's host lengths where needed.
    token_reqs: torch.Tensor | None = None
    # Matrices every NSA layer of the step reads alike, computed by the first layer that asks.
    shared: NSAStepCache = field(default_factory=NSAStepCache)

class PlanFence:
    """``wait`` until the copies queued after the last ``mark`` have run (the host buffers they read may be
    rewritten); ``mark`` after a plan queued its copies. As a rule they ran before that step's kernels,
    so the wait is free. Off CUDA copies are done on return: nothing to wait for."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._event: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def mark(self) -> None:
        if self._cuda:
            self._event = torch.cuda.Event()
            self._event.record()


def import_triton_kernels(backend: str, module: str):
    """``attnzoo.attention.kernels.<module>``, or a BackendError naming ``backend`` where triton cannot import."""
    try:
        return importlib.import_module(f"attnzoo.attention.kernels.{module}")
    except ImportError as e:  # triton missing or broken
        raise BackendError(f"the {backend} backend cannot import triton ({e})",
                           fix="pip install 'attnzoo[triton]', or choose backend='torch'") from e


class AttentionLayer(Protocol):
    """What a backend reads of the layer it serves (``attnzoo.attention.layer.Attention``): the contract
    names these fields rather than importing the layer, which imports this module."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scale: float
    sliding_window: int | None
    logit_softcap: float | None
    kind: str  # "mha" or "mla"
    index_head_dim: int  # NSA: its indexer key width; 0 otherwise
    sparse: bool  # NSA (with or without its own indexer key cache)
    sinks: torch.Tensor | None  # [num_heads] attention-sink logits, or None


class AttentionBackend(ABC):
    capabilities: ClassVar[BackendCapabilities]
    name: ClassVar[str]
    supports_cuda_graph: ClassVar[bool] = False
    supports_cascade: ClassVar[bool] = False
    supports_cascade_extend: ClassVar[bool] = False
    cascade_extend_scope: ClassVar[str] = ""  # e.g. "MLA layers": shown in load_model's explanation
    cascade_shared_pass: ClassVar[str] = ""  # likewise
    supports_cascade_graph: ClassVar[bool] = False
    splits_mixed_steps: ClassVar[bool] = False
    captures_mixed_steps: ClassVar[bool] = False
    # q may arrive as a strided view (rotated in place in the QKV projection's output by the store's RoPE)
    strided_query: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        caps = cls.__dict__.get("capabilities")
        if caps is None:
            return  # a variant of its parent (tests) runs under the parent's declaration
        cls.name = caps.name
        cls.supports_cuda_graph = caps.cuda_graph
        cls.supports_cascade = caps.cascade
        if "nsa" in caps.kinds:
            if not issubclass(cls, NSABackend):
                raise BackendError(f"backend {caps.name!r} declares NSA layers but does not derive from NSABackend",
                                   fix="derive the class from attnzoo.attention.backends.base.NSABackend")
            cls.mla_kv_layout = KVLayout(caps.mla_kv_layout)

    # What to choose instead when a check fails (the errors' ``fix``).
    fix: ClassVar[str] = "choose backend='triton' or 'torch'"

    def __init__(self, pool: KVPool):
        self.pool = pool
        # The GPU class the checks apply ("cpu" off CUDA); FlashInfer-based backends set it from the
        # compute capability they query.
        self.gpu = device_gpu(pool.device)

    def require_pool(self) -> None:
        """Raise unless the declaration allows this pool (dtype, page size, KV dtype) on ``self.gpu``."""
        self.capabilities.require_pool(gpu=self.gpu, dtype=str(self.pool.dtype).removeprefix("torch."),
                                       page_size=self.pool.page_size, kv_cache_dtype=self.pool.kv_cache_dtype,
                                       fix=self.fix)

    def check_layer(self, phase: str, layer: "AttentionLayer"):
        """The declared kernel that serves ``layer`` in ``phase`` here, or the BackendError saying why none.
        extend/decode call it; the policy's check of the model's profile is the same ``capabilities.check``."""
        return self.capabilities.require_layer(phase, layer, gpu=self.gpu, kv_cache_dtype=self.pool.kv_cache_dtype,
                                               fix=self.fix)

    def prepare(self, meta: BatchMetadata) -> StepPlan:
        """Once per step, before the model runs: the step's plan. Default: nothing to plan."""
        return StepPlan()

    @abstractmethod
    def extend(self, layer: "AttentionLayer", q: torch.Tensor, meta: BatchMetadata, plan: StepPlan) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, v_head_dim]."""

    @abstractmethod
    def decode(self, layer: "AttentionLayer", q: torch.Tensor, meta: BatchMetadata, plan: StepPlan) -> torch.Tensor:
        """q: [num_reqs, num_heads, head_dim] -> [num_reqs, num_heads, v_head_dim]."""

    def warm_up(self, layers) -> None:
        """Compile, for these attention layers, the kernel variants only large steps choose (``Engine.warm_up``
        runs two short prompts; a server calls it before it answers): nothing here, where every path those
        prompts take is every path there is."""

    def init_graph_state(self, max_batch_size: int, max_pages_per_req: int) -> None:
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")

    def prepare_graph(self, meta: BatchMetadata, capturing: bool) -> StepPlan:
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")

    def cascade_graph_key(self, meta: BatchMetadata):
        raise NotImplementedError(f"backend {self.name!r} does not capture cascade decode steps")


class NSABackend(AttentionBackend):
    """A backend that serves sparse (NSA) layers: the hooks ``NSAAttention`` calls (``attention/nsa.py``),
    after it stored the step's entries and indexer keys. Every class whose capabilities include "nsa"
    derives from this; its plans are ``NSAPlan``s."""

    mla_kv_layout: ClassVar[KVLayout] = KVLayout.BF16  # the entry layout nsa_sparse_mla reads (declared)
    # Its copy of the MLA cache in ``mla_kv_layout``, where that is not the pool's own (BF16) layout:
    # NSAAttention converts each stored token into it.
    kv_copy: LayoutCache | None = None

    def prepare(self, meta: BatchMetadata) -> NSAPlan:
        return NSAPlan()

    @abstractmethod
    def nsa_topk(self, layer: "AttentionLayer", q: torch.Tensor, weights: torch.Tensor, meta: BatchMetadata,
                 plan: NSAPlan, *, topk: int, scale: float) -> torch.Tensor:
        """Indexer query q [T, Hi, D], weights [T, Hi] float32 (already / sqrt(Hi)) -> the ``topk`` best
        positions of each token's request: [T, min(topk, max_seq_len)] int32, -1 = none."""

    @abstractmethod
    def nsa_sparse_mla(self, layer: "AttentionLayer", q: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata,
                       plan: NSAPlan) -> torch.Tensor:
        """Absorbed query q [T, H, rank + rope] over the entries at ``positions`` [T, k] int32 -> [T, H, rank]."""


class CompressedBackend:
    """What a backend implements to serve compressed (DeepSeek-V4) layers, after ``CompressedAttention``
    stored the step's keys and entries. Mixed into an ``AttentionBackend``; its capabilities list "dsv4"."""

    def dsv4_topk(self, layer: "AttentionLayer", q: torch.Tensor, weights: torch.Tensor, meta: BatchMetadata,
                  plan: StepPlan, *, topk: int, scale: float) -> torch.Tensor:
        """Indexer query q [T, Hi, Di], weights [T, Hi] float32 -> the ``topk`` best visible entries of
        each token's request: [T, k] int32 entry numbers, -1 = none (k <= topk)."""
        raise NotImplementedError

    def dsv4_attend(self, layer: "AttentionLayer", q: torch.Tensor, sinks: torch.Tensor,
                    entry_ids: torch.Tensor | None, meta: BatchMetadata, plan: StepPlan) -> torch.Tensor:
        """q [T, H, D] over its raw window and its compressed entries (CSA: ``entry_ids`` [T, k]; HCA:
        every completed one), one softmax with the sink logits [H] -> [T, H, D] float32."""
        raise NotImplementedError


def device_gpu(device: torch.device) -> str:
    """The GPU class (``gpus.GPUS``) of a device: "cpu" off CUDA."""
    if device.type != "cuda":
        return "cpu"
    return gpu_of(torch.cuda.get_device_capability(device))


def gpu_class(gpu: str) -> str:
    """The class the policy has rows for of a GPU name ("sm90", "sm_86", "SM100", "cpu")."""
    g = str(gpu).strip().lower().replace("_", "")
    m = re.fullmatch(r"sm(\d+)(\d)", g)
    if g in GPUS or (m and (int(m[1]), int(m[2])) in GPU_CLASSES):
        return g if g in GPUS else GPU_CLASSES[int(m[1]), int(m[2])]
    raise PolicyError(f"GPU {gpu!r} is not one the policy knows",
                      fix=f"pass one of: {', '.join(GPUS)} (sm86/sm87 count as sm80, sm121 as sm120)")


def detect_gpu(device=None) -> str:
    """"cpu", or the CUDA compute capability of ``device`` (default: the current one) as "smXY"."""
    if (device is not None and torch.device(device).type != "cuda") or not torch.cuda.is_available():
        return "cpu"
    return "sm%d%d" % torch.cuda.get_device_capability(device)

