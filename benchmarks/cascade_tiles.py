"""The Triton cascade decode (``cascade_decode_attention``) with the shared pass's BLOCK_M narrowed to the
rows (request x group head) a batch has, as it was chosen until the tiles stopped depending on the batch,
against the fixed extend tile, on a Llama-3.1-8B-shaped layer (32 heads, 8 KV heads, head dim 128, bf16):
a shared prefix of 1312 tokens plus 100 of each request's own. Times are CUDA-event medians of whole calls
(three launches each), which are launch-bound at small batches.

``--sweep``: at 1319 requests (the e2e batch), on the Llama-8B layer, a gpt-oss-20b one (64 heads, 8 KV
heads, head dim 64) and DeepSeek-V2-Lite's absorbed MLA (16 heads on one latent KV head of 576 channels, the
values its first 512), each kernel's time under the profiler, then the shared pass's tiles swept (CUDA-graph
replays of the whole call; each checked against the default tile's output).

``--extend``: the MLA extend step after a shared cached prefix (DeepSeek-V2-Lite's layer, the e2e run's 1280
shared tokens in pages of 64), requests of 100 new tokens after 0-63 own cached ones, 128 to 8192 new tokens in
all: the plain extend kernel against ``cascade_extend_attention`` (the prefix as GEMMs, then the kernel over each
request's own keys), each checked against the other, and the cascade's kernels under the profiler.

``--shared-sdpa``: the Llama layer's cascade at 64-1319 requests x 72 and 200 own keys, three ways (the default,
stage 1 on the cascade's own tile, then cuDNN's shared pass too; ``shared_sdpa``), cuDNN's first call at a new
row count, and stage 1's tiles over plain decode batches.

    python benchmarks/cascade_tiles.py [--sweep [--layers dsv2lite-mla,...] | --extend | --shared-sdpa]
"""
import argparse
import functools
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import graph_of, time_cuda  # noqa: E402

from attnzoo.attention.kernels import decode as dec  # noqa: E402
from attnzoo.attention.kernels import decode_launch as how  # noqa: E402
from attnzoo.attention.kernels.extend import extend_launch_config  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE, SHARED, OWN = 32, 8, 128, 16, 1312, 100
# heads, KV heads, head dim, value dim (MLA: the values are the key's first channels, a view of the cache)
LAYERS = {"llama8b": (32, 8, 128, None), "gpt-oss-20b": (64, 8, 64, None), "dsv2lite-mla": (16, 1, 576, 512)}
# MLA's [512, rows] float32 accumulator takes narrower row blocks and fewer stages than the 64-128 wide heads;
# on an H100, 64 keys a step faulted at every width tried and 128 with 4 warps (illegal address; the
# interpreter computes those tiles right)
TILES = {"mla": ((32, 64), (32, 128), (8,), (1, 2)), "mha": ((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))}


def case(batch: int, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, v_dim=None, device="cuda"):
    """(q, k cache, v cache, block tables, seq lens): every request's table starts with the shared pages."""
    shared = list(range(1, SHARED // PAGE + 1))
    own_pages = -(-(SHARED + OWN + 1) // PAGE) - len(shared)
    k = torch.randn(1 + len(shared) + batch * own_pages, kv_heads, PAGE, head_dim, device=device, dtype=torch.bfloat16)
    first = 1 + len(shared)
    tables = [shared + list(range(first + b * own_pages, first + (b + 1) * own_pages)) for b in range(batch)]
    v = torch.randn_like(k) if v_dim is None else k[..., :v_dim]
    return (torch.randn(batch, heads, head_dim, device=device, dtype=torch.bfloat16), k, v,
            torch.tensor(tables, dtype=torch.int32, device=device),
            torch.full((batch,), SHARED + OWN + 1, dtype=torch.int32, device=device))


def print_kernels(replay, times: int = 10) -> None:
    """Each kernel's GPU time in a call and its launches a call, under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(times):
            replay()
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if e.self_device_time_total > 0:
            print(f"      {e.key[:40]:40s} {e.self_device_time_total / e.count:8.1f} us x {e.count // times}")


def sweep(layers, batch: int = 1319) -> None:
    for name in layers:
        heads, kv_heads, d, dv = LAYERS[name]
        q, k, v, tables, seq = case(batch, heads, kv_heads, d, dv)
        dv = dv or d
        partial = torch.empty(batch, heads, 2, dv, device="cuda")
        lse, out = torch.empty(batch, heads, 2, device="cuda"), q.new_empty(batch, heads, dv)
        run = lambda cfg: lambda: dec.cascade_decode_attention(  # noqa: E731
            q, k, v, tables, seq, shared_len=SHARED, scale=d ** -0.5, num_kv_splits=1, num_shared_splits=1,
            launch_config=cfg, partial=partial, lse=lse, out=out)
        default = how.cascade_launch_config(d, dv, torch.bfloat16)
        ref = run(default)().float().clone()
        replay = graph_of(run(default))
        print(f"{name} layer, {batch} requests, default {default}: {time_cuda(replay) * 1000:.1f} us")
        print_kernels(replay)
        plain = graph_of(lambda: dec.decode_attention(q, k, v, tables, seq, scale=d ** -0.5, out=out))
        print(f"   plain decode (every request reads the prefix): {time_cuda(plain) * 1000:.1f} us")
        if dec.shared_pass_kind(q, k, v, SHARED, None) == "gemm":  # MLA: the shared pass as two GEMMs (cascade_gemm)
            err = (run(None)().float() - ref).abs().max().item()
            gemm = graph_of(run(None))
            print(f"   shared pass as GEMMs: {time_cuda(gemm) * 1000:.1f} us, max diff {err:.1e}")
            print_kernels(gemm)
        timed = []
        for bm, bn, warps, stages in itertools.product(*TILES["mla" if d > 256 else "mha"]):
            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
            try:
                if (run(cfg)().float() - ref).abs().max().item() > 2e-2:
                    print(f"   wrong output: {cfg}")
                    continue
            except Exception as e:  # noqa: BLE001 (out of shared memory: not a candidate)
                print(f"   {cfg}: {type(e).__name__}")
                if type(e).__name__ == "AcceleratorError":  # a fault: the CUDA context is gone for what follows
                    print("   the GPU faulted: the tiles after this one were not tried")
                    break
                continue
            timed.append((time_cuda(graph_of(run(cfg))) * 1000, cfg))
        for t, cfg in sorted(timed, key=lambda r: r[0])[:5]:
            print(f"   {t:7.1f} us {cfg}")


def extend_case(tokens: int, shared: int = 1280, page: int = 64, new: int = 100, device="cuda"):
    """(q, k cache, v cache, block tables, q_indptr, prefix lens, max_q_len) of an MLA extend step: requests of up
    to ``new`` tokens (the last one shorter) after ``shared`` tokens in the same pages and 0-63 of their own."""
    lens = [new] * (tokens // new) + ([tokens % new] if tokens % new else [])
    own = [(37 * i) % 64 for i in range(len(lens))]
    n_shared = shared // page
    pages = [-(-(o + n) // page) for o, n in zip(own, lens)]
    k = torch.randn(1 + n_shared + sum(pages), 1, page, 576, device=device, dtype=torch.bfloat16) * 0.5
    first, tables = 1 + n_shared, []
    for n in pages:
        tables.append(list(range(1, 1 + n_shared)) + list(range(first, first + n)))
        first += n
    width = max(map(len, tables))
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    indptr = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=device)
    prefix = torch.tensor([shared + o for o in own], dtype=torch.int32, device=device)
    q = torch.randn(tokens, 16, 576, device=device, dtype=torch.bfloat16)
    return q, k, k[..., :512], tables, indptr, prefix, max(lens)


def extend_sweep() -> None:
    from attnzoo.attention.kernels import extend as ext

    print(f"{torch.cuda.get_device_name()}: MLA extend (16 heads, 576/512), 1280 shared tokens, us per call")
    for tokens in (128, 256, 512, 1024, 2048, 4096, 8192):
        q, k, v, tables, indptr, prefix, max_q = extend_case(tokens)
        args = (q, k, v, tables, indptr, prefix)
        plain = lambda: ext.extend_attention(*args, max_q_len=max_q, scale=0.04)  # noqa: E731
        cascade = lambda: ext.cascade_extend_attention(*args, shared_len=1280, max_q_len=max_q, scale=0.04)  # noqa: E731
        err = (plain().float() - cascade().float()).abs().max().item()
        chosen = ext.gemm_cascade(q, k, v, 1280, None)
        t_plain, t_casc = (time_cuda(graph_of(f)) * 1000 for f in (plain, cascade))
        print(f"tokens {tokens:5d}  plain {t_plain:8.1f}  cascade {t_casc:8.1f}  ratio {t_casc / t_plain:5.2f}  "
              f"chosen {chosen!s:5}  max diff {err:.1e}")
        if tokens == 8192:
            print_kernels(graph_of(cascade))
    # The scores' chunk: small enough that the softmax and the values' product may read it from L2, large enough
    # for the GEMMs to fill the GPU. The extend step at 8192 tokens and the decode step at 1319 requests.
    from attnzoo.attention.kernels import cascade_gemm

    q, k, v, tables, indptr, prefix, max_q = extend_case(8192)
    extend = lambda: ext.cascade_extend_attention(q, k, v, tables, indptr, prefix, shared_len=1280,  # noqa: E731
                                                  max_q_len=max_q, scale=0.04)
    dq, dk, dv, dtables, seq = case(1319, 16, 1, 576, 512)
    partial, lse = torch.empty(1319, 16, 2, 512, device="cuda"), torch.empty(1319, 16, 2, device="cuda")
    decode = lambda: dec.cascade_decode_attention(dq, dk, dv, dtables, seq, shared_len=SHARED,  # noqa: E731
                                                  scale=0.04, num_kv_splits=1, partial=partial, lse=lse)
    # The second half's tiles (each request's own keys, about 130 a token here), safest first: a fault ends the sweep.
    ref = extend().float()
    for bm, bn, warps, stages in ((32, 32, 4, 2), (32, 128, 8, 1), (32, 32, 4, 1), (32, 32, 8, 1), (16, 32, 4, 1),
                                  (16, 32, 4, 2), (16, 128, 8, 1), (64, 32, 8, 1)):
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
        run = lambda: ext.cascade_extend_attention(q, k, v, tables, indptr, prefix, shared_len=1280,  # noqa: E731
                                                   max_q_len=max_q, scale=0.04, launch_config=cfg)
        try:
            err = (run().float() - ref).abs().max().item()
            print(f"rest tile {cfg}: {time_cuda(graph_of(run)) * 1000:7.1f} us the call, max diff {err:.1e}")
        except Exception as e:  # noqa: BLE001 (out of shared memory: not a candidate)
            print(f"rest tile {cfg}: {type(e).__name__}")
            if type(e).__name__ == "AcceleratorError":  # a fault: the CUDA context is gone for what follows
                return
    default = cascade_gemm.CHUNK_SCORE_BYTES
    try:
        for mb in (8, 16, 32, 64, 128, 256):
            cascade_gemm.CHUNK_SCORE_BYTES = mb << 20
            print(f"score chunks of {mb:3d} MB: extend 8192 tokens {time_cuda(graph_of(extend)) * 1000:7.1f} us, "
                  f"decode 1319 requests {time_cuda(graph_of(decode)) * 1000:6.1f} us")
    finally:
        cascade_gemm.CHUNK_SCORE_BYTES = default


def shared_sdpa(batches=(64, 128, 256, 512, 1024, 1319), owns=(72, 200)) -> None:
    """The Llama-8B layer's cascade call three ways, CUDA-graph replays: the Triton shared pass with stage 1's
    default tile, with the cascade's own tile, and the cuDNN shared pass with it; each checked against the first.
    Then cuDNN's first call at a new row count (its plan built) and stage 1's tiles over plain decode batches."""
    from attnzoo.attention.kernels import cascade_sdpa

    global OWN
    print(f"{torch.cuda.get_device_name()}: Llama-8B layer, shared {SHARED} tokens, us per cascade call")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    d, default_own = HEAD_DIM, how.decode_launch_config(HEAD_DIM, HEAD_DIM, HEADS // KV_HEADS, torch.bfloat16)
    floor, own_launch = cascade_sdpa.MIN_ROWS, dec.cascade_own_launch_config
    for own, batch in itertools.product(owns, batches):
        OWN = own
        q, k, v, tables, seq = case(batch)
        out = q.new_empty(batch, HEADS, d)
        # the Triton pass splits the prefix as the backend does (to fill the GPU at small batches); cuDNN takes one
        tiled_splits = how.choose_num_shared_splits(batch=batch, num_kv_heads=KV_HEADS, group=HEADS // KV_HEADS,
                                                    shared_len=SHARED, num_sms=sms, block_m=64, max_splits=63)

        def call(shared_splits=1):
            return dec.cascade_decode_attention(q, k, v, tables, seq, shared_len=SHARED, scale=d ** -0.5,
                                                num_kv_splits=1, num_shared_splits=shared_splits, out=out, graph=True)
        row, ref = [], None
        for name, own_tile, cudnn in (("default", False, False), ("own tile", True, False),
                                      ("own + cudnn", True, True)):
            fn = functools.partial(call, 1 if cudnn else tiled_splits)
            cascade_sdpa.MIN_ROWS = 0 if cudnn else 1 << 62
            dec.cascade_own_launch_config = own_launch if own_tile else (lambda *a: None)
            try:
                got = fn().float()
                ref = got.clone() if ref is None else ref
                t = time_cuda(graph_of(fn)) * 1000
            finally:
                cascade_sdpa.MIN_ROWS, dec.cascade_own_launch_config = floor, own_launch
            row.append(f"{name} {t:6.1f} ({(got - ref).abs().max().item():.0e})")
        print(f"own {own:3d} batch {batch:5d} rows {batch * HEADS:6d}: " + "  ".join(row))
        if batch == batches[-1]:
            cascade_sdpa.MIN_ROWS = 0
            try:
                print_kernels(graph_of(call))
            finally:
                cascade_sdpa.MIN_ROWS = floor
    q, k, v, tables, seq = case(777)
    rows = q.view(777, KV_HEADS, -1, d).transpose(0, 1).reshape(1, KV_HEADS, -1, d)
    keys = torch.randn(1, KV_HEADS, SHARED, d, device="cuda", dtype=q.dtype)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    cascade_sdpa._attend(rows, keys, keys, 0.1)
    torch.cuda.synchronize()
    print(f"cuDNN's first call at a new row count ({rows.shape[2]} rows): {(time.perf_counter() - t0) * 1000:.1f} ms")
    for batch, ctx in ((1, 1400), (8, 1400), (83, 1150), (256, 400), (1319, 300)):
        OWN = max(1, ctx - SHARED - 1)
        q, k, v, tables, seq = case(batch)
        seq.fill_(ctx)
        splits = how.layer_kv_splits(batch=batch, heads=HEADS, num_kv_heads=KV_HEADS, head_dim=d, v_dim=d,
                                     values_in_keys=False, dtype=q.dtype, max_kv_len=ctx,
                                     num_sms=sms)
        row = []
        tiles = ((32, 4, 2), (16, 1, 1), (16, 2, 2), (16, 4, 2), (32, 2, 2))
        for cfg in (None, *(dict(default_own, BLOCK_N=n, num_warps=w, num_stages=st) for n, w, st in tiles)):
            fn = functools.partial(dec.decode_attention, q, k, v, tables, seq, scale=d ** -0.5, num_kv_splits=splits,
                                   launch_config=cfg)
            row.append(f"{time_cuda(graph_of(fn)) * 1000:6.1f}")
        print(f"plain decode batch {batch:5d} x {ctx} keys, {splits} splits: default, then (BLOCK_N, warps, "
              f"stages) {tiles}: " + " / ".join(row))


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    group = HEADS // KV_HEADS
    print(f"{torch.cuda.get_device_name()}: shared {SHARED} + own {OWN} tokens, us per call")
    for batch in (2, 4, 8, 16, 64, 256, 1319):
        q, k, v, tables, seq = case(batch)
        fixed = extend_launch_config(HEAD_DIM, HEAD_DIM, torch.bfloat16)
        narrowed = dict(fixed, BLOCK_M=min(fixed["BLOCK_M"], max(dec.MIN_TILE, dec.next_pow2(batch * group))))
        splits = min(how.choose_num_kv_splits(batch=batch, num_kv_heads=KV_HEADS, group=group, max_kv_len=OWN + 1,
                                              num_sms=sms), how.MAX_KV_SPLITS - 1)
        row, outs = [], []
        for name, cfg in (("narrowed", narrowed), ("fixed", fixed)):
            shared_splits = how.choose_num_shared_splits(batch=batch, num_kv_heads=KV_HEADS, group=group,
                                                         shared_len=SHARED, num_sms=sms, block_m=cfg["BLOCK_M"],
                                                         max_splits=how.MAX_KV_SPLITS - splits)
            fn = lambda: dec.cascade_decode_attention(  # noqa: E731
                q, k, v, tables, seq, shared_len=SHARED, scale=HEAD_DIM ** -0.5, num_kv_splits=splits,
                num_shared_splits=shared_splits, launch_config=cfg)
            outs.append(fn().float())
            row.append(f"{name} BLOCK_M {cfg['BLOCK_M']:3d}: {time_cuda(fn, warmup=5, iters=50) * 1000:6.1f}")
        print(f"batch {batch:5d}  " + "  ".join(row) + f"  max diff {(outs[0] - outs[1]).abs().max().item():.1e}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--extend", action="store_true", help="the MLA extend cascade against the plain kernel")
    ap.add_argument("--shared-sdpa", action="store_true",
                    help="the Llama layer's cascade: cuDNN's shared pass and stage 1's own tile against the defaults")
    ap.add_argument("--layers", default=",".join(LAYERS), help=f"the sweep's layers, of {', '.join(LAYERS)}")
    args = ap.parse_args()
    if args.extend:
        extend_sweep()
    elif args.shared_sdpa:
        shared_sdpa()
    else:
        sweep(args.layers.split(",")) if args.sweep else main()
