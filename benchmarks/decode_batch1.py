"""Batch-1 decode attention, stage by stage, as a decode step runs it: one request, a CUDA graph of
``--layers`` back-to-back layers, each over its own paged cache (so the caches stream from HBM, not L2).

    python benchmarks/decode_batch1.py [--shapes llama8b,dsv2lite] [--context 1600] [--layers 32]
                                       [--variants all] [--out PREFIX] [--ncu]

Per (shape, variant): microseconds a layer for stage 1 + stage 2 (``decode_attention``), stage 1 alone and
stage 2 alone, and the bandwidth the pair reaches on the layer's KV bytes. A variant changes the split
count or stage 1's tile (``launch_config``); every variant is first checked against a float32 reference.
``--ncu``: each variant runs a few eager calls only (for ``ncu -k regex:_decode_stage``), nothing timed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import graph_of, time_cuda, write_result  # noqa: E402

from attnzoo.attention.kernels import decode as dec  # noqa: E402
from attnzoo.attention.kernels.decode_launch import decode_launch_config, layer_kv_splits  # noqa: E402

# heads, KV heads, key dim, value dim, values inside the key (MLA), the sliding window (None: every key)
SHAPES = {
    "llama8b": dict(heads=32, kv_heads=8, dim=128, v_dim=128, v_from_k=False, window=None),
    "dsv2lite": dict(heads=16, kv_heads=1, dim=576, v_dim=512, v_from_k=True, window=None),
    "gemma4_31b_global": dict(heads=32, kv_heads=4, dim=512, v_dim=512, v_from_k=True, window=None),
    "gemma4_31b_sliding": dict(heads=32, kv_heads=16, dim=256, v_dim=256, v_from_k=False, window=1024),
}
GRAPH_MAX_KV_LEN = 131072  # a graph covers the model's context: its split counts follow the SMs, not the step
PAGE = 16


# module knobs of ``decode`` a variant may change: the merge's value chunks (none; 64 wide, as many as it takes)
KNOBS = {"no_chunk": {"MERGE_CHUNKS": 1}, "chunk64": {"MERGE_CHUNKS": 16}}


def graph_splits(shape: dict) -> int:
    """The split count the backend picks for this shape in a batch-1 graph (triton.py's decode)."""
    return layer_kv_splits(batch=1, heads=shape["heads"], num_kv_heads=shape["kv_heads"], head_dim=shape["dim"],
                           v_dim=shape["v_dim"], values_in_keys=shape["v_from_k"], dtype=torch.bfloat16,
                           max_kv_len=min(GRAPH_MAX_KV_LEN, shape["window"] or GRAPH_MAX_KV_LEN),
                           num_sms=torch.cuda.get_device_properties(0).multi_processor_count)


def variants(shape: dict) -> dict[str, tuple[int, dict | None, dict]]:
    """name -> (splits, launch_config or None for the default, decode module knobs)."""
    base = decode_launch_config(shape["dim"], shape["v_dim"], shape["heads"] // shape["kv_heads"], torch.bfloat16)
    splits = graph_splits(shape)
    out = {"default": (splits, None, {})}
    out.update({name: (splits, None, knobs) for name, knobs in KNOBS.items()})
    for s in (4, 8, 16, 32, 64):
        if s != splits:
            out[f"splits{s}"] = (s, None, {})
    # 64 keys a tile at MLA's 576 channels faulted (an illegal address) on an H200: not a tile the launcher picks
    for n in (16, 32) if shape["dim"] > 256 else (16, 32, 64):
        for w, st in ((4, 1), (4, 2), (4, 3), (8, 2)):
            cfg = dict(base, BLOCK_N=n, num_warps=w, num_stages=st)
            if cfg != base:
                out[f"n{n}_w{w}_s{st}"] = (splits, cfg, {})
    return out


def build(shape: dict, context: int, layers: int, device):
    """Per layer a cache whose pages the block table visits in a shuffled order, the query, the outputs."""
    pages = -(-context // PAGE)
    gen = torch.Generator().manual_seed(0)
    caches, tables = [], []
    for _ in range(layers):
        k = torch.randn(pages + 1, shape["kv_heads"], PAGE, shape["dim"], generator=gen).to(device, torch.bfloat16)
        v = (k[..., : shape["v_dim"]] if shape["v_from_k"] else
             torch.randn(pages + 1, shape["kv_heads"], PAGE, shape["v_dim"], generator=gen).to(device, torch.bfloat16))
        caches.append((k, v))
        tables.append((torch.randperm(pages, generator=gen) + 1).to(device, torch.int32)[None])
    q = torch.randn(1, shape["heads"], shape["dim"], generator=gen).to(device, torch.bfloat16)
    seq_lens = torch.tensor([context], dtype=torch.int32, device=device)
    return q, caches, tables, seq_lens


def reference(q, k, v, table, context: int, scale: float, window: int | None) -> torch.Tensor:
    first = max(0, context - window) if window else 0  # a sliding layer attends to the last ``window`` keys
    rows_k = k[table[0].long()].transpose(1, 2).reshape(-1, k.shape[1], k.shape[3])[first:context].float()
    rows_v = v[table[0].long()].transpose(1, 2).reshape(-1, v.shape[1], v.shape[3])[first:context].float()
    group = q.shape[1] // k.shape[1]
    rows_k, rows_v = rows_k.repeat_interleave(group, 1), rows_v.repeat_interleave(group, 1)
    p = torch.softmax(torch.einsum("hd,thd->ht", q[0].float(), rows_k) * scale, dim=-1)
    return torch.einsum("ht,thd->hd", p, rows_v)


def run_shape(name: str, shape: dict, args) -> list[dict]:
    q, caches, tables, seq_lens = build(shape, args.context, args.layers, torch.device("cuda"))
    scale = shape["dim"] ** -0.5
    want = reference(q, *caches[0], tables[0], args.context, scale, shape["window"])
    keys = min(args.context, shape["window"] or args.context)
    kv_bytes = keys * shape["kv_heads"] * (shape["dim"] + (0 if shape["v_from_k"] else shape["v_dim"])) * 2
    chosen = variants(shape)
    if args.variants != "all":
        chosen = {k: v for k, v in chosen.items() if k in args.variants.split(",")}
    rows = []
    for vname, (splits, cfg, knobs) in chosen.items():
        saved = {k: getattr(dec, k) for k in knobs}
        for k, v in knobs.items():
            setattr(dec, k, v)
        try:
            rows.append(run_variant(name, vname, shape, splits, cfg, q, caches, tables, seq_lens, want, kv_bytes, args))
        finally:
            for k, v in saved.items():
                setattr(dec, k, v)
    return rows


def run_variant(name, vname, shape, splits, cfg, q, caches, tables, seq_lens, want, kv_bytes, args) -> dict:
    device, scale = q.device, shape["dim"] ** -0.5
    out = torch.empty(1, shape["heads"], shape["v_dim"], dtype=torch.bfloat16, device=device)
    partial = torch.empty(1, shape["heads"], splits, shape["v_dim"], dtype=torch.float32, device=device)
    lse = torch.empty(1, shape["heads"], splits, dtype=torch.float32, device=device)

    def both(i, cfg=cfg, splits=splits, out=out, partial=partial, lse=lse):
        k, v = caches[i]
        return dec.decode_attention(q, k, v, tables[i], seq_lens, scale=scale, num_kv_splits=splits, out=out,
                                    partial=partial, lse=lse, launch_config=cfg, sliding_window=shape["window"])

    def stage1(i, cfg=cfg, splits=splits, partial=partial, lse=lse):
        k, v = caches[i]
        dec._stage1(q, k, v, tables[i], seq_lens, partial, lse, direct=splits == 1, num_kv_splits=splits,
                    scale=scale, sliding_window=shape["window"], logit_softcap=None, kv_skip=0, launch_config=cfg)

    def stage2(i, out=out, partial=partial, lse=lse):
        dec._stage2(partial, lse, out)

    try:
        got = both(0).float()
    except Exception as e:  # a tile that does not compile or fit: reported, not timed
        return {"shape": name, "variant": vname, "error": f"{type(e).__name__}: {e}"[:200]}
    err = (got[0] - want).abs().max().item()
    row = {"shape": name, "variant": vname, "splits": splits, "config": cfg, "max_err": err}
    if err > 2e-2:
        row["error"] = f"wrong output, max abs error {err:.3g}"
        return row
    if args.ncu:
        for _ in range(3):
            both(0)
        torch.cuda.synchronize()
        return row
    for part, fn in (("both", both), ("stage1", stage1), ("stage2", stage2)):
        replay = graph_of(lambda fn=fn: [fn(i) for i in range(args.layers)])
        row[f"{part}_us"] = time_cuda(replay, warmup=3, iters=args.iters) * 1e3 / args.layers
    row["kv_tb_s"] = kv_bytes / (row["both_us"] * 1e-6) / 1e12
    print(f"{name:18s} {vname:20s} both {row['both_us']:6.2f} us  stage1 {row['stage1_us']:6.2f}  "
          f"stage2 {row['stage2_us']:6.2f}  KV {row['kv_tb_s']:.2f} TB/s  err {err:.1e}", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama8b,dsv2lite")
    ap.add_argument("--context", type=int, default=1600, help="keys of the one request (a GSM8K 8-shot prompt + 256)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--variants", default="all", help="comma-separated names, or all")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args()
    rows = []
    for name in args.shapes.split(","):
        rows += run_shape(name, SHAPES[name], args)
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:18s} {r['variant']:14s} {r['error']}")
    if args.out:
        write_result(args.out, {"rows": rows, "context": args.context, "layers": args.layers, "page_size": PAGE})


if __name__ == "__main__":
    main()
