"""A DeepSeek-V2-Lite MoE block's experts (64 routed of 2048 -> 1408, top-6, and the 2 shared as one 2816-wide
MLP) with the shared experts after the routed ones' inputs on one stream, or on a side stream beside the routed
GEMMs (``layers.moe.layer.SHARED_OVERLAP_ROWS``), by rows. CUDA-graph replays over layer copies that do not fit
L2 together; each side checked to give the same bits first.

    python benchmarks/moe_shared_overlap.py --out benchmarks/results/moe_shared_overlap
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import gpu_slug, parse_ints, write_result  # noqa: E402
from skinny_gemm import graph_us  # noqa: E402

from attnzoo.layers.moe import FusedMoE  # noqa: E402
from attnzoo.layers.moe import layer as moe_layer  # noqa: E402
from attnzoo.models.common import GatedMLP  # noqa: E402

E, K, H, I, SHARED = 64, 6, 2048, 1408, 2816
COPIES = 4  # 4 x 1.2 GB of experts: no layer finds its weights in L2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=parse_ints, default=[1, 4, 16, 64, 128, 256, 512, 1024])
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    layers = [(FusedMoE(E, H, I, init_std=0.02).to(dev, dt), GatedMLP(H, SHARED).to(dev, dt)) for _ in range(COPIES)]
    rows_out = []
    print(f"{'rows':>5} {'serial us':>10} {'overlap us':>11} {'x':>6}")
    with torch.no_grad():
        for t in args.rows:
            x = torch.randn(t, H, device=dev, dtype=dt)
            ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(t)])
            weights = torch.softmax(torch.randn(t, K, device=dev), -1)
            row = {"rows": t}
            outs = {}
            for name, limit in (("serial", 0), ("overlap", 1 << 30)):
                moe_layer.SHARED_OVERLAP_ROWS = limit
                outs[name] = layers[0][0](x, weights, ids, shared=layers[0][1])
                row[f"{name}_us"] = graph_us(lambda i: layers[i][0](x, weights, ids, shared=layers[i][1]), COPIES)
            row["same_bits"] = bool(torch.equal(outs["serial"], outs["overlap"]))
            rows_out.append(row)
            print(f"{t:>5} {row['serial_us']:>10.1f} {row['overlap_us']:>11.1f} {row['serial_us'] / row['overlap_us']:>6.2f}"
                  + ("" if row["same_bits"] else "  DIFFERS"))
    out = args.out if args.out.endswith(".json") else args.out + f"_{gpu_slug()}"
    print("wrote", write_result(out, {"rows": rows_out}, benchmark="moe_shared_overlap.py"))


if __name__ == "__main__":
    main()
