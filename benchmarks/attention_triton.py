"""Decode and extend attention timings on one GPU, per backend, for real models' attention shapes.

    python benchmarks/attention_triton.py [--backends torch,triton] [--shapes ...] [--output FILE.json]

Every backend goes through the ``AttentionBackend`` contract (``prepare`` once per step, then
``decode`` / ``extend`` of one layer), so any backend registered in ``attnzoo.attention.backends``
(FlashInfer ones once wired in) can be named in ``--backends``. Before timing, each backend is checked
against the torch reference on a small case of each shape; a backend that fails the check or cannot
run here is reported and skipped, never silently timed.

Reported per case: median time (CUDA events, L2 flushed before every run), achieved bandwidth = bytes
of q and of the KV actually needed read + output written, over time, its ratio to the measured
device-to-device copy bandwidth (torch copy of a large buffer, read + write bytes), and for extend the
attention FLOP/s. The table prints to stdout; the JSON (device, versions, copy bandwidth, every row)
goes to ``--output`` (default ``benchmarks/results/attention_triton_<gpu>.json``).
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from attnzoo.attention.backends import backend_names, get_backend_class  # noqa: E402
from attnzoo.attention.backends.torch_ref import TorchBackend  # noqa: E402
from attnzoo.attention.kv_cache import KVPool  # noqa: E402
from attnzoo.attention.layer import Attention  # noqa: E402
from attnzoo.attention.metadata import ForwardMode, build_metadata  # noqa: E402
from attnzoo.errors import AttnzooError  # noqa: E402


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int | None = None
    kind: str = "mha"
    source: str = ""


# Public configs: Llama-3.1-8B config.json; Gemma-4-31B text_config (num_attention_heads 32,
# num_key_value_heads 16 / head_dim 256 on sliding layers with sliding_window 1024,
# num_global_key_value_heads 4 / global_head_dim 512 on full-attention layers); DeepSeek-V3 absorbed
# MLA (128 heads, kv_lora_rank 512 + qk_rope_head_dim 64).
SHAPES = {
    s.name: s
    for s in (
        Shape("llama3.1-8b", 32, 8, 128, 128, source="meta-llama/Llama-3.1-8B"),
        Shape("gemma4-31b-global", 32, 4, 512, 512, source="google/gemma-4-31B-it full_attention"),
        Shape("gemma4-31b-sliding", 32, 16, 256, 256, window=1024, source="google/gemma-4-31B-it sliding_attention"),
        Shape("deepseek-v3-mla", 128, 1, 576, 512, kind="mla", source="deepseek-ai/DeepSeek-V3 absorbed MLA"),
    )
}
DEFAULT_SHAPES = ["llama3.1-8b", "gemma4-31b-global", "gemma4-31b-sliding"]


def layer_for(shape: Shape) -> Attention:
    return Attention(0, shape.heads, shape.kv_heads, shape.head_dim, v_head_dim=shape.v_head_dim,
                     sliding_window=shape.window, kind=shape.kind)


class Case:
    """One layer's pool, step metadata and query for (shape, mode, batch, context)."""

    def __init__(self, shape: Shape, mode: str, batch: int, ctx: int, page_size: int, dtype, device, seed=0):
        self.shape, self.mode, self.batch, self.ctx = shape, mode, batch, ctx
        self.layer = layer_for(shape)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        pages_per_req = -(-ctx // page_size)
        # Decode over a sliding window only reads the last `window` tokens: give the earlier positions
        # page 0 (reserved, never read by a correct kernel) so long contexts fit in memory.
        first_real = 0
        if mode == "decode" and shape.window:
            first_real = max(0, (ctx - shape.window) // page_size)
        real = pages_per_req - first_real
        num_pages = batch * real + 1
        self.pool = KVPool([self.layer.kv_cache_spec()], num_pages=num_pages, page_size=page_size,
                           dtype=dtype, device=device)
        self.pool.buffer.view(dtype).normal_()
        order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # fragmented, like a busy cache
        tables = [[0] * first_real + order[i * real:(i + 1) * real] for i in range(batch)]
        if mode == "decode":
            prefix, q_lens = [ctx - 1] * batch, [1] * batch
        else:
            prefix, q_lens = [0] * batch, [ctx] * batch
        self.meta = build_metadata(prefix_lens=prefix, q_lens=q_lens, block_tables=tables, page_size=page_size,
                                   device=device, mode=ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND)
        tokens = sum(q_lens)
        self.q = torch.randn(tokens, shape.heads, shape.head_dim, device=device, dtype=dtype)

    def run(self, backend, plan):
        if self.mode == "decode":
            return backend.decode(self.layer, self.q, self.meta, plan)
        return backend.extend(self.layer, self.q, self.meta, plan)

    def bytes_moved(self) -> int:
        """q read + the KV each query needs read once + output written."""
        s, elt = self.shape, self.q.element_size()
        tokens = self.q.shape[0]
        kv_tokens = self.batch * (min(self.ctx, s.window) if (s.window and self.mode == "decode") else self.ctx)
        per_kv_token = s.kv_heads * (s.head_dim + (0 if s.kind == "mla" else s.v_head_dim))
        return elt * (tokens * s.heads * s.head_dim + kv_tokens * per_kv_token + tokens * s.heads * s.v_head_dim)

    def flops(self) -> float:
        """2 * (head_dim + v_head_dim) per visible (query, key) pair and head."""
        s = self.shape
        if self.mode == "decode":
            pairs = self.batch * (min(self.ctx, s.window) if s.window else self.ctx)
        else:
            n, w = self.ctx, s.window or self.ctx
            full = n * (n + 1) / 2  # causal triangle
            if w < n:
                full -= (n - w) * (n - w + 1) / 2  # keys that fell out of every window
            pairs = self.batch * full
        return 2.0 * s.heads * (s.head_dim + s.v_head_dim) * pairs


def kv_bytes_needed(shape: Shape, mode: str, batch: int, ctx: int, page_size: int, elt: int) -> int:
    kv = shape.kv_heads * (shape.head_dim + (0 if shape.kind == "mla" else shape.v_head_dim)) * elt
    tokens_kept = min(ctx, shape.window + 2 * page_size) if (mode == "decode" and shape.window) else ctx
    q_and_out = (ctx if mode == "extend" else 1) * shape.heads * (shape.head_dim + shape.v_head_dim) * elt
    return batch * (tokens_kept * kv + q_and_out)


def time_cuda(fn, *, warmup: int, iters: int, flush: torch.Tensor) -> float:
    """Median milliseconds of ``fn``, with the L2 cache flushed before each run (not timed)."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy: bytes read + bytes written per second (GB/s)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    flush = torch.empty(1, dtype=torch.uint8, device=device)
    ms = time_cuda(lambda: dst.copy_(src), warmup=5, iters=30, flush=flush)
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


def make_backend(name: str, pool: KVPool):
    return get_backend_class(name)(pool)


def check_backend(name: str, shape: Shape, mode: str, page_size: int, dtype, device) -> tuple[bool, str]:
    """Small case vs the torch reference: relative error <= 1e-2 and no NaN."""
    try:
        case = Case(shape, mode, 3, 300 if mode == "decode" else 160, page_size, dtype, device, seed=1)
        backend = make_backend(name, case.pool)
        plan = backend.prepare(case.meta)
        out = case.run(backend, plan).float()
        ref_be = TorchBackend(case.pool)
        plan = ref_be.prepare(case.meta)
        ref = case.run(ref_be, plan).float()
    except AttnzooError as e:
        return False, f"cannot run: {e}"
    except Exception as e:  # a crashing backend is reported, and the benchmark goes on with the others
        return False, f"crashed: {type(e).__name__}: {e}"
    if out.isnan().any():
        return False, "NaN in output"
    err = ((out - ref).norm() / ref.norm()).item()
    return err <= 1e-2, f"relative error {err:.2e}"


def versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("triton", "flashinfer", "transformers"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:
            v[mod] = None
    return v


def parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="torch,triton",
                    help=f"comma-separated, from: {', '.join(backend_names())}")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"from: {', '.join(SHAPES)}")
    ap.add_argument("--modes", default="decode,extend")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--contexts", default="512,4096,16384")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--max-extend-tokens", type=int, default=65536,
                    help="skip extend cases with more new tokens than this (batch * context)")
    ap.add_argument("--torch-max-tokens", type=int, default=65536,
                    help="time the torch reference only where batch * context is at most this (it is slow)")
    ap.add_argument("--torch-max-extend-ctx", type=int, default=4096,
                    help="the torch reference materialises [heads, ctx, ctx] scores: skip longer extends")
    ap.add_argument("--memory-fraction", type=float, default=0.6,
                    help="skip cases whose pool would take more than this fraction of free GPU memory")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--output", default=None, help="JSON path (default benchmarks/results/attention_triton_<gpu>.json)")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    backends = [b for b in args.backends.split(",") if b]
    unknown = [b for b in backends if b not in backend_names()]
    shapes = [s for s in args.shapes.split(",") if s]
    unknown += [s for s in shapes if s not in SHAPES]
    if unknown:
        print(f"unknown backend(s)/shape(s): {', '.join(unknown)}; backends: {', '.join(backend_names())}; "
              f"shapes: {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    modes = [m for m in args.modes.split(",") if m]
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    gpu_slug = re.sub(r"[^a-z0-9]+", "_", props.name.lower()).strip("_")
    out_path = Path(args.output or Path(__file__).parent / "results" / f"attention_triton_{gpu_slug}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)

    copy_gbps = copy_bandwidth(device)
    print(f"# {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
          f"copy bandwidth {copy_gbps:.0f} GB/s (read + write)")

    checks = []
    ok_backends: dict[tuple[str, str, str], bool] = {}
    for shape in shapes:
        for mode in modes:
            for b in backends:
                ok, why = check_backend(b, SHAPES[shape], mode, args.page_size, dtype, device)
                ok_backends[(b, shape, mode)] = ok
                checks.append({"backend": b, "shape": shape, "mode": mode, "ok": ok, "detail": why})
                print(f"# check {b:>12} {shape:<20} {mode:<7} {'ok  ' if ok else 'FAIL'} {why}")

    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    rows = []
    header = (f"{'shape':<20} {'mode':<7} {'batch':>5} {'ctx':>6} {'backend':>12} {'ms':>9} "
              f"{'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8}")
    print(header)
    print("-" * len(header))
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        for mode in modes:
            for batch in parse_ints(args.batches):
                for ctx in parse_ints(args.contexts):
                    if mode == "extend" and batch * ctx > args.max_extend_tokens:
                        continue
                    need = kv_bytes_needed(shape, mode, batch, ctx, args.page_size, torch.empty((), dtype=dtype).element_size())
                    free, _ = torch.cuda.mem_get_info()
                    if need > args.memory_fraction * free:
                        rows.append({"shape": shape_name, "mode": mode, "batch": batch, "ctx": ctx,
                                     "skipped": f"needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"})
                        print(f"{shape_name:<20} {mode:<7} {batch:>5} {ctx:>6}  skipped: {rows[-1]['skipped']}")
                        continue
                    case = Case(shape, mode, batch, ctx, args.page_size, dtype, device)
                    for b in backends:
                        if not ok_backends[(b, shape_name, mode)]:
                            continue
                        if b == "torch" and (batch * ctx > args.torch_max_tokens
                                             or (mode == "extend" and ctx > args.torch_max_extend_ctx)):
                            continue
                        backend = make_backend(b, case.pool)
                        t0 = time.perf_counter()
                        plan = backend.prepare(case.meta)
                        prepare_ms = (time.perf_counter() - t0) * 1e3
                        iters = args.iters if b != "torch" else max(3, args.iters // 10)
                        ms = time_cuda(lambda: case.run(backend, plan), warmup=args.warmup if b != "torch" else 1,
                                       iters=iters, flush=flush)
                        gbps = case.bytes_moved() / (ms * 1e-3) / 1e9
                        tflops = case.flops() / (ms * 1e-3) / 1e12
                        row = {"shape": shape_name, "mode": mode, "batch": batch, "ctx": ctx, "backend": b,
                               "page_size": args.page_size, "ms": ms, "bytes": case.bytes_moved(), "GBps": gbps,
                               "frac_of_copy": gbps / copy_gbps, "TFLOPs": tflops, "prepare_ms_host": prepare_ms}
                        rows.append(row)
                        print(f"{shape_name:<20} {mode:<7} {batch:>5} {ctx:>6} {b:>12} {ms:>9.3f} "
                              f"{gbps:>7.0f} {100 * gbps / copy_gbps:>5.0f}% {tflops:>8.1f}")
                        del backend
                    del case
                    torch.cuda.empty_cache()

    result = {
        "benchmark": "attention_triton",
        "device": props.name,
        "sm": f"sm{props.major}{props.minor}",
        "num_sms": props.multi_processor_count,
        "versions": versions(),
        "dtype": args.dtype,
        "page_size": args.page_size,
        "copy_bandwidth_GBps": copy_gbps,
        "shapes": {s: asdict(SHAPES[s]) for s in shapes},
        "checks": checks,
        "rows": rows,
        "args": vars(args),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    target = [r for r in rows if r.get("shape") == "llama3.1-8b" and r.get("mode") == "decode"
              and r.get("batch") == 64 and r.get("ctx") == 4096 and r.get("backend") == "triton"]
    if target:
        frac = target[0]["frac_of_copy"]
        result["target_decode_b64_ctx4096_d128"] = {"frac_of_copy": frac, "meets_70pct": frac >= 0.7}
        print(f"# target: triton decode, Llama-3.1-8B, batch 64, ctx 4096: {100 * frac:.0f}% of copy bandwidth "
              f"({'meets' if frac >= 0.7 else 'below'} the 70% target)")
    out_path.write_text(json.dumps(result, indent=2, default=str))
    print(f"# wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
