"""MoE routing: router logits -> (weights, expert ids), DeepSeek's softmax or sigmoid scores, group-limited
choice, top-k, renormalisation and scaling; one Triton launch per layer on a GPU, the router's GEMV included at
decode's few tokens (``route``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attnzoo import pdl
from attnzoo.errors import ModelLoadError
from attnzoo.layers.moe.fused import _kernels


GROUP_SCORES = (None, "max", "top2")


def select_experts_reference(logits, *, top_k: int, sigmoid: bool, group_score: str | None = None, n_group: int = 1,
                             topk_group: int = 1, correction_bias=None, renormalize: bool = False,
                             scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops of DeepSeek's routers (transformers' ``deepseek_v2`` / ``deepseek_v3``), the oracle."""
    t, e = logits.shape
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    choice = scores + correction_bias if correction_bias is not None else scores
    if group_score is not None:
        grouped = choice.view(t, n_group, -1)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if group_score == "top2" else grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        mask = group_mask.repeat_interleave(e // n_group, dim=1)
        choice = choice.masked_fill(~mask, float("-inf") if sigmoid else 0.0)
    if sigmoid:
        ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    else:
        weights, ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def select_experts(logits: torch.Tensor, *, top_k: int, sigmoid: bool, group_score: str | None = None,
                   n_group: int = 1, topk_group: int = 1, correction_bias: torch.Tensor | None = None,
                   renormalize: bool = False, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] float32 -> (weights [T, k] float32, expert ids [T, k] int64).

    Scores are softmax(logits), or sigmoid(logits) with ``correction_bias`` [E] added for the choice
    only (weights are the unbiased scores). ``group_score`` limits the choice to the ``topk_group`` best
    of ``n_group`` expert groups, ranked by their best ("max") or two best ("top2") scores; then the
    top-k experts, weights renormalized to sum 1 if asked, times ``scale``. One Triton launch on a GPU
    (the ~15 small torch ops of ``select_experts_reference`` elsewhere); ids come in any order.
    """
    _check_group_score(group_score)
    if not _fused_triton(logits):
        return select_experts_reference(logits, top_k=top_k, sigmoid=sigmoid, group_score=group_score,
                                        n_group=n_group, topk_group=topk_group, correction_bias=correction_bias,
                                        renormalize=renormalize, scale=scale)
    t, e = logits.shape
    logits = logits.float()
    choice, flags = _choice_args(e, top_k, sigmoid, group_score, n_group, topk_group, correction_bias, renormalize,
                                 scale)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _kernels().route_kernel[(t,)](
            logits, correction_bias if correction_bias is not None else logits, weights, ids, e, *choice,
            logits.stride(0), **flags, **pdl.launch_args(logits),
        )
    return weights, ids


# Up to this many tokens the router's float32 GEMV and the choice can be one launch (``router_kernel``), and while the
# tokens' reads of the weight (each token's programs read all of it, from L2 after the first) stay within
# ONE_LAUNCH_BYTES; past either, the GEMV is cuBLAS's. Measured at one token of DeepSeek-V2-Lite (a 0.5 MiB weight):
# the cast, cuBLAS's GEMV and reduction and the choice were four launches (results/batch1_router_*).
ROUTER_ROWS = 16
ONE_LAUNCH_BYTES = 8 << 20


def arrivals_counter(device=None) -> torch.Tensor:
    """The zeroed int32 counters ``route`` needs, one per token up to ``ROUTER_ROWS``; every launch leaves them zeroed.
    One set per router module: two launches that could overlap (another stream) must never share a set, or a token
    would be routed on part of its logits."""
    return torch.zeros(ROUTER_ROWS, dtype=torch.int32, device=device)


def route(x: torch.Tensor, weight: torch.Tensor, arrivals: torch.Tensor, *, top_k: int, sigmoid: bool,
          group_score: str | None = None, n_group: int = 1, topk_group: int = 1,
          correction_bias: torch.Tensor | None = None, renormalize: bool = False,
          scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_experts(F.linear(x.float(), weight), ...)``: x [T, H] in the model dtype, the router weight [E, H]
    float32. At up to ``arrivals.numel()`` tokens on a GPU (or where ``fused.use("triton")`` asks) and a small
    enough weight, one launch: each program's block of experts' logits, then each token's last program routes it."""
    t, hidden = x.shape
    _check_group_score(group_score)
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] != hidden:
        raise ModelLoadError(f"router weight {tuple(weight.shape)} {weight.dtype} does not fit x {tuple(x.shape)}",
                             fix="keep the router weight float32 [experts, hidden]")
    one_launch = 0 < t <= arrivals.numel() and t * weight.numel() * weight.element_size() <= ONE_LAUNCH_BYTES
    if not (one_launch and _fused_triton(x)):
        return select_experts(F.linear(x.float(), weight), top_k=top_k, sigmoid=sigmoid, group_score=group_score,
                              n_group=n_group, topk_group=topk_group, correction_bias=correction_bias,
                              renormalize=renormalize, scale=scale)
    x, weight = x.contiguous(), weight.contiguous()
    e = weight.shape[0]
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    block_e = 1 << (-(-e // 128) - 1).bit_length()  # at most ~128 programs a token (E=64: 64, E=256: 128)
    blocks = -(-e // block_e)
    choice, flags = _choice_args(e, top_k, sigmoid, group_score, n_group, topk_group, correction_bias, renormalize,
                                 scale)
    _kernels().router_kernel[(t, blocks)](
        x, weight, logits, arrivals, correction_bias if correction_bias is not None else logits, weights, ids,
        hidden, e, *choice, x.stride(0), weight.stride(0), logits.stride(0),
        **flags, BLOCK_E=block_e, BLOCK_K=max(16, 1024 // block_e), **pdl.launch_args(x, t * blocks),
    )
    return weights, ids


def _choice_args(e, top_k, sigmoid, group_score, n_group, topk_group, correction_bias, renormalize, scale):
    """The routing kernels' runtime arguments after the expert count, and their constexprs."""
    flags = dict(SIGMOID=sigmoid, GROUP_SCORE=GROUP_SCORES.index(group_score),
                 HAS_BIAS=correction_bias is not None, RENORM=renormalize, TOP_K=top_k,
                 K_POW2=1 << (top_k - 1).bit_length(), E_POW2=1 << (e - 1).bit_length())
    return (e // n_group, n_group, topk_group, float(scale)), flags


def _check_group_score(group_score) -> None:
    if group_score not in GROUP_SCORES:
        raise ModelLoadError(f"unknown expert-group score {group_score!r}", fix=f"use one of {GROUP_SCORES}")


def _fused_triton(x: torch.Tensor) -> bool:
    """Whether the MoE kernels run for ``x``: always on a GPU (the reference's host sync could not be
    captured in a CUDA graph), on a CPU where ``fused.use("triton")`` asks for every fused kernel (under
    Triton's interpreter: tests and launch counts of whole layers)."""
    from attnzoo.layers import fused

    return x.is_cuda or fused._triton(x) is not None
