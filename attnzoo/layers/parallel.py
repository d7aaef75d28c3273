"""Tensor parallelism (Megatron-style) on torch.distributed: a TP context and the parallel layers.

A ``TPContext`` names this process's rank, the world size and its groups; it is built by the engine's
launcher (``attnzoo.engine.tensor_parallel``) and passed to model constructors, which read only the
head counts and layers below from it. Nothing here touches torch.distributed's global state.

Layers split their weights across ranks and load by slicing the full checkpoint tensor: every
parameter that is a shard carries ``tp_shard`` (full tensor -> this rank's slice), which
``CausalLM.load_weights`` applies before its shape check. The loader hands it checkpoint tensors not
read yet (``models.loader.LazyTensor``), so a rank reads only its slice. At world size 1 every layer
computes exactly what ``nn.Linear`` / ``nn.Embedding`` compute.

- ``ColumnParallelLinear``: this rank's output features (heads); no communication.
- ``RowParallelLinear``: this rank's input features; the partial outputs are summed by one
  all-reduce (the one per attention block and per MLP), or left to the caller (``reduce=False``) when
  two partial sums share one reduction (DeepSeek's routed plus shared experts).
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: contiguous vocabulary ranges (the last rank's
  padded with zero rows); embeddings all-reduce, logits all-gather. Same split, so they can be tied.
- ``Fp8RowParallelLinear``: RowParallelLinear on FP8 block-scaled weights. FP8 column-parallel layers
  are plain ``Fp8Linear`` / ``Fp8MergedLinear`` with cuts; ``Narrow.blocks`` cuts the block factors
  (``models.quantization`` decides which layers stay FP8: those whose cut falls on block boundaries).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.errors import ModelLoadError
from attnzoo.layers import skinny
from attnzoo.layers.fp8 import Fp8Format, Fp8Linear


@dataclass(frozen=True)
class TPContext:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # collectives of the forward pass (NCCL on GPUs, gloo on CPU); None at world size 1

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (every rank gets the same bits: routing stays identical)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d] per rank -> [..., world_size * d], rank order."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        # torch 2.13 renamed all_gather_into_tensor; both take [world * n, ...] outputs on gloo and NCCL.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        gather(out, x.contiguous(), group=self.group)
        out = out.view(self.world_size, *x.shape)
        return out.movedim(0, -2).reshape(*x.shape[:-1], self.world_size * x.shape[-1])

    # ------------------------------------------------------------------ partitioning

    def split(self, n: int, what: str) -> int:
        """This rank's share of ``n`` (heads, features, experts); they must divide evenly."""
        if n % self.world_size:
            raise ModelLoadError(
                f"{what} ({n}) is not divisible by tensor_parallel_size {self.world_size}",
                fix=f"use a tensor_parallel_size that divides {n}",
            )
        return n // self.world_size

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """(first, count) of this rank's contiguous share of ``n``."""
        size = self.split(n, what)
        return self.rank * size, size

    def kv_heads(self, num_kv_heads: int, num_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank keeps for its query heads.

        With at least as many KV heads as ranks they are split like the query heads; with fewer
        (Gemma 4's 4 global KV heads at TP 8), each rank keeps a copy of the one KV head its query
        heads read: ranks r*kv/tp..(r+1)*kv/tp - 1 share head r // (tp / kv).
        """
        self.split(num_heads, "num_attention_heads")
        if num_kv_heads >= self.world_size:
            return self.shard(num_kv_heads, "num_key_value_heads")
        if self.world_size % num_kv_heads:
            raise ModelLoadError(
                f"{num_kv_heads} KV heads cannot be replicated evenly over tensor_parallel_size {self.world_size}",
                fix=f"use a tensor_parallel_size that is a multiple or a divisor of {num_kv_heads}",
            )
        return self.rank // (self.world_size // num_kv_heads), 1


SINGLE = TPContext()


@dataclass(frozen=True)
class Narrow:
    """The cut ``full.narrow(dim, start, size)`` of a tensor that is ``full_size`` long along ``dim``
    (None: unknown)."""

    dim: int
    start: int
    size: int
    full_size: int | None = None

    def __call__(self, full):
        return full.narrow(self.dim, self.start, self.size)

    def blocks(self, block: int) -> Narrow | None:
        """The same cut of the per-block factors (one per ``block`` along ``dim``: FP8 ``weight_scale_inv``),
        or None when this rank's part does not begin on a block boundary or ends inside a block short of
        the tensor's end: its rows would then share a block, and its factor, with another rank's."""
        ends_whole = self.size % block == 0 or (self.full_size is not None and self.start + self.size == self.full_size)
        if self.start % block or not ends_whole:
            return None
        full = None if self.full_size is None else -(-self.full_size // block)
        return Narrow(self.dim, self.start // block, -(-self.size // block), full)


def narrow(dim: int, start: int, size: int, full_size: int | None = None) -> Narrow:
    return Narrow(dim, start, size, full_size)


def _zeros(full) -> torch.Tensor:
    return torch.zeros(tuple(full.shape))


def _padded_rows(start: int, size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows start..start+size of the full tensor, zero rows past its end (the padded vocabulary)."""

    def take(full: torch.Tensor) -> torch.Tensor:
        rows = full[start : start + size]
        if rows.shape[0] == size:
            return rows
        pad = rows.new_zeros((size - rows.shape[0], *rows.shape[1:]))
        return torch.cat([rows, pad])

    return take


def mark_shard(param: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Tell the loader how to cut this rank's part of ``param`` from the checkpoint's full tensor."""
    param.tp_shard = fn
    return param


class Linear(nn.Linear):
    """nn.Linear whose product is ``skinny.linear``: the skinny kernel at decode's few rows, cuBLAS otherwise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny.linear(x, self.weight, self.bias)


class ColumnParallelLinear(Linear):
    """y = x W^T + b with this rank's rows of W and b (its output features); no communication.

    ``rows``: (first, count) of the output features this rank keeps (default: an even split);
    replicated KV heads pass their own range.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, tp: TPContext = SINGLE,
                 rows: tuple[int, int] | None = None):
        start, size = rows if rows is not None else tp.shard(out_features, "output features")
        super().__init__(in_features, size, bias=bias)
        if (start, size) != (0, out_features):
            mark_shard(self.weight, narrow(0, start, size, out_features))
            if bias:
                mark_shard(self.bias, narrow(0, start, size, out_features))


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T (+ b once): this rank's input features (columns of W).

    ``reduce=False`` returns the partial sum (the bias counted on rank 0 only) for the caller to
    all-reduce together with another partial sum.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, tp: TPContext = SINGLE,
                 reduce: bool = True):
        start, size = tp.shard(in_features, "input features")
        super().__init__(size, out_features, bias=bias)
        self.tp, self.reduce = tp, reduce
        if size != in_features:
            mark_shard(self.weight, narrow(1, start, size, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = skinny.linear(x, self.weight, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce(y) if self.reduce else y


class Fp8RowParallelLinear(Fp8Linear):
    """RowParallelLinear with FP8 block-scaled weights: this rank's input features are whole 128-blocks
    (``cut``: their columns of the weight; ``cut.blocks``: their columns of ``weight_scale_inv``), so its
    activation groups are the unsplit layer's and the partial sums add up to its output. The bias is
    counted once: other ranks load zeros for it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, fmt: Fp8Format = Fp8Format(), *,
                 tp: TPContext = SINGLE, reduce: bool = True, cut: Narrow, device=None):
        super().__init__(in_features, out_features, bias, fmt, device=device)
        self.tp, self.reduce, self.cut = tp, reduce, cut
        mark_shard(self.weight, cut)
        mark_shard(self.weight_scale_inv, cut.blocks(fmt.block_k))
        if bias and tp.rank:
            mark_shard(self.bias, _zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.tp.all_reduce(y) if self.reduce else y


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows of this rank's vocabulary range; other ranks' tokens read zeros, then one all-reduce."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TPContext = SINGLE):
        per = -(-num_embeddings // tp.world_size)
        super().__init__(per, embedding_dim)
        self.tp, self.start, self.vocab_size = tp, tp.rank * per, num_embeddings
        if tp.world_size > 1:
            mark_shard(self.weight, _padded_rows(self.start, per))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))


class ParallelLMHead(Linear):
    """Logits for this rank's vocabulary range, gathered into the full [n, vocab] on every rank."""

    def __init__(self, hidden: int, vocab_size: int, *, tp: TPContext = SINGLE):
        per = -(-vocab_size // tp.world_size)
        super().__init__(hidden, per, bias=False)
        self.tp, self.vocab_size = tp, vocab_size
        if tp.world_size > 1:
            mark_shard(self.weight, _padded_rows(tp.rank * per, per))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last(skinny.linear(hidden, self.weight))
        return logits[..., : self.vocab_size]
