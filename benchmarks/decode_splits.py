"""The Triton paged decode (``decode_attention``, no shared prefix) at serving-sized batches: KV splits and
stage-1 tiles swept against the launch the backend picks, on a Llama-3.1-8B layer (32 heads, 8 KV heads,
head dim 128, bf16, pages of 16).

At 64-128 requests of about 1k tokens the kernel runs one program per (request, KV head), each walking its
keys one tile after another: this asks whether more splits (shorter walks, a merge after) or deeper
pipelining read the KV cache closer to copy bandwidth. Every variant is checked against the default's
output first; times are CUDA-graph replays (median of CUDA events).

    python benchmarks/decode_splits.py [--batches 64,96,128] [--contexts 512,1024,2048]
"""
import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import graph_of, parse_ints, time_cuda, write_result  # noqa: E402

from attnzoo.attention.kernels import decode as dec  # noqa: E402
from attnzoo.attention.kernels import decode_launch as how  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def case(batch: int, ctx: int):
    pages = -(-ctx // PAGE)
    k = torch.randn(1 + batch * pages, KV_HEADS, PAGE, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(batch * pages, device="cuda").to(torch.int32) + 1  # pages scattered, as a pool's are
    return (torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16), k, torch.randn_like(k),
            perm.view(batch, pages), torch.full((batch,), ctx, dtype=torch.int32, device="cuda"))


def copy_gbps() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / (time_cuda(lambda: y.copy_(x)) * 1e-3) / 1e9  # time_cuda: ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="64,96,128")
    ap.add_argument("--contexts", default="512,1024,2048")
    ap.add_argument("--splits", default="1,2,3,4,6,8")
    ap.add_argument("--tiles", default=None,
                    help="BLOCK_N/stages/warps triples to try, e.g. '64/1/4,32/2/4' (default: a grid of 16)")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)
    props = torch.cuda.get_device_properties(0)
    copy = copy_gbps()
    base = how.decode_launch_config(HEAD_DIM, HEAD_DIM, HEADS // KV_HEADS, torch.bfloat16)
    grid = [(n, s, w) for n, s, w in itertools.product((32, 64, 128), (1, 2, 3), (4, 8)) if not (n == 128 and s == 3)]
    if args.tiles:
        grid = [tuple(parse_ints(t.replace("/", ","))) for t in args.tiles.split(",") if t]
    if (base["BLOCK_N"], base["num_stages"], base["num_warps"]) not in grid:
        grid.append((base["BLOCK_N"], base["num_stages"], base["num_warps"]))  # the default is the reference
    tiles = [dict(base, BLOCK_N=n, num_stages=s, num_warps=w) for n, s, w in grid]
    rows = []
    print(f"{props.name}, copy {copy:.0f} GB/s; default tile {base}")
    for batch, ctx in itertools.product(parse_ints(args.batches), parse_ints(args.contexts)):
        q, k, v, tables, seq = case(batch, ctx)
        nbytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
        picked = how.choose_num_kv_splits(batch=batch, num_kv_heads=KV_HEADS, group=HEADS // KV_HEADS,
                                          max_kv_len=ctx, num_sms=props.multi_processor_count)
        ref = None
        results = []
        for splits, cfg in itertools.product(parse_ints(args.splits), tiles):
            partial = torch.empty(batch, HEADS, splits, HEAD_DIM, device="cuda")
            lse, out = torch.empty(batch, HEADS, splits, device="cuda"), torch.empty_like(q)

            def run(splits=splits, cfg=cfg, partial=partial, lse=lse, out=out, inputs=(q, k, v, tables, seq)):
                return dec.decode_attention(*inputs, scale=HEAD_DIM ** -0.5, num_kv_splits=splits,
                                            launch_config=cfg, partial=partial, lse=lse, out=out)
            try:
                got = run().float()
            except Exception as e:  # noqa: BLE001 - a tile that does not fit this GPU is skipped, and said
                print(f"  skipped splits={splits} {cfg}: {type(e).__name__}")
                continue
            if ref is None:
                ref = dec.decode_attention(q, k, v, tables, seq, scale=HEAD_DIM ** -0.5, num_kv_splits=picked).float()
            err = (got - ref).abs().max().item()
            if err > 2e-2:
                raise SystemExit(f"batch {batch} ctx {ctx} splits {splits} {cfg}: max abs error {err} vs the default")
            us = time_cuda(graph_of(run)) * 1e3
            results.append({"splits": splits, **{k_: cfg[k_] for k_ in ("BLOCK_N", "num_stages", "num_warps")},
                            "us": round(us, 1), "frac_of_copy": round(nbytes / (us * 1e-6) / 1e9 / copy, 3)})
        partial = torch.empty(batch, HEADS, picked, HEAD_DIM, device="cuda")
        lse, out = torch.empty(batch, HEADS, picked, device="cuda"), torch.empty_like(q)
        auto_us = time_cuda(graph_of(lambda: dec.decode_attention(  # noqa: E731 - the backend's own choice
            q, k, v, tables, seq, scale=HEAD_DIM ** -0.5, num_kv_splits=picked, partial=partial, lse=lse,
            out=out))) * 1e3
        auto = {"splits": picked, "us": round(auto_us, 1), "frac_of_copy": round(nbytes / (auto_us * 1e-6) / 1e9 / copy, 3)}
        default = next(r for r in results if r["splits"] == picked and r["BLOCK_N"] == base["BLOCK_N"]
                       and r["num_stages"] == base["num_stages"] and r["num_warps"] == base["num_warps"])
        best = min(results, key=lambda r: r["us"])
        print(f"batch {batch:4d} ctx {ctx:5d}: default (splits {picked}) {default['us']:7.1f} us "
              f"({default['frac_of_copy']:.2f} of copy)  auto {auto['us']:7.1f} us ({auto['frac_of_copy']:.2f})  best {best['us']:7.1f} us ({best['frac_of_copy']:.2f}) {best}")
        rows.append({"batch": batch, "ctx": ctx, "picked_splits": picked, "default": default, "auto": auto, "best": best,
                     "all": results})
    if args.out:
        write_result(args.out, {"copy_GBps": round(copy), "default_tile": base, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
