"""Triton conversion kernels between MLA cache layouts (``attnzoo/attention/kv_layout.py``).

``pack_rows``: model-dtype entries -> a packed layout, written at given slots (or row by row); this is
what runs once per token when a layer stores its entries and a backend keeps a copy in another layout.
One program per token; the sparse attention kernel reads the packed rows back in registers.

The bf16 rope part is rounded with integer arithmetic (round to nearest even) rather than a cast:
Triton's interpreter does not round float32 -> bfloat16 to nearest, and the torch reference does.
Divisions use ``div_rn`` (IEEE) so the fp8 bytes match the torch reference on the GPU too.
fp8 values are encoded and decoded with integer arithmetic (``codec.py``: ``fp8_bytes`` here, ``fp8_value``
for the sparse attention kernel), so the kernels also run on GPUs without fp8 support.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnzoo.attention.kernels.codec import bf16_bits, fp8_bytes
from attnzoo.attention.kv_cache import FP8_BLOCK, KVLayout
from attnzoo.errors import BackendError

_CONVERTED = (KVLayout.FP8_NOPE_SCALED_BF16_ROPE,)  # the layouts these kernels write and read


@triton.jit
def _pack_kernel(
    SRC, DST, SLOTS,
    stride_sn, stride_sd, stride_dn,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    NB: tl.constexpr,  # latent blocks of FP8_BLOCK values
    BLOCK_NB: tl.constexpr,
    FP8_BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
):
    i = tl.program_id(0)
    if HAS_SLOTS:
        row = tl.load(SLOTS + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    src = SRC + i.to(tl.int64) * stride_sn
    dst = DST + row * stride_dn
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < ROPE
    rope = tl.load(src + (RANK + offs_p) * stride_sd, mask=p_ok, other=0.0).to(tl.float32)
    offs_b = tl.arange(0, BLOCK_NB)
    offs_c = tl.arange(0, FP8_BLOCK_C)
    b_ok = offs_b < NB
    offs = offs_b[:, None] * FP8_BLOCK_C + offs_c[None, :]  # [BLOCK_NB, 128]
    lat = tl.load(src + offs * stride_sd, mask=b_ok[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(lat), 1)
    # float32 tiny as the floor: an all-zero block must not divide by zero (as in the reference).
    s = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)  # [BLOCK_NB]
    q = tl.math.div_rn(lat, s[:, None])
    tl.store(dst + offs, fp8_bytes(q), mask=b_ok[:, None])
    tl.store((dst + RANK).to(tl.pointer_type(tl.float32)) + offs_b, s, mask=b_ok)
    tl.store((dst + RANK + 4 * NB).to(tl.pointer_type(tl.uint16)) + offs_p, bf16_bits(rope), mask=p_ok)


def _geometry(layout: KVLayout, rank: int, rope: int) -> dict:
    if layout not in _CONVERTED:
        raise BackendError(f"no conversion kernel for KV layout {layout.value}: it is the model dtype itself",
                           fix="use the entries as they are")
    layout.check(rank, rope)
    nb = rank // FP8_BLOCK
    return dict(RANK=rank, ROPE=rope, NB=nb, FP8_BLOCK_C=FP8_BLOCK,
                BLOCK_R=triton.next_power_of_2(rank), BLOCK_P=triton.next_power_of_2(max(rope, 1)))


def pack_rows(
    entries: torch.Tensor,  # [N, rank + rope], float
    out: torch.Tensor,  # [rows, row_bytes] uint8, contiguous rows
    layout: KVLayout,
    *,
    rank: int,
    slots: torch.Tensor | None = None,  # [N] int64: out row of each entry; None: row i
) -> None:
    n = entries.shape[0]
    rope = entries.shape[1] - rank
    geo = _geometry(layout, rank, rope)
    if out.dtype != torch.uint8 or out.stride(-1) != 1 or out.shape[-1] != layout.row_bytes(rank, rope, entries.dtype):
        raise BackendError(f"pack_rows needs uint8 rows of {layout.row_bytes(rank, rope, entries.dtype)} bytes, "
                           f"got {tuple(out.shape)} {out.dtype}", fix="allocate the destination with KVLayout.row_bytes")
    if n == 0:
        return
    _pack_kernel[(n,)](
        entries, out, slots if slots is not None else out,
        entries.stride(0), entries.stride(1), out.stride(0),
        BLOCK_NB=triton.next_power_of_2(max(geo["NB"], 1)), HAS_SLOTS=slots is not None, **geo,
    )
