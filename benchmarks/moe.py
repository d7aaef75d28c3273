"""The fused MoE layer (attnzoo/layers/moe.py) on one GPU against a dense GEMM of the same work.

    python benchmarks/moe.py [--shapes v3,v2_lite] [--batches 1,64,512] [--dtypes bf16,fp8]
                             [--sweep] [--output FILE.json]

Shapes (routed experts only; the shared experts are an ordinary dense MLP):
  v3       DeepSeek-V3: 256 experts, top-8, hidden 7168, moe_intermediate 2048 (one layer: 22.5 GB in bf16)
  v2_lite  DeepSeek-V2-Lite: 64 experts, top-6, hidden 2048, moe_intermediate 1408

Per (shape, dtype, batch): T tokens routed uniformly at random (k distinct experts each), then
  moe_eager  ``fused_moe`` called from Python (the expert sort, both grouped GEMMs, act, the sum)
  moe_graph  the same captured in a CUDA graph and replayed (what a decode step runs)
  dense      one GEMM with the same weight bytes and FLOPs: x [M, H] @ W [H, N] with N = 3 I x (experts
             actually chosen) and M = T k / (experts chosen); bf16 ``torch.mm``, fp8 ``torch._scaled_mm``
             (per-tensor scales, M padded to 16). ``ratio`` = moe_graph / dense (the target is <= 1.5).
Weight bytes count only the chosen experts (plus FP8 block scales). Every case is first checked against
the per-expert reference (``moe_reference``; FP8 with the kernel's activation rounding). Times are
CUDA-event medians with the L2 flushed before each run. ``--sweep`` also times a few tile configs per
case and records the best (for tuning ``default_config``). The JSON (device, versions, shapes, rows)
goes to ``--output`` (default ``benchmarks/results/moe_<gpu>.json``).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from attention_triton import time_cuda, versions  # noqa: E402

from attnzoo.layers.moe import FP8, MoEConfig, default_config, fused_moe, moe_reference  # noqa: E402

SHAPES = {  # experts, top-k, hidden, intermediate; from the models' config.json
    "v3": (256, 8, 7168, 2048),
    "v2_lite": (64, 6, 2048, 1408),
}
SWEEP = [MoEConfig(*c) for c in [
    (16, 64, 64, 1, 4, 4), (16, 128, 64, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3),
    (32, 64, 64, 8, 4, 4), (32, 128, 128, 8, 4, 3), (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 3),
    (64, 128, 128, 8, 4, 3), (128, 128, 64, 16, 8, 3), (128, 128, 128, 16, 8, 3), (64, 256, 64, 8, 8, 3),
]]


def routing(t, k, e, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(t, e, generator=g, device=device).argsort(dim=1)[:, :k]
    return torch.rand(t, k, generator=g, device=device), ids


def make_experts(e, h, i, dtype: str, device):
    """Random stacked experts; FP8 as block-quantized values with 128x128 multipliers."""
    shapes = {"w13": (e, 2 * i, h), "w2": (e, h, i)}
    if dtype == "bf16":
        return {n: torch.randn(s, device=device, dtype=torch.bfloat16).mul_(0.02) for n, s in shapes.items()}
    out = {}
    for n, s in shapes.items():
        w = torch.empty(s, device=device, dtype=FP8)
        for x in range(e):  # one expert at a time: no full-size float copy
            w[x] = torch.randn(s[1:], device=device).to(FP8)
        out[n] = w
        out[n + "_scale_inv"] = torch.rand(e, -(-s[1] // 128), -(-s[2] // 128), device=device) * 0.01 + 0.01
    return out


def dense_case(n_active, t, k, h, i, dtype: str, device):
    """A GEMM with the MoE's weight bytes (chosen experts) and FLOPs."""
    n = 3 * i * n_active
    m = max(1, round(t * k / n_active))
    if dtype == "bf16":
        x = torch.randn(m, h, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, h, device=device, dtype=torch.bfloat16)
        return (lambda: torch.mm(x, w.t())), m, n
    m16 = -(-m // 16) * 16
    x = torch.randn(m16, h, device=device, dtype=torch.bfloat16).to(FP8)
    w = torch.randn(n, h, device=device, dtype=torch.bfloat16).to(FP8)
    one = torch.ones((), device=device)
    return (lambda: torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)), m16, n


def graph_of(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run_case(shape, dtype, t, w, flush, *, sweep: bool, device) -> dict:
    e, k, h, i = SHAPES[shape]
    weights, ids = routing(t, k, e, device, seed=t)
    x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
    scales = {n: w[n] for n in ("w13_scale_inv", "w2_scale_inv") if n in w}
    run = lambda cfg=None: fused_moe(x, w["w13"], w["w2"], weights, ids, config=cfg, **scales)  # noqa: E731
    check = rel_err(run(), moe_reference(x, w["w13"], w["w2"], weights, ids, quantize_activations=dtype == "fp8",
                                         **scales))
    n_active = int(torch.unique(ids).numel())
    elt = 1 if dtype == "fp8" else 2
    weight_bytes = n_active * 3 * i * h * elt + (n_active * 4 * sum(s[0].numel() for s in scales.values()))
    flops = 2 * t * k * 3 * i * h
    timing = dict(warmup=5, iters=30, flush=flush)
    eager = time_cuda(run, **timing)
    graph = time_cuda(graph_of(run), **timing)
    dense_fn, m, n = dense_case(n_active, t, k, h, i, dtype, device)
    dense = time_cuda(dense_fn, **timing)
    row = {
        "shape": shape, "dtype": dtype, "batch": t, "experts": e, "top_k": k, "hidden": h, "intermediate": i,
        "active_experts": n_active, "weight_bytes": weight_bytes, "flops": flops,
        "config": asdict(default_config(t * k, e, dtype == "fp8")), "check_rel_err": check,
        "moe_eager_ms": eager, "moe_graph_ms": graph, "dense_ms": dense, "dense_m": m, "dense_n": n,
        "ratio": graph / dense, "moe_graph_GBps": weight_bytes / graph / 1e6, "moe_graph_TFLOPs": flops / graph / 1e9,
    }
    if sweep:
        best = None
        for cfg in SWEEP:
            if dtype == "fp8" and cfg.block_k != 128:
                continue
            try:
                ms = time_cuda(graph_of(lambda: run(cfg)), **timing)
            except Exception as exc:  # a tile that does not fit (shared memory) is skipped
                print(f"  sweep {cfg}: {type(exc).__name__}", flush=True)
                continue
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best:
            row["sweep_best_ms"], row["sweep_best_config"] = best[0], asdict(best[1])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="v3,v2_lite", help=f"from: {', '.join(SHAPES)}")
    ap.add_argument("--batches", default="1,64,512")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP tile configs per case")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/moe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    gpu_slug = re.sub(r"[^a-z0-9]+", "_", props.name.lower()).strip("_")
    out_path = Path(args.output or Path(__file__).parent / "results" / f"moe_{gpu_slug}.json")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    batches = [int(b) for b in args.batches.split(",") if b]
    rows, t0 = [], time.perf_counter()
    head = (f"{'shape':8} {'dtype':5} {'batch':>5} {'active':>6} {'eager ms':>9} {'graph ms':>9} {'dense ms':>9} "
            f"{'ratio':>6} {'GB/s':>7} {'TFLOP/s':>8} {'err':>8}")
    print(head + "\n" + "-" * len(head), flush=True)
    for shape in args.shapes.split(","):
        e, k, h, i = SHAPES[shape]
        for dtype in args.dtypes.split(","):
            w = make_experts(e, h, i, dtype, device)
            for t in batches:
                r = run_case(shape, dtype, t, w, flush, sweep=args.sweep, device=device)
                rows.append(r)
                print(f"{shape:8} {dtype:5} {t:>5} {r['active_experts']:>6} {r['moe_eager_ms']:>9.3f} "
                      f"{r['moe_graph_ms']:>9.3f} {r['dense_ms']:>9.3f} {r['ratio']:>6.2f} {r['moe_graph_GBps']:>7.0f} "
                      f"{r['moe_graph_TFLOPs']:>8.1f} {r['check_rel_err']:>8.1e}"
                      + (f"  sweep best {r['sweep_best_ms']:.3f} ms {r['sweep_best_config']}" if "sweep_best_ms" in r else ""),
                      flush=True)
            del w
            torch.cuda.empty_cache()
    result = {
        "device": props.name, "sm": f"{props.major}{props.minor}", "versions": versions(),
        "shapes": {s: dict(zip(("experts", "top_k", "hidden", "intermediate"), SHAPES[s])) for s in args.shapes.split(",")},
        "elapsed_s": time.perf_counter() - t0, "rows": rows,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
