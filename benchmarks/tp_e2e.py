"""End-to-end throughput at tensor parallel 1 and 2 on the GSM8K-shaped workload of ``e2e.py``.

Workload: the GSM8K 8-shot prompts (pre-tokenised, 1313-token shared prefix), ``--new-tokens`` output
tokens each with EOS ignored, random bf16 weights (``load_model(load_format="random")``). Each
(shape, TP) pair loads the model with ``tensor_parallel_size=TP`` from this process (rank 0; the other
ranks are spawned), warms up, runs the workload once and records output tokens/s, TTFT, TPOT, the KV
capacity (tokens per rank: every rank holds the same token count for its own heads), KV bytes per token
per rank, rank 0's peak memory, each GPU's used memory (device-wide, all ranks), the weights' format
(``--weights fp8``: which layers hold FP8 block shards per rank) and the CUDA-graph/eager step counts,
and the roofline fraction: ``e2e.py``'s estimate for one rank's share of the schedule (its dense shard,
the experts of its own it can touch per step, its KV heads) over the measured time; the collectives'
time is not in the estimate.

Shapes: e2e.py's (one table: ``--shape`` takes any of its names), e.g. ``llama70b`` (Llama-3.1-70B: 80
layers, 64 heads / 8 KV heads; does not fit one GPU with a useful KV cache, so run it at TP 2),
``gemma4-31b`` (google/gemma-4-31B-it's text model), ``dsv3`` (DeepSeek-V3: MLA, 256 experts top-8).

    python benchmarks/tp_e2e.py --shape gemma4-31b --tp 1,2 --out benchmarks/results/tp_e2e_gemma4_31b_2xh200
    python benchmarks/tp_e2e.py --shape llama70b --tp 2 --out benchmarks/results/tp_e2e_llama70b_2xh200
    python benchmarks/tp_e2e.py --shape dsv3 --weights fp8 --tp 8 --out benchmarks/results/tp_e2e_dsv3_fp8_8xh200
    python benchmarks/tp_e2e.py --shape dsv3 --layers 8 --weights fp8 --tp 2 ...   # reduced depth on 2 GPUs

Every run prints load_model's phases as they end (build: random weights drawn on each rank's GPU; KV cache:
rank 0 also waits there for the slowest rank; CUDA graphs: capture and the decode kernels' JIT), then the
first generate's time (the prefill kernels' JIT) and whether the first decode step's logits are finite.
``--dry-run`` stops there (no workload, no roofline measurement): where a short GPU call's minutes go.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from common import git_sha, source_hash, versions  # noqa: E402
from e2e import FP8_BLOCK_CONFIG, SHAPE_NAMES, load_timings, timed_generate, warm_up  # noqa: E402
from e2e import make_config as e2e_make_config  # noqa: E402

from attnzoo.roofline import device_limits, model_profile, roofline_seconds  # noqa: E402

LABELS = {"llama70b": "Llama-3.1-70B-shaped", "gemma4-31b": "Gemma-4-31B-shaped (text model)",
          "dsv3": "DeepSeek-V3-shaped (MLA, 256 experts top-8)"}


def make_config(shape: str, layers: int | None):
    """The same shapes as e2e.py (one definition of each)."""
    config, _ = e2e_make_config(shape, layers)
    label = LABELS.get(shape, f"{shape}-shaped")
    return config, label + (f", {layers} layers" if layers else "")


def rank_profile(llm, tp: int) -> dict:
    """e2e.py's roofline inputs for one rank: its weights as loaded (dense shards, its E/tp experts), and
    top_k scaled alike, so that an expert is touched with the unsplit model's probability k/E."""
    prof = model_profile(llm)
    if prof["num_experts"]:
        prof["num_experts"] /= tp
        prof["top_k"] /= tp
    return prof


def gpu_used_gib() -> list[float]:
    """Each visible GPU's used memory, device-wide (every rank's process, allocator caches included), from
    NVML where it is installed (mem_get_info would open a CUDA context of this process on every GPU)."""
    out = []
    for i in range(torch.cuda.device_count()):
        try:
            used = torch.cuda.device_memory_used(i)
        except Exception:  # no NVML bindings (nvidia-ml-py)
            free, total = torch.cuda.mem_get_info(i)
            used = total - free
        out.append(round(used / 2**30, 2))
    return out


def run(config, prompts, *, tp: int, new_tokens: int, backend: str | None, max_running: int, limits: dict,
        dry_run: bool = False) -> dict:
    import attnzoo

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t_load = time.perf_counter()
    llm = attnzoo.load_model(config, load_format="random", backend=backend, dtype="bfloat16", device="cuda",
                             max_running=max_running, tensor_parallel_size=tp, progress=True)
    load_s = time.perf_counter() - t_load
    try:
        timings = load_timings(llm, load_s)
        weights = llm.info()["weights"]
        for key in ("dequantized_at_load", "split_blocks"):  # FP8 runs: every FP8 layer stays FP8 on every rank
            if key in weights:
                raise SystemExit(f"{key}: {weights[key]}")
        timings.update(warm_up(llm, prompts, full=False))  # kernels compile (the full pass evicts rank 0's cache)
        if dry_run:
            info = llm.info()
            return {"tensor_parallel_size": tp, "dry_run": True, **timings, "prefill_backend": info["prefill_backend"],
                    "decode_backend": info["decode_backend"], "kv_cache_tokens": info["kv_cache_tokens"],
                    "rank0_peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "gpu_used_gib": gpu_used_gib(),
                    "weights": weights}
        outs, wall, _ = timed_generate(llm, prompts, new_tokens)
        n_out = sum(len(o.token_ids) for o in outs)
        ttft = [o.time_to_first_token for o in outs]
        tpot = [(o.latency - o.time_to_first_token) / max(1, len(o.token_ids) - 1) for o in outs]
        # The measurement first, in case what follows does not finish within a short GPU call (the 2x H200
        # DeepSeek-V3 run of session 6 generated, then was cut before its results were written).
        print(f"tp {tp}: measured " + json.dumps({"output_tok_per_s": n_out / wall, "wall_s": wall,
                                                  "ttft_mean_s": statistics.mean(ttft),
                                                  "tpot_mean_ms": 1e3 * statistics.mean(tpot)}), flush=True)
        info = llm.info()
        print(f"tp {tp}: info read; roofline and memory next", flush=True)
        prof = rank_profile(llm, tp)
        roof = roofline_seconds(llm.engine.step_log, prof, limits)
        return {
            "tensor_parallel_size": tp, "prefill_backend": info["prefill_backend"],
            "decode_backend": info["decode_backend"], "page_size": info["page_size"], "cascade": info["cascade"],
            "prompts": len(prompts), "output_tokens": n_out, "wall_s": wall, "output_tok_per_s": n_out / wall,
            "ttft_mean_s": statistics.mean(ttft), "tpot_mean_ms": 1e3 * statistics.mean(tpot),
            "kv_cache_tokens": info["kv_cache_tokens"], "kv_bytes_per_token_per_rank": info["kv_bytes_per_token"],
            "rank0_peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "load_s": load_s,
            "gpu_used_gib": gpu_used_gib(), "weights": weights,
            "rank_weights_gib": (prof["dense_bytes"] + prof["expert_bytes"]) / 2**30,
            "roofline_s": roof, "roofline_fraction": roof / wall, "steps": len(llm.engine.step_log),
            "graph_steps": llm.engine.graph_stats["replayed"], "eager_steps": llm.engine.graph_stats["eager"],
            "max_running": max_running, "decision_profile": info["decision"]["profile"], **timings,
        }
    finally:
        print(f"tp {tp}: closing the model", flush=True)
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPE_NAMES, required=True)
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes to run, comma-separated")
    ap.add_argument("--out", required=True, help="output path prefix: writes PREFIX.json")
    ap.add_argument("--backend", default=None, help="attention backend (default: the policy's)")
    ap.add_argument("--prompts", type=int, default=1319)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-running", type=int, default=None, help="default: the engine's (sized from the KV cache)")
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                    help="fp8: DeepSeek-V3's block-scaled FP8 format (as e2e.py --weights fp8)")
    ap.add_argument("--layers", type=int, default=None, help="reduce depth (a quick check of the setup)")
    ap.add_argument("--dry-run", action="store_true",
                    help="load and warm up only: each load phase's time, the first generate's (JIT), the logits check")
    args = ap.parse_args()

    config, label = make_config(args.shape, args.layers)
    if args.weights == "fp8":
        config.quantization_config = dict(FP8_BLOCK_CONFIG)
    data = json.loads((Path(__file__).parent / "data" / "gsm8k_8shot_tokens.json").read_text())
    prompts = [data["prefix"] + q for q in data["questions"]][: args.prompts]
    results = []
    limits = {} if args.dry_run else device_limits()
    for tp in (int(t) for t in args.tp.split(",")):
        r = run(config, prompts, tp=tp, new_tokens=args.new_tokens, backend=args.backend, max_running=args.max_running,
                limits=limits, dry_run=args.dry_run)
        print(json.dumps({k: v for k, v in r.items() if k != "decision_profile"}), flush=True)
        results.append(r)
    base = next((r for r in results if r["tensor_parallel_size"] == 1), None)
    for r in results:
        if base is not None and not args.dry_run:
            r["speedup_vs_tp1"] = r["output_tok_per_s"] / base["output_tok_per_s"]
            r["kv_capacity_vs_tp1"] = r["kv_cache_tokens"] / base["kv_cache_tokens"]

    meta = {"device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}", **versions(), "git_sha": git_sha(), "source_hash": source_hash(), "limits": limits,
            "model": f"{label}, random {args.weights} weights", "config": config.to_dict(),
            "workload": f"{len(prompts)} GSM8K 8-shot prompts ({len(data['prefix'])}-token shared prefix), "
                        f"{args.new_tokens} output tokens each, EOS ignored"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2, default=str))
    if args.dry_run:
        return
    print(f"\n{label}, {meta['device']}")
    print(f"{'TP':>3s} {'decode':>12s} {'tok/s':>9s} {'x TP1':>6s} {'TTFT s':>7s} {'TPOT ms':>8s} {'KV tokens':>10s} "
          f"{'peak GiB':>8s} {'roofline':>8s}  GPU used GiB")
    for r in results:
        print(f"{r['tensor_parallel_size']:3d} {r['decode_backend']:>12s} {r['output_tok_per_s']:9.0f} "
              f"{r.get('speedup_vs_tp1', float('nan')):6.2f} {r['ttft_mean_s']:7.2f} {r['tpot_mean_ms']:8.1f} "
              f"{r['kv_cache_tokens']:10d} {r['rank0_peak_mem_gib']:8.1f} {r['roofline_fraction']:8.2f}  "
              f"{r['gpu_used_gib']}")
        print(f"    weights: {r['weights']}")


if __name__ == "__main__":
    main()
