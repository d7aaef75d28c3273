"""A batch-1 decode chain of our own kernels in one CUDA graph, launched with and without programmatic dependent
launch (attnzoo.pdl): what PDL takes off a step's kernel boundaries, apart from everything else a step does.

    python benchmarks/pdl_chain.py [--layers 27] [--out benchmarks/results/pdl_chain_<gpu>.json]

Per layer, DeepSeek-V2-Lite's dense work at one token: the input norm, the merged q / KV-latent projection
(3648 x 2048), o_proj (2048 x 2048), the add-and-norm, the shared experts' gated gate_up (2 x 2816 x 2048) and
down (2048 x 2816): six Triton launches, distinct weights per layer so that L2 holds none. Checked first: the
chain's output has the same bits with and without PDL.
"""
from __future__ import annotations

import argparse

import torch

from common import RESULTS, gpu_slug, graph_of, time_cuda, write_result
from attnzoo import pdl
from attnzoo.layers import fused, skinny
from attnzoo.models.common import RMSNorm

HIDDEN, QKV, SHARED = 2048, 3648, 2816


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    layers = [{
        "qkv": torch.randn(QKV, HIDDEN, device=dev, dtype=dt) * 0.02,
        "o": torch.randn(HIDDEN, HIDDEN, device=dev, dtype=dt) * 0.02,
        "gate_up": torch.randn(2 * SHARED, HIDDEN, device=dev, dtype=dt) * 0.02,
        "down": torch.randn(HIDDEN, SHARED, device=dev, dtype=dt) * 0.02,
    } for _ in range(args.layers)]
    norm = RMSNorm(HIDDEN).to(dev, dt)
    x0 = torch.randn(1, HIDDEN, device=dev, dtype=dt)

    def chain():
        x, residual = x0, None
        for w in layers:
            h, residual = norm.add_and_norm(x, residual)
            a = skinny.linear(h, w["qkv"])
            h, residual = norm.add_and_norm(skinny.linear(a[:, :HIDDEN], w["o"]), residual)
            x = skinny.linear(skinny.gated(h, w["gate_up"], None, "silu"), w["down"])
        return x

    assert skinny.fits(x0, layers[0]["qkv"]) and fused.enabled(x0)
    rows, outs = [], {}
    for on in (False, True, False, True):  # interleaved: a drifting clock shows as disagreeing pairs
        with pdl.use(on):
            out = torch.empty(1, HIDDEN, device=dev, dtype=dt)
            replay = graph_of(lambda: out.copy_(chain()))
            replay()
            torch.cuda.synchronize()
            outs.setdefault(on, out.clone())
            ms = time_cuda(replay, warmup=10, iters=50)
        rows.append({"pdl": on, "chain_us": ms * 1e3, "kernels": 6 * args.layers})
        print(f"PDL {'on ' if on else 'off'}: {ms * 1e3:8.1f} us for {6 * args.layers} kernels", flush=True)
    same = torch.equal(outs[False], outs[True])
    print("same bits with and without PDL:", same)
    off = min(r["chain_us"] for r in rows if not r["pdl"])
    on = min(r["chain_us"] for r in rows if r["pdl"])
    print(f"saved per kernel boundary: {(off - on) / (6 * args.layers):.2f} us")
    out = args.out or RESULTS / f"pdl_chain_{gpu_slug()}.json"
    write_result(out, {"layers": args.layers, "rows": rows, "same_bits": same,
                       "saved_us_per_kernel": (off - on) / (6 * args.layers)}, benchmark="pdl_chain.py")
    if not same:
        raise SystemExit("PDL changed the chain's output")


if __name__ == "__main__":
    main()
