"""DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3 with DeepSeek Sparse Attention (NSA / DSA).

Each MLA layer gains a lightning indexer with its own weights: a query of ``index_n_heads`` heads of
``index_head_dim`` (``wq_b`` on the q low-rank residual: V3.2 configs always have q_lora_rank), one key per
token (``wk`` then the LayerNorm ``k_norm``) and per-head weights (``weights_proj``, kept in float32 as
in the reference). Indexer query and key are roped on their first ``qk_rope_head_dim`` channels with
rotate-half (non-interleaved) RoPE, while the MLA RoPE stays interleaved. The indexer key is cached per
token beside the MLA entry, and each query attends only to its ``index_topk`` best-scoring cached
tokens: ``attnzoo.attention.nsa`` holds the scoring, selection and sparse attention. Everything else
(MoE, MLA projections, YaRN) is DeepSeek-V3.

The math follows transformers' ``models/deepseek_v32``.
"""
from __future__ import annotations

import torch
from torch import nn

from attnzoo.attention.layer import ForwardContext
from attnzoo.attention.nsa import NSAAttention
from attnzoo.errors import ModelLoadError
from attnzoo.layers.parallel import SINGLE, TPContext
from attnzoo.models.common import apply_rope
from attnzoo.models.deepseek_v2 import DeepseekAttention, DeepseekV3ForCausalLM


class DeepseekV32Indexer(nn.Module):
    """The indexer's projections: x [T, hidden], q residual [T, q_lora] -> its query, key and head weights."""

    def __init__(self, config, *, interleaved_rope: bool = False):
        super().__init__()
        self.interleaved_rope = interleaved_rope  # V3.2: rotate-half; GLM-5: interleaved pairs
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.wq_b = nn.Linear(self.query_input_dim(config), self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False, dtype=torch.float32)

    @staticmethod
    def query_input_dim(config) -> int:
        return config.q_lora_rank  # wq_b reads the q low-rank residual (Mistral Large 4: the hidden states)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) must not round weights_proj (transformers keeps it in float32).
        super()._apply(fn, recurse)
        if self.weights_proj.weight.dtype != torch.float32:
            self.weights_proj.weight.data = self.weights_proj.weight.data.float()
        return self

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # The rest passes through.
        return apply_rope(x, cos[:, : self.rope_dim], sin[:, : self.rope_dim], interleaved=self.interleaved_rope)

    def forward(self, x, q_resid, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> q [T, Hi, D] and k [T, D], roped; weights [T, Hi] float32."""
        t = x.shape[0]
        q = self._rope(self.wq_b(q_resid).view(t, self.n_heads, self.head_dim), cos, sin)
        k = self._rope(self.k_norm(self.wk(x))[:, None, :], cos, sin)[:, 0]
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float()
        return q, k, weights


class DeepseekV32Attention(DeepseekAttention):
    indexer_interleaved_rope = False  # GLM-5 ropes its indexer on interleaved pairs
    indexer_cls = DeepseekV32Indexer

    @staticmethod
    def has_indexer(config, layer_id: int) -> bool:
        return True  # GLM-5's "shared" layers reuse an earlier layer's selection instead

    def __init__(self, config, layer_id: int, *, interleaved_rope: bool, tp: TPContext = SINGLE):
        # Tensor parallel: the indexer is replicated (it scores tokens for all heads alike).
        super().__init__(config, layer_id, interleaved_rope=interleaved_rope, tp=tp)
        own = self.has_indexer(config, layer_id)
        self.indexer = self.indexer_cls(config, interleaved_rope=self.indexer_interleaved_rope) if own else None
        self.mla = self.nsa_core(config, layer_id, own)

    def nsa_core(self, config, layer_id: int, own_indexer: bool, **overrides) -> NSAAttention:
        """The attention core; ``overrides``: NSAAttention keywords as a subclass needs them."""
        kw = dict(kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                  qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, scale=self.mla.scale,
                  index_head_dim=config.index_head_dim if own_indexer else 0, index_n_heads=config.index_n_heads,
                  index_topk=config.index_topk)
        return NSAAttention(layer_id, self.num_heads, **{**kw, **overrides})

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q_nope, q_pe, q_resid, latent, k_pe = self.project(x, cos, sin)
        index_q = index_k = index_weights = None  # no indexer: the step's last selection is reused
        if self.indexer is not None:
            index_q, index_k, index_weights = self.indexer(x, q_resid, cos, sin)
        out = self.mla(q_nope, q_pe, latent, k_pe, self.kv_b_proj.weight, ctx,
                       index_q=index_q, index_k=index_k, index_weights=index_weights, q_pe_in_slot=True)
        return self.o_proj(out)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    attention_cls = DeepseekV32Attention

    def __init__(self, config, tp: TPContext = SINGLE):
        _check_config(config)
        super().__init__(config, tp)

    @staticmethod
    def interleaved_rope(config) -> bool:
        return True  # V3.2's MLA RoPE is always interleaved: its config has no rope_interleave switch


def _check_config(config) -> None:
    n_dense = min(config.first_k_dense_replace, config.num_hidden_layers)
    expected = ["dense"] * n_dense + ["sparse"] * (config.num_hidden_layers - n_dense)
    given = getattr(config, "mlp_layer_types", None)
    if given is not None and list(given) != expected:
        raise ModelLoadError(
            f"mlp_layer_types {list(given)} is not first_k_dense_replace={config.first_k_dense_replace} dense "
            "layers then MoE layers",
            fix="make mlp_layer_types agree with first_k_dense_replace in config.json",
        )
