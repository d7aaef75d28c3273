"""Triton kernels behind ``attnzoo.layers.fused`` (which holds their torch references and picks one).

Each kernel rounds to the input dtype where the torch reference does (after an activation, after a
residual add, after a post-norm), so a fused model follows the reference's rounding points and differs
only in float32 reduction order. Importing this module imports triton; on a CPU the kernels run only
under Triton's interpreter (``TRITON_INTERPRET=1`` before triton is first imported).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnzoo import pdl
from attnzoo.attention.kernels.codec import bf16_bits
from attnzoo.attention.kernels.common import next_pow2, prior_done

# Elements one program keeps in registers: rows of a norm or heads of a RoPE tile are packed up to it.
_TILE = 2048

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


ROUND_OF = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # the rounding points of rounded, by storage dtype


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


@triton.jit
def _rms(x, w, eps, offset, N: tl.constexpr, HAS_W: tl.constexpr):
    """x [R, BLOCK] float32 (zero past N) -> x / rms(x) * (w + offset), float32."""
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * inv[:, None]
    if HAS_W:
        y = y * (w[None, :] + offset)
    return y


@triton.jit
def _rms_norm_kernel(
    X, RES, XW, W, SCALE, OUT, RES_OUT,
    num_rows, inner,  # rows are (outer, inner) pairs: [T, H, N] views of per-head norms, inner 1 otherwise
    stride_xo, stride_xi, stride_oo, stride_oi, stride_r, stride_ro,
    eps, offset, x_eps, x_offset,
    N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    HAS_W: tl.constexpr, HAS_RES: tl.constexpr, X_NORM: tl.constexpr, HAS_XW: tl.constexpr,
    HAS_SCALE: tl.constexpr, PDL: tl.constexpr,
):
    prior_done(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < N)[None, :]
    outer = (rows // inner).to(tl.int64)
    sub = (rows % inner).to(tl.int64)
    x = tl.load(X + (outer * stride_xo + sub * stride_xi)[:, None] + cols[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if X_NORM:  # a post-norm on x before the residual add (Gemma): rounded as its own op would be
        xw = tl.zeros([BLOCK], tl.float32)
        if HAS_XW:
            xw = tl.load(XW + cols, mask=cols < N, other=0.0).to(tl.float32)
        x = _rms(x, xw, x_eps, x_offset, N, HAS_XW).to(dtype).to(tl.float32)
    if HAS_RES:
        r = tl.load(RES + (outer * stride_r)[:, None] + cols[None, :], mask=mask, other=0.0)
        s = (x + r.to(tl.float32)).to(dtype)
        if HAS_SCALE:  # Gemma 4's layer scalar, a second rounding as its own multiply's
            s = (s.to(tl.float32) * tl.load(SCALE).to(tl.float32)).to(dtype)
        tl.store(RES_OUT + (outer * stride_ro)[:, None] + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    w = tl.zeros([BLOCK], tl.float32)
    if HAS_W:
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = _rms(x, w, eps, offset, N, HAS_W)
    tl.store(OUT + (outer * stride_oo + sub * stride_oi)[:, None] + cols[None, :], y.to(dtype), mask=mask)


def rms_norm(x, weight, eps, offset, *, residual=None, x_weight=None, x_eps=0.0, x_offset=0.0, x_norm=False,
             scale=None):
    """x [..., N] (rows of stride-1 channels; [T, H, N] views allowed) -> normed, and the new residual
    (x + residual) * scale when ``residual`` is given (x first normalised by ``x_weight`` when ``x_norm``;
    ``scale`` a one-element tensor or None)."""
    if scale is not None and residual is None:
        raise ValueError("rms_norm: scale applies to the residual sum; pass residual too")
    n = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    x3 = x if x.dim() == 3 and residual is None else x.reshape(-1, 1, n)
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    outer, inner = x3.shape[0], x3.shape[1]
    res = res_out = out
    if residual is not None:
        res = residual.reshape(-1, n)
        if res.stride(-1) != 1:
            res = res.contiguous()
        res_out = torch.empty(res.shape, dtype=x.dtype, device=x.device)
    block = max(16, next_pow2(n))
    rows = max(1, min(_TILE // block, next_pow2(outer * inner)))
    if outer * inner == 0:
        return out.view(x.shape) if residual is None else (out.view(x.shape), res_out.view(residual.shape))
    _rms_norm_kernel[(triton.cdiv(outer * inner, rows),)](
        x3, res, out if x_weight is None else x_weight, out if weight is None else weight,
        out if scale is None else scale, out, res_out,
        outer * inner, inner,
        x3.stride(0), x3.stride(1), out.stride(0), out.stride(1), res.stride(0), res_out.stride(0),
        float(eps), float(offset), float(x_eps), float(x_offset),
        N=n, BLOCK=block, ROWS=rows, HAS_W=weight is not None, HAS_RES=residual is not None,
        X_NORM=x_norm, HAS_XW=x_weight is not None, HAS_SCALE=scale is not None, num_warps=_warps(block * rows),
        **pdl.launch_args(x),
    )
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(residual.shape))


@triton.jit
def tanh(y):
    # through exp (not every Triton has tl.tanh), of -2|y| so that nothing overflows
    e = tl.exp(-2.0 * tl.abs(y))
    th = (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -th, th)


@triton.jit
def _act_and_mul_kernel(X, OUT, stride_x, stride_o, I: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr,
                        ROUND: tl.constexpr, PDL: tl.constexpr):
    prior_done(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(X + t * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(X + t * stride_x + I + cols, mask=mask, other=0.0)
    dtype = g.dtype
    g = g.to(tl.float32)
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    else:
        a = 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    # Rounded after the activation as in torch's act(gate) * up (by ``rounded``: compiled, a cast pair need not round)
    a = rounded(a, ROUND)
    tl.store(OUT + t * stride_o + cols, rounded(a * u.to(tl.float32), ROUND).to(dtype), mask=mask)


def act_and_mul(x, act: str):
    """x [T, 2I] (gate then up) -> act(gate) * up [T, I]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = x.reshape(-1, x.shape[-1])
    i = x.shape[-1] // 2
    out = torch.empty(x2.shape[0], i, dtype=x.dtype, device=x.device)
    block = min(1024, max(16, next_pow2(i)))
    if x2.shape[0]:
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(i, block))](
            x2, out, x2.stride(0), out.stride(0), I=i, BLOCK=block, ACT=ACTIVATIONS[act], ROUND=ROUND_OF.get(x.dtype, ""),
            num_warps=4, **pdl.launch_args(x),
        )
    return out.view(*x.shape[:-1], i)


@triton.jit
def _softcap_kernel(X, OUT, n, cap, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, tanh(x / cap) * cap, mask=mask)


def softcap(x, cap: float):
    """x [..., V] -> tanh(x / cap) * cap, float32."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    block = 4096
    if x.numel():
        _softcap_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), float(cap), BLOCK=block, num_warps=8)
    return out


@triton.jit
def _argmax_chunks_kernel(X, VAL, IDX, BAD, V, stride_x, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    prior_done(PDL)
    # One chunk of one row: its largest finite value, that value's first index, and whether it holds NaN/+inf.
    r, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + r * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    bad = (x != x) | (x == float("inf"))
    x = tl.where(bad, float("-inf"), x)
    at = r * CHUNKS + c
    tl.store(VAL + at, tl.max(x, axis=0))
    tl.store(IDX + at, c * BLOCK + tl.argmax(x, axis=0, tie_break_left=True))
    tl.store(BAD + at, tl.max(bad.to(tl.int32), axis=0))


@triton.jit
def _argmax_rows_kernel(VAL, IDX, BAD, OUT, CHUNKS: tl.constexpr, CP: tl.constexpr, PDL: tl.constexpr):
    prior_done(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CP)
    ok = c < CHUNKS
    val = tl.load(VAL + r * CHUNKS + c, mask=ok, other=float("-inf"))
    best = tl.argmax(val, axis=0, tie_break_left=True)  # the first chunk holding the row's maximum
    idx = tl.sum(tl.where(c == best, tl.load(IDX + r * CHUNKS + c, mask=ok, other=0), 0), axis=0)
    bad = (tl.max(tl.load(BAD + r * CHUNKS + c, mask=ok, other=0), axis=0) > 0) | (tl.max(val, axis=0) == float("-inf"))
    tl.store(OUT + r, tl.where(bad, -1, idx).to(tl.int64))


def argmax_finite(x):
    """x [rows, V] -> int64 [rows]: each row's first argmax, -1 where the row holds NaN or +inf or is all -inf."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, v = x.shape
    block = min(4096, max(16, next_pow2(v)))
    chunks = triton.cdiv(v, block)
    val = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    bad = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows:
        _argmax_chunks_kernel[(rows, chunks)](x, val, idx, bad, v, x.stride(0), CHUNKS=chunks, BLOCK=block,
                                              num_warps=8, **pdl.launch_args(x))
        _argmax_rows_kernel[(rows,)](val, idx, bad, out, CHUNKS=chunks, CP=max(2, next_pow2(chunks)), num_warps=1,
                                     **pdl.launch_args(x))
    return out


@triton.jit
def rounded(x, ROUND: tl.constexpr):
    # float32 -> the nearest value of ROUND ("bf16", "fp16" or "" for none), kept in float32. bf16 by integer
    # arithmetic (codec.bf16_bits, NaN kept): compiled, a bf16 cast pair did not round as torch does.
    if ROUND == "bf16":
        x = (bf16_bits(x).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    elif ROUND == "fp16":
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def rope_tile(X, OUT, COS, SIN, W, t, h0, stride_t, stride_h, stride_ot, stride_oh, stride_ct, eps, offset,
              HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
              PASS_PAD: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr,
              NORM: tl.constexpr, HAS_W: tl.constexpr, ROTATE: tl.constexpr, TAIL: tl.constexpr,
              IN_PLACE: tl.constexpr):
    # Heads [h0, h0 + BLOCK_H) of token t: the rotary channels as two halves (x1 rotates with x2), the
    # other channels (partial RoPE) passed through; NORM: the head's RMSNorm first, over all D. TAIL: the
    # rotary channels are the last 2 HALF and written back where they were (DeepSeek-V4), else the first,
    # interleaved pairs written de-interleaved. IN_PLACE: written into X (without NORM only the rotary
    # channels: the launcher passes PASS_PAD 0), else into OUT (token and head strides stride_ot, stride_oh).
    heads = h0 + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF_PAD)
    mask = (heads < HEADS)[:, None] & (i < HALF)[None, :]
    row = X + t * stride_t + heads[:, None] * stride_h
    r0 = D - 2 * HALF if TAIL else 0
    if INTERLEAVED:  # pairs (x0, x1), (x2, x3), ...
        i1, i2 = r0 + 2 * i, r0 + 2 * i + 1
    else:
        i1, i2 = r0 + i, r0 + HALF + i
    x1 = tl.load(row + i1[None, :], mask=mask, other=0.0)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = tl.load(row + i2[None, :], mask=mask, other=0.0).to(tl.float32)
    jj = tl.arange(0, PASS_PAD if PASS_PAD > 0 else 16)  # without PASS_PAD all masked
    j = (0 if TAIL else 2 * HALF) + jj
    pmask = (heads < HEADS)[:, None] & (jj < (D - 2 * HALF if PASS_PAD > 0 else 0))[None, :]
    p = tl.load(row + j[None, :], mask=pmask, other=0.0)
    if NORM:  # rounded to the input dtype after the norm, as the norm's own kernel stores it
        pf = p.to(tl.float32)
        inv = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1) + tl.sum(pf * pf, axis=1)) / D + eps)
        a, b, pf = a * inv[:, None], b * inv[:, None], pf * inv[:, None]
        if HAS_W:
            a = a * (tl.load(W + i1, mask=i < HALF, other=0.0).to(tl.float32)[None, :] + offset)
            b = b * (tl.load(W + i2, mask=i < HALF, other=0.0).to(tl.float32)[None, :] + offset)
            pf = pf * (tl.load(W + j, mask=jj < D - 2 * HALF, other=0.0).to(tl.float32)[None, :] + offset)
        a, b, p = a.to(dtype).to(tl.float32), b.to(dtype).to(tl.float32), pf.to(dtype)
    if IN_PLACE:
        dst = row
    else:
        dst = OUT + t * stride_ot + heads[:, None] * stride_oh
    if ROTATE:
        c = tl.load(COS + t * stride_ct + i, mask=i < HALF, other=0.0)[None, :]
        s = tl.load(SIN + t * stride_ct + i, mask=i < HALF, other=0.0)[None, :]
        a, b = a * c - b * s, b * c + a * s
    if INTERLEAVED and not TAIL:
        o1, o2 = i, HALF + i
        if IN_PLACE:  # every thread's loads before any store: pairs are written to other threads' channels
            tl.debug_barrier()
    else:
        o1, o2 = i1, i2
    tl.store(dst + o1[None, :], a.to(dtype), mask=mask)
    tl.store(dst + o2[None, :], b.to(dtype), mask=mask)
    if PASS_PAD > 0:
        tl.store(dst + j[None, :], p, mask=pmask)


@triton.jit
def _rope_kernel(Q, K, V, QO, KO, VO, COS, SIN, QW, KW, VW,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
                 q_eps, q_offset, k_eps, k_offset, v_eps, v_offset,
                 QH: tl.constexpr, KH: tl.constexpr, VH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                 HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                 INTERLEAVED: tl.constexpr, NORM: tl.constexpr,
                 HAS_QW: tl.constexpr, HAS_KW: tl.constexpr, HAS_VW: tl.constexpr,
                 TAIL: tl.constexpr = False, IN_PLACE: tl.constexpr = False, PDL: tl.constexpr = False):
    # Programs along axis 1: q's head blocks, then k's, then v's (VH 0 without v; v is normed, not rotated).
    prior_done(PDL)
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    q_blocks = tl.cdiv(QH, BLOCK_H)
    k_blocks = tl.cdiv(KH, BLOCK_H)
    if blk < q_blocks:
        rope_tile(Q, QO, COS, SIN, QW, t, blk * BLOCK_H, stride_qt, stride_qh, QH * D, D, stride_ct, q_eps, q_offset,
                  QH, D, HALF, HALF_PAD, PASS_PAD, BLOCK_H, INTERLEAVED, NORM, HAS_QW, True, TAIL, IN_PLACE)
    elif blk < q_blocks + k_blocks:
        rope_tile(K, KO, COS, SIN, KW, t, (blk - q_blocks) * BLOCK_H, stride_kt, stride_kh, KH * D, D, stride_ct,
                  k_eps, k_offset, KH, D, HALF, HALF_PAD, PASS_PAD, BLOCK_H, INTERLEAVED, NORM, HAS_KW, True, TAIL,
                  IN_PLACE)
    else:  # v keeps its channel order: read as halves in place, never interleaved
        rope_tile(V, VO, COS, SIN, VW, t, (blk - q_blocks - k_blocks) * BLOCK_H, stride_vt, stride_vh, VH * D, D,
                  stride_ct, v_eps, v_offset, VH, D, HALF, HALF_PAD, PASS_PAD, BLOCK_H, False, NORM, HAS_VW, False,
                  TAIL, IN_PLACE)


def _heads_per_program(heads: int, width: int) -> int:
    """Heads of ``width`` values each that a RoPE program holds: about _TILE values, a power of two."""
    fit = _TILE // width
    return max(1, min(next_pow2(heads), 1 << (fit.bit_length() - 1) if fit else 1))


def _rows(x):
    return None if x is None else (x if x.stride(-1) == 1 else x.contiguous())


def _rope_launch(q, k, v, cos, sin, norms, interleaved: bool, *, half: int | None = None, tail: bool = False,
                 in_place: bool = False):
    """q [T, Hq, D], k and v [T, Hk, D] or None, cos/sin [T, R] (``half``: R / 2 frequencies read, default
    R // 2); norms: None, or the (q, k, v) norms' parameters (``fused.NormParams``); ``tail``, ``in_place``:
    as ``rope_tile``'s -> q, k, v (new contiguous tensors, or the inputs written in place)."""
    t, qh, d = q.shape
    if not in_place:
        q, k, v = _rows(q), _rows(k), _rows(v)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    half = cos.shape[-1] // 2 if half is None else half
    kh = 0 if k is None else k.shape[1]
    vh = 0 if v is None else v.shape[1]
    if in_place:
        qo, ko, vo = q, k, v
    else:
        qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        ko = None if k is None else torch.empty(k.shape, dtype=k.dtype, device=k.device)
        vo = None if v is None else torch.empty(v.shape, dtype=v.dtype, device=v.device)
    half_pad = max(16, next_pow2(half))
    norms = tuple(norms or ()) + (None,) * (3 - len(norms or ()))
    weights = [qo if n is None or n.weight is None else n.weight for n in norms]
    eps_off = [x for n in norms for x in ((0.0, 0.0) if n is None else (float(n.eps), float(n.offset)))]
    # In place without a norm, the channels RoPE leaves alone are neither read nor written.
    passed = 2 * half < d and not (in_place and norms[0] is None)
    pass_pad = max(16, next_pow2(d - 2 * half)) if passed else 0
    # The passed-through channels count towards a program's values (V4 rotates 64 of 512).
    block_h = _heads_per_program(max(qh, kh, vh), 2 * half_pad + pass_pad)
    blocks = triton.cdiv(qh, block_h) + triton.cdiv(kh, block_h) + triton.cdiv(vh, block_h)
    if t:
        kk, vv = (q if k is None else k), (q if v is None else v)
        _rope_kernel[(t, blocks)](
            q, kk, vv, qo, qo if ko is None else ko, qo if vo is None else vo, cos, sin, *weights,
            q.stride(0), q.stride(1), kk.stride(0), kk.stride(1), vv.stride(0), vv.stride(1), cos.stride(0),
            *eps_off,
            QH=qh, KH=kh, VH=vh, D=d, HALF=half, HALF_PAD=half_pad,
            PASS_PAD=pass_pad,
            BLOCK_H=block_h, INTERLEAVED=interleaved, NORM=norms[0] is not None,
            HAS_QW=norms[0] is not None and norms[0].weight is not None,
            HAS_KW=norms[1] is not None and norms[1].weight is not None,
            HAS_VW=norms[2] is not None and norms[2].weight is not None, TAIL=tail, IN_PLACE=in_place, num_warps=4,
            **pdl.launch_args(q),
        )
    return qo, ko, vo


def rope(q, k, cos, sin, *, interleaved: bool):
    """q [T, Hq, D], k [T, Hk, D] or None, cos/sin [T, R] (R <= D, cat(f, f)) -> new contiguous q, k."""
    return _rope_launch(q, k, None, cos, sin, None, interleaved)[:2]


def norm_rope(q, k, v, cos, sin, norms, *, interleaved: bool):
    """``fused.norm_rope``: q, k, v per-head normed by ``norms`` (q's, or q's, k's and v's), q and k roped."""
    return _rope_launch(q, k, v, cos, sin, norms, interleaved)


def rope_tail(x, cos, sin, norm, *, in_place: bool):
    """``fused.rope_tail``: x [T, H, D] (optionally normed by ``norm``) with interleaved pairs on its last
    2 R channels rotated where they are, cos/sin [T, R]."""
    return _rope_launch(x, None, None, cos, sin, None if norm is None else (norm,), True, half=cos.shape[-1],
                        tail=True, in_place=in_place)[0]


@triton.jit
def _mla_entry_kernel(Q, KV, QO, ENTRY, COS, SIN, W, stride_qt, stride_qh, stride_ot, stride_oh, stride_kvt, stride_ct,
                      eps, offset, H: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, HALF: tl.constexpr,
                      HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr,
                      HAS_W: tl.constexpr, PDL: tl.constexpr):
    # Program 0 of token t: the entry (the latent normed, the shared key roped); the others: q's head blocks.
    prior_done(PDL)
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    if blk > 0:
        rope_tile(Q, QO, COS, SIN, QO, t, (blk - 1) * BLOCK_H, stride_qt, stride_qh, stride_ot, stride_oh, stride_ct,
                  0.0, 0.0, H, 2 * HALF, HALF, HALF_PAD, 0, BLOCK_H, INTERLEAVED, False, False, True, False, False)
    else:
        cols = tl.arange(0, BLOCK_R)
        x = tl.load(KV + t * stride_kvt + cols, mask=cols < R, other=0.0)
        w = tl.zeros([BLOCK_R], tl.float32)
        if HAS_W:
            w = tl.load(W + cols, mask=cols < R, other=0.0).to(tl.float32)
        y = _rms(x.to(tl.float32)[None, :], w, eps, offset, R, HAS_W)
        tl.store(ENTRY + t * (R + 2 * HALF) + cols[None, :], y.to(x.dtype), mask=(cols < R)[None, :])
        # the shared key: one head of 2 HALF rotary channels after the latent, in and out
        rope_tile(KV + R, ENTRY + R, COS, SIN, ENTRY, t, 0, stride_kvt, 0, R + 2 * HALF, 0, stride_ct, 0.0, 0.0,
                  1, 2 * HALF, HALF, HALF_PAD, 0, 1, INTERLEAVED, False, False, True, False, False)


def mla_entry(q_pe, kv, norm, cos, sin, *, interleaved: bool, q_out=None):
    """``fused.mla_entry``: q_pe [T, H, P] (rows of stride-1 channels), kv [T, R + P], cos/sin [T, P] -> roped
    q_pe [T, H, P] (into ``q_out`` where given, its channels of stride 1) and the entry [T, R + P], new and
    contiguous."""
    t, h, p = q_pe.shape
    r = kv.shape[1] - p
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    if q_out is None:
        q_out = torch.empty((t, h, p), dtype=q_pe.dtype, device=q_pe.device)
    entry = torch.empty((t, r + p), dtype=kv.dtype, device=kv.device)
    half = p // 2
    half_pad = max(16, next_pow2(half))
    block_h = _heads_per_program(h, 2 * half_pad)
    if t:
        _mla_entry_kernel[(t, 1 + triton.cdiv(h, block_h))](
            q_pe, kv, q_out, entry, cos, sin, entry if norm.weight is None else norm.weight,
            q_pe.stride(0), q_pe.stride(1), q_out.stride(0), q_out.stride(1), kv.stride(0), cos.stride(0),
            float(norm.eps), float(norm.offset),
            H=h, R=r, BLOCK_R=max(16, next_pow2(r)), HALF=half, HALF_PAD=half_pad, BLOCK_H=block_h,
            INTERLEAVED=interleaved, HAS_W=norm.weight is not None, num_warps=4, **pdl.launch_args(kv),
        )
    return q_out, entry
