"""The fused MoE path (Triton): align the (token, slot) assignments by expert, two grouped GEMMs around the
activation (unquantized experts: in gate_up's epilogue), the weighted sum of each token's rows; every buffer and grid
sized by the shape, never the routing."""
from __future__ import annotations

import functools

import torch

from attnzoo import pdl
from attnzoo.errors import BackendError, ModelLoadError
from attnzoo.layers.fp8 import GROUP as QUANT_GROUP
from attnzoo.layers.fp8 import GROUPS_PER_PROGRAM, MIN_AMAX, act_quant
from attnzoo.layers.moe.reference import ACTIVATIONS, FP8, MXFP4, SWIGLU_ALPHA, SWIGLU_LIMIT, _cdiv
from attnzoo.layers.moe.tiles import MoEConfig, tile_config
from attnzoo.layers.mxfp4 import BLOCK as MXFP4_BLOCK

# Bounds the transient [T*k, 2I] / [T*k, H] buffers of a long prefill; shapes still depend on T only.
MAX_CHUNK_TOKENS = 4096
# Off: slower at batch 1 (V2-Lite, results/moe_gated_gemm_nvidia_h200.txt); large batches not measured yet
GATED_GEMM = False


def padded_slots(num_assignments: int, num_local: int, block_m: int) -> int:
    """Worst-case length of the padded, expert-sorted assignment list (a multiple of block_m): every
    expert's run is padded by at most block_m - 1 rows, and at most num_assignments experts have rows.
    The bound is reached (one assignment on each of min(T*k, E) experts at decode), so the grid is sized
    no larger than some routing needs; blocks past the routing's padded total exit before reading rows or weights."""
    worst = min(num_assignments * block_m, num_assignments + num_local * (block_m - 1))
    return _cdiv(worst, block_m) * block_m


def _kernels():
    from attnzoo.layers import moe_kernels  # imports triton: on first use only

    return moe_kernels


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_local: int, expert_start: int = 0):
    """Sort the flat (token, slot) assignments by local expert, each expert's run padded to block_m.

    -> sorted_ids int32 [padded_slots]: flat assignment index t*k + j, or T*k (a sentinel) in padding;
       expert_ids int32 [padded_slots / block_m]: the local expert of each block;
       total int32 [1]: padded rows in use (blocks at or past it are unused, their entries unset).
    Assignments to experts outside [expert_start, expert_start + num_local) are left out. Shapes depend
    on (T*k, num_local, block_m) only, and nothing is read back to the host.
    """
    k = _kernels()
    ids = topk_ids.reshape(-1).contiguous()
    n = ids.numel()
    slots = padded_slots(n, num_local, block_m)
    dev = ids.device
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(slots // block_m, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    bins = 1 << num_local.bit_length()  # > num_local: the last bin collects other ranks' experts
    k.align_kernel[(num_local,)](ids, sorted_ids, expert_ids, total, n, expert_start, num_local,
                                 BLOCK_M=block_m, BINS=bins, CHUNK=256, **pdl.launch_args(ids))
    return sorted_ids, expert_ids, total


@functools.lru_cache(maxsize=64)
def _one_row_blocks(k: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids, total) of one token's k assignments, one row block each: block j holds assignment j
    in its first row and the sentinel k in the rest. The same for every routing of one token."""
    sorted_ids = torch.full((k, block_m), k, dtype=torch.int32)
    sorted_ids[:, 0] = torch.arange(k, dtype=torch.int32)
    return sorted_ids.reshape(-1).to(device), torch.tensor([k * block_m], dtype=torch.int32, device=device)


def align_one_token(topk_ids: torch.Tensor, block_m: int):
    """``moe_align_block_size`` for a single token holding every expert: its k experts are distinct (top-k),
    so block j can serve assignment j alone and no expert's weights are read twice; the sort is a constant
    and the expert of each block is the token's id list itself. Saves the sort launch where a decode step
    of one request is launch-bound."""
    k = topk_ids.shape[1]
    sorted_ids, total = _one_row_blocks(k, block_m, topk_ids.device)
    # The ids as the router gave them (int64): the GEMM reads either width, and a cast would be a launch.
    return sorted_ids, topk_ids.reshape(-1), total


def _grouped_gemm(a, a_scale, w, w_scale, out, weights, align, cfg: MoEConfig, *, num_valid: int, rows_per_a: int,
                  split_n: int, mul_weight: bool, block=(128, 128), bias=None, act: str | None = None,
                  clamp: float = 0.0):
    """out[row] = a[row // rows_per_a] @ w[expert]^T (times weights[row], float32 [T*k], if mul_weight):
    both projections pass the same argument types, so they share one compiled kernel. ``w`` uint8
    [E, N, K/2] is MXFP4 (``w_scale`` its E8M0 bytes [E, N, K/32]), decoded in the K loop. ``act`` (unquantized
    w [E, 2I, K]; a kernel variant of its own): out [rows, I] = act(gate) * up, ``_act_and_mul``'s values, each
    program reading half its tile's rows from gate and half from up (16 of each at least)."""
    sorted_ids, expert_ids, total = align
    mxfp4 = w.dtype == MXFP4
    n_out, k_in = w.shape[1], w.shape[2] * (2 if mxfp4 else 1)
    fp8 = w.dtype == FP8
    scaled = fp8 or mxfp4
    if act is not None:
        if scaled:
            raise BackendError(f"the gated grouped GEMM takes unquantized experts, not {w.dtype}",
                               fix="pass act=None for FP8 or MXFP4 experts and apply the activation after the GEMM")
        n_out //= 2
    block_n = max(16, cfg.block_n // 2) if act is not None else cfg.block_n
    num_m_blocks = expert_ids.numel()
    grid = (num_m_blocks * _cdiv(n_out, block_n),)
    dummy = out  # never read when the matching flag is off
    _kernels().gemm_kernel[grid](
        a, w, out, a_scale if fp8 else dummy, w_scale if scaled else dummy, weights, dummy if bias is None else bias,
        sorted_ids, expert_ids, total,
        n_out, k_in, num_valid, num_m_blocks, split_n, rows_per_a, int(mul_weight),
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        a_scale.stride(0) if fp8 else 0, a_scale.stride(1) if fp8 else 0,
        w_scale.stride(0) if scaled else 0, w_scale.stride(1) if scaled else 0, w_scale.stride(2) if scaled else 0,
        0 if bias is None else bias.stride(0),
        FP8=fp8, IEEE=a.dtype == torch.float32, HAS_BIAS=bias is not None,
        F32_OPERANDS=a.device.type != "cuda",
        GROUP_N=block[0], GROUP_K=block[1],
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, B_MXFP4=mxfp4, **pdl.launch_args(a),
        GATED=act is not None, ACT=ACTIVATIONS.index(act or "silu") + 1, ALPHA=SWIGLU_ALPHA, LIMIT=SWIGLU_LIMIT,
        CLAMP=float(clamp),
    )


def _act_and_mul(gate_up: torch.Tensor, act: str, quant: bool, dtype, ue8m0: bool = False, clamp: float = 0.0):
    """[M, 2I] -> act(gate) * up [M, I] in ``dtype``, or (float8 [M, I], float32 scales [M, groups]) quantized
    as ``fp8.act_quant`` quantizes (the same Triton function, fused here to save a pass over [M, I])."""
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    block, groups = (QUANT_GROUP, GROUPS_PER_PROGRAM) if quant else (1024, 1)
    y = torch.empty(m, inter, dtype=FP8 if quant else dtype, device=gate_up.device)
    s = torch.empty(m, _cdiv(inter, QUANT_GROUP), dtype=torch.float32, device=gate_up.device) if quant else y
    _kernels().act_kernel[(m, _cdiv(inter, block * groups))](
        gate_up, y.view(torch.uint8) if quant else y, s, inter, gate_up.stride(0), y.stride(0), s.stride(0),
        ACT=ACTIVATIONS.index(act) + 1, ALPHA=SWIGLU_ALPHA, LIMIT=SWIGLU_LIMIT, CLAMP=float(clamp), QUANT=quant, UE8M0=ue8m0,
        MIN_AMAX=MIN_AMAX, BLOCK=block, GROUPS=groups, **pdl.launch_args(gate_up),
    )
    return y, (s if quant else None)


def _check_mxfp4(x, w13, w2, s13, s2, cfg: MoEConfig) -> None:
    h, inter = x.shape[1], w2.shape[2] * 2
    if cfg.block_k % MXFP4_BLOCK:
        raise ModelLoadError(f"MXFP4 MoE needs BLOCK_K ({cfg.block_k}) a multiple of {MXFP4_BLOCK} (one scale per "
                             f"{MXFP4_BLOCK} inputs)", fix="use the default MoEConfig, or BLOCK_K 32, 64 or 128")
    if w2.dtype != MXFP4 or s13 is None or s2 is None or s13.dtype != MXFP4 or s2.dtype != MXFP4:
        raise ModelLoadError("MXFP4 MoE needs both w13 and w2 uint8 with uint8 E8M0 w13_scale_inv / w2_scale_inv",
                             fix="pass both projections packed, with their scales (FusedMoE(quant='mxfp4') does)")
    want = {"w13": (w13.shape[0], 2 * inter, h // 2), "w2": (w2.shape[0], h, inter // 2),
            "w13_scale_inv": (w13.shape[0], 2 * inter, h // MXFP4_BLOCK),
            "w2_scale_inv": (w2.shape[0], h, inter // MXFP4_BLOCK)}
    got = {"w13": w13, "w2": w2, "w13_scale_inv": s13, "w2_scale_inv": s2}
    bad = [f"{n} {tuple(got[n].shape)} (expected {shape})" for n, shape in want.items() if tuple(got[n].shape) != shape]
    if h % MXFP4_BLOCK or inter % MXFP4_BLOCK or bad:
        raise ModelLoadError(f"MXFP4 MoE shapes do not fit hidden {h} / intermediate {inter}: {', '.join(bad)}",
                             fix=f"hidden and intermediate must be multiples of {MXFP4_BLOCK}, weights [E, N, K/2] "
                                 f"bytes with scales [E, N, K/{MXFP4_BLOCK}]")


def fused_moe(x, w13, w2, topk_weights, topk_ids, *, act: str = "silu", expert_start: int = 0,
              holds_all_experts: bool = True, w13_scale_inv=None, w2_scale_inv=None, block=(128, 128),
              ue8m0: bool = False, add: torch.Tensor | None = None, config: MoEConfig | None = None,
              w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
              swiglu_limit: float = 0.0, add_stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """The experts' weighted sum per token through the grouped Triton GEMMs (see the module docstring).

    ``holds_all_experts=False`` (an expert-parallel share): rows of assignments to other ranks' experts
    are zeroed, as no GEMM writes them. FP8 weights (float8_e4m3fn with their ``*_scale_inv``) run w8a8,
    activations quantized by ``fp8.act_quant`` (power-of-two scales under ``ue8m0``, the checkpoint's
    ``scale_fmt``). ``add`` [T, H] (the shared experts' output) is added in the final sum's kernel, which
    waits for ``add_stream`` (where ``add`` is still being written, if it is) before it starts.
    ``w13_bias`` [E, 2I] / ``w2_bias`` [E, H] (gpt-oss) are added in the GEMMs' epilogues.
    MXFP4 weights (gpt-oss's checkpoints as stored) run w4a16: ``w13`` uint8 [E, 2I, H/2] and ``w2`` uint8
    [E, H, I/2] hold two e2m1 codes per byte (the even input in the low nibble) and ``w13_scale_inv`` /
    ``w2_scale_inv`` uint8 [E, 2I, H/32] / [E, H, I/32] their E8M0 scales (``layers.mxfp4``); the GEMM
    decodes them in its K loop and multiplies in the activation dtype (``block`` and ``ue8m0`` unused).
    """
    t, k = topk_ids.shape
    if add_stream is not None and (t == 0 or t > MAX_CHUNK_TOKENS):
        torch.cuda.current_stream(x.device).wait_stream(add_stream)
    if t == 0:
        return torch.zeros_like(x) if add is None else add.clone()
    if t > MAX_CHUNK_TOKENS:
        return torch.cat([
            fused_moe(x[i : i + MAX_CHUNK_TOKENS], w13, w2, topk_weights[i : i + MAX_CHUNK_TOKENS],
                      topk_ids[i : i + MAX_CHUNK_TOKENS], act=act, expert_start=expert_start,
                      holds_all_experts=holds_all_experts, w13_scale_inv=w13_scale_inv, w2_scale_inv=w2_scale_inv,
                      block=block, ue8m0=ue8m0, add=None if add is None else add[i : i + MAX_CHUNK_TOKENS],
                      config=config, w13_bias=w13_bias, w2_bias=w2_bias, swiglu_limit=swiglu_limit)
            for i in range(0, t, MAX_CHUNK_TOKENS)
        ])
    mxfp4 = w13.dtype == MXFP4
    num_local, inter = w2.shape[0], w2.shape[2] * (2 if mxfp4 else 1)
    fp8 = w13.dtype == FP8
    fmt = "fp8" if fp8 else "mxfp4" if mxfp4 else "bf16"
    cfg = config or tile_config(t, k, num_local, x.shape[1], inter, fmt, x.device)
    if mxfp4:
        _check_mxfp4(x, w13, w2, w13_scale_inv, w2_scale_inv, cfg)
    if fp8 and (block[1] % cfg.block_k or block[1] != QUANT_GROUP):
        raise ModelLoadError(
            f"FP8 MoE needs BLOCK_K ({cfg.block_k}) dividing the weight block's K side ({block[1]}) and a K side of "
            f"{QUANT_GROUP} (the activation group)", fix="use the default MoEConfig and weight_block_size [128, 128]",
        )
    x = x.contiguous()
    align = (align_one_token(topk_ids, cfg.block_m) if t == 1 and holds_all_experts
             else moe_align_block_size(topk_ids, cfg.block_m, num_local, expert_start))
    a, a_scale = act_quant(x, QUANT_GROUP, ue8m0) if fp8 else (x, None)
    # An expert-parallel share leaves other ranks' rows unwritten: zeros (act(0) * 0 is 0), not garbage
    new = torch.empty if holds_all_experts else torch.zeros
    flat_weights = topk_weights.reshape(-1).float().contiguous()
    if GATED_GEMM and fmt == "bf16":
        h, h_scale = new(t * k, inter, dtype=x.dtype, device=x.device), None
        _grouped_gemm(a, None, w13, None, h, flat_weights, align, cfg, num_valid=t * k, rows_per_a=k, split_n=inter,
                      mul_weight=False, block=block, bias=w13_bias, act=act, clamp=swiglu_limit)
    else:
        gate_up = new(t * k, 2 * inter, dtype=x.dtype, device=x.device)
        _grouped_gemm(a, a_scale, w13, w13_scale_inv, gate_up, flat_weights, align, cfg, num_valid=t * k,
                      rows_per_a=k, split_n=inter, mul_weight=False, block=block, bias=w13_bias)
        h, h_scale = _act_and_mul(gate_up, act, fp8, x.dtype, ue8m0, swiglu_limit)
    down = new(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(h, h_scale, w2, w2_scale_inv, down, flat_weights, align, cfg, num_valid=t * k, rows_per_a=1,
                  split_n=w2.shape[1], mul_weight=True, block=block, bias=w2_bias)
    out = torch.empty_like(x)
    if add_stream is not None:
        torch.cuda.current_stream(x.device).wait_stream(add_stream)
    add = None if add is None else add.contiguous()
    _kernels().sum_kernel[(t, _cdiv(x.shape[1], 1024))](down, out if add is None else add, out, x.shape[1], TOP_K=k,
                                                       ADD=add is not None, BLOCK=1024, **pdl.launch_args(x))
    return out
