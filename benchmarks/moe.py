"""The fused MoE layer (attnzoo/layers/moe.py) on one GPU against a dense GEMM of the same work.

    python benchmarks/moe.py [--shapes v3,v2_lite] [--batches 1,64,512] [--dtypes bf16,fp8]
    python benchmarks/moe.py --shapes gpt_oss_20b --dtypes bf16,mxfp4
                             [--sweep [--tables DIR]] [--output FILE.json]

Shapes (routed experts only; the shared experts are an ordinary dense MLP):
  v3       DeepSeek-V3: 256 experts, top-8, hidden 7168, moe_intermediate 2048 (one layer: 22.5 GB in bf16)
  v2_lite  DeepSeek-V2-Lite: 64 experts, top-6, hidden 2048, moe_intermediate 1408
  gpt_oss_20b  gpt-oss-20b: 32 experts, top-4, hidden 2880, intermediate 2880 (dtype mxfp4: its checkpoint's
           expert format, the w4a16 path; its dense GEMM is bf16 with the same FLOPs)

Per (shape, dtype, batch): T tokens routed uniformly at random (k distinct experts each), then
  moe_eager  ``fused_moe`` called from Python (the expert sort, both grouped GEMMs, act, the sum)
  moe_graph  the same captured in a CUDA graph and replayed (what a decode step runs)
  dense      one GEMM with the same weight bytes and FLOPs: x [M, H] @ W [H, N] with N = 3 I x (experts
             actually chosen) and M = T k / (experts chosen); bf16 ``torch.mm``, fp8 ``torch._scaled_mm``
             (per-tensor scales, M padded to 16). ``ratio`` = moe_graph / dense (the target is <= 1.5).
Weight bytes count only the chosen experts (plus FP8 block scales). Every case is first checked against
the per-expert reference (``moe_reference``; FP8 with the kernel's activation rounding). Times are
CUDA-event medians with the L2 flushed before each run. The tiles are those ``fused_moe`` picks
(``tile_config``: the shipped table for this GPU and shape, else ``default_config``).

``--sweep`` (default batches 1,16,64,256,512,2048) also times a pruned set of tiles per case (BLOCK_M
near the mean rows per chosen expert, so small batches only try 16; N/K tiles and stages that fit
shared memory; 6-14 candidates, each checked against the picked tile's output), prints the ratio before
(the picked tile) and after (the best), and merges the best per (shape, dtype, batch) into this GPU's
table, ``attnzoo/layers/moe_configs/<gpu>.json`` (``--tables DIR`` elsewhere), which ``fused_moe`` reads
from then on. Mostly Triton compiles (about 85 distinct tiles, one compiled GEMM each: the batch
sizes and both projections share it); budgeted at under 6 minutes on an H200 for both shapes and dtypes. The JSON (device, versions, shapes,
rows) goes to ``--output`` (default ``benchmarks/results/moe_<gpu>.json``).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from common import RESULTS, graph_of, time_cuda, write_result  # noqa: E402

from attnzoo.layers.moe import (  # noqa: E402
    FP8, MXFP4, TILE_TABLES, MoEConfig, gpu_slug, moe_reference, fused_moe, tile_config, tile_key, weight_format,
    write_tile_table,
)

SHAPES = {  # experts, top-k, hidden, intermediate; from the models' config.json
    "v3": (256, 8, 7168, 2048),
    "v2_lite": (64, 6, 2048, 1408),
    "gpt_oss_20b": (32, 4, 2880, 2880),
    "dsv4_flash": (256, 6, 4096, 2048),
}
SWEEP_BATCHES = "1,16,64,256,512,2048"


def sweep_space(t: int, k: int, e: int, fp8) -> list[MoEConfig]:
    """Candidate tiles for T tokens: BLOCK_M the mean rows per chosen expert rounded up to a power of two,
    half that, and twice that when the mean is near the top (16..128); wide-and-shallow N tiles for
    16-row blocks (weight streaming), square ones above; FP8 K tiles are the 128-channel scale group; stages that fit in 160 KB of shared memory."""
    per_expert = t * k / min(e, t * k)
    np2 = 1 << max(0, (int(-(-per_expert // 1)) - 1).bit_length())
    clamp = lambda v: min(128, max(16, v))  # noqa: E731
    fmt = weight_format(fp8)
    fp8 = fmt == "fp8"
    elt = 1 if fp8 else 2  # MXFP4 tiles are decoded to bf16 for the dot; bf16's K tiles are whole 32-groups
    out = []
    # Rows per expert scatter around the mean: near the top of its power of two, try the next one too.
    bms = {clamp(np2 // 2), clamp(np2)} | ({clamp(2 * np2)} if per_expert >= 0.75 * np2 else set())
    for bm in sorted(bms):
        bns = (32, 64, 128) if bm == 16 else (64, 128) if bm == 32 else (64, 128, 256)
        bks = (128,) if fp8 else (128, 256) if bm == 16 else (64, 128) if bm == 32 else (64,)
        stages = (3, 5) if bm == 16 else (3, 4)
        for bn in bns:
            for bk in bks:
                for st in stages:
                    if st * (bm * bk + bk * bn) * elt > 160 * 1024:
                        continue
                    out.append(MoEConfig(bm, bn, bk, 1 if bm >= np2 else 8, 4 if bm * bn <= 64 * 128 else 8, st))
    return out


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
    if dtype == "mxfp4":  # uniform codes, E8M0 scales near 2^-7 (weights of about 0.02)
        for n, s in shapes.items():
            out[n] = torch.randint(0, 256, (*s[:2], s[2] // 2), device=device, dtype=torch.int32).to(MXFP4)
            out[n + "_scale_inv"] = torch.randint(118, 122, (*s[:2], s[2] // 32), device=device,
                                                  dtype=torch.int32).to(MXFP4)
        return out
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
    if dtype in ("bf16", "mxfp4"):
        x = torch.randn(m, h, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, h, device=device, dtype=torch.bfloat16)
        return (lambda: torch.mm(x, w.t())), m, n
    m16 = -(-m // 16) * 16
    x = torch.randn(m16, h, device=device, dtype=torch.bfloat16).to(FP8)
    w = torch.randn(n, h, device=device, dtype=torch.bfloat16).to(FP8)
    one = torch.ones((), device=device)
    return (lambda: torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)), m16, n


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
    elt = {"fp8": 1, "mxfp4": 0.5}.get(dtype, 2)
    scale_bytes = 1 if dtype == "mxfp4" else 4
    weight_bytes = int(n_active * 3 * i * h * elt) + n_active * scale_bytes * sum(s[0].numel() for s in scales.values())
    flops = 2 * t * k * 3 * i * h
    timing = dict(warmup=5, iters=30, flush=flush)
    eager = time_cuda(run, **timing)
    graph = time_cuda(graph_of(run), **timing)
    dense_fn, m, n = dense_case(n_active, t, k, h, i, dtype, device)
    dense = time_cuda(dense_fn, **timing)
    row = {
        "shape": shape, "dtype": dtype, "batch": t, "experts": e, "top_k": k, "hidden": h, "intermediate": i,
        "active_experts": n_active, "weight_bytes": weight_bytes, "flops": flops,
        "config": asdict(tile_config(t, k, e, h, i, dtype, device)), "check_rel_err": check,
        "moe_eager_ms": eager, "moe_graph_ms": graph, "dense_ms": dense, "dense_m": m, "dense_n": n,
        "ratio": graph / dense, "moe_graph_GBps": weight_bytes / graph / 1e6, "moe_graph_TFLOPs": flops / graph / 1e9,
    }
    if sweep:
        picked, best = run(), None
        sweep_timing = dict(warmup=3, iters=15, flush=flush)
        # The picked tile runs under the same timing: "after" is never a noisier copy of "before".
        now = tile_config(t, k, e, h, i, dtype, device)
        for cfg in [now] + [c for c in sweep_space(t, k, e, dtype) if c != now]:
            try:
                err = rel_err(run(cfg), picked)
                ms = time_cuda(graph_of(lambda: run(cfg)), **sweep_timing)
            except Exception as exc:  # a tile that does not fit (shared memory, registers) is skipped
                print(f"  sweep {cfg}: {type(exc).__name__}", flush=True)
                continue
            if err > 2e-2:
                print(f"  sweep {cfg}: output differs from the picked tile's (rel err {err:.1e}); skipped", flush=True)
                continue
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best:
            row["sweep_best_ms"], row["sweep_best_config"] = best[0], asdict(best[1])
            row["sweep_best_ratio"] = best[0] / dense
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="v3,v2_lite", help=f"from: {', '.join(SHAPES)}")
    ap.add_argument("--batches", default=None, help=f"default 1,64,512 ({SWEEP_BATCHES} with --sweep)")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--sweep", action="store_true",
                    help="also time candidate tiles per case; write the best to the table")
    ap.add_argument("--tables", default=str(TILE_TABLES), help="where --sweep writes this GPU's tile table")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/moe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    slug = gpu_slug(props.name)
    out_path = Path(args.output or RESULTS / f"moe_{slug}.json")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    batches = [int(b) for b in (args.batches or (SWEEP_BATCHES if args.sweep else "1,64,512")).split(",") if b]
    tuned: dict[str, dict[int, MoEConfig]] = {}
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
                if "sweep_best_config" in r:
                    tuned.setdefault(tile_key(e, i, h, dtype), {})[t] = MoEConfig(**r["sweep_best_config"])
            del w
            torch.cuda.empty_cache()
    result = {
        "sm": f"{props.major}{props.minor}",
        "shapes": {s: dict(zip(("experts", "top_k", "hidden", "intermediate"), SHAPES[s])) for s in args.shapes.split(",")},
        "elapsed_s": time.perf_counter() - t0, "rows": rows,
    }
    if tuned:
        table = Path(args.tables) / f"{slug}.json"
        write_tile_table(table, props.name, result["sm"], tuned)
        print(f"\nratio (moe graph / dense) before -> after the sweep; tiles written to {table}")
        for r in rows:
            if "sweep_best_ratio" in r:
                print(f"  {r['shape']:8} {r['dtype']:5} {r['batch']:>5}  {r['ratio']:5.2f} -> "
                      f"{r['sweep_best_ratio']:5.2f}  {r['sweep_best_config']}")
    out_path = write_result(out_path, result)
    print(f"wrote {out_path} ({result['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
