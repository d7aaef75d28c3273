"""How the decode kernels are launched: stage 1's tiles, how many KV splits, the cascade's shared-pass tiles,
and (``fill_waves``) a narrower stage-1 tile where the default's programs would leave the GPU's last wave of
resident programs mostly empty. Host-side decisions only; the kernels are in ``decode``."""
from __future__ import annotations

import functools

import torch

from attnzoo.attention.kernels.common import MIN_TILE, OutOfResources, head_dim_tiles, resident_ctas, value_tile
from attnzoo.attention.kernels.extend import extend_launch_config

MAX_KV_SPLITS = 64
# The fewest keys a split takes (min_split_keys may ask more): 256 held Gemma-4-31B's 1024-key windows to 4 splits
MIN_TOKENS_PER_SPLIT = 64
# Stage-1 tiles tried beside the default (``fill_waves``): 32 keys a step take fewer registers than 64, so
# more programs share an SM; the default keeps a batch whose programs fill their waves.
WAVE_TILE_N = 32
WAVE_TILES = ({"BLOCK_N": WAVE_TILE_N, "num_stages": 2}, {"BLOCK_N": WAVE_TILE_N, "num_stages": 3})
WAVE_GAIN = 1.1


@functools.cache  # callers copy the dict before changing it
def decode_launch_config(head_dim: int, v_head_dim: int, group: int, dtype: torch.dtype) -> dict:
    """Tile sizes for stage 1, tuned on an H100 for KV bandwidth, which bounds the kernel
    (benchmarks/attention_triton.py). Smaller GPUs shrink them at launch (``common.launch``)."""
    bd, bdr = head_dim_tiles(head_dim)
    width = bd + bdr + value_tile(v_head_dim)
    block_h = MIN_TILE if group <= MIN_TILE else min(64, 1 << (group - 1).bit_length())
    if width <= 256:
        block_n, warps, stages = 64, 4, 1
    elif width <= 512:
        block_n, warps, stages = 32, 4, 2
    else:
        block_n, warps, stages = 32, 4, 3
    if block_h > MIN_TILE:  # MLA-like groups: 64 heads x 512 channels of accumulator
        warps, stages = 8, 2
    if dtype == torch.float32:
        block_n = max(MIN_TILE, block_n // 2)
    return {"BLOCK_H": block_h, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}


def cascade_own_launch_config(head_dim: int, v_head_dim: int, group: int, dtype: torch.dtype) -> dict | None:
    """Stage 1's tiles over each request's own keys after a cascade's shared prefix: spans of tens to hundreds
    of keys, one program each, in many waves. For widths up to 256, the wave tile (32 keys, 2 stages, loads
    pipelined) in place of the default's 64 in 1: at 1319 requests on an H200, 72 own keys 187 -> 131 us, 200 own
    keys 357 -> 285 us (benchmarks/results/cascade_sdpa_nvidia_h200.txt). ``None``: stage 1's own choice, where
    its default is not 64 keys in one stage (wider heads, MLA-like groups, float32)."""
    cfg = decode_launch_config(head_dim, v_head_dim, group, dtype)
    if cfg["BLOCK_N"] <= WAVE_TILE_N or cfg["num_stages"] > 1:
        return None
    return dict(cfg, **WAVE_TILES[0])


def min_split_keys(group: int, v_dim: int, key_bytes: int) -> int:
    """The fewest keys a split takes: MIN_TOKENS_PER_SPLIT, or as many as it takes to read as many bytes as the
    float32 partials it leaves the merge (``group`` x ``v_dim`` a KV head; ``key_bytes`` of KV a key and KV head).
    DeepSeek-V3's MLA (128 heads of 512 values, 1152 bytes a key) needs 228."""
    return max(MIN_TOKENS_PER_SPLIT, -(-group * v_dim * 4 // key_bytes))


def choose_num_kv_splits(
    *, batch: int, num_kv_heads: int, group: int, max_kv_len: int, num_sms: int, block_h: int = MIN_TILE,
    min_split: int = MIN_TOKENS_PER_SPLIT,
) -> int:
    """How many KV splits make ``batch`` decode programs fill ``num_sms`` multiprocessors, none of fewer than
    ``min_split`` keys (host ints only)."""
    head_blocks = -(-group // block_h)
    programs = batch * num_kv_heads * head_blocks
    want = -(-2 * num_sms // programs)
    longest = max(1, max_kv_len // min_split)
    return max(1, min(want, longest, MAX_KV_SPLITS))


def layer_kv_splits(*, batch: int, heads: int, num_kv_heads: int, head_dim: int, v_dim: int, values_in_keys: bool,
                    dtype: torch.dtype, max_kv_len: int, num_sms: int) -> int:
    """``choose_num_kv_splits`` for one attention layer's caches (stage 1's head tile, a key's bytes; MLA's values
    are the keys' first channels, ``values_in_keys``)."""
    group = heads // num_kv_heads
    block_h = decode_launch_config(head_dim, v_dim, group, dtype)["BLOCK_H"]
    key_bytes = (head_dim + (0 if values_in_keys else v_dim)) * dtype.itemsize
    return choose_num_kv_splits(batch=batch, num_kv_heads=num_kv_heads, group=group, max_kv_len=max_kv_len,
                                num_sms=num_sms, block_h=block_h, min_split=min_split_keys(group, v_dim, key_bytes))


def choose_num_shared_splits(
    *, batch: int, num_kv_heads: int, group: int, shared_len: int, num_sms: int, block_m: int,
    max_splits: int = MAX_KV_SPLITS,
) -> int:
    """How many splits of the shared prefix make the cascade's shared pass fill ``num_sms``
    multiprocessors: it runs ceil(batch * group / block_m) row blocks per KV head (host ints only)."""
    row_blocks = -(-batch * group // block_m)
    splits = choose_num_kv_splits(batch=row_blocks, num_kv_heads=num_kv_heads, group=1, block_h=1,
                                  max_kv_len=shared_len, num_sms=num_sms)
    return max(1, min(splits, max_splits))


@functools.cache  # read per layer and step; callers copy the dict before changing it
def cascade_launch_config(head_dim: int, v_head_dim: int, dtype: torch.dtype) -> dict:
    """Tiles of the cascade's shared pass. Its rows are (request, group head) pairs over the same keys,
    as extend's are (token, group head) pairs: extend's tiles, whatever the batch, but for widths up to 128
    64 rows in 2 stages, the sweep's best at large batches (benchmarks/results/cascade_sweep_nvidia_h100.txt).
    A BLOCK_M narrowed to small batches compiled a variant mid-run whenever the batch crossed a class, and
    measured no faster at 2-16 requests (benchmarks/results/cascade_tiles_nvidia_h100.txt)."""
    cfg = dict(extend_launch_config(head_dim, v_head_dim, dtype))
    bd, bdr = head_dim_tiles(head_dim)
    if max(bd + bdr, value_tile(v_head_dim)) <= 128 and dtype != torch.float32:
        cfg.update(BLOCK_M=64, num_stages=2)
    return cfg


def wave_fill(programs: int, slots: int) -> float:
    """The share of the launched waves' program slots that ``programs`` fill (the last wave may be part-empty)."""
    return programs / (-(-programs // slots) * slots)


# (kernel, device, dtypes, constexprs, default config, programs) -> the config launched; and
# (kernel, device, dtypes, constexprs, config) -> programs an SM holds (None: the config does not fit the GPU)
_WAVE_PICKS: dict[tuple, dict] = {}
_RESIDENT: dict[tuple, int | None] = {}


def fill_waves(kernel, grid, args, constexprs: dict, cfg: dict, programs: int) -> dict:
    """The default tile, or a narrower one where the default's programs spill into a mostly empty last wave
    that the narrower tile's (more of them fit an SM) avoid: stage 1 is bound by KV bandwidth only while every
    SM streams (benchmarks/results/decode_splits_nvidia_h100.json). Decided once per shape and program count;
    each tile's occupancy is read once per shape, at its first launch."""
    q, k_cache = args[0], args[1]
    shape = (id(kernel), q.device.index, q.dtype, k_cache.dtype, tuple(constexprs.values()))
    key = (*shape, tuple(cfg.items()), programs)
    if key in _WAVE_PICKS:
        return _WAVE_PICKS[key]

    def slots(c: dict) -> int | None:
        rkey = (*shape, tuple(c.items()))
        if rkey not in _RESIDENT:
            try:
                _RESIDENT[rkey] = resident_ctas(kernel, grid, args, constexprs, c)
            except OutOfResources:  # a GPU with less shared memory: launch() shrinks the default as before
                _RESIDENT[rkey] = None
        n = _RESIDENT[rkey]
        return None if n is None else n * torch.cuda.get_device_properties(q.device).multi_processor_count

    best, base = cfg, slots(cfg)
    # Every candidate is compiled at the shape's first launch (load's graph captures, the warm-up), not when a
    # batch first spills a wave in the middle of a run, where a compile stalls every request for its seconds.
    alts = [(c, slots(c)) for c in (dict(cfg, **alt) for alt in WAVE_TILES)] if base is not None else []
    if base is not None and programs > base:
        best_fill = wave_fill(programs, base)
        for c, n in alts if best_fill < 1 / WAVE_GAIN else ():
            if n is not None and wave_fill(programs, n) > best_fill * WAVE_GAIN:
                best, best_fill = c, wave_fill(programs, n)
    _WAVE_PICKS[key] = best
    return best
