"""Decode GEMMs at a few rows (1-16 by default; a served batch's 128 at most): cuBLAS (``F.linear``) against
the skinny Triton kernel, tile configs swept (past 16 rows a tile holds every row, plain and swapped).

Each case is timed as the decode step runs it: inside a CUDA graph, one call per copy of the weight with
enough copies that none is read from L2 (a model's layers never share a weight). Every config is first
checked against a float32 product. Shapes: the dense projections of Llama-3.1-8B, Gemma-4-31B and the
Llama LM head, at full width.

    python benchmarks/skinny_gemm.py --out benchmarks/results/skinny_gemm_<gpu>
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import gpu_slug, parse_ints, write_result  # noqa: E402

from attnzoo.layers import fused, skinny, skinny_kernels as sk  # noqa: E402

SHAPES = {  # name: (N, K)
    "llama8b.qkv": (6144, 4096), "llama8b.o": (4096, 4096), "llama8b.gate_up": (28672, 4096),
    "llama8b.down": (4096, 14336), "llama8b.lm_head": (128256, 4096),
    "gemma4_31b.qkv_sliding": (12288, 5376), "gemma4_31b.o_sliding": (5376, 8192),
    "gemma4_31b.gate_up": (43008, 5376), "gemma4_31b.down": (5376, 21504),
    "gemma4_31b.lm_head": (262144, 5376),
    "dsv2lite.q": (3072, 2048), "dsv2lite.kv_a": (576, 2048), "dsv2lite.o": (2048, 2048),
    "dsv2lite.shared_gate_up": (5632, 2048), "dsv2lite.shared_down": (2048, 2816),
}
CONFIGS = [sk.Config(32, 256, 4, 4), sk.Config(16, 256, 4, 4), sk.Config(32, 128, 4, 8), sk.Config(64, 256, 4, 3),
           sk.Config(32, 256, 4, 6), sk.Config(64, 128, 4, 6), sk.Config(32, 256, 8, 4), sk.Config(32, 512, 4, 3),
           sk.Config(64, 256, 4, 4), sk.Config(128, 128, 4, 4), sk.Config(64, 256, 8, 3), sk.Config(128, 256, 8, 3)]
# Rows past 16 (a served batch's decode steps): every row in one tile, so W is still read once, by row count
WIDE = [(32, 128, 4, 4, False), (32, 256, 4, 3, False), (64, 128, 4, 4, False), (64, 64, 4, 6, False),
        (128, 64, 8, 4, False), (64, 128, 8, 3, False), (64, 128, 4, 4, True), (64, 64, 4, 6, True),
        (64, 256, 4, 3, True), (128, 64, 4, 4, True), (128, 128, 8, 3, True), (32, 128, 4, 4, True)]


def configs_for_rows(m: int) -> list:
    if m <= sk.BLOCK_M:  # each also as W x^T (tensor cores' 64-deep side on W's rows)
        return CONFIGS + [c._replace(swap=True) for c in CONFIGS if c.block_n >= 64]
    block_m = 1 << (m - 1).bit_length()
    return [sk.Config(bn, bk, w, st, block_m, swap) for bn, bk, w, st, swap in WIDE]


L2_FLUSH_BYTES = 400 << 20  # weight copies per graph: at least this much, so no call finds its weight in L2


def graph_us(fn, copies: int, replays: int = 20) -> float:
    """Microseconds per call of fn(i) for i over the weight copies, replayed as one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * copies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=parse_ints, default=[1, 2, 4, 8, 16])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    dt, dev = torch.bfloat16, "cuda"
    rows_out = []
    print(f"{'shape':24} {'M':>3} {'MB':>7} {'cublas us':>9} {'GB/s':>6} {'best us':>8} {'GB/s':>6} {'x':>5}  best config")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = max(1, min(32, -(-L2_FLUSH_BYTES // nbytes)))
        ws = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, dtype=dt, device=dev)
            ref = (x.float() @ ws[0].float().T)
            cub = graph_us(lambda i: F.linear(x, ws[i]), copies)
            row = dict(shape=name, N=n, K=k, M=m, weight_MB=nbytes / 1e6, cublas_us=cub, configs={})
            for c in configs_for_rows(m):
                try:
                    got = sk.linear(x, ws[0], config=c).float()
                except triton.runtime.errors.OutOfResources as e:  # a wide tile on a GPU of less shared memory
                    row["configs"][str(tuple(c))] = dict(error=str(e)[:200])
                    continue
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                if err > 2e-2:
                    row["configs"][str(tuple(c))] = dict(error=err)
                    continue
                row["configs"][str(tuple(c))] = dict(us=graph_us(lambda i: sk.linear(x, ws[i], config=c), copies),
                                                     rel_err=err)
            ok = {kc: v["us"] for kc, v in row["configs"].items() if "us" in v}
            best = min(ok, key=ok.get)
            rule = str(tuple(skinny.config_for(n, k, m))) if m <= skinny.MAX_ROWS else None
            row.update(best=best, best_us=ok[best], speedup=cub / ok[best], rule=rule, rule_us=ok.get(rule))
            if name.endswith("gate_up") and m <= skinny.MAX_ROWS:  # activation in the launch, against its own launch
                act = "gelu_tanh" if name.startswith("gemma") else "silu"
                row["act_separate_us"] = graph_us(lambda i: fused.act_and_mul(skinny.linear(x, ws[i]), act), copies)
                row["gated_us"] = graph_us(lambda i: skinny.gated(x, ws[i], None, act), copies)
                print(f"{'':24} {m:>3} {act}: projection + activation {row['act_separate_us']:.1f} us, "
                      f"one launch {row['gated_us']:.1f} us")
            rows_out.append(row)
            print(f"{name:24} {m:>3} {nbytes / 1e6:>7.1f} {cub:>9.1f} {nbytes / cub / 1e3:>6.0f} {ok[best]:>8.1f} "
                  f"{nbytes / ok[best] / 1e3:>6.0f} {cub / ok[best]:>5.2f}  {best} rule {row['rule_us'] or float('nan'):.1f}")
        del ws
        torch.cuda.empty_cache()
    out = args.out if args.out.endswith(".json") else args.out + f"_{gpu_slug()}"
    print("wrote", write_result(out, {"rows": rows_out}, benchmark="skinny_gemm.py"))


if __name__ == "__main__":
    main()
