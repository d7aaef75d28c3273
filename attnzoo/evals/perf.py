"""What a run cost and where it ran from: latency distributions, throughput per phase, memory, the engine's
state, and the provenance of the code and the checkpoint (for the report's ``performance`` and ``provenance``)."""
from __future__ import annotations

import hashlib
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

# Bytes read from each end of a weights file for the checkpoint's content hash: enough to tell two
# checkpoints apart (headers, first and last tensors) without reading gigabytes.
_HASH_EDGE = 1 << 20


def distribution(values: list[float]) -> dict[str, float] | None:
    """mean / p50 / p90 / p99 / max of ``values`` (None when there are none)."""
    if not values:
        return None
    v = np.asarray(values, dtype=float)
    return {"n": int(v.size), "mean": float(v.mean()), "p50": float(np.percentile(v, 50)),
            "p90": float(np.percentile(v, 90)), "p99": float(np.percentile(v, 99)), "max": float(v.max())}


def phase_throughput(step_log: list[dict] | None, t0: float | None) -> dict[str, Any]:
    """Prefill and decode throughput apart, from the engine's per-step log: a step that carries any
    prompt tokens (more new tokens than requests) counts as prefill, with the decode rows batched into it;
    steps of decode rows only count as decode. A step's time is from the previous step's tokens reaching
    the host (or ``t0``) to its own."""
    out = {"prefill_tokens": 0, "prefill_s": 0.0, "decode_tokens": 0, "decode_s": 0.0, "steps": 0}
    last = t0
    for step in step_log or []:
        dt = 0.0 if last is None else max(0.0, step["t"] - last)
        last = step["t"]
        out["steps"] += 1
        phase = "prefill" if step["new_tokens"] > step["num_reqs"] else "decode"
        out[f"{phase}_tokens"] += step["new_tokens"]
        out[f"{phase}_s"] += dt
    for phase in ("prefill", "decode"):
        s = out[f"{phase}_s"]
        out[f"{phase}_tokens_per_s"] = out[f"{phase}_tokens"] / s if s > 0 else None
    return out


def peak_memory(device: str) -> dict[str, Any]:
    """The device's peak allocated memory (CUDA) and this process's peak resident memory."""
    out: dict[str, Any] = {}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out["host_peak_rss_gib"] = round(rss / (2**30 if sys.platform == "darwin" else 2**20), 3)  # bytes on macOS, KiB on Linux
    if str(device).startswith("cuda"):
        import torch

        out["gpu_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        out["gpu_peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
    return out


def engine_state(info: dict) -> dict[str, Any]:
    """The KV capacity and the engine's settings that decide its speed (from LLM.info())."""
    keys = ("kv_cache_tokens", "kv_cache_pages", "page_size", "kv_dtype", "kv_cache_dtype", "kv_bytes_per_token",
            "max_running", "context_len", "cuda_graph", "cascade", "tensor_parallel_size", "weights", "load_timings")
    return {k: info.get(k) for k in keys}


def performance(records, info: dict, step_log: list[dict] | None, t0: float | None) -> dict[str, Any]:
    """Per-request TTFT and TPOT distributions, phase throughput, peak memory and the engine state."""
    ttft = [r.ttft_s for r in records if getattr(r, "ttft_s", None) is not None]
    # time per output token after the first: (last token - first token) / (tokens - 1)
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in records
            if getattr(r, "latency_s", None) is not None and r.output_tokens > 1]
    return {"ttft_s": distribution(ttft), "tpot_s": distribution(tpot),
            "throughput": phase_throughput(step_log, t0), "memory": peak_memory(info["device"]),
            "engine": engine_state(info)}


# ------------------------------------------------------------------------------------------ provenance


def git_commit(path: Path | None = None) -> dict[str, Any] | None:
    """The git commit of the attnzoo source tree and whether it had changes (None outside a checkout)."""
    root = path or Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None}


def checkpoint_identity(directory: Path | None, gguf_file: str | None = None) -> dict[str, Any]:
    """The checkpoint's hub revision (a snapshot folder's name) and a content hash: sha256 over
    config.json, generation_config.json, the tokenizer's files, and each weights file's size and its first
    and last MiB (named ``content_sha256_edges``: not a hash of every byte)."""
    if directory is None:
        return {"path": None, "revision": None, "content_sha256_edges": None}
    directory = Path(directory).resolve()
    revision = directory.name if directory.parent.name == "snapshots" else None
    h = hashlib.sha256()
    small = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    weights = sorted(p for p in directory.iterdir() if p.is_file() and (
        p.suffix in (".safetensors", ".bin", ".gguf", ".pt") and (gguf_file is None or p.name == gguf_file)))
    for name in small:
        p = directory / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes())
    for p in weights:
        size = p.stat().st_size
        h.update(f"{p.name}\0{size}\0".encode())
        with open(p, "rb") as fh:
            h.update(fh.read(_HASH_EDGE))
            if size > _HASH_EDGE:
                fh.seek(max(_HASH_EDGE, size - _HASH_EDGE))
                h.update(fh.read())
    return {"path": str(directory), "revision": revision, "content_sha256_edges": h.hexdigest(),
            "weights_files": [p.name for p in weights]}
