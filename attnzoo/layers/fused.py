"""Fused elementwise ops of the model files, each one kernel on a GPU where torch spends several:

* ``rms_norm``: x / rms(x) * (offset + weight) in float32 (per-head [T, H, D] views too);
* ``add_rms_norm``: the residual add and the next norm, optionally with Gemma's post-norm of x first
  and its per-layer scalar after the add;
* ``act_and_mul``: silu(gate) * up or gelu_tanh(gate) * up from one [T, 2I] gate_up projection;
* ``rope``: rotate-half or interleaved-pair RoPE of q and k in one launch (partial RoPE too);
* ``norm_rope``: per-head RMSNorms of q, k and v, then RoPE of q and k, in one launch (Gemma 4);
* ``rope_tail``: DeepSeek-V4's RoPE on the trailing channels, pairs kept in place, after an optional
  per-head RMSNorm (torch: the norm's pass, then ~8 launches over the rotary slice);
* ``softcap``: float32 logits tanh(x / cap) * cap from the LM head's output (Gemma's final soft-cap);
* ``argmax_finite``: greedy tokens from the logits, -1 for a row with a non-finite top value;
* ``hc_project``: DeepSeek-V4's hyper-connection mixes, the RMS-normed streams times a small float32 matrix,
  in one pass over the streams (torch: a float32 copy, the norm's read and write, then a float32 GEMM);
* ``hc_weights``: DeepSeek-V4's hyper-connection weights (pre, post, Sinkhorn-projected comb) from the
  projected streams, where torch launches ~6 kernels per Sinkhorn iteration;
* ``hc_collapse`` / ``hc_mix``: the streams collapsed into a block's input, and the block's output spread
  back over the streams they mix (torch: a broadcast product and a sum; a batched n x n matmul and an add);
* ``gated_pool``: V4's compressor pooling, a per-channel softmax over a block's gate logits weighting its
  values (torch: six passes over [blocks, span, dim], float32 for most).

The torch functions here are the reference: they run on CPU tensors and are the oracle the Triton
kernels (``fused_kernels``; DeepSeek-V4's in ``v4_kernels``; used for CUDA tensors) are tested against.
``use("torch")`` runs the reference on a GPU (for unfused-vs-fused checks), ``use("triton")`` the kernels
on a CPU under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Protocol

import torch
import torch.nn.functional as F

from attnzoo.errors import BackendError
from attnzoo.lazy import optional_module

IMPLS = ("torch", "triton")
_forced: str | None = None


class NormParams(Protocol):
    """What the ops read from a norm module (``models.common.RMSNorm``): weight None means no scale."""

    weight: torch.Tensor | None
    eps: float
    offset: float


@contextlib.contextmanager
def use(impl: str) -> Iterator[None]:
    """Run every op in the block with ``impl`` ("torch" or "triton") whatever the device."""
    global _forced
    if impl not in IMPLS:
        raise BackendError(f"unknown fused-op implementation {impl!r}", fix=f"use one of {IMPLS}")
    previous, _forced = _forced, impl
    try:
        yield
    finally:
        _forced = previous


def _kernels(module: str = "fused_kernels"):
    return optional_module(f"attnzoo.layers.{module}")


def _triton(x: torch.Tensor, module: str = "fused_kernels"):
    """The kernel module when ``x`` should take the Triton path, else None."""
    if _forced is None:
        return _kernels(module) if x.is_cuda else None  # no triton installed: the torch ops still run
    if _forced == "torch":
        return None
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise BackendError("the fused Triton ops run on a CPU only under Triton's interpreter",
                           fix="set TRITON_INTERPRET=1 before triton is imported, or use fused.use('torch')")
    kernels = _kernels(module)
    if kernels is None:
        raise BackendError("fused.use('triton') was asked for but triton is not installed",
                           fix="pip install 'attnzoo[triton]'")
    return kernels


def enabled(x: torch.Tensor) -> bool:
    """Whether the ops run as Triton kernels for ``x`` (kernels that fuse them into others, too)."""
    return _triton(x) is not None


# ----------------------------------------------------------------------------------------------
# torch references


def rms_norm_ref(x: torch.Tensor, norm: NormParams) -> torch.Tensor:
    w = None if norm.weight is None else norm.weight.float() + norm.offset
    return F.rms_norm(x.float(), (x.shape[-1],), w, norm.eps).to(x.dtype)


def add_rms_norm_ref(x, residual, norm: NormParams, x_norm: NormParams | None = None, scale=None):
    if x_norm is not None:
        x = rms_norm_ref(x, x_norm)
    s = x if residual is None else residual + x
    if scale is not None:
        s = s * scale
    return rms_norm_ref(s, norm), s


def act_and_mul_ref(x: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x [T, heads, D] with cos/sin [T, R] (cat(f, f), R <= D): RoPE on the first R channels.

    Interleaved RoPE rotates pairs (x0, x1), (x2, x3), ... and writes them de-interleaved (all first
    members, then all second members): q and k get the same permutation, so their dot products, all
    attention ever uses, are those of the pair layout.
    """
    r = cos.shape[-1]
    half = r // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    if interleaved:
        x1, x2 = x[..., 0:r:2].float(), x[..., 1:r:2].float()
    else:
        x1, x2 = x[..., :half].float(), x[..., half:r].float()
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)


def rope_tail_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: NormParams | None = None,
                  in_place: bool = False) -> torch.Tensor:
    """x [T, ..., D] with cos/sin [T, R] (R frequencies): interleaved pairs on the last 2 R channels rotated
    where they are; ``norm``: x RMS-normed over D first (rounded to x's dtype, as the norm stores it)."""
    if norm is not None:
        normed = rms_norm_ref(x, norm)
        x = x.copy_(normed) if in_place else normed
    elif not in_place:
        x = x.clone()
    r = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    rope = x[..., -r:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    x[..., -r:] = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return x


def norm_rope_ref(q, k, v, cos, sin, q_norm: NormParams, k_norm: NormParams | None = None,
                  v_norm: NormParams | None = None, interleaved: bool = False):
    q = rope_ref(rms_norm_ref(q, q_norm), cos, sin, interleaved)
    if k is None:
        return q, None, None
    return q, rope_ref(rms_norm_ref(k, k_norm), cos, sin, interleaved), None if v is None else rms_norm_ref(v, v_norm)


def mla_entry_ref(q_pe, kv, norm: NormParams, cos, sin, interleaved: bool = False):
    p = q_pe.shape[-1]
    latent, k_pe = kv.split([kv.shape[-1] - p, p], dim=-1)
    k_pe = rope_ref(k_pe[:, None, :], cos, sin, interleaved)[:, 0]
    return rope_ref(q_pe, cos, sin, interleaved), torch.cat([rms_norm_ref(latent, norm), k_pe], dim=-1)


def softcap_ref(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x.float() / cap) * cap


def argmax_finite_ref(x: torch.Tensor) -> torch.Tensor:
    # NaN and +inf win argmax, so the top value is non-finite iff the row holds one, or is all -inf
    tokens = x.argmax(dim=-1)
    return torch.where(torch.isfinite(x.gather(-1, tokens[:, None]))[:, 0], tokens, -1)


def hc_project_ref(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    normed = F.rms_norm(streams.flatten(1).float(), (streams.shape[1] * streams.shape[2],), eps=eps)
    return F.linear(normed, fn.float())


def hc_weights_ref(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int, eps: float):
    pre, post, comb = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post * scale[1] + post_b)
    comb = torch.softmax(comb.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):  # Sinkhorn-Knopp: rows, then columns, sum to 1
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def gated_pool_ref(rows: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, bias: torch.Tensor, dim: int,
                   rate: int, overlap: bool) -> torch.Tensor:
    kv, gate = rows[slots].chunk(2, dim=-1)  # [n, span, W]
    if overlap:  # the previous block's first halves, then this block's second halves
        kv = torch.cat([kv[:, :rate, :dim], kv[:, rate:, dim:]], dim=1)
        gate = torch.cat([gate[:, :rate, :dim], gate[:, rate:, dim:]], dim=1)
        bias = torch.cat([bias[:, :dim], bias[:, dim:]], dim=0)
    gate = (gate.float() + bias).masked_fill(~valid[..., None], float("-inf"))
    kv = kv.masked_fill(~valid[..., None], 0)
    return (kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1)


def hc_collapse_ref(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def hc_mix_ref(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # sum_j comb[j, k] * stream_j: comb is applied transposed (it is not symmetric).
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(comb.to(dt).transpose(-1, -2), streams)


# ----------------------------------------------------------------------------------------------
# the ops


def rms_norm(x: torch.Tensor, norm: NormParams) -> torch.Tensor:
    """x [..., N] -> x / rms(x) * (offset + weight), computed in float32, in x's dtype."""
    k = _triton(x)
    if k is None:
        return rms_norm_ref(x, norm)
    return k.rms_norm(x, norm.weight, norm.eps, norm.offset)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, norm: NormParams, *, x_norm: NormParams | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (norm(s), s) with s = (residual + x_norm(x)) * scale (x itself without ``x_norm``; residual None:
    no add; ``scale``: a one-element tensor, Gemma 4's per-layer scalar, or None)."""
    k = _triton(x)
    if k is None:
        return add_rms_norm_ref(x, residual, norm, x_norm, scale)
    if residual is None:  # the first layer: no stream to add to yet, rare enough for separate launches
        s = x if x_norm is None else k.rms_norm(x, x_norm.weight, x_norm.eps, x_norm.offset)
        s = s if scale is None else s * scale
        return k.rms_norm(s, norm.weight, norm.eps, norm.offset), s
    if x_norm is None:
        return k.rms_norm(x, norm.weight, norm.eps, norm.offset, residual=residual, scale=scale)
    return k.rms_norm(x, norm.weight, norm.eps, norm.offset, residual=residual, x_norm=True,
                      x_weight=x_norm.weight, x_eps=x_norm.eps, x_offset=x_norm.offset, scale=scale)


GATED_ACTS = ("silu", "gelu_tanh")


def check_gated_act(act: str) -> None:
    if act not in GATED_ACTS:
        raise BackendError(f"unknown gated activation {act!r}", fix="use 'silu' or 'gelu_tanh'")


def act_and_mul(x: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """x [..., 2I] (gate then up) -> act(gate) * up [..., I]; act "silu" or "gelu_tanh"."""
    check_gated_act(act)
    k = _triton(x)
    return act_and_mul_ref(x, act) if k is None else k.act_and_mul(x, act)


def rope(
    q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [T, Hq, D] and k [T, Hk, D] (or None) roped with cos/sin [T, R] float32 (R <= D)."""
    kern = _triton(q)
    if kern is None:
        return rope_ref(q, cos, sin, interleaved), None if k is None else rope_ref(k, cos, sin, interleaved)
    return kern.rope(q, k, cos, sin, interleaved=interleaved)


def norm_rope(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *,
    q_norm: NormParams, k_norm: NormParams | None = None, v_norm: NormParams | None = None, interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(rope(q_norm(q)), rope(k_norm(k)), v_norm(v)) for q [T, Hq, D], k and v [T, Hk, D] (v may read the
    same memory as k: Gemma 4's global layers take values from the key projection), cos/sin [T, R].
    Each norm's output is rounded to the input dtype before RoPE, as the separate ops round it. k and v
    None: a KV-sharing layer's query only; v alone None: QK-norm only (Qwen3, Gemma 3), v returned None."""
    if k is None and v is not None:
        raise BackendError("norm_rope got v without k", fix="pass k with v, or None for both")
    kern = _triton(q)
    if kern is None:
        return norm_rope_ref(q, k, v, cos, sin, q_norm, k_norm, v_norm, interleaved)
    norms = (q_norm,) if k is None else (q_norm, k_norm) if v is None else (q_norm, k_norm, v_norm)
    return kern.norm_rope(q, k, v, cos, sin, norms, interleaved=interleaved)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, norm: NormParams | None = None,
              in_place: bool = False) -> torch.Tensor:
    """DeepSeek-V4's RoPE: x [T, H, D] or [T, D] with cos/sin [T, R] float32 (R frequencies): interleaved
    pairs on the last 2 R channels rotated where they are (the output is un-rotated and mixed by a projection,
    so channel order matters); ``norm``: x per-head RMS-normed first (one pass, where torch makes two);
    ``in_place``: x written (without a norm only its rotary channels), else a new tensor."""
    k = _triton(x)
    if k is None or x.dim() not in (2, 3) or x.stride(-1) != 1:
        return rope_tail_ref(x, cos, sin, norm, in_place)
    out = k.rope_tail(x if x.dim() == 3 else x.unsqueeze(1), cos, sin, norm, in_place=in_place)
    return out.view(x.shape)


def mla_entry(q_pe: torch.Tensor, kv: torch.Tensor, norm: NormParams, cos: torch.Tensor, sin: torch.Tensor, *,
              interleaved: bool = False, q_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's work between its projections and attention: q_pe [T, H, P] roped (written into ``q_out`` [T, H, P]
    where given: ``MLAAttention.rope_slot``), and the cache entry [T, R + P] = [RMSNorm(latent), RoPE(k_pe)] of
    kv = [latent, k_pe] [T, R + P], cos/sin [T, P]. One kernel on a GPU where the RoPE, the norm and the
    concatenation were three."""
    if q_out is not None and (q_out.shape != q_pe.shape or q_out.dtype != q_pe.dtype):
        raise ValueError(f"mla_entry: q_out {tuple(q_out.shape)} {q_out.dtype} is not q_pe's {tuple(q_pe.shape)} "
                         f"{q_pe.dtype}")
    k = _triton(q_pe)
    if (k is None or cos.shape[-1] != q_pe.shape[-1] or q_pe.stride(-1) != 1 or kv.stride(-1) != 1
            or (q_out is not None and q_out.stride(-1) != 1)):
        q, entry = mla_entry_ref(q_pe, kv, norm, cos, sin, interleaved)
        return (q, entry) if q_out is None else (q_out.copy_(q), entry)
    return k.mla_entry(q_pe, kv, norm, cos, sin, interleaved=interleaved, q_out=q_out)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """x [..., V] (logits in any float dtype) -> tanh(x / cap) * cap in float32: one pass over the logits
    where torch makes four (the float copy, the divide, tanh, the multiply), each over [tokens, vocab]."""
    k = _triton(x)
    return softcap_ref(x, cap) if k is None else k.softcap(x, cap)


def argmax_finite(x: torch.Tensor) -> torch.Tensor:
    """x [rows, V] (logits) -> int64 [rows]: each row's argmax (the first on ties), -1 where the row holds NaN
    or +inf or is all -inf; two launches where torch runs one block per row for argmax (slow over a large
    vocabulary at a few rows), then a gather, an isfinite and a where."""
    k = _triton(x)
    return argmax_finite_ref(x) if k is None else k.argmax_finite(x)


def hc_project(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek-V4 mHC: streams [T, n, H] -> float32 [T, M], the streams as [T, n H] RMS-normed together (no
    scale) in float32, times fn [M, n H] (float32, to float32's accuracy: no plain TF32)."""
    t, n, h = streams.shape
    if fn.dim() != 2 or fn.shape[1] != n * h:
        raise BackendError(f"hc_project got streams {list(streams.shape)} and fn {list(fn.shape)}",
                           fix=f"pass fn [M, {n * h}]: one row per mix over the {n} streams' {h} channels")
    k = _triton(streams, "v4_kernels")
    return hc_project_ref(streams, fn, eps) if k is None else k.hc_project(streams, fn, eps)


def hc_weights(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, n: int, iters: int, eps: float):
    """DeepSeek-V4 mHC: mixes [T, (2 + n) n] float32 (the normed streams' projection), scale [3], base
    [(2 + n) n] -> pre [T, n] = sigmoid + eps, post [T, n] = 2 sigmoid, comb [T, n, n] = softmax over the
    last axis + eps, then normalized over columns, rows and columns (``iters`` Sinkhorn steps in all)."""
    if mixes.dtype != torch.float32 or mixes.shape[-1] != (2 + n) * n:
        raise BackendError(f"hc_weights wants float32 mixes [T, {(2 + n) * n}], got {mixes.dtype} {list(mixes.shape)}",
                           fix="project the float32 normed streams with the (2 + n) n x (n hidden) matrix")
    k = _triton(mixes, "v4_kernels")
    if k is None:
        return hc_weights_ref(mixes, scale, base, n, iters, eps)
    return k.hc_weights(mixes, scale, base, n, iters, eps)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams [T, n, H] with pre [T, n] float32 -> sum_j pre[:, j] * streams[:, j] [T, H] in streams' dtype."""
    k = _triton(streams, "v4_kernels")
    return hc_collapse_ref(streams, pre) if k is None else k.hc_collapse(streams, pre)


def hc_mix(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """New streams [T, n, H]: stream k = post[:, k] * out + sum_j comb[:, j, k] * streams[:, j], for the
    block output out [T, H]; post and comb float32, rounded to streams' dtype as the reference rounds them."""
    t, n, h = streams.shape
    if out.shape != (t, h) or out.dtype != streams.dtype or post.shape != (t, n) or comb.shape != (t, n, n):
        raise BackendError(f"hc_mix got streams {list(streams.shape)} {streams.dtype}, post {list(post.shape)}, comb "
                           f"{list(comb.shape)}, out {list(out.shape)} {out.dtype}",
                           fix="pass out [T, H] in the streams' dtype, post [T, n] and comb [T, n, n]")
    k = _triton(streams, "v4_kernels")
    return hc_mix_ref(streams, post, comb, out) if k is None else k.hc_mix(streams, post, comb, out)


def gated_pool(rows: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, bias: torch.Tensor, *, dim: int,
               rate: int, overlap: bool) -> torch.Tensor:
    """V4's compressor pooling of n blocks, read where the pool keeps the states (no gathered copy).

    rows [S, 2W]: per token [kv | gate], W = 2 * dim with overlap, else dim (a view with unit channel
    stride, such as a column slice of the pool's state rows); slots [n, span] int64 row ids, span = 2 * rate
    with overlap (the previous block first), else rate; valid [n, span] bool; bias [rate, W] float32.
    -> [n, dim] in rows' dtype: per channel, sum_j softmax_j(gate_j + bias_j) * kv_j over the valid j (the
    softmax in float32, rounded to rows' dtype before the product, as the reference rounds it); with overlap
    the previous block's j read the first dim channels, this block's the second. Every block needs a valid j."""
    n, span = slots.shape
    width = 2 * dim if overlap else dim
    if (rows.dim() != 2 or rows.shape[1] != 2 * width or rows.stride(-1) != 1 or span != (2 if overlap else 1) * rate
            or valid.shape != slots.shape or bias.shape != (rate, width)):
        raise BackendError(f"gated_pool got rows {list(rows.shape)} (strides {rows.stride()}), slots {list(slots.shape)}, "
                           f"valid {list(valid.shape)}, bias {list(bias.shape)} for dim {dim}, rate {rate}, overlap "
                           f"{overlap}", fix=f"pass rows [S, {2 * width}] with unit channel stride, slots and valid "
                           f"[n, {(2 if overlap else 1) * rate}], bias [{rate}, {width}]")
    k = _triton(rows, "v4_kernels")
    if k is None:
        return gated_pool_ref(rows, slots, valid, bias, dim, rate, overlap)
    return k.gated_pool(rows, slots, valid, bias, dim, rate, overlap)
