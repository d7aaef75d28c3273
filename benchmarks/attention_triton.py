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
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from attention_cases import DEFAULT_SHAPES, SHAPES, Case, Shape, kv_bytes_needed  # noqa: E402
from common import RESULTS, gpu_slug, parse_ints, time_cuda, write_result  # noqa: E402

from attnzoo.attention.backends import backend_names, get_backend_class  # noqa: E402
from attnzoo.attention.backends.torch_ref import TorchBackend  # noqa: E402
from attnzoo.attention.kv_cache import KVPool  # noqa: E402
from attnzoo.errors import AttnzooError  # noqa: E402
from attnzoo.roofline import copy_bandwidth  # noqa: E402


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
    out_path = Path(args.output or RESULTS / f"attention_triton_{gpu_slug()}.json")

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
        "num_sms": props.multi_processor_count,
        "dtype": args.dtype,
        "page_size": args.page_size,
        "copy_bandwidth_GBps": copy_gbps,
        "shapes": {s: asdict(SHAPES[s]) for s in shapes},
        "checks": checks,
        "rows": rows,
        "args": vars(args),
    }
    target = [r for r in rows if r.get("shape") == "llama3.1-8b" and r.get("mode") == "decode"
              and r.get("batch") == 64 and r.get("ctx") == 4096 and r.get("backend") == "triton"]
    if target:
        frac = target[0]["frac_of_copy"]
        result["target_decode_b64_ctx4096_d128"] = {"frac_of_copy": frac, "meets_70pct": frac >= 0.7}
        print(f"# target: triton decode, Llama-3.1-8B, batch 64, ctx 4096: {100 * frac:.0f}% of copy bandwidth "
              f"({'meets' if frac >= 0.7 else 'below'} the 70% target)")
    out_path = write_result(out_path, result)
    print(f"# wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
