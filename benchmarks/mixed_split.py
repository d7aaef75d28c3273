"""A mixed step's attention, one layer: decode rows beside a prompt chunk, as one extend call against the decode rows
split off to the decode backend (``HybridBackend.decode_rows``), on the Triton backend. Checked against each other,
then timed as CUDA graphs (GPU time only) and eagerly (the host's launches included), by decode-row count: where
the split starts to pay is ``hybrid.MIXED_SPLIT_MIN_ROWS``.

    python benchmarks/mixed_split.py [--shape llama3.1-8b] [--rows 4,8,16,32,64,96] [--context 1100] [--chunk 427@512]
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_cases import SHAPES, layer_for  # noqa: E402
from common import RESULTS, gpu_slug, graph_of, parse_ints, time_cuda, write_result  # noqa: E402

from attnzoo.attention.backends.hybrid import HybridBackend, MixedPlan  # noqa: E402
from attnzoo.attention.backends.triton import TritonBackend  # noqa: E402
from attnzoo.attention.kv_cache import KVPool  # noqa: E402
from attnzoo.attention.metadata import build_metadata  # noqa: E402


def step(shape, rows: int, context: int, chunk: int, chunk_prefix: int, page: int, device):
    """(layer, backends, metadata, q): ``rows`` requests decoding at ``context`` keys, then one chunk."""
    layer = layer_for(shape)
    prefix = [context - 1] * rows + [chunk_prefix]
    q_lens = [1] * rows + [chunk]
    need = [-(-(p + q) // page) for p, q in zip(prefix, q_lens)]
    pool = KVPool([layer.kv_cache_spec()], num_pages=sum(need) + 1, page_size=page, dtype=torch.bfloat16,
                  device=device)
    pool.buffer.view(torch.bfloat16).normal_()
    order = (torch.randperm(sum(need)) + 1).tolist()  # fragmented, like a busy cache
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n])
        at += n
    meta = build_metadata(prefix_lens=prefix, q_lens=q_lens, block_tables=tables, page_size=page, device=device)
    tri = TritonBackend(pool)
    hb = HybridBackend(tri, tri)
    q = torch.randn(sum(q_lens), shape.heads, shape.head_dim, device=device, dtype=torch.bfloat16)
    return layer, hb, meta, q


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="4,8,16,32,64,96")
    ap.add_argument("--context", type=int, default=1100, help="keys each decode row reads")
    ap.add_argument("--chunk", default="427@512", help="the prompt chunk's tokens @ its cached prefix")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shape, (chunk, chunk_prefix) = SHAPES[args.shape], map(int, args.chunk.split("@"))
    out = []
    for rows in parse_ints(args.rows):
        layer, hb, meta, q = step(shape, rows, args.context, chunk, chunk_prefix, args.page_size, "cuda")
        hb.mixed_min_rows = None
        whole = hb.prepare(meta)
        hb.mixed_min_rows = 1
        split = hb.prepare(meta)
        assert isinstance(split, MixedPlan) and not isinstance(whole, MixedPlan)
        a, b = hb.run(layer, q, meta, whole), hb.run(layer, q, meta, split)
        err = (a.float() - b.float()).abs().max().item()
        if err > 2e-2:
            raise SystemExit(f"rows {rows}: split and whole differ by {err}")
        row = {"rows": rows, "max_abs_diff": err}
        for name, plan in (("whole", whole), ("split", split)):
            fn = lambda plan=plan: hb.run(layer, q, meta, plan)  # noqa: E731
            row[f"{name}_graph_us"] = round(1e3 * time_cuda(graph_of(fn), iters=50), 1)
            # eager, back to back: the GPU waits on the host's launches where they take longer than the kernels
            row[f"{name}_eager_us"] = round(1e3 * time_cuda(lambda fn=fn: [fn() for _ in range(10)], iters=10) / 10, 1)
        out.append(row)
        print(json.dumps(row), flush=True)
    path = args.out or RESULTS / f"mixed_split_{args.shape}_{gpu_slug()}.json"
    write_result(path, {"shape": args.shape, "context": args.context, "chunk": args.chunk, "rows": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
