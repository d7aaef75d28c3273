"""The torch reference backend's cost per step: wall time, torch ops dispatched (on a GPU each is about
one kernel launch) and host syncs, for a decode step and a mixed extend step (decode rows beside
prompt chunks, what continuous batching runs while requests are still arriving).

Shapes default to SmolLM2-135M (9 query heads, 3 KV heads, head dim 64, 30 layers); the 30 layers run
over one layer's cache (the cost per layer is the same, the memory 30 times smaller).

    python benchmarks/torch_ref_step.py                       # CPU, 64 requests x ~1000 tokens
    python benchmarks/torch_ref_step.py --device cuda --reqs 1319
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from attnzoo.attention.backends.torch_ref import TorchBackend  # noqa: E402
from attnzoo.attention.kv_cache import KVPool, PageAllocator  # noqa: E402
from attnzoo.attention.layer import Attention  # noqa: E402
from attnzoo.attention.metadata import build_metadata  # noqa: E402

# Ops that make the host wait for the device.
SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.item", "aten.equal", "aten.is_nonzero")


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--reqs", type=int, default=64, help="requests in the step")
    p.add_argument("--ctx", type=int, default=1000, help="mean context length (lengths spread +-10%%)")
    p.add_argument("--chunks", type=int, default=4, help="mixed step: requests bringing a prompt chunk")
    p.add_argument("--chunk-len", type=int, default=256)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (1: steadier timings on a shared machine)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    h, hkv, d = map(int, args.heads.split(","))
    dev, ps = torch.device(args.device), args.page_size
    g = torch.Generator().manual_seed(0)
    lens = (args.ctx * (0.9 + 0.2 * torch.rand(args.reqs, generator=g))).long().tolist()
    layer = Attention(0, h, hkv, d)
    pages = sum(-(-(n + args.chunk_len) // ps) for n in lens) + 1
    pool = KVPool([layer.kv_cache_spec()], num_pages=pages, page_size=ps, dtype=torch.bfloat16, device=dev)
    pool.k(0).copy_(torch.randn(pool.k(0).shape, generator=g).to(torch.bfloat16))
    pool.v(0).copy_(torch.randn(pool.v(0).shape, generator=g).to(torch.bfloat16))
    alloc = PageAllocator(pages)
    tables = [alloc.alloc(-(-(n + args.chunk_len) // ps)) for n in lens]
    be = TorchBackend(pool)

    def step(q_lens):
        meta = build_metadata(prefix_lens=[n - 1 for n in lens], q_lens=q_lens, block_tables=tables, page_size=ps,
                              device=dev)
        q = torch.randn(meta.num_tokens, h, d, generator=g).to(dev, torch.bfloat16)
        return meta, q

    n_mixed = min(args.chunks, args.reqs)
    cases = {"decode": step([1] * args.reqs),
             f"mixed ({args.reqs - n_mixed} decode rows + {n_mixed} chunks of {args.chunk_len})":
             step([args.chunk_len] * n_mixed + [1] * (args.reqs - n_mixed))}
    print(f"torch backend on {dev}: {args.reqs} requests, context {min(lens)}..{max(lens)}, "
          f"{h}/{hkv} heads, head dim {d}, {args.layers} layers, page {ps}")
    for name, (meta, q) in cases.items():
        run = be.decode if meta.is_decode else be.extend

        def once():
            plan = be.prepare(meta)
            for _ in range(args.layers):
                run(layer, q, meta, plan)

        with torch.inference_mode():
            once()  # warm-up
            with OpCounter() as c:
                once()
            times = []
            for _ in range(args.repeats):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                once()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        syncs = sum(n for op, n in c.ops.items() if op in SYNC_OPS)
        print(f"  {name}: {1e3 * min(times):.1f} ms per step, {sum(c.ops.values())} torch ops "
              f"({sum(c.ops.values()) / args.layers:.0f} per layer), {syncs} host syncs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
