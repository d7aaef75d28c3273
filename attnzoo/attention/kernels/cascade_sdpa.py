"""The cascade's shared pass for multi-head (MHA, GQA) layers as one call of cuDNN's fused attention.

At a large decode batch the shared pass is a dense, prefill-like attention of every (request, group head) row
against the same prefix keys. The Triton pass (``decode._cascade_shared``) runs it well below the tensor cores'
rate; cuDNN's flash attention runs the same rows at about 2.6x (benchmarks/results/cascade_sdpa_nvidia_h200.txt).
Its layout is dense: the rows are copied per KV head into [1, kv_heads, batch x group, head_dim] and the prefix's
pages gathered into contiguous keys and values, then its output and log-sum-exp are copied into the split slot the
Triton pass would have written, so stage 2 merges them unchanged. MLA layers take ``cascade_gemm`` instead.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from attnzoo.attention.kernels.common import next_pow2, values_in_key
from attnzoo.errors import BackendError

# (request, query head) rows from which cuDNN runs the pass: below, the copies around it cost more than it saves
# (benchmarks/results/cascade_sdpa_nvidia_h200.txt)
MIN_ROWS = 16384
# cuDNN's flash attention takes head dims up to 128 on every GPU it runs on (wider ones only on some)
MAX_HEAD_DIM = 128
# requests a program of the row copies moves: a few KB of rows each
COPY_REQUESTS = 16


# The batch changes from step to step: not specialized on (each new value compiled a variant mid-run).
@triton.jit(do_not_specialize=["batch", "stride_qb", "stride_qh"])
def _rows_by_kv_head(Q, ROWS, batch, stride_qb, stride_qh, GROUP: tl.constexpr, D: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr):
    # q [batch, kv_heads x GROUP, D] (channels adjacent) -> rows [kv_heads, batch x GROUP, D], contiguous
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    g = tl.arange(0, BLOCK_G)
    kvh = tl.program_id(1)
    d = tl.arange(0, D)
    ok = (b[:, None, None] < batch) & (g[None, :, None] < GROUP)
    src = Q + b[:, None, None].to(tl.int64) * stride_qb + (kvh * GROUP + g)[None, :, None] * stride_qh + d
    row = (kvh.to(tl.int64) * batch + b[:, None, None]) * GROUP + g[None, :, None]
    tl.store(ROWS + row * D + d, tl.load(src, mask=ok), mask=ok)


@triton.jit(do_not_specialize=["pages", "stride_kp", "stride_kh", "stride_vp", "stride_vh"])
def _gather_prefix(K, V, BT, KS, VS, pages, stride_kp, stride_kh, stride_vp, stride_vh,
                   PAGE_SIZE: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    # page i of the prefix, KV head h -> keys/values [kv_heads, pages x PAGE_SIZE, D] from row i x PAGE_SIZE
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    page = tl.load(BT + i).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, D)
    ok = t[:, None] < PAGE_SIZE
    dst = ((kvh * pages + i) * PAGE_SIZE + t[:, None]).to(tl.int64) * D + d[None, :]
    tl.store(KS + dst, tl.load(K + page * stride_kp + kvh * stride_kh + t[:, None] * D + d[None, :], mask=ok), mask=ok)
    tl.store(VS + dst, tl.load(V + page * stride_vp + kvh * stride_vh + t[:, None] * D + d[None, :], mask=ok), mask=ok)


@triton.jit(do_not_specialize=["batch", "stride_pb", "stride_ph", "stride_lb", "stride_lh", "slot_p", "slot_l"])
def _to_slot(OUT, LSE_E, PARTIAL, LSE, batch, stride_pb, stride_ph, stride_lb, stride_lh, slot_p, slot_l,
             GROUP: tl.constexpr, D: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr):
    # out [kv_heads, batch x GROUP, D] and its natural-log LSE -> the split slot: float32 partial, log2 LSE
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    g = tl.arange(0, BLOCK_G)
    kvh = tl.program_id(1)
    d = tl.arange(0, D)
    ok = (b[:, None] < batch) & (g[None, :] < GROUP)
    row = (kvh.to(tl.int64) * batch + b[:, None]) * GROUP + g[None, :]
    head = kvh * GROUP + g[None, :]
    dst = b[:, None].to(tl.int64) * stride_pb + head * stride_ph + slot_p
    o = tl.load(OUT + row[:, :, None] * D + d, mask=ok[:, :, None])
    tl.store(PARTIAL + dst[:, :, None] + d, o.to(tl.float32), mask=ok[:, :, None])
    lse = tl.load(LSE_E + row, mask=ok)
    tl.store(LSE + b[:, None].to(tl.int64) * stride_lb + head * stride_lh + slot_l, lse * 1.4426950408889634, mask=ok)


def layer_qualifies(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, v_dim: int, v_from_k: bool,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> bool:
    """The step-independent half of ``applies``: a layer with keys and values of their own (not MLA's latent)
    and the same width, a power of two up to MAX_HEAD_DIM (the copies' tiles), in 16-bit floats with an unscaled
    cache of the same dtype."""
    return (dtype in (torch.bfloat16, torch.float16) and kv_dtype == dtype and not v_from_k
            and head_dim == v_dim and 16 <= head_dim <= MAX_HEAD_DIM and head_dim & (head_dim - 1) == 0
            and k_scale == v_scale == 1.0)


def cudnn_attention_available(device: torch.device, shared_len: int = 0) -> bool:
    """cuDNN's fused attention through torch on ``device``: an NVIDIA GPU of Ampere or newer (not ROCm, whose
    "cudnn" is MIOpen), cuDNN 9.3 or later (earlier 9.x mis-computed the softmax statistics this pass merges), a
    torch whose op returns them (2.5 or later), torch's switches for it on; not cuDNN 9.14 past 1024 keys, which
    faults or gives NaN there under graph capture without a causal mask (TransformerEngine turns it off alike)."""
    if device.type != "cuda" or not _cudnn_attention(device.index or 0):
        return False
    if not (torch.backends.cudnn.enabled and torch.backends.cuda.cudnn_sdp_enabled()):
        return False
    return not (91400 <= torch.backends.cudnn.version() < 91500 and shared_len > 1024)


@functools.cache
def _cudnn_attention(device_index: int) -> bool:
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return ((major, minor) >= (2, 5) and torch.version.hip is None and torch.backends.cudnn.is_available()
            and (torch.backends.cudnn.version() or 0) >= 90300
            and torch.cuda.get_device_capability(device_index) >= (8, 0))


def applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, v_from_k: bool, shared_len: int,
            softcap: float | None, k_scale: float = 1.0, v_scale: float = 1.0, *, graph: bool = False) -> bool:
    """Whether this cascade step's shared pass runs through cuDNN: a layer ``layer_qualifies`` admits, on a GPU
    where cuDNN's attention runs, at least MIN_ROWS rows, no softcapping, in a step captured as a CUDA graph
    (``graph``): cuDNN builds a plan per row count and prefix length (about 50 ms), which a graph's capture
    pays once and an eager step of a new batch size would pay mid-run."""
    batch, heads = q.shape[:2]
    return (graph and not softcap and batch * heads >= MIN_ROWS and q.stride(2) == 1
            and _cache_runs(k_cache, v_cache, q.dtype, v_from_k, k_scale, v_scale, shared_len))


def _cache_runs(k_cache, v_cache, dtype, v_from_k: bool, k_scale: float, v_scale: float, shared_len: int) -> bool:
    # the step-independent conditions, which the warm-up asks too: the layer, the pool's layout, cuDNN here
    return (_pages_flatten(k_cache) and _pages_flatten(v_cache)
            and layer_qualifies(dtype, k_cache.dtype, k_cache.shape[-1], v_cache.shape[-1], v_from_k, k_scale, v_scale)
            and cudnn_attention_available(k_cache.device, shared_len))


def _pages_flatten(cache: torch.Tensor) -> bool:
    # a page's slots and channels are one run of memory: flatten(2) is a view, not a copy of the pool
    return cache.stride(3) == 1 and cache.stride(2) == cache.shape[3]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    # [1, kv heads, rows or keys, d] each -> (output like q, natural-log LSE with kv heads x rows elements). The
    # aten ops behind F.scaled_dot_product_attention, which alone return the LSE the merge needs (torch >= 2.5).
    if q.is_cuda:
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            query=q, key=k, value=v, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, is_causal=False,
            return_debug_mask=False, scale=scale)
    else:  # the same layout through torch's CPU flash attention: what the CPU tests check the copies with
        res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query=q, key=k, value=v, dropout_p=0.0, is_causal=False, scale=scale)
    return res[0], res[1]


def shared_pass(
    q: torch.Tensor,  # [batch, heads, head_dim], channels adjacent (a view of a fused projection is fine)
    k_cache: torch.Tensor,  # [num_pages, kv_heads, page_size, head_dim]
    v_cache: torch.Tensor,  # [num_pages, kv_heads, page_size, head_dim]
    block_tables: torch.Tensor,  # [batch, max_pages] int32: the shared pages are row 0's first
    partial: torch.Tensor,  # [batch, heads, splits, head_dim] float32, channels adjacent
    lse: torch.Tensor,  # [batch, heads, splits] float32
    *,
    slot: int,  # the split slot the prefix's output goes to
    shared_len: int,  # whole pages
    scale: float,
) -> None:
    """Decode: attend every (request, head) row to the shared prefix: its normalised output into
    ``partial[:, :, slot]`` and its log2-LSE into ``lse[:, :, slot]``, as ``_cascade_shared`` writes them."""
    if partial.stride(3) != 1 or block_tables.stride(1) != 1:
        raise BackendError("cascade_sdpa: the split scratch's channels or the block table's pages are not adjacent",
                           fix="pass contiguous scratch and block tables (as the backend allocates them)")
    batch, heads, d = q.shape
    kv_heads, page_size = k_cache.shape[1:3]
    group, pages = heads // kv_heads, shared_len // page_size
    rows = q.new_empty(1, kv_heads, batch * group, d)
    keys, values = (q.new_empty(1, kv_heads, shared_len, d) for _ in range(2))
    grid = (-(-batch // COPY_REQUESTS), kv_heads)
    tiles = dict(GROUP=group, D=d, BLOCK_B=COPY_REQUESTS, BLOCK_G=next_pow2(group))
    _rows_by_kv_head[grid](q, rows, batch, q.stride(0), q.stride(1), **tiles)
    _gather_prefix[(pages, kv_heads)](k_cache, v_cache, block_tables, keys, values, pages, k_cache.stride(0),
                                      k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), PAGE_SIZE=page_size,
                                      D=d, BLOCK_T=next_pow2(page_size))
    out, lse_e = _attend(rows, keys, values, scale)
    if not out.is_contiguous():  # the copy below reads rows in order
        out = out.contiguous()
    _to_slot[grid](out, lse_e.contiguous(), partial, lse, batch, partial.stride(0), partial.stride(1), lse.stride(0),
                   lse.stride(1), slot * partial.stride(2), slot * lse.stride(2), **tiles)


def warm_up(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, *, scale: float, k_scale: float = 1.0,
            v_scale: float = 1.0) -> int:
    """Compile the copies around cuDNN's call (and load cuDNN's attention) for a layer of this shape before a
    captured step needs them (the engine's two-prompt warm-up never has MIN_ROWS rows): one request over page 0
    (the pool's padding page; nothing is written to the cache). -> the calls made: 0 where the layer does not
    qualify or cuDNN does not run here."""
    d, page_size = k_cache.shape[-1], k_cache.shape[2]
    if not _cache_runs(k_cache, v_cache, k_cache.dtype, values_in_key(k_cache, v_cache), k_scale, v_scale, page_size):
        return 0
    q = k_cache.new_zeros(1, num_heads, d)
    partial = torch.empty(1, num_heads, 2, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(1, num_heads, 2, dtype=torch.float32, device=q.device)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=q.device)
    shared_pass(q, k_cache, v_cache, tables, partial, lse, slot=1, shared_len=page_size, scale=scale)
    return 1
