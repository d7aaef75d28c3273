"""The skinny projection's L2 prefetch (``skinny_kernels.PREFETCH_BUDGET``): a residual add + RMSNorm, then the
projection of its output, as a batch-1 decode step runs them (CUDA graph, PDL, weights cycled past L2), for each
prefetch budget in bytes a program. With PDL the projection's programs launch while the norm runs; the budget is
how much of their weight they ask L2 for before they wait on it. Every budget is first checked to give the same
output, bit for bit, as no prefetch.

    python benchmarks/skinny_prefetch.py --out benchmarks/results/skinny_prefetch
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import gpu_slug, parse_ints, write_result  # noqa: E402
from skinny_gemm import L2_FLUSH_BYTES, SHAPES, graph_us  # noqa: E402

from attnzoo.layers import fused, skinny, skinny_kernels as sk  # noqa: E402
from attnzoo.models.common import RMSNorm  # noqa: E402

DEFAULT_SHAPES = "llama8b.qkv,llama8b.o,llama8b.gate_up,llama8b.down,dsv2lite.q,dsv2lite.o,gemma4_31b.qkv_sliding"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=parse_ints, default=[1, 8])
    ap.add_argument("--budgets", type=parse_ints, default=[0, 16384, 32768, 65536, 131072, 262144])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    args = ap.parse_args()
    dt, dev = torch.bfloat16, "cuda"
    rows_out = []
    print(f"{'shape':24} {'M':>3} " + " ".join(f"{b // 1024:>6}K" for b in args.budgets)
          + "  alone   us per norm + projection (alone: the projection only, default budget)")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        act = ("gelu_tanh" if name.startswith("gemma") else "silu") if name.endswith("gate_up") else None
        copies = max(1, min(32, -(-L2_FLUSH_BYTES // (n * k * 2))))
        ws = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(copies)]
        norm = RMSNorm(k).to(dev, dt)
        for m in args.rows:
            # the tile linear() and gated() pick: gated the one-row rule, half its rows of gate, of up
            config = skinny.config_for(n, k, 1 if act else m)
            if act:
                config = config._replace(block_n=config.block_n // 2)
            x, res = torch.randn(m, k, dtype=dt, device=dev), torch.randn(m, k, dtype=dt, device=dev)

            def step(i, budget):
                h, _ = fused.add_rms_norm(x, res, norm)
                return sk.linear(h, ws[i], config=config, act=act, prefetch=budget)

            want = step(0, 0)
            h = fused.add_rms_norm(x, res, norm)[0]
            row = dict(shape=name, N=n, K=k, M=m, config=tuple(config), gated=act, us={}, same={},
                       projection_alone_us=graph_us(lambda i: sk.linear(h, ws[i], config=config, act=act), copies))
            for b in args.budgets:
                row["same"][b] = bool(torch.equal(step(0, b), want))
                row["us"][b] = graph_us(lambda i: step(i, b), copies)
            rows_out.append(row)
            flag = "" if all(row["same"].values()) else "  DIFFERS"
            print(f"{name:24} {m:>3} " + " ".join(f"{row['us'][b]:>7.1f}" for b in args.budgets)
                  + f" {row['projection_alone_us']:>6.1f}" + flag)
        del ws
        torch.cuda.empty_cache()
    out = args.out if args.out.endswith(".json") else args.out + f"_{gpu_slug()}"
    print("wrote", write_result(out, {"rows": rows_out, "budgets": args.budgets}, benchmark="skinny_prefetch.py"))


if __name__ == "__main__":
    main()
