"""The grouped GEMMs' tiles: ``MoEConfig``, the defaults by rows per expert, and the per-GPU tuned tables
(``attnzoo/layers/moe_configs/``, written by ``benchmarks/moe.py --sweep``) read and written as data."""
from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from attnzoo.errors import BackendError
from attnzoo.layers.fp8 import GROUP as QUANT_GROUP


@dataclass(frozen=True)
class MoEConfig:
    """Tile shape of the grouped GEMMs (both projections)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


WEIGHT_FORMATS = ("bf16", "fp8", "mxfp4")  # the experts' stored format: the tables' "dtype=" and the kernel branch


def weight_format(fmt) -> str:
    """A weight format name; True / False (the former ``fp8`` flag) are "fp8" / "bf16"."""
    if isinstance(fmt, bool):
        return "fp8" if fmt else "bf16"
    if fmt not in WEIGHT_FORMATS:
        raise BackendError(f"MoE weight format {fmt!r} is unknown", fix=f"use one of {WEIGHT_FORMATS}")
    return fmt


def default_config(num_assignments: int, num_local: int, fp8) -> MoEConfig:
    """Tiles by the mean rows per expert (vLLM's defaults and tuned Hopper tables as the starting point):
    decode-sized groups use short blocks (few padded rows, many programs over N to stream the weights);
    larger groups use square tiles. FP8 block-scaled GEMMs use BLOCK_K = 128, one scale per K step; MXFP4
    too (64 bytes of a weight row per K step, four E8M0 scales). ``fp8``: a weight format or the FP8 flag."""
    fmt = weight_format(fp8)
    fp8 = fmt == "fp8"
    per_expert = num_assignments / max(num_local, 1)
    bk = 64 if fmt == "bf16" else 128
    if per_expert < 1 and fmt == "bf16":
        # Decode's few tokens: each chosen expert's block holds a row or two, and the GEMM only streams its
        # weights; long K steps stream them faster (batch-1 e2e, results/batch1_mla_absorb_moe_gated_*).
        return MoEConfig(16, 64, 256, 1, 4, 3)
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
TILE_TABLES = Path(__file__).resolve().parents[1] / "moe_configs"


def tile_key(num_local: int, intermediate: int, hidden: int, dtype: str) -> str:
    return f"E={num_local},N={intermediate},K={hidden},dtype={dtype}"


def gpu_slug(name: str) -> str:
    """A table's file name: "NVIDIA H200" -> "nvidia_h200"."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def check_config(cfg: MoEConfig, fp8, where: str) -> MoEConfig:
    """A tile the kernels can run: powers of two, BLOCK_M >= 16 (tensor-core rows), FP8 K tiles inside one
    128-channel scale group and >= 32 (Triton's smallest K for an 8-bit tl.dot on NVIDIA GPUs), MXFP4 K
    tiles whole 32-value scale groups. ``fp8``: a weight format or the FP8 flag."""
    fmt = weight_format(fp8)
    fp8 = fmt == "fp8"
    ints = [cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps, cfg.num_stages]
    pow2 = all(isinstance(v, int) and v > 0 and v & (v - 1) == 0 for v in ints[:5])
    if not (pow2 and isinstance(cfg.num_stages, int) and 1 <= cfg.num_stages <= 8 and cfg.block_m >= 16
            and cfg.block_n >= 16 and cfg.block_k >= 16
            and (not fp8 or (QUANT_GROUP % cfg.block_k == 0 and cfg.block_k >= 32))
            and (fmt != "mxfp4" or cfg.block_k >= 32)):
        raise BackendError(f"MoE tile config {cfg} in {where} cannot run", fix=(
            "use powers of two (BLOCK_M/N/K >= 16; FP8 BLOCK_K 32, 64 or 128; MXFP4 BLOCK_K >= 32) and 1-8 stages, "
            "or delete the entry "
            "and re-run benchmarks/moe.py --sweep"))
    return cfg


def _key_format(key: str) -> str:
    return next((f for f in WEIGHT_FORMATS if key.endswith(f"dtype={f}")), "bf16")


def read_tile_table(path: Path) -> dict:
    """One GPU's table: {"device", "sm", "configs": {key: {M: MoEConfig}}}, every entry checked."""
    try:
        raw = json.loads(path.read_text())
        names = {f.name for f in fields(MoEConfig)}
        configs = {}
        for key, by_m in raw["configs"].items():
            fmt = _key_format(key)
            configs[key] = {int(m): check_config(MoEConfig(**{n: c[n] for n in names}), fmt, f"{path} [{key}][{m}]")
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
            check_config(c, _key_format(key), f"{path} [{key}][{m}]")
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


def tile_config(num_tokens: int, top_k: int, num_local: int, hidden: int, intermediate: int, fp8,
                device: torch.device, tables_dir: Path = TILE_TABLES) -> MoEConfig:
    """The grouped GEMMs' tiles for T tokens: a shipped tuned table (``moe_configs/``) where one matches
    this GPU and shape, else ``default_config``. ``fp8``: the weight format ("bf16", "fp8", "mxfp4") or
    the FP8 flag."""
    fp8 = weight_format(fp8)
    if device.type == "cuda":
        name, sm = _device_ids(device.index if device.index is not None else torch.cuda.current_device())
        key = tile_key(num_local, intermediate, hidden, fp8)
        cfg = pick_config(_tables(tables_dir), name, sm, key, num_tokens)
        if cfg is not None:
            return cfg
    return default_config(num_tokens * top_k, num_local, fp8)
