"""FlashInfer's two paged decode kernels on our layer shapes: the CUDA-core decode kernel against the
tensor-core (prefill-kernel) path, ``use_tensor_cores`` of ``BatchDecodeWithPagedKVCacheWrapper``.

The flashinfer backend picks the tensor-core path from a GQA group of TENSOR_CORE_DECODE_MIN_GROUP; this
measures that rule per head dim (Gemma 4's global layers: group 8 at head dim 512, K doubling as V).
Each case checks the two outputs agree, then times each (CUDA events, median of 20 after 5 warm-ups).

    python benchmarks/decode_kernels.py --out benchmarks/results/decode_kernels_nvidia_h200.json
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import time_cuda, write_result  # noqa: E402

# name: (q heads, kv heads, head dim, K doubles as V)
SHAPES = {"gemma4-31b global": (32, 4, 512, True), "gemma4-31b sliding": (32, 16, 256, False),
          "llama-3.1-8b": (32, 8, 128, False)}
PAGE = 16


def case(fi, qh, kvh, d, k_is_v, batch, ctx, workspace):
    pages_per = -(-ctx // PAGE)
    num_pages = batch * pages_per + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(num_pages, kvh, PAGE, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = k if k_is_v else torch.randn(num_pages, kvh, PAGE, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(batch, qh, d, device="cuda", dtype=torch.bfloat16, generator=g)
    indptr = torch.arange(0, batch + 1, dtype=torch.int32) * pages_per
    indices = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(1))[: batch * pages_per].int() + 1
    last = torch.full((batch,), ctx - (pages_per - 1) * PAGE, dtype=torch.int32)
    out, ms = {}, {}
    for tc in (False, True):
        w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="HND", use_tensor_cores=tc)
        w.plan(indptr=indptr.cuda(), indices=indices.cuda(), last_page_len=last.cuda(), num_qo_heads=qh,
               num_kv_heads=kvh, head_dim=d, page_size=PAGE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        out[tc] = w.run(q, (k, v))
        ms[tc] = time_cuda(lambda: w.run(q, (k, v)), warmup=5, iters=20)
    err = ((out[True].float() - out[False].float()).norm() / out[False].float().norm()).item()
    kv_bytes = batch * ctx * kvh * d * 2 * (1 if k_is_v else 2)
    return {"batch": batch, "ctx": ctx, "cuda_core_us": ms[False] * 1e3, "tensor_core_us": ms[True] * 1e3,
            "rel_err": err, "kv_GBps_best": kv_bytes / min(ms.values()) / 1e6}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="64,239")
    ap.add_argument("--ctxs", default="256,1024")
    args = ap.parse_args(argv)
    import flashinfer as fi

    workspace = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    print(f"{'shape':20s} {'batch':>5s} {'ctx':>5s} {'cuda-core us':>12s} {'tensor-core us':>14s} {'rel err':>8s} {'GB/s':>6s}")
    for name, (qh, kvh, d, k_is_v) in SHAPES.items():
        for b in map(int, args.batches.split(",")):
            for c in map(int, args.ctxs.split(",")):
                r = {"shape": name, "q_heads": qh, "kv_heads": kvh, "head_dim": d, "k_is_v": k_is_v,
                     **case(fi, qh, kvh, d, k_is_v, b, c, workspace)}
                assert r["rel_err"] < 2e-2, r
                rows.append(r)
                print(f"{name:20s} {b:5d} {c:5d} {r['cuda_core_us']:12.1f} {r['tensor_core_us']:14.1f} "
                      f"{r['rel_err']:8.1e} {r['kv_GBps_best']:6.0f}", flush=True)
    if args.out:
        write_result(args.out, {"rows": rows}, page_size=PAGE)


if __name__ == "__main__":
    main()
