"""Which backend serves a step: the one place that decides it.

A model runs with two backends, one per phase (``Decision.prefill_backend`` / ``decode_backend``, often
the same one). EXTEND steps run on the prefill backend, DECODE steps on the decode backend; the engine
plans the step, each attention layer runs it and CUDA graphs capture it through this object (in the
spirit of mini-sglang's hybrid backend), so none of them picks a backend of its own.

``create`` also applies a prefill backend's declared substitution: where its declaration says extend
runs as another backend on this GPU (``Kernel.runs_as``: trtllm_mha has no context kernel off
SM100/SM103, where its prefill is the flashinfer backend's), that backend is built for prefill.

Mixed steps (decode rows beside prompt chunks, as a server's steps are): an extend kernel gives each request a
tile of query rows and walks its keys serially, so a decode row costs it as much as a chunk's block of rows,
while the decode kernel splits a row's keys across the GPU. Where both backends declare ``splits_mixed_steps``,
the step's leading decode rows (the scheduler puts them first) run as a decode step on the decode backend and
the chunks as an extend step on the prefill backend (``MixedPlan``), as vLLM's FlashInfer backend does. A mixed step
captured whole (``engine.mixed_graphs``) runs the decode part over all of its rows, then the extend part writes the
chunks' rows over it (``MixedStepPlan``), where both backends declare ``captures_mixed_steps``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from attnzoo.attention import kv_layout
from attnzoo.attention.backends import get_backend_class
from attnzoo.attention.backends.base import AttentionBackend, AttentionLayer, StepPlan, device_gpu
from attnzoo.attention.kv_cache import KVLayout, KVPool
from attnzoo.attention.metadata import BatchMetadata
from attnzoo.errors import BackendError

# Fewest leading decode rows a mixed step splits off: with fewer, the decode rows' programs fit beside the chunk's in
# the extend kernel; from here the split is faster on the GPU. Its launches cost the host more, which a large step's
# GPU time hides (benchmarks/results/mixed_split_nvidia_h200.txt).
MIXED_SPLIT_MIN_ROWS = 32


@dataclass
class MixedPlan(StepPlan):
    """An EXTEND step run as two: its leading requests (one new token each on a cached prefix) as a DECODE step on
    the decode backend, the rest as an EXTEND step on the prefill backend, each with its own metadata
    (``BatchMetadata.split``) and plan."""

    decode_meta: BatchMetadata
    decode_plan: StepPlan
    extend_meta: BatchMetadata
    extend_plan: StepPlan


@dataclass
class MixedStepPlan(StepPlan):
    """A mixed step captured whole (``engine.mixed_graphs``): the decode part over every row of the step (rows that
    are not decode rows read no key), then the extend part over chunk slots whose ``q_indptr`` indexes the same
    rows, written over the decode part's output at those rows."""

    decode_meta: BatchMetadata
    decode_plan: StepPlan
    extend_meta: BatchMetadata
    extend_plan: StepPlan


class HybridBackend:
    def __init__(self, prefill_backend: AttentionBackend, decode_backend: AttentionBackend):
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend
        # Why a mixed step may not split here (None: it may): the runner sets it from the model
        # (``layer.beyond_the_layer``), and with it the floor below.
        self.mixed_refused: str | None = "the model was not checked (a backend pair outside a runner)"
        self._mixed_min_rows: int | None = None

    @property
    def strided_query(self) -> bool:
        """Whether both backends take q as a strided view (``AttentionBackend.strided_query``)."""
        return self.prefill_backend.strided_query and self.decode_backend.strided_query

    @property
    def mixed_min_rows(self) -> int | None:
        """Fewest leading decode rows a mixed step splits off (``decode_rows``); None: never."""
        return self._mixed_min_rows

    @mixed_min_rows.setter
    def mixed_min_rows(self, rows: int | None) -> None:
        if rows is not None and self.mixed_refused is not None:
            raise BackendError(f"mixed steps cannot be split here: {self.mixed_refused}",
                               fix="leave mixed_min_rows at None for this model")
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise BackendError(f"mixed_min_rows must be a positive integer or None, got {rows!r}",
                               fix="pass e.g. 32, or None to never split")
        self._mixed_min_rows = rows

    @staticmethod
    def _prefill_class(prefill: str, device: torch.device) -> str:
        kernel = get_backend_class(prefill).capabilities.kernel_on("prefill", device_gpu(device))
        return (kernel.runs_as if kernel else None) or prefill

    @classmethod
    def create(cls, prefill: str, decode: str, pool: KVPool, **kwargs) -> "HybridBackend":
        """The registered backends ``prefill`` and ``decode`` over ``pool`` (``kwargs``: their constructors'),
        one instance where both phases run the same backend."""
        prefill = cls._prefill_class(prefill, pool.device)
        pre = get_backend_class(prefill)(pool, **kwargs)
        dec = pre if decode == prefill else get_backend_class(decode)(pool, **kwargs)
        return cls(pre, dec)

    @classmethod
    def copy_bytes_per_token(cls, prefill: str, decode: str, specs, dtype: torch.dtype, device: torch.device) -> int:
        """Bytes per pool token that ``create``'s backends keep beside the pool (an NSA backend's copy of the MLA
        cache in its own layout): KV sizing charges them to the pool's pages. Read from each backend's declared
        layout; ``nsa.py`` refuses a backend whose copy does not match its declaration."""
        names = {cls._prefill_class(prefill, device), decode}
        layouts = (KVLayout(get_backend_class(n).capabilities.mla_kv_layout) for n in names)
        return sum(kv_layout.copy_bytes_per_token(specs, layout, dtype) for layout in layouts)

    def for_step(self, meta: BatchMetadata) -> AttentionBackend:
        return self.decode_backend if meta.is_decode else self.prefill_backend

    def distinct(self) -> list[AttentionBackend]:
        """The backends, each once (the prefill backend first)."""
        pre, dec = self.prefill_backend, self.decode_backend
        return [pre] if dec is pre else [pre, dec]

    def warm_up(self, layers) -> None:
        """Each backend's ``warm_up`` for the model's attention layers."""
        for backend in self.distinct():
            backend.warm_up(layers)

    def mixed_split(self) -> tuple[int | None, str]:
        """(the fewest leading decode rows a mixed step splits off, or None: never; why)."""
        if self.mixed_refused is not None:
            return None, self.mixed_refused
        if not (self.prefill_backend.splits_mixed_steps and self.decode_backend.splits_mixed_steps):
            return None, "a backend of the pair does not declare splits_mixed_steps"
        if self._mixed_min_rows is None:
            return None, "off (mixed_min_rows=None)"
        return self._mixed_min_rows, "the decode rows run on the decode backend, the chunks on the prefill backend"

    def mixed_capture(self) -> str | None:
        """Why mixed steps cannot be captured whole (``engine.mixed_graphs``) with these backends; None: they can."""
        if self.mixed_refused is not None:
            return self.mixed_refused
        names = [b.name for b in self.distinct() if not b.captures_mixed_steps]
        if names:
            return f"backend {', '.join(map(repr, names))} does not declare captures_mixed_steps"
        return None

    def decode_rows(self, meta: BatchMetadata) -> int:
        """How many leading requests of an EXTEND step run as a decode step (``MixedPlan``); 0: none. Not where
        a prefix is shared (the step's cascade reads it once for all its requests)."""
        floor = self.mixed_split()[0]
        if floor is None or meta.is_decode or meta.shared_prefix_len:
            return 0
        n = meta.leading_decode_rows()
        return n if floor <= n < meta.num_reqs else 0

    def prepare(self, meta: BatchMetadata) -> StepPlan:
        """Once per step, before the model runs: the step's backend's plan, or a mixed step's two."""
        if n := self.decode_rows(meta):
            head, tail = meta.split(n)
            return MixedPlan(head, self.decode_backend.prepare(head), tail, self.prefill_backend.prepare(tail))
        return self.for_step(meta).prepare(meta)

    def run(self, layer: AttentionLayer, q: torch.Tensor, meta: BatchMetadata, plan: StepPlan) -> torch.Tensor:
        """One layer's attention over the cache (its k/v already stored) with the step's ``plan``."""
        if isinstance(plan, MixedStepPlan):
            out = self.decode_backend.decode(layer, q, plan.decode_meta, plan.decode_plan)
            return self.prefill_backend.extend(layer, q, plan.extend_meta, plan.extend_plan, out=out)
        if isinstance(plan, MixedPlan):  # the decode part's rows first, one per request
            n = plan.decode_meta.num_reqs
            return torch.cat([self.decode_backend.decode(layer, q[:n], plan.decode_meta, plan.decode_plan),
                              self.prefill_backend.extend(layer, q[n:], plan.extend_meta, plan.extend_plan)])
        backend = self.for_step(meta)
        return (backend.decode if meta.is_decode else backend.extend)(layer, q, meta, plan)

    # ---- CUDA graphs: decode steps, on the decode backend ----
    @property
    def supports_cuda_graph(self) -> bool:
        return self.decode_backend.supports_cuda_graph

    def init_graph_state(self, max_batch_size: int, max_pages_per_req: int) -> None:
        self.decode_backend.init_graph_state(max_batch_size, max_pages_per_req)

    def prepare_graph(self, meta: BatchMetadata, capturing: bool) -> StepPlan:
        """A captured decode step's plan, built outside the graph (before capture and before each replay)."""
        return self.decode_backend.prepare_graph(meta, capturing)

    @property
    def supports_cascade_graph(self) -> bool:
        return self.decode_backend.supports_cascade_graph

    def cascade_graph_key(self, meta: BatchMetadata):
        return self.decode_backend.cascade_graph_key(meta)
