"""DeepSeek-V4's KV compressors and interleaved RoPE: the weights and math that turn a block of tokens
into one compressed entry (``attention/compressed.py`` decides when and stores it).

A compressor projects every token to a key part C and a gate part Z (``kv_proj``, ``gate_proj``; the
layer stores [C | Z] per token as the block's "state"). A completed block of ``rate`` tokens starting at
position s becomes one entry: sum_j softmax_j(Z_j + B_j) * C_j over the block (softmax per channel,
float32; B = ``position_bias``), then ``kv_norm`` and RoPE at position s. With ``overlap`` (CSA and its
indexer) C and Z are twice as wide: an entry pools the previous block's first halves and its own block's
second halves, 2 * rate slots (the first block has no previous one: those slots weigh 0). The same math
as transformers' ``DeepseekV4HCACompressor`` / ``DeepseekV4CSACompressor`` / ``DeepseekV4Indexer``.
"""
from __future__ import annotations

import torch
from torch import nn

from attnzoo.layers import fused
from attnzoo.models.common import MergedLinear, RMSNorm, RotaryEmbedding


class V4Rope(nn.Module):
    """Interleaved RoPE on the trailing ``rope_dim`` channels (pairs (x0, x1), (x2, x3), ... kept in
    place: V4's attention output is un-rotated and mixed by a projection, so channel order matters)."""

    def __init__(self, config, rope_label: str, rope_dim: int):
        super().__init__()
        params = config.rope_parameters[rope_label]
        rot = RotaryEmbedding(config, rope_type=params.get("rope_type", "default"), layer_type=rope_label,
                              head_dim=rope_dim)
        self.inv_freq, self.scaling = rot.inv_freq, rot.scaling

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rope_dim / 2] float32."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        f = positions.float()[:, None] * self.inv_freq[None, :]
        return f.cos() * self.scaling, f.sin() * self.scaling

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm=None) -> torch.Tensor:
        """x [T, ..., D] with cos/sin [T, rope_dim / 2]: its trailing channels rotated IN PLACE, x returned
        (every caller passes a tensor it just made; a copy of the other channels costs a pass over x);
        sin negated un-rotates; ``norm``: an RMSNorm over D applied first, in the same pass."""
        return fused.rope_tail(x, cos, sin, norm=norm, in_place=True)


class Compressor(nn.Module):
    """One compressor: ``project`` (per token) and ``pool`` (per completed block)."""

    def __init__(self, hidden: int, dim: int, rate: int, *, overlap: bool, eps: float, rope: V4Rope):
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.kv_gate_proj = MergedLinear(hidden, {"kv_proj": width, "gate_proj": width})
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)
        self.rope = rope  # the layer's compress RoPE (no weights)

    @property
    def state_dim(self) -> int:
        return 2 * (2 * self.dim if self.overlap else self.dim)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the per-token state [T, state_dim] = [C | Z]."""
        return self.kv_gate_proj(x)

    def pool(self, rows: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, first: torch.Tensor):
        """rows [S, state_dim] (the pool's state rows, a view), slots [n, span] the row of each position of
        each block (span = 2 * rate with overlap, the previous block first), valid [n, span] bool, first [n]
        the block's first position -> (entries [n, dim] roped, None)."""
        entries = fused.gated_pool(rows, slots, valid, self.position_bias, dim=self.dim, rate=self.rate,
                                   overlap=self.overlap)
        cos, sin = self.rope.tables(first)
        return self.rope.apply(entries, cos, sin, norm=self.kv_norm), None


class IndexerScorer(nn.Module):
    def __init__(self, hidden: int, n_heads: int):
        super().__init__()
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)


class Indexer(Compressor):
    """CSA's lightning indexer: its own overlapping compressor at ``index_head_dim`` (its keys), a query
    of ``index_n_heads`` heads from the layer's q low-rank residual, and per-head weights."""

    def __init__(self, config, rate: int, rope: V4Rope):
        super().__init__(config.hidden_size, config.index_head_dim, rate, overlap=True, eps=config.rms_norm_eps,
                         rope=rope)
        self.n_heads = config.index_n_heads
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.n_heads * self.dim, bias=False)
        self.scorer = IndexerScorer(config.hidden_size, self.n_heads)

    def query(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """-> query [T, Hi, Di] roped, weights [T, Hi] float32 already / sqrt(Hi)."""
        q = self.rope.apply(self.q_b_proj(q_resid).view(x.shape[0], self.n_heads, self.dim), cos, sin)
        return q, self.scorer.weights_proj(x).float() * self.n_heads**-0.5


class CSACompressor(Compressor):
    """The CSA branch: an overlapping compressor at the layer's head dim, plus the indexer; its state is
    both compressors' side by side, and it pools (entries, indexer keys)."""

    def __init__(self, config, rate: int, rope: V4Rope):
        super().__init__(config.hidden_size, config.head_dim, rate, overlap=True, eps=config.rms_norm_eps, rope=rope)
        self.indexer = Indexer(config, rate, rope)

    @property
    def state_dim(self) -> int:
        return super().state_dim + self.indexer.state_dim

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([super().project(x), self.indexer.project(x)], dim=-1)

    def pool(self, rows, slots, valid, first):
        split = Compressor.state_dim.fget(self)
        return (super().pool(rows[:, :split], slots, valid, first)[0],
                self.indexer.pool(rows[:, split:], slots, valid, first)[0])
