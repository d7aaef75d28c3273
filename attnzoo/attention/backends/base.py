"""The backend contract: what every attention backend implements, and nothing more.

Per step the engine calls ``prepare(meta)`` once (plan kernels, build index arrays); then every
attention layer calls ``extend`` (EXTEND steps) or ``decode`` (DECODE steps). By the time either runs,
the layer has already stored this step's k/v in the pool, so a backend only reads the cache.

CUDA-graph hooks: a backend that can run inside a captured decode graph sets
``supports_cuda_graph = True`` and implements ``init_graph_state`` (static buffers for the largest
batch) and ``prepare_graph(meta, capturing)`` (refill those buffers in place for a replay). That ``meta``
covers the batch-size bucket: its device tensors are the graph's static buffers, its host lists
(``seq_lens_cpu``, ``q_lens_cpu``) the real step's padded to the bucket (padding rows: one token in
page 0); at capture they are the worst case (every row at the graph's longest context).

Cascade attention: a backend that reads a prefix shared by every request of a DECODE step once for the
whole batch (``meta.shared_prefix_len``) sets ``supports_cascade = True``; others ignore the field and
read every request's pages as usual, which gives the same result. ``supports_cascade_extend``: the
same for EXTEND steps (every new token of the step comes after the shared pages).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.metadata import BatchMetadata

if TYPE_CHECKING:
    from attnzoo.attention.layer import Attention


class AttentionBackend(ABC):
    name: ClassVar[str]
    supports_cuda_graph: ClassVar[bool] = False
    supports_cascade: ClassVar[bool] = False
    supports_cascade_extend: ClassVar[bool] = False

    def __init__(self, pool: KVPool):
        self.pool = pool

    def prepare(self, meta: BatchMetadata) -> None:
        """Once per step, before the model runs. Default: nothing to plan."""

    @abstractmethod
    def extend(self, layer: "Attention", q: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, v_head_dim]."""

    @abstractmethod
    def decode(self, layer: "Attention", q: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        """q: [num_reqs, num_heads, head_dim] -> [num_reqs, num_heads, v_head_dim]."""

    def init_graph_state(self, max_batch_size: int, max_pages_per_req: int) -> None:
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")

    def prepare_graph(self, meta: BatchMetadata, capturing: bool) -> None:
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")
