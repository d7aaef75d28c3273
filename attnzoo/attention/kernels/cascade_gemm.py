"""The cascade's shared pass for MLA as two GEMMs around a row softmax.

At a large decode batch, MLA's shared pass is a dense attention of every (request, head) row against the
same prefix keys: [rows, 576] x [576, prefix] scores, then [rows, prefix] x [prefix, 512] values. The
flash-style Triton pass holds a [512, rows] float32 accumulator per program, which leaves it 32 rows and one
pipeline stage on an H100 (the other tiles faulted or ran no faster: benchmarks/cascade_tiles.py); cuBLAS
runs both products faster (benchmarks/results/cascade_mla_gemm_nvidia_h100.txt), at the cost of writing the
scores out once (in float32, chunks of rows at a time) and reading them back in the softmax. The output and log-sum-exp go into
the same split slots the Triton pass writes, so stage 2 merges them unchanged.

Extend steps after a shared cached prefix (``extend.cascade_extend_attention``) run the same two GEMMs for
every (new token, head) row: the output straight into the step's output, which the extend kernel then
merges with each token's attention to its own request's keys.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from attnzoo.attention.kernels.common import next_pow2

# Scores of one chunk of rows, float32: the pass's transient memory (inside a CUDA graph, in its pool; with the
# chunk's probabilities, within engine.memory.HEADROOM). Larger chunks ran faster, smaller ones gained nothing
# from L2 (benchmarks/results/cascade_extend_mla_nvidia_h100.txt); 256 MB gained little more.
CHUNK_SCORE_BYTES = 128 << 20
# Keys a row's softmax holds in registers at once: longer prefixes stay with the Triton pass.
MAX_SHARED_LEN = 8192
# (request, head) rows from which the GEMMs run the pass: measured faster at 1319 x 16 rows only
# (benchmarks/results/cascade_mla_gemm_nvidia_h100.txt); below, the Triton pass, whose rows fill fewer waves
MIN_ROWS = 4096
# Extend steps, whose alternative reads the prefix once per request, not once per row block: faster from the
# smallest size measured, 128 tokens x 16 heads (benchmarks/results/cascade_extend_mla_nvidia_h100.txt)
EXTEND_MIN_ROWS = 2048


# the prefix length, the chunk's first row and the split count change from step to step: not specialized on,
# or each new value compiled a variant mid-run (as decode.py's kernels); nor is LSE's alignment (a decode split
# slot lies 4 bytes a slot into its row, an extend step's LSE at its start)
@triton.jit(do_not_specialize=["LSE", "n", "first_row", "stride_s", "stride_p", "stride_lb", "stride_lh"])
def _row_softmax(S, P, LSE, n, heads, first_row, stride_s, stride_p, stride_lb, stride_lh, qk_scale,
                 BLOCK: tl.constexpr):
    # One row of scores: P = softmax(S * scale), normalised; LSE in log2 units, as the split slots keep it.
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(S + r * stride_s + cols, mask=ok, other=float("-inf")) * qk_scale
    m = tl.max(x, 0)
    e = tl.exp2(x - m)
    total = tl.sum(e, 0)
    tl.store(P + r * stride_p + cols, (e / total).to(P.dtype.element_ty), mask=ok)
    row = first_row + r
    tl.store(LSE + (row // heads) * stride_lb + (row % heads) * stride_lh, m + tl.log2(total))


def layer_qualifies(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, num_kv_heads: int, v_from_k: bool,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> bool:
    """The step-independent half of ``applies``: an MLA layer (one latent KV head whose values are its first
    channels, wider than 256) in 16-bit floats with an unscaled cache of the same dtype, and a torch whose
    matmul keeps 16-bit products in float32 (``mm``'s ``out_dtype``)."""
    return (dtype in (torch.bfloat16, torch.float16) and kv_dtype == dtype and v_from_k and num_kv_heads == 1
            and head_dim > 256 and k_scale == v_scale == 1.0 and _has_mm_out_dtype())


def applies(q: torch.Tensor, k_cache: torch.Tensor, v_from_k: bool, shared_len: int, softcap: float | None,
            k_scale: float = 1.0, v_scale: float = 1.0, *, min_rows: int | None = None) -> bool:
    """Whether the shared pass of this cascade step runs as GEMMs: a layer ``layer_qualifies`` admits, on a GPU,
    enough rows, a prefix short enough for one softmax tile, no softcapping (fp8 caches, scaled caches, float32
    models and softcapping stay with the Triton pass)."""
    batch, heads, head_dim = q.shape
    # read here, not bound as the default: a driver that changes MIN_ROWS changes the decision
    min_rows = MIN_ROWS if min_rows is None else min_rows
    return (q.is_cuda and not softcap and batch * heads >= min_rows and shared_len <= MAX_SHARED_LEN
            and layer_qualifies(q.dtype, k_cache.dtype, head_dim, k_cache.shape[1], v_from_k, k_scale, v_scale))


@functools.cache
def _has_mm_out_dtype() -> bool:
    return "dtype" in torch.ops.aten.mm.overloads()


def _mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # bf16 products summed in float32, kept in float32 (cuBLAS's out_dtype; the CPU has no such op)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)


def _prefix_gemms(q, keys, o, lse, *, scale: float, v_dim: int) -> None:
    """Every (row, head) of ``q`` [n, heads, head_dim] attends to all of ``keys`` [prefix, head_dim] (values its
    first v_dim channels): the normalised output into ``o`` [n, heads, v_dim] (q's dtype or float32; its first two
    dims mergeable, channels adjacent: a contiguous output or a split slot),
    the log2-LSE into ``lse`` [n, heads] (float32, any strides); in chunks of whole rows of q."""
    n, heads, head_dim = q.shape
    shared_len = keys.shape[0]
    rows = q.reshape(n * heads, head_dim)
    values = keys[:, :v_dim]
    per_chunk = max(1, CHUNK_SCORE_BYTES // (4 * shared_len * heads))
    for b0 in range(0, n, per_chunk):
        b1 = min(n, b0 + per_chunk)
        scores = _mm_f32(rows[b0 * heads : b1 * heads], keys.t())  # [chunk rows, shared_len]
        probs = torch.empty(scores.shape, dtype=q.dtype, device=q.device)
        _row_softmax[(scores.shape[0],)](
            scores, probs, lse, shared_len, heads, b0 * heads, scores.stride(0), probs.stride(0),
            lse.stride(0), lse.stride(1), float(scale * 1.4426950408889634),
            BLOCK=next_pow2(shared_len), num_warps=8,
        )
        # cuBLAS writes rows that lie apart (a split slot: channels adjacent) in place
        dst = o[b0:b1].view(-1, v_dim)
        if o.dtype == q.dtype:
            torch.mm(probs, values, out=dst)
        else:
            _mm_f32(probs, values, out=dst)


def _prefix_keys(k_cache: torch.Tensor, block_tables: torch.Tensor, shared_len: int) -> torch.Tensor:
    # the shared pages (row 0's first) gathered into one contiguous [shared_len, head_dim]
    pages = block_tables[0, : shared_len // k_cache.shape[2]]
    return k_cache.index_select(0, pages).reshape(shared_len, k_cache.shape[-1])


def shared_pass(
    q: torch.Tensor,  # [batch, heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, 1, page_size, head_dim]: the values are its first v_dim channels
    block_tables: torch.Tensor,  # [batch, max_pages] int32: the shared pages are row 0's first
    partial: torch.Tensor,  # [batch, heads, splits, v_dim] float32
    lse: torch.Tensor,  # [batch, heads, splits] float32
    *,
    slot: int,  # the split slot the prefix's output goes to
    shared_len: int,  # whole pages
    scale: float,
    v_dim: int,
) -> None:
    """Decode: attend every (request, head) row to the shared prefix: its normalised output into
    ``partial[:, :, slot]`` and its log2-LSE into ``lse[:, :, slot]``."""
    _prefix_gemms(q, _prefix_keys(k_cache, block_tables, shared_len), partial[:, :, slot], lse[:, :, slot],
                  scale=scale, v_dim=v_dim)


def extend_shared_pass(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]: every new token of the step
    k_cache: torch.Tensor,  # [num_pages, 1, page_size, head_dim]: the values are its first v_dim channels
    block_tables: torch.Tensor,  # [num_reqs, max_pages] int32: the shared pages are row 0's first
    out: torch.Tensor,  # [num_tokens, heads, v_dim], q's dtype, contiguous
    lse: torch.Tensor,  # [num_tokens, heads] float32
    *,
    shared_len: int,  # whole pages, all of them before every new token
    scale: float,
) -> None:
    """Extend: attend every (token, head) row to the shared prefix (no causal mask: each token comes after
    it): the normalised output into ``out``, the log2-LSE into ``lse``, for ``extend``'s merge."""
    _prefix_gemms(q, _prefix_keys(k_cache, block_tables, shared_len), out, lse, scale=scale, v_dim=out.shape[-1])
