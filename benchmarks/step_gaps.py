"""Where the GPU idles between decode steps at small batch: a torch-profiler trace of N decode steps, its
GPU idle gaps, and the host work that runs during them (what the next kernel waited for).

    python benchmarks/step_gaps.py --shape llama8b --prompts 1 --steps 32 --out $OUT/gaps_llama8b
Writes PREFIX.txt: the summary and the largest gaps with the host calls inside them.
"""
import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import SHAPE_NAMES, make_config  # noqa: E402

import attnzoo  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def gaps_of(trace: dict, min_us: float):
    ev = trace["traceEvents"]
    gpu = sorted((e for e in ev if e.get("cat") in GPU_CATS and "dur" in e), key=lambda e: e["ts"])
    host = [e for e in ev if e.get("cat") in ("cuda_runtime", "cpu_op", "cuda_driver", "user_annotation") and "dur" in e]
    out, end, prev = [], None, None
    for e in gpu:
        if end is not None and e["ts"] - end >= min_us:
            out.append((e["ts"] - end, end, e["ts"], prev["name"], e["name"]))
        if end is None or e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    busy = sum(e["dur"] for e in gpu)
    span = (gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]) if gpu else 0
    return out, host, busy, span


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPE_NAMES, default="llama8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--min-gap-us", type=float, default=15.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cfg, _ = make_config(args.shape, args.layers)
    data = json.loads((Path(__file__).parent / "data" / "gsm8k_8shot_tokens.json").read_text())
    prompts = [data["prefix"] + q for q in data["questions"]][: args.prompts]
    llm = attnzoo.load_model(cfg, load_format="random", dtype="bfloat16", device="cuda", max_running=max(args.prompts, 1))
    for _ in range(3):  # warm: the prefix cache, and graphs, captured once a batch size was seen (capture_after)
        llm.generate(prompts, max_new_tokens=args.steps + 1, ignore_eos=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, max_new_tokens=args.steps + 1, ignore_eos=True)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, max_new_tokens=args.steps + 1, ignore_eos=True)
        torch.cuda.synchronize()
    path = Path("/tmp") / (Path(args.out).name + ".trace.json")  # large: kept off the results
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    gaps, host, busy, span = gaps_of(trace, args.min_gap_us)
    lines = [f"# {args.shape} batch {args.prompts}, {args.steps + 1} tokens; info: decode={llm.info()['decode_backend']} "
             f"graphs={llm.engine.graph_stats} overlap={llm.engine.overlap_stats}",
             f"unprofiled wall {wall * 1e3:.1f} ms = {wall * 1e3 / (args.steps + 1):.2f} ms/token; profiled GPU span "
             f"{span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle in gaps >= {args.min_gap_us} us: "
             f"{sum(g[0] for g in gaps) / 1e3:.1f} ms in {len(gaps)} gaps"]
    # host calls overlapping the gaps, by name: what the GPU waited for
    during = collections.Counter()
    for g, a, b, _, _ in gaps:
        for h in host:
            lo, hi = max(a, h["ts"]), min(b, h["ts"] + h["dur"])
            if hi > lo:
                during[(h.get("cat"), h["name"])] += hi - lo
    lines.append("host time inside the gaps, by call (overlapping calls both count):")
    lines += [f"  {us / 1e3:8.2f} ms  {cat:14s} {name[:100]}" for (cat, name), us in during.most_common(30)]
    lines.append("largest gaps (us, after kernel -> before kernel):")
    for g, a, b, before, after in sorted(gaps, reverse=True)[:15]:
        lines.append(f"  {g:8.1f}  {before[:60]} -> {after[:60]}")
    text = "\n".join(lines)
    print(text)
    Path(args.out + ".txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
