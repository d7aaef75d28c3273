"""DeepSeek-V4's compressed attention kernel (``kernels/compressed.attend``) at V4-Flash's shapes, launch configs swept.

64 query heads of 512 on one key head (the keys are the values), a 128-token raw window, and per layer kind the
compressed entries: none (sliding), every completed 128:1 entry (HCA), or the indexer's 512 picks of the 4:1
entries (CSA; at the GSM8K workload's ~1,450-token contexts every visible entry is picked, the rest are -1).
Decode: one query token per request; extend: a chunk of each request's new tokens after a cached prefix.
Every config is first checked against ``compressed_reference.attend_reference`` on a few requests, then timed
(CUDA events, median) on the full batch. ``--configs`` lists BLOCK_H x BLOCK_N x warps x stages.

    python benchmarks/compressed_attend.py --out benchmarks/results/compressed_attend_<gpu>
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import time_cuda, write_result  # noqa: E402

from attnzoo.attention.compressed import CompressedAttention  # noqa: E402
from attnzoo.attention.compressed_reference import attend_reference  # noqa: E402
from attnzoo.attention.kernels import compressed as kernels  # noqa: E402
from attnzoo.attention.kv_cache import KVPool  # noqa: E402
from attnzoo.attention.metadata import build_metadata  # noqa: E402
from attnzoo.attention.reference import token_requests  # noqa: E402

HEADS, DIM, WINDOW, PAGE, TOPK = 64, 512, 128, 64, 512
RATES = {"sliding": 0, "hca": 128, "csa": 4}


def parse_configs(s: str) -> list[dict]:
    out = []
    for item in s.split(","):
        h, n, w, st = (int(x) for x in item.split("x"))
        out.append({"BLOCK_H": h, "BLOCK_N": n, "num_warps": w, "num_stages": st})
    return out


def build(kind: str, prefix: list[int], q_lens: list[int], seed: int = 0, dev: str = "cuda"):
    """A pool holding random keys/entries for these requests, their metadata, queries, sinks and CSA picks."""
    rate = RATES[kind]
    layer = CompressedAttention(0, HEADS, DIM, sliding_window=WINDOW, scale=DIM**-0.5, compress_rate=rate,
                                overlap=kind == "csa", state_dim=2 * DIM if rate else 0,
                                index_dim=128 if kind == "csa" else 0, index_n_heads=64 if kind == "csa" else 0,
                                index_topk=TOPK if kind == "csa" else 0)
    pages = [-(-(p + n) // PAGE) for p, n in zip(prefix, q_lens)]
    pool = KVPool([layer.kv_cache_spec()], num_pages=sum(pages) + 1, page_size=PAGE, dtype=torch.bfloat16,
                  device=dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    for name in ("k", "compressed") if rate else ("k",):
        v = pool.view(0, name)
        v.copy_(torch.randn(v.shape, generator=g, device=dev))
    tables, first = [], 1
    for n in pages:  # requests' pages interleaved with nothing: contiguous runs, as a fresh pool hands them out
        tables.append(list(range(first, first + n)))
        first += n
    meta = build_metadata(prefix_lens=prefix, q_lens=q_lens, block_tables=tables, page_size=PAGE, device=dev)
    q = torch.randn(meta.num_tokens, HEADS, DIM, generator=g, device=dev).to(torch.bfloat16)
    sinks = torch.randn(HEADS, generator=g, device=dev)
    ids = None
    if kind == "csa":  # every visible entry, in random order, -1 past them
        visible = (meta.positions + 1) // rate
        r = torch.rand(meta.num_tokens, TOPK, generator=g, device=dev)
        order = r.masked_fill(torch.arange(TOPK, device=dev)[None, :] >= visible[:, None], 2.0).argsort(-1)
        ids = torch.where(order < visible[:, None], order, -1).to(torch.int32)
    return layer, pool, meta, q, sinks, ids


def run_kernel(layer, pool, meta, q, sinks, ids, config):
    comp = pool.view(0, "compressed").reshape(-1, DIM) if layer.compress_rate else None
    return kernels.attend(q, pool.k(0).reshape(-1, DIM), comp, sinks, meta.block_tables, meta.block_tables,
                          token_requests(meta), meta.positions, ids, window=WINDOW, rate=layer.compress_rate,
                          page_size=PAGE, scale=layer.scale, config=config)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="sliding,hca,csa")
    ap.add_argument("--decode-batch", type=int, default=1319)
    ap.add_argument("--context", type=int, default=1450, help="tokens before each decode query")
    ap.add_argument("--extend", default="48x160", help="requests x new tokens per extend step (after --prefix)")
    ap.add_argument("--prefix", type=int, default=1313)
    ap.add_argument("--configs", default="16x16x8x1,16x32x8x1,16x32x8x2,32x16x8x1,32x32x8x2,64x16x8x1,64x32x8x2,"
                                          "64x16x16x1,64x32x16x2,32x64x8x2")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: the correctness checks alone (TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    default = kernels.attend_tiles(HEADS, DIM, args.device == "cuda")
    configs = [default] + [c for c in parse_configs(args.configs) if c != default]
    er, en = (int(x) for x in args.extend.split("x"))
    steps = {"decode": ([args.context] * args.decode_batch, [1] * args.decode_batch),
             "extend": ([args.prefix] * er, [en] * er)}
    rows = []
    for kind in args.kinds.split(","):
        for step, (prefix, q_lens) in steps.items():
            few = build(kind, prefix[:3], q_lens[:3], seed=1, dev=args.device)
            want = attend_reference(few[1].k(0), few[1].view(0, "compressed") if few[0].compress_rate else None,
                                    few[3], few[4], few[5], few[2], window=WINDOW, rate=few[0].compress_rate,
                                    scale=few[0].scale)
            case = build(kind, prefix, q_lens, dev=args.device) if args.device == "cuda" else None
            base = None
            for cfg in configs:
                row = {"kind": kind, "step": step, "tokens": sum(q_lens), "config": cfg}
                try:
                    err = (run_kernel(*few, cfg) - want).abs().max().item() / want.abs().max().item()
                    row["max_rel_err"] = err
                    if err > 2e-2:
                        raise AssertionError(f"relative error {err:.2e}")
                    if case is not None:
                        row["ms"] = time_cuda(lambda: run_kernel(*case, cfg), iters=10)
                except Exception as e:  # noqa: BLE001 - a config that fails is recorded and skipped
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                base = base if base is not None else row.get("ms")
                if "ms" in row and base:
                    row["speedup_vs_default"] = base / row["ms"]
                rows.append(row)
                c = cfg
                tiles = f"H{c['BLOCK_H']:<3d}N{c['BLOCK_N']:<3d}w{c['num_warps']:<3d}s{c['num_stages']}"
                print(f"{kind:8s} {step:7s} {tiles}"
                      f"  {row.get('ms', float('nan')):8.3f} ms  x{row.get('speedup_vs_default', 0):.2f}"
                      f"  err {row.get('max_rel_err', float('nan')):.1e} {row.get('error', '')}", flush=True)
            del case
            torch.cuda.empty_cache()
    if args.out:
        print("wrote", write_result(args.out, {"rows": rows}, heads=HEADS, head_dim=DIM, window=WINDOW,
                                    page_size=PAGE, topk=TOPK, default_config=default))
    failed = [f"{r['kind']} {r['step']}: {r['error']}" for r in rows if r["config"] == default and "error" in r]
    if failed:  # another config may fail and be skipped; the one the model runs may not
        raise SystemExit("the default config failed: " + "; ".join(failed))


if __name__ == "__main__":
    main()
