"""Mixture-of-experts: routing, stacked expert weights, a fused Triton path and the per-expert oracle.

``select_experts`` turns router logits into (weights, expert ids): DeepSeek's softmax or sigmoid scores,
group-limited choice, top-k, renormalisation and scaling, one Triton launch per layer on a GPU.

``FusedMoE`` holds a contiguous range of a layer's routed experts (all of them, or one expert-parallel
rank's share; ``holds(e)`` is the one answer to which rank owns an expert) as two stacked tensors,
``w13`` [E_local, 2I, H] (gate rows then up rows) and ``w2`` [E_local, H, I], and takes the routing the
model computed: ``topk_ids`` [T, k] (global expert ids) and ``topk_weights`` [T, k] float32. Each
token's output is sum_j w_j * down(act(gate(x)) * up(x)) over its chosen experts held here; experts
held elsewhere contribute zero (the expert-parallel caller all-reduces).

On CUDA it runs ``fused_moe``, in the style of vLLM's / SGLang's fused_moe:
  1. ``moe_align_block_size`` sorts the T*k (token, slot) assignments by expert and pads each expert's
     run to a multiple of BLOCK_M (one small Triton kernel, no host sync).
  2. One grouped GEMM launch computes every block's gate_up rows (each block reads one expert's weights),
     an elementwise kernel applies act(gate) * up, and a second grouped GEMM launch computes down and
     multiplies each row by its routing weight; one kernel sums the k rows of a token (plus the shared
     experts' output when given).
Every buffer and grid is sized for the worst case of the shape (T, k, E_local), never for the routing:
blocks past the padded total exit at once. A captured CUDA graph therefore replays any routing, and
only the experts actually chosen are read, instead of every expert running on every token. The tiles
come from ``tile_config``: a table tuned per GPU (``moe_configs/``, written by ``benchmarks/moe.py
--sweep``), else ``default_config``.

With ``quant="fp8"`` the weights are float8_e4m3fn with float32 ``w13_scale_inv`` / ``w2_scale_inv``,
one multiplier per [128, 128] block (DeepSeek-V3's ``weight_block_size``), and the GEMMs are w8a8 as in
DeepSeek's reference: activations quantized per token per 128-channel group by ``fp8.act_quant`` (the
one implementation the FP8 linear layers use; power-of-two scales under the checkpoint's ``scale_fmt:
"ue8m0"``), the float32 accumulator scaled per block. The gate and up halves of ``w13`` keep their own
scale blocks, so ``w13_scale_inv`` is [E, 2 * ceil(I/128), ceil(H/128)] (= ceil(2I/128) rows when 128
divides I, as in vLLM's layout) and I need not be a multiple of 128.

On CPU ``moe_reference`` (a loop over the experts that have tokens, float32 accumulation, FP8 weights
dequantized, activations rounded as the kernels round them) computes the same sum: it is the oracle the
fused path is tested against. The Triton kernels also run on CPU under ``TRITON_INTERPRET=1`` (inside
``fused.use("triton")``, as every fused op of a layer) for tests.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.errors import BackendError, ModelLoadError, WeightError
from attnzoo.layers.fp8 import GROUP as QUANT_GROUP
from attnzoo.layers.fp8 import CODE_RMS, GROUPS_PER_PROGRAM, MIN_AMAX, act_quant, act_quant_reference, random_codes_

log = logging.getLogger("attnzoo")

ACTIVATIONS = ("silu", "gelu_tanh")
FP8 = torch.float8_e4m3fn
# Bounds the transient [T*k, 2I] / [T*k, H] buffers of a long prefill; shapes still depend on T only.
MAX_CHUNK_TOKENS = 4096


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------
# Reference (CPU oracle)


def _act(gate: torch.Tensor, act: str) -> torch.Tensor:
    return F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")


def scale_rows(n: int, split: int, block_n: int, device=None) -> torch.Tensor:
    """Scale-block row of each of ``n`` weight rows whose first ``split`` rows (gate) and the rest (up)
    are blocked separately: rows [0, split) use blocks 0.., rows [split, n) start a new block."""
    r = torch.arange(n, device=device)
    return torch.where(r < split, r // block_n, _cdiv(split, block_n) + (r - split) // block_n)


def dequantize_block_fp8(w: torch.Tensor, scale_inv: torch.Tensor, *, split: int, block=(128, 128)) -> torch.Tensor:
    """One expert's FP8 weight [N, K] times its block multipliers [blocks_n, blocks_k] -> float32 [N, K]."""
    n, k = w.shape
    rows = scale_rows(n, split, block[0], w.device)
    cols = torch.arange(k, device=w.device) // block[1]
    return w.float() * scale_inv[rows][:, cols]


def _fake_quant_fp8(x: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """x rounded through the per-token-group FP8 quantization (what the w8a8 kernel's inputs hold)."""
    q, s = act_quant_reference(x, QUANT_GROUP, ue8m0)
    return (q.float() * s.repeat_interleave(QUANT_GROUP, dim=1)[:, : x.shape[1]]).to(x.dtype)


def moe_reference(x, w13, w2, topk_weights, topk_ids, *, act: str = "silu", expert_start: int = 0,
                  w13_scale_inv=None, w2_scale_inv=None, block=(128, 128), quantize_activations: bool = False,
                  ue8m0: bool = False, swiglu_limit: float = 0.0):
    """The per-expert loop: for each local expert with tokens, its gated MLP on those tokens.

    One float32 row per (token, slot), summed over the slots at the end: deterministic (no atomic
    index_add) and accumulated in float32. FP8 weights are dequantized per expert; with
    ``quantize_activations`` (FP8 weights only) the GEMM inputs are rounded as the w8a8 kernel rounds
    them (``fp8.act_quant_reference``; scales powers of two under ``ue8m0``): the arithmetic of the
    fused path, as ``Fp8Linear``'s CPU emulation is that of its GEMMs.
    One host sync (the per-expert counts): this is the eager/CPU oracle, never captured.
    """
    t, k = topk_ids.shape
    num_local, inter = w2.shape[0], w2.shape[2]
    local = topk_ids.reshape(-1) - expert_start
    local = torch.where((local >= 0) & (local < num_local), local, num_local)  # others: a dropped bucket
    order = local.argsort(stable=True)
    counts = torch.bincount(local, minlength=num_local + 1).tolist()
    flat_w = topk_weights.reshape(-1).float()
    # FP8 weights dequantized to the model dtype: the same model with dequantized weights. The w8a8
    # emulation computes in float32 on the quantized values, as the kernel's float32 accumulator does.
    wdt = torch.float32 if quantize_activations else x.dtype
    out = torch.zeros(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts[:num_local]):
        if n == 0:
            continue
        rows = order[start : start + n]
        start += n
        a, b = w13[e], w2[e]
        if w13_scale_inv is not None:
            a = dequantize_block_fp8(a, w13_scale_inv[e], split=inter, block=block).to(wdt)
            b = dequantize_block_fp8(b, w2_scale_inv[e], split=b.shape[0], block=block).to(wdt)
        h = x[rows // k]
        if quantize_activations:
            h = _fake_quant_fp8(h.float(), ue8m0)
        gate_up = F.linear(h, a)
        if quantize_activations:
            gate_up = gate_up.to(x.dtype).float()  # the kernel stores it in the model dtype
        gate, up = gate_up.chunk(2, dim=-1)
        if swiglu_limit:  # DeepSeek-V4: gate clamped above, up on both sides, before the activation
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
        h = _act(gate, act) * up
        if quantize_activations:
            h = _fake_quant_fp8(h, ue8m0)
        out[rows] = F.linear(h, b).float() * flat_w[rows, None]
    return out.view(t, k, -1).sum(dim=1).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Routing

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
    if group_score not in GROUP_SCORES:
        raise ModelLoadError(f"unknown expert-group score {group_score!r}", fix=f"use one of {GROUP_SCORES}")
    if not _fused_triton(logits):
        return select_experts_reference(logits, top_k=top_k, sigmoid=sigmoid, group_score=group_score,
                                        n_group=n_group, topk_group=topk_group, correction_bias=correction_bias,
                                        renormalize=renormalize, scale=scale)
    t, e = logits.shape
    logits = logits.float()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _kernels().route_kernel[(t,)](
            logits, correction_bias if correction_bias is not None else logits, weights, ids, e, e // n_group,
            n_group, topk_group, float(scale), logits.stride(0),
            SIGMOID=sigmoid, GROUP_SCORE=GROUP_SCORES.index(group_score), HAS_BIAS=correction_bias is not None,
            RENORM=renormalize, TOP_K=top_k, K_POW2=1 << (top_k - 1).bit_length(), E_POW2=1 << (e - 1).bit_length(),
        )
    return weights, ids


def _fused_triton(x: torch.Tensor) -> bool:
    """Whether the MoE kernels run for ``x``: always on a GPU (the reference's host sync could not be
    captured in a CUDA graph), on a CPU where ``fused.use("triton")`` asks for every fused kernel (under
    Triton's interpreter: tests and launch counts of whole layers)."""
    from attnzoo.layers import fused

    return x.is_cuda or fused._triton(x) is not None


# ----------------------------------------------------------------------------------------------
# Fused path (Triton)


@dataclass(frozen=True)
class MoEConfig:
    """Tile shape of the grouped GEMMs (both projections)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


def default_config(num_assignments: int, num_local: int, fp8: bool) -> MoEConfig:
    """Tiles by the mean rows per expert (vLLM's defaults and tuned Hopper tables as the starting point):
    decode-sized groups use short blocks (few padded rows, many programs over N to stream the weights);
    larger groups use square tiles. FP8 block-scaled GEMMs use BLOCK_K = 128, one scale per K step."""
    per_expert = num_assignments / max(num_local, 1)
    bk = 128 if fp8 else 64
    if per_expert <= 16:
        return MoEConfig(16, 64, bk, 1, 4, 4)
    if per_expert <= 48:
        return MoEConfig(32, 128 if fp8 else 64, bk, 8, 4, 4)
    if per_expert <= 192:
        return MoEConfig(64, 128, bk, 8, 4, 3)
    return MoEConfig(128, 128, bk, 16, 8, 3)


# Tuned tiles, as data: one JSON file per GPU written by ``benchmarks/moe.py --sweep``:
#   {"device": "NVIDIA H200", "sm": "90", "configs": {"E=64,N=1408,K=2048,dtype=fp8": {"1": {MoEConfig}, ...}}}
# E = experts held here, N = moe intermediate, K = hidden, the inner keys the token counts M swept.
TILE_TABLES = Path(__file__).with_name("moe_configs")


def tile_key(num_local: int, intermediate: int, hidden: int, dtype: str) -> str:
    return f"E={num_local},N={intermediate},K={hidden},dtype={dtype}"


def gpu_slug(name: str) -> str:
    """A table's file name: "NVIDIA H200" -> "nvidia_h200"."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def check_config(cfg: MoEConfig, fp8: bool, where: str) -> MoEConfig:
    """A tile the kernels can run: powers of two, BLOCK_M >= 16 (tensor-core rows), FP8 K tiles inside one
    128-channel scale group and >= 32 (Triton's smallest K for an 8-bit tl.dot on NVIDIA GPUs)."""
    ints = [cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps, cfg.num_stages]
    pow2 = all(isinstance(v, int) and v > 0 and v & (v - 1) == 0 for v in ints[:5])
    if not (pow2 and isinstance(cfg.num_stages, int) and 1 <= cfg.num_stages <= 8 and cfg.block_m >= 16
            and cfg.block_n >= 16 and cfg.block_k >= 16
            and (not fp8 or (QUANT_GROUP % cfg.block_k == 0 and cfg.block_k >= 32))):
        raise BackendError(f"MoE tile config {cfg} in {where} cannot run", fix=(
            "use powers of two (BLOCK_M/N/K >= 16; FP8 BLOCK_K 32, 64 or 128) and 1-8 stages, or delete the entry "
            "and re-run benchmarks/moe.py --sweep"))
    return cfg


def read_tile_table(path: Path) -> dict:
    """One GPU's table: {"device", "sm", "configs": {key: {M: MoEConfig}}}, every entry checked."""
    try:
        raw = json.loads(path.read_text())
        names = {f.name for f in fields(MoEConfig)}
        configs = {}
        for key, by_m in raw["configs"].items():
            fp8 = key.endswith("dtype=fp8")
            configs[key] = {int(m): check_config(MoEConfig(**{n: c[n] for n in names}), fp8, f"{path} [{key}][{m}]")
                            for m, c in by_m.items()}
        return {"device": str(raw["device"]), "sm": str(raw["sm"]), "configs": configs}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise BackendError(f"MoE tile table {path} is unreadable ({type(e).__name__}: {e})",
                           fix="re-run benchmarks/moe.py --sweep to rewrite it, or delete it") from None


def write_tile_table(path: Path, device_name: str, sm: str, configs: dict[str, dict[int, MoEConfig]]) -> None:
    """Merge ``configs`` ({key: {M: tile}}) into the table at ``path`` (created if absent); entries of the
    same key and M are replaced, the rest kept."""
    merged = read_tile_table(path)["configs"] if path.exists() else {}
    for key, by_m in configs.items():
        for m, c in by_m.items():
            check_config(c, key.endswith("dtype=fp8"), f"{path} [{key}][{m}]")
        merged.setdefault(key, {}).update(by_m)
    body = {key: {str(m): vars(c) for m, c in sorted(by_m.items())} for key, by_m in sorted(merged.items())}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": device_name, "sm": sm, "configs": body}, indent=1) + "\n")
    _tables.cache_clear()


@functools.cache
def _tables(directory: Path) -> tuple[dict, ...]:
    return tuple(read_tile_table(p) for p in sorted(directory.glob("*.json")))


def pick_config(tables, device_name: str, sm: str, key: str, num_tokens: int) -> MoEConfig | None:
    """The tuned tile for ``key`` at ``num_tokens``: from this GPU's table (same device name), else from a
    table of the same architecture (sm); the entry of the nearest swept token count (log scale). None when
    no table has the key."""
    for same in (lambda t: t["device"] == device_name, lambda t: t["sm"] == sm):
        for table in tables:
            by_m = table["configs"].get(key) if same(table) else None
            if by_m:
                return by_m[min(by_m, key=lambda m: (abs(math.log2(m) - math.log2(max(num_tokens, 1))), m))]
    return None


@functools.cache
def _device_ids(device_index: int) -> tuple[str, str]:
    props = torch.cuda.get_device_properties(device_index)
    return props.name, f"{props.major}{props.minor}"


def tile_config(num_tokens: int, top_k: int, num_local: int, hidden: int, intermediate: int, fp8: bool,
                device: torch.device, tables_dir: Path = TILE_TABLES) -> MoEConfig:
    """The grouped GEMMs' tiles for T tokens: a shipped tuned table (``moe_configs/``) where one matches
    this GPU and shape, else ``default_config``."""
    if device.type == "cuda":
        name, sm = _device_ids(device.index if device.index is not None else torch.cuda.current_device())
        key = tile_key(num_local, intermediate, hidden, "fp8" if fp8 else "bf16")
        cfg = pick_config(_tables(tables_dir), name, sm, key, num_tokens)
        if cfg is not None:
            return cfg
    return default_config(num_tokens * top_k, num_local, fp8)


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
                                 BLOCK_M=block_m, BINS=bins, CHUNK=256)
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
                  split_n: int, mul_weight: bool, block=(128, 128)):
    """out[row] = a[row // rows_per_a] @ w[expert]^T (times weights[row], float32 [T*k], if mul_weight):
    both projections pass the same argument types, so they share one compiled kernel."""
    sorted_ids, expert_ids, total = align
    n_out, k_in = w.shape[1], w.shape[2]
    fp8 = w.dtype == FP8
    num_m_blocks = expert_ids.numel()
    grid = (num_m_blocks * _cdiv(n_out, cfg.block_n),)
    dummy = out  # never read when the matching flag is off
    _kernels().gemm_kernel[grid](
        a, w, out, a_scale if fp8 else dummy, w_scale if fp8 else dummy, weights,
        sorted_ids, expert_ids, total,
        n_out, k_in, num_valid, num_m_blocks, split_n, rows_per_a, int(mul_weight),
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        a_scale.stride(0) if fp8 else 0, a_scale.stride(1) if fp8 else 0,
        w_scale.stride(0) if fp8 else 0, w_scale.stride(1) if fp8 else 0, w_scale.stride(2) if fp8 else 0,
        FP8=fp8, IEEE=a.dtype == torch.float32,
        F32_OPERANDS=a.device.type != "cuda",
        GROUP_N=block[0], GROUP_K=block[1],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _act_and_mul(gate_up: torch.Tensor, act: str, quant: bool, dtype, ue8m0: bool = False, limit: float = 0.0):
    """[M, 2I] -> act(gate) * up [M, I] in ``dtype``, or (float8 [M, I], float32 scales [M, groups]) quantized
    as ``fp8.act_quant`` quantizes (the same Triton function, fused here to save a pass over [M, I])."""
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    block, groups = (QUANT_GROUP, GROUPS_PER_PROGRAM) if quant else (1024, 1)
    y = torch.empty(m, inter, dtype=FP8 if quant else dtype, device=gate_up.device)
    s = torch.empty(m, _cdiv(inter, QUANT_GROUP), dtype=torch.float32, device=gate_up.device) if quant else y
    _kernels().act_kernel[(m, _cdiv(inter, block * groups))](
        gate_up, y.view(torch.uint8) if quant else y, s, inter, gate_up.stride(0), y.stride(0), s.stride(0),
        ACT=1 if act == "silu" else 2, QUANT=quant, UE8M0=ue8m0, MIN_AMAX=MIN_AMAX, BLOCK=block, GROUPS=groups,
        LIMIT=float(limit),
    )
    return y, (s if quant else None)


def fused_moe(x, w13, w2, topk_weights, topk_ids, *, act: str = "silu", expert_start: int = 0,
              holds_all_experts: bool = True, w13_scale_inv=None, w2_scale_inv=None, block=(128, 128),
              ue8m0: bool = False, add: torch.Tensor | None = None, config: MoEConfig | None = None,
              swiglu_limit: float = 0.0) -> torch.Tensor:
    """The experts' weighted sum per token through the grouped Triton GEMMs (see the module docstring).

    ``holds_all_experts=False`` (an expert-parallel share): rows of assignments to other ranks' experts
    are zeroed, as no GEMM writes them. FP8 weights (float8_e4m3fn with their ``*_scale_inv``) run w8a8,
    activations quantized by ``fp8.act_quant`` (power-of-two scales under ``ue8m0``, the checkpoint's
    ``scale_fmt``). ``add`` [T, H] (the shared experts' output) is added in the final sum's kernel.
    """
    t, k = topk_ids.shape
    if t == 0:
        return torch.zeros_like(x) if add is None else add.clone()
    if t > MAX_CHUNK_TOKENS:
        return torch.cat([
            fused_moe(x[i : i + MAX_CHUNK_TOKENS], w13, w2, topk_weights[i : i + MAX_CHUNK_TOKENS],
                      topk_ids[i : i + MAX_CHUNK_TOKENS], act=act, expert_start=expert_start,
                      holds_all_experts=holds_all_experts, w13_scale_inv=w13_scale_inv, w2_scale_inv=w2_scale_inv,
                      block=block, ue8m0=ue8m0, add=None if add is None else add[i : i + MAX_CHUNK_TOKENS],
                      config=config, swiglu_limit=swiglu_limit)
            for i in range(0, t, MAX_CHUNK_TOKENS)
        ])
    num_local, inter = w2.shape[0], w2.shape[2]
    fp8 = w13.dtype == FP8
    cfg = config or tile_config(t, k, num_local, x.shape[1], inter, fp8, x.device)
    if fp8 and (block[1] % cfg.block_k or block[1] != QUANT_GROUP):
        raise ModelLoadError(
            f"FP8 MoE needs BLOCK_K ({cfg.block_k}) dividing the weight block's K side ({block[1]}) and a K side of "
            f"{QUANT_GROUP} (the activation group)", fix="use the default MoEConfig and weight_block_size [128, 128]",
        )
    x = x.contiguous()
    align = (align_one_token(topk_ids, cfg.block_m) if t == 1 and holds_all_experts
             else moe_align_block_size(topk_ids, cfg.block_m, num_local, expert_start))
    a, a_scale = act_quant(x, QUANT_GROUP, ue8m0) if fp8 else (x, None)
    # An expert-parallel share leaves other ranks' rows unwritten: zeros, not garbage, for the act kernel to read.
    gate_up = (torch.empty if holds_all_experts else torch.zeros)(t * k, 2 * inter, dtype=x.dtype, device=x.device)
    flat_weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(a, a_scale, w13, w13_scale_inv, gate_up, flat_weights, align, cfg, num_valid=t * k, rows_per_a=k,
                  split_n=inter, mul_weight=False, block=block)
    h, h_scale = _act_and_mul(gate_up, act, fp8, x.dtype, ue8m0, swiglu_limit)
    down = (torch.empty if holds_all_experts else torch.zeros)(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(h, h_scale, w2, w2_scale_inv, down, flat_weights, align, cfg, num_valid=t * k, rows_per_a=1,
                  split_n=w2.shape[1], mul_weight=True, block=block)
    out = torch.empty_like(x)
    add = None if add is None else add.contiguous()
    _kernels().sum_kernel[(t, _cdiv(x.shape[1], 1024))](down, out if add is None else add, out, x.shape[1], TOP_K=k,
                                                       ADD=add is not None, BLOCK=1024)
    return out


# ----------------------------------------------------------------------------------------------
# Module

# The weight format of the FusedMoE layers a model builds unquantized, set by ``build_experts_as``.
_BUILD_AS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("attnzoo_fused_moe_build_as", default=None)


@contextlib.contextmanager
def build_experts_as(**kwargs):
    """FusedMoE layers constructed without ``quant`` inside this block take ``kwargs`` (quant, block, ue8m0)
    instead: an FP8 weight plan builds a model's experts FP8 from the start, so no float copy of an expert
    stack is ever allocated (models.quantization)."""
    token = _BUILD_AS.set(kwargs)
    try:
        yield
    finally:
        _BUILD_AS.reset(token)


# checkpoint projection -> (stacked parameter, which half of w13)
_PROJECTIONS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
_STACKED = {"gate_up_proj": "w13", "down_proj": "w2"}  # transformers' stacked expert tensors (Gemma 4)


class FusedMoE(nn.Module):
    """A layer's routed experts (or the contiguous share ``experts`` of them) as stacked weights.

    forward(x [T, H], topk_weights [T, k] float32, topk_ids [T, k] global ids) -> [T, H]: the fused
    Triton path on CUDA, the per-expert reference elsewhere. Checkpoint tensors reach the stacked
    parameters through ``load_checkpoint_tensor`` (per-expert ``{e}.gate_proj.weight`` / ``up_proj`` /
    ``down_proj`` and their ``.weight_scale_inv``, or stacked ``gate_up_proj`` / ``down_proj``).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str = "silu", *,
                 experts: range | None = None, quant: str | None = None, block=(128, 128), ue8m0: bool = False,
                 init_std: float = 0.02, swiglu_limit: float = 0.0):
        super().__init__()
        build_as = _BUILD_AS.get()
        if quant is None and build_as is not None:
            quant, block, ue8m0 = build_as["quant"], build_as.get("block", block), build_as.get("ue8m0", ue8m0)
        experts = range(num_experts) if experts is None else experts
        if not (isinstance(experts, range) and experts.step == 1 and len(experts)
                and 0 <= experts.start and experts.stop <= num_experts):
            raise ModelLoadError(f"expert share {experts!r} is not a non-empty contiguous range of 0..{num_experts - 1}",
                                 fix="give each rank range(start, stop) of the layer's experts")
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"MoE activation {act!r} is not supported", fix=f"use one of {ACTIVATIONS}")
        if quant not in (None, "fp8"):
            raise ModelLoadError(f"MoE weight format {quant!r} is not supported", fix="use quant=None or 'fp8'")
        self.num_experts, self.hidden, self.intermediate, self.act = num_experts, hidden, intermediate, act
        self.swiglu_limit = float(swiglu_limit or 0.0)  # > 0: gate and up clamped (DeepSeek-V4)
        self.expert_start, self.num_local = experts.start, len(experts)
        self.quant, self.block = quant, tuple(block)
        self.ue8m0 = bool(quant) and ue8m0  # FP8 activation scales rounded up to powers of two (scale_fmt)
        shapes = {"w13": (self.num_local, 2 * intermediate, hidden), "w2": (self.num_local, hidden, intermediate)}
        for name, shape in shapes.items():
            if quant is None:
                # Initialised (not torch.empty) so that load_format="random" models compute finite numbers.
                setattr(self, name, nn.Parameter(torch.empty(shape).normal_(0, init_std)))
            else:
                # Random FP8 codes drawn for the whole stack at once, on its device, and block multipliers
                # giving the float experts' spread (init_std): no float copy of the stack, no loop over experts.
                setattr(self, name, nn.Parameter(random_codes_(torch.empty(shape, dtype=FP8)), requires_grad=False))
                setattr(self, name + "_scale_inv", nn.Parameter(
                    torch.full(self._scale_shape(name), init_std / CODE_RMS, dtype=torch.float32), requires_grad=False))
        self._loaded: set[tuple[str, int, int]] = set()

    def _scale_shape(self, name: str) -> tuple[int, int, int]:
        bn, bk = self.block
        if name == "w13":
            return self.num_local, 2 * _cdiv(self.intermediate, bn), _cdiv(self.hidden, bk)
        return self.num_local, _cdiv(self.hidden, bn), _cdiv(self.intermediate, bk)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) must neither widen the FP8 weights nor round their float32 multipliers: what a
        # conversion changed the dtype of is put back from the original (moved to the new device).
        kept = {n: getattr(self, n).data for n in ("w13", "w2", "w13_scale_inv", "w2_scale_inv")} if self.quant else {}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            p = getattr(self, name)
            if p.dtype != before.dtype:
                p.data = before.to(p.device)
        return self

    def extra_repr(self) -> str:
        share = f"experts {self.expert_start}..{self.expert_start + self.num_local - 1} of {self.num_experts}"
        quant = f"{self.quant}, ue8m0 scales" if self.ue8m0 else self.quant
        return f"{share}, hidden={self.hidden}, intermediate={self.intermediate}, act={self.act}, quant={quant}"

    @property
    def share(self) -> range:
        """The global ids of the experts held here (this rank's share under expert parallelism)."""
        return range(self.expert_start, self.expert_start + self.num_local)

    def holds(self, expert: int) -> bool:
        """Whether expert ``expert`` (global id) is held here: the one place that says which rank owns it
        (checkpoint loaders ask this before reading or dequantizing an expert's tensors)."""
        return self.expert_start <= expert < self.expert_start + self.num_local

    def _weights(self) -> dict:
        if self.quant is None:
            return {}
        return {"w13_scale_inv": self.w13_scale_inv, "w2_scale_inv": self.w2_scale_inv, "block": self.block,
                "ue8m0": self.ue8m0}

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                add: torch.Tensor | None = None) -> torch.Tensor:
        """-> the experts' weighted sum per token [T, H], plus ``add`` [T, H] (the shared experts' output;
        the same kernel on a GPU)."""
        if _fused_triton(x):
            return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, act=self.act,
                             expert_start=self.expert_start, holds_all_experts=self.num_local == self.num_experts,
                             add=add, swiglu_limit=self.swiglu_limit, **self._weights())
        # FP8 on CPU: the w8a8 arithmetic in float32, as Fp8Linear's CPU emulation.
        out = moe_reference(x, self.w13, self.w2, topk_weights, topk_ids, act=self.act,
                            expert_start=self.expert_start, quantize_activations=self.quant == "fp8",
                            swiglu_limit=self.swiglu_limit, **self._weights())
        return out if add is None else out + add

    # -- loading --------------------------------------------------------------------------------

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor, *, full_name: str | None = None) -> None:
        """Copy one checkpoint tensor (``name`` relative to this module) into its slice of the stacked
        parameters; tensors of experts held by other ranks are skipped."""
        full_name = full_name or name
        parts = name.split(".")
        if len(parts) == 1 and parts[0] in _STACKED:
            param = _STACKED[parts[0]]
            if tensor.shape[0] != self.num_experts:
                raise WeightError(f"stacked expert tensor {full_name!r} has {tensor.shape[0]} experts, expected "
                                  f"{self.num_experts}", fix="the checkpoint does not match its config.json")
            self._check_format(full_name, tensor, False)
            share = tensor[self.expert_start : self.expert_start + self.num_local]
            self._copy(getattr(self, param), share, full_name)
            halves = (0, 1) if param == "w13" else (0,)
            self._loaded.update((param, e, h) for e in range(self.num_local) for h in halves)
            return
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in _PROJECTIONS \
                or parts[2] not in ("weight", "weight_scale_inv"):
            raise WeightError(f"checkpoint tensor {full_name!r} is not an expert weight",
                              fix="check that config.json's architectures matches the weights")
        expert = int(parts[0])
        if expert >= self.num_experts:
            raise WeightError(f"checkpoint tensor {full_name!r} names expert {expert} of {self.num_experts}",
                              fix="the checkpoint does not match its config.json (n_routed_experts)")
        if not self.holds(expert):
            return
        e = expert - self.expert_start
        param, half = _PROJECTIONS[parts[1]]
        scale = parts[2] == "weight_scale_inv"
        self._check_format(full_name, tensor, scale)
        if scale:
            param += "_scale_inv"
        dst = getattr(self, param)[e]
        if param.startswith("w13"):
            rows = dst.shape[0] // 2
            dst = dst[half * rows : (half + 1) * rows]
        self._copy(dst, tensor, full_name)
        self._loaded.add((param, e, half))

    def _check_format(self, full_name: str, tensor: torch.Tensor, scale: bool) -> None:
        fp8 = self.quant == "fp8"
        if (scale and not fp8) or (not scale and fp8 != (tensor.dtype == FP8)):
            raise WeightError(
                f"expert tensor {full_name!r} ({tensor.dtype}) does not fit experts built "
                f"{'FP8 block-quantized' if fp8 else 'unquantized'}",
                fix="build the MoE with quant='fp8' for an FP8 block-quantized checkpoint, quant=None otherwise",
            )

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, full_name: str) -> None:
        if tuple(src.shape) != tuple(dst.shape):
            raise WeightError(f"weight {full_name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}",
                              fix="the checkpoint does not match its config.json; re-export it")
        with torch.no_grad():
            dst.copy_(src.to(dst.dtype))

    def loaded_parameters(self) -> list[str]:
        """Names of the parameters every slice of which has been loaded."""
        names = ["w13", "w2"] + (["w13_scale_inv", "w2_scale_inv"] if self.quant else [])
        return [n for n in names
                if all((n, e, h) in self._loaded for e in range(self.num_local) for h in ((0, 1) if n.startswith("w13") else (0,)))]
