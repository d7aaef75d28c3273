"""MLA decode on one GPU for DeepSeek-V3 shapes, per backend: the attention kernel and the whole MLA core.

    python benchmarks/mla_decode.py [--backends torch,triton] [--batches 1,16,64,128]
                                    [--contexts 1024,8192] [--page-size 64] [--output FILE.json]

DeepSeek-V3 attention (deepseek-ai/DeepSeek-V3 config.json): 128 heads, kv_lora_rank 512,
qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128. Decode runs the absorbed form: per request
one query of 128 heads x 576 over the latent cache (one entry of 576 values per token), values = the
first 512 channels of the entry.

Two rows per (backend, batch, context):
  attention  ``backend.decode`` of one layer: q [B, 128, 576] -> latent out [B, 128, 512].
             Bytes = q read + every cached entry read once + output written.
  mla_core   ``MLAAttention`` (attnzoo/attention/mla.py) in a DECODE step: store the new entry,
             absorb q_nope through W_UK, attention, project through W_UV. Bytes add W_UK/W_UV
             (128 x 256 x 512 weights), the inputs, the store and the [B, 128 x 128] output. At small
             batches the weights, not the cache, dominate: the absorbed form's fixed cost.

Every backend is first checked against the torch reference on a small case (relative error <= 1e-2
in bf16, no NaN); one that fails or cannot run here (package missing, GPU or page size unsupported) is
reported with the reason and not timed. Times are CUDA-event medians with the L2 cache flushed before
every run; bandwidth is compared to the measured device-to-device copy bandwidth (read + write).
The table prints to stdout; the JSON (device, versions, copy bandwidth, checks, rows) goes to
``--output`` (default ``benchmarks/results/mla_decode_<gpu>.json``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from common import RESULTS, gpu_slug, parse_ints, time_cuda, write_result  # noqa: E402

from attnzoo.attention.backends import backend_names, get_backend_class  # noqa: E402
from attnzoo.attention.kv_cache import KVPool  # noqa: E402
from attnzoo.attention.layer import ForwardContext  # noqa: E402
from attnzoo.attention.metadata import ForwardMode, build_metadata  # noqa: E402
from attnzoo.attention.mla import MLAAttention, absorb_query, split_kv_b  # noqa: E402
from attnzoo.errors import AttnzooError  # noqa: E402
from attnzoo.roofline import copy_bandwidth  # noqa: E402

HEADS, RANK, ROPE, NOPE, V_DIM = 128, 512, 64, 128, 128
SOURCE = "deepseek-ai/DeepSeek-V3 (num_attention_heads 128, kv_lora_rank 512, qk_rope_head_dim 64)"


class Case:
    """One MLA layer's pool (random entries, fragmented pages), a DECODE step, and its inputs."""

    def __init__(self, batch: int, ctx: int, page_size: int, dtype, device, seed: int = 0):
        self.batch, self.ctx = batch, ctx
        self.core = MLAAttention(0, HEADS, kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                                 v_head_dim=V_DIM, scale=(NOPE + ROPE) ** -0.5)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        pages_per_req = -(-ctx // page_size)
        num_pages = batch * pages_per_req + 1
        self.pool = KVPool([self.core.attn.kv_cache_spec()], num_pages=num_pages, page_size=page_size,
                           dtype=dtype, device=device)
        self.pool.buffer.view(dtype).normal_()
        order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # fragmented, like a busy cache
        tables = [order[i * pages_per_req:(i + 1) * pages_per_req] for i in range(batch)]
        self.meta = build_metadata(prefix_lens=[ctx - 1] * batch, q_lens=[1] * batch, block_tables=tables,
                                   page_size=page_size, device=device, mode=ForwardMode.DECODE)
        rnd = lambda *s: torch.randn(*s, device=device, dtype=dtype)  # noqa: E731
        self.q_nope, self.q_pe = rnd(batch, HEADS, NOPE), rnd(batch, HEADS, ROPE)
        self.latent, self.k_pe = rnd(batch, RANK), rnd(batch, ROPE)
        self.kv_b = rnd(HEADS * (NOPE + V_DIM), RANK) * RANK**-0.5
        w_uk, _ = split_kv_b(self.kv_b, HEADS, NOPE)
        self.q = torch.cat([absorb_query(self.q_nope, w_uk), self.q_pe], dim=-1).contiguous()  # [B, H, 576]

    def attention(self, backend, plan):
        return backend.decode(self.core.attn, self.q, self.meta, plan)

    def mla_core(self, backend, plan):
        ctx = ForwardContext(self.meta, self.pool, backend, backend, plan)
        return self.core(self.q_nope, self.q_pe, self.latent, self.k_pe, self.kv_b, ctx)

    def bytes_moved(self, component: str, elt: int) -> int:
        b, entry = self.batch, RANK + ROPE
        attn = elt * (b * HEADS * entry + b * self.ctx * entry + b * HEADS * RANK)
        if component == "attention":
            return attn
        weights = HEADS * (NOPE + V_DIM) * RANK
        inputs = b * (HEADS * (NOPE + ROPE) + RANK + ROPE)
        return attn + elt * (weights + inputs + b * entry + b * HEADS * V_DIM)


def check_backend(name: str, page_size: int, dtype, device) -> tuple[bool, str]:
    """Both components on a small case vs the torch reference: relative error <= 1e-2, no NaN."""
    try:
        case = Case(3, 300, page_size, dtype, device, seed=1)
        ref_backend = get_backend_class("torch")(case.pool)
        backend = get_backend_class(name)(case.pool)
        errs = []
        for run in (case.attention, case.mla_core):
            ref = run(ref_backend, ref_backend.prepare(case.meta)).float()
            out = run(backend, backend.prepare(case.meta)).float()
            if out.isnan().any():
                return False, f"NaN in {run.__name__} output"
            errs.append(((out - ref).norm() / ref.norm()).item())
    except AttnzooError as e:
        return False, f"cannot run: {e}"
    except Exception as e:  # a crashing backend is reported, and the benchmark goes on with the others
        return False, f"crashed: {type(e).__name__}: {e}"
    worst = max(errs)
    return worst <= 1e-2, f"relative error {worst:.2e}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="torch,triton", help=f"comma-separated, from: {', '.join(backend_names())}")
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--page-size", type=int, default=64, help="64 suits every MLA backend (trtllm_mla: 32 or 64)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--components", default="attention,mla_core")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--output", default=None, help="JSON path (default benchmarks/results/mla_decode_<gpu>.json)")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    # torch first: the other backends' rows report their speedup over it.
    backends = sorted((b for b in args.backends.split(",") if b), key=lambda b: b != "torch")
    components = [c for c in args.components.split(",") if c]
    unknown = [b for b in backends if b not in backend_names()]
    unknown += [c for c in components if c not in ("attention", "mla_core")]
    if unknown:
        print(f"unknown backend(s)/component(s): {', '.join(unknown)}; backends: {', '.join(backend_names())}; "
              "components: attention, mla_core", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    elt = torch.empty((), dtype=dtype).element_size()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    out_path = Path(args.output or RESULTS / f"mla_decode_{gpu_slug()}.json")

    copy_gbps = copy_bandwidth(device)
    print(f"# {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
          f"copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    print(f"# shape: {SOURCE}; page size {args.page_size}; {args.dtype}")

    checks, ok = [], {}
    for b in backends:
        ok[b], why = check_backend(b, args.page_size, dtype, device)
        checks.append({"backend": b, "ok": ok[b], "detail": why})
        print(f"# check {b:>14} {'ok  ' if ok[b] else 'FAIL'} {why}")

    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    rows = []
    header = f"{'component':<10} {'batch':>5} {'ctx':>6} {'backend':>14} {'ms':>9} {'GB/s':>7} {'%copy':>6} {'vs torch':>8}"
    print(header)
    print("-" * len(header))
    for batch in parse_ints(args.batches):
        for ctx in parse_ints(args.contexts):
            case = Case(batch, ctx, args.page_size, dtype, device)
            for component in components:
                torch_ms = None
                for b in backends:
                    if not ok[b]:
                        continue
                    backend = get_backend_class(b)(case.pool)
                    fn = getattr(case, component)
                    plan = backend.prepare(case.meta)  # once per step, as the engine does: not per layer
                    slow = b == "torch"
                    ms = time_cuda(lambda: fn(backend, plan), warmup=1 if slow else args.warmup,
                                   iters=max(3, args.iters // 10) if slow else args.iters, flush=flush)
                    torch_ms = ms if b == "torch" else torch_ms
                    nbytes = case.bytes_moved(component, elt)
                    gbps = nbytes / (ms * 1e-3) / 1e9
                    speedup = torch_ms / ms if torch_ms else None
                    rows.append({"component": component, "batch": batch, "ctx": ctx, "backend": b,
                                 "page_size": args.page_size, "ms": ms, "bytes": nbytes, "GBps": gbps,
                                 "frac_of_copy": gbps / copy_gbps, "speedup_vs_torch": speedup})
                    print(f"{component:<10} {batch:>5} {ctx:>6} {b:>14} {ms:>9.3f} {gbps:>7.0f} "
                          f"{100 * gbps / copy_gbps:>5.0f}% {'' if speedup is None else f'{speedup:.1f}x':>8}")
                    del backend
            del case
            torch.cuda.empty_cache()

    result = {
        "benchmark": "mla_decode",
        "num_sms": props.multi_processor_count,
        "dtype": args.dtype,
        "page_size": args.page_size,
        "shape": {"heads": HEADS, "kv_lora_rank": RANK, "qk_rope_head_dim": ROPE, "qk_nope_head_dim": NOPE,
                  "v_head_dim": V_DIM, "source": SOURCE},
        "copy_bandwidth_GBps": copy_gbps,
        "checks": checks,
        "rows": rows,
        "args": vars(args),
    }
    out_path = write_result(out_path, result)
    print(f"# wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
