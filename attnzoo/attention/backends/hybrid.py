"""Which backend serves a step: the one place that decides it.

A model runs with two backends, one per phase (``Decision.prefill_backend`` / ``decode_backend``, often
the same one). EXTEND steps run on the prefill backend, DECODE steps on the decode backend; the engine
plans the step, each attention layer runs it and CUDA graphs capture it through this object (in the
spirit of mini-sglang's hybrid backend), so none of them picks a backend of its own.

``create`` also applies a prefill backend's declared substitution: where its declaration says extend
runs as another backend on this GPU (``Kernel.runs_as``: trtllm_mha has no context kernel off
SM100/SM103, where its prefill is the flashinfer backend's), that backend is built for prefill.
"""
from __future__ import annotations

import torch

from attnzoo.attention import kv_layout
from attnzoo.attention.backends import get_backend_class
from attnzoo.attention.backends.base import AttentionBackend, AttentionLayer, StepPlan, device_gpu
from attnzoo.attention.kv_cache import KVLayout, KVPool
from attnzoo.attention.metadata import BatchMetadata


class HybridBackend:
    def __init__(self, prefill_backend: AttentionBackend, decode_backend: AttentionBackend):
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend

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

    def prepare(self, meta: BatchMetadata) -> StepPlan:
        """Once per step, before the model runs: the step's backend's plan."""
        return self.for_step(meta).prepare(meta)

    def run(self, layer: AttentionLayer, q: torch.Tensor, meta: BatchMetadata, plan: StepPlan) -> torch.Tensor:
        """One layer's attention over the cache (its k/v already stored) with the step's ``plan``."""
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
