"""Helpers shared by the Triton attention kernels (and the small device functions other kernels share too:
``prior_done``, ``last_arrival``, ``l2_prefetch``): tile shapes for head dims.

Head dims need not be powers of two (MLA keys are 512 + 64 = 576 wide, tiny test models use 40 or 48).
Triton tiles must be, so a head dim is covered by a power-of-two main tile plus, when the rest is itself
a power of two of at least 16 (576 = 512 + 64, 192 = 128 + 64, 48 = 32 + 16), a second tile: no padded
lanes are loaded. Any other width uses one padded, masked tile (40 -> 64).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from attnzoo.errors import BackendError

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # older Triton layouts
    from triton.runtime.autotuner import OutOfResources  # type: ignore[no-redef]

# tl.dot needs every tile side to be at least 16 on the GPU.
MIN_TILE = 16
MAX_HEAD_DIM = 1024


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def prior_done(PDL: tl.constexpr):
    # attnzoo.pdl: wait for the previous kernel's writes, then let the next kernel launch (it waits in turn).
    # In this order only one kernel waits ahead: launched before its wait, each would let the next launch too,
    # a chain of waiting programs taking the SMs' slots (measured slower: results/pdl_batch1_nvidia_h100.txt).
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def last_arrival(counter, arrivals):
    # -> whether this program is the last of ``arrivals`` to get here, for split work finished by one program.
    # The barrier orders every thread's stores before the one gpu-scope release-acquire atomic (it runs on one
    # thread), so the last program sees the others' stores (read them past L1: cache_modifier=".cg"). The last
    # resets the int32 counter to 0 for the next launch, a CUDA graph's replay included.
    tl.debug_barrier()
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == arrivals - 1
    if last:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def l2_prefetch(ptrs, nbytes):
    # cp.async.bulk.prefetch, SM90+ only (callers gate it on PDL): asks L2 for ``nbytes`` (a multiple of 16) from each
    # address of ``ptrs``, which must be 16-byte aligned; no registers, no wait. L2 is where this GPU's memory is
    # coherent, so prefetching what a prior kernel still writes cannot make anyone read stale data: before
    # prior_done, it lets reads of constant data (weights) start early.
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;", "=r,l,r",
                              [ptrs, tl.full(ptrs.shape, nbytes, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@functools.cache
def head_dim_tiles(head_dim: int) -> tuple[int, int]:
    """-> (main tile width, remainder tile width or 0) covering ``head_dim`` channels."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise BackendError(
            f"head dim {head_dim} is outside what the triton kernels support (1..{MAX_HEAD_DIM})",
            fix="use the torch backend for this model",
        )
    full = max(MIN_TILE, next_pow2(head_dim))
    if full == head_dim or head_dim < 2 * MIN_TILE:
        return full, 0
    main = full // 2
    rest = head_dim - main
    if rest >= MIN_TILE and rest & (rest - 1) == 0:
        return main, rest
    return full, 0


@functools.cache
def value_tile(v_head_dim: int) -> int:
    head_dim_tiles(v_head_dim)  # range check
    return max(MIN_TILE, next_pow2(v_head_dim))


def values_in_key(k_cache, v_cache) -> bool:
    """MLA: the values are the key's first channels (a view of the same cache). Reusing the key tile for them
    needs the value tile to be exactly the key's main tile, unpadded."""
    v_dim = v_cache.shape[-1]
    return (v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride()
            and v_dim == head_dim_tiles(k_cache.shape[-1])[0] == value_tile(v_dim))


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_args(cache: torch.Tensor) -> dict:
    """The operand dtype and precision of the kernels' tl.dot calls, as constexpr kernel arguments.

    The tensor cores take the cache dtype; an fp8 cache is widened to bfloat16 first (the queries are
    not quantized). Triton's CPU interpreter multiplies the raw bits of bfloat16
    operands in tl.dot (triton-lang/triton#11584; upstream does not support bfloat16 there), so off
    the GPU the operands go through float32. float32 models are compared with transformers to 1e-4:
    no TF32 rounding for them.
    """
    dtype = cache.dtype if cache.device.type == "cuda" else torch.float32
    if dtype == torch.float8_e4m3fn:
        dtype = torch.bfloat16
    return {"DOT_DTYPE": _TL_DTYPES[dtype], "DOT_PREC": "ieee" if dtype == torch.float32 else "tf32"}


def check_kernel_dtypes(q: torch.Tensor, *caches: torch.Tensor) -> None:
    for t in (q, *caches):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32) and not (
                t is not q and t.dtype == torch.float8_e4m3fn):
            raise BackendError(
                f"triton attention kernels take float16, bfloat16 or float32 tensors (and float8_e4m3fn "
                f"KV caches), got {t.dtype}",
                fix="run the model and its KV cache in one of those dtypes, or use the torch backend",
            )


@triton.jit
def add_sinks(SINKS, heads, row_ok, acc, m_i, l_i):
    """Each row's head sink logit joins its softmax denominator (a key of value zero): -> (acc, l_i)
    rescaled to the larger of the running max and the sink."""
    sink = tl.load(SINKS + heads, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return acc * alpha[None, :], l_i * alpha + tl.exp2(sink - m_new)


@triton.jit
def softcap_fn(x, cap):
    # cap * tanh(x / cap), written with exp so that it runs on every Triton version and the interpreter;
    # 1 - 2 / (e^{2y} + 1) saturates cleanly to +-1 instead of producing inf / inf.
    y = x / cap
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))


@triton.jit
def attend(
    Q, q_rows, row_ok, K, V, bt_row, kvh, lo, hi,
    stride_qd, stride_kp, stride_kh, stride_kt, stride_kd, stride_vp, stride_vh, stride_vt, stride_vd,
    sm_scale, softcap, pos, seen, window,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    V_FROM_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Running softmax of BLOCK_R query rows (q at Q + q_rows) over the keys [lo, hi) of one KV head,
    paged through bt_row. -> (acc [BLOCK_DV, BLOCK_R] unnormalised, running max m_i, sum l_i), log2 units.
    The one loop of decode, the cascade's shared pass and extend. ``CAUSAL``: a row at position ``pos``
    sees keys up to it (extend); ``HAS_WINDOW``: keys before ``seen`` are not loaded (their pages may be
    released) and, with ``CAUSAL``, a row sees only the ``window`` keys ending at it."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # Tiles are keys-major (scores [keys, rows], accumulator [v channels, rows]): both products then
    # read their register-computed operand (q, p) as the B operand through shared memory. On Hopper,
    # register-A wgmma is miscompiled by the ptxas that Triton bundles (triton-lang/triton#11781) and
    # gave wrong attention; this layout never emits it.
    q_t = tl.load(Q + q_rows[None, :] + offs_d[:, None] * stride_qd,
                  mask=row_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
    q_t = q_t.to(DOT_DTYPE)  # [BLOCK_D, BLOCK_R]
    if BLOCK_DR > 0:
        offs_dr = BLOCK_D + tl.arange(0, BLOCK_DR)
        qr_t = tl.load(Q + q_rows[None, :] + offs_dr[:, None] * stride_qd, mask=row_ok[None, :], other=0.0)
        qr_t = qr_t.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_DV, BLOCK_R], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 instead of exp

    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        if HAS_WINDOW:
            n_ok = n_ok & (offs_n >= seen)
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = offs_n % PAGE_SIZE
        k_row = K + page * stride_kp + kvh * stride_kh + slot * stride_kt  # [BLOCK_N] pointers
        k = tl.load(
            k_row[:, None] + offs_d[None, :] * stride_kd,
            mask=n_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
            other=0.0,
        )
        k = k.to(DOT_DTYPE)
        qk = tl.dot(k, q_t, input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_R]
        if BLOCK_DR > 0:
            kr = tl.load(k_row[:, None] + offs_dr[None, :] * stride_kd, mask=n_ok[:, None], other=0.0)
            qk += tl.dot(kr.to(DOT_DTYPE), qr_t, input_precision=DOT_PREC)
        if HAS_SOFTCAP:
            qk = softcap_fn(qk * sm_scale, softcap) * 1.4426950408889634
        else:
            qk = qk * qk_scale
        if CAUSAL:
            visible = offs_n[:, None] <= pos[None, :]
            if HAS_WINDOW:
                visible = visible & (offs_n[:, None] > pos[None, :] - window)
            qk = tl.where(visible, qk, float("-inf"))
        else:
            qk = tl.where(n_ok[:, None], qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 0))
        p = tl.exp2(qk - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        if V_FROM_K:
            # The values are the key's first V_DIM channels (MLA latent): reuse the loaded tile.
            v = k
        else:
            v_row = V + page * stride_vp + kvh * stride_vh + slot * stride_vt
            v = tl.load(
                v_row[:, None] + offs_dv[None, :] * stride_vd,
                mask=n_ok[:, None] & (offs_dv[None, :] < V_DIM),
                other=0.0,
            )
        pv = tl.dot(tl.trans(v.to(DOT_DTYPE)), p.to(DOT_DTYPE), input_precision=DOT_PREC)
        acc = acc * alpha[None, :] + pv  # [BLOCK_DV, BLOCK_R]
        m_i = m_new
    return acc, m_i, l_i


@functools.cache
def _sm_limits(device_index: int) -> tuple[int, int, int]:
    p = torch.cuda.get_device_properties(device_index)
    return (getattr(p, "regs_per_multiprocessor", 65536), getattr(p, "shared_memory_per_multiprocessor", 233472),
            getattr(p, "max_threads_per_multi_processor", 2048))


def resident_ctas(kernel, grid, args: tuple, constexprs: dict, cfg: dict) -> int:
    """How many programs of ``kernel`` under ``cfg`` one SM runs at once: its registers, shared memory and
    threads against the SM's (compiled here if not yet, not launched)."""
    compiled = kernel.warmup(*args, grid=grid(cfg), **constexprs, **cfg)
    compiled.run  # noqa: B018 - loading the binary is what fills n_regs
    if getattr(compiled, "n_regs", None) is None:  # its load failed once already (Triton keeps the kernel)
        raise OutOfResources(0, 0, "the kernel did not load")
    regs, smem, threads = _sm_limits(args[0].device.index or 0)
    warps = compiled.metadata.num_warps
    warp_regs = -(-compiled.n_regs * 32 // 256) * 256  # registers go to warps in units of 256
    by_regs = regs // max(1, warp_regs * warps)
    by_smem = smem // (compiled.metadata.shared + 1024)  # the driver keeps 1 KB per resident block
    return max(1, min(by_regs, by_smem, threads // (32 * warps)))


# (kernel, device, constexprs, requested config) -> the config that fit, so a shrink happens once.
_FITTED: dict[tuple, dict] = {}


def launch(kernel, grid, args: tuple, constexprs: dict, cfg: dict, *, tile_keys: tuple[str, ...]) -> None:
    """Launch ``kernel`` with the tile config ``cfg``, shrinking it when the GPU lacks shared memory.

    The default tiles are tuned for SM90's 228 KB of shared memory; an SM89 GPU has 100 KB and an
    SM80 one 164 KB. On OutOfResources this drops pipeline stages first, then halves the tiles named
    in ``tile_keys`` (never below 16). ``grid`` is a function of the config (tile sizes shape it).
    """
    device = args[0].device
    # Call sites pass their dicts in a fixed order: the values alone identify the launch.
    key = (id(kernel), device.index, tuple(constexprs.values()), tuple(cfg.items()))
    cfg = dict(_FITTED.get(key, cfg))
    while True:
        try:
            kernel[grid(cfg)](*args, **constexprs, **cfg)
            if key not in _FITTED:
                _FITTED[key] = cfg
            return
        except OutOfResources:
            if cfg.get("num_stages", 1) > 1:
                cfg["num_stages"] -= 1
                continue
            big = [k for k in tile_keys if cfg[k] > MIN_TILE]
            if not big:
                raise
            tile = max(big, key=lambda k: cfg[k])
            cfg[tile] //= 2
            cfg["num_stages"] = 2
