"""Every available attention backend, timed in one run on one GPU, for real models' attention shapes.

    PYTHONPATH=. python benchmarks/attention.py [--quick] [--output-dir DIR] [--backends LABEL,...]

Backends (by label; each needs its package and a GPU it runs on, else it is reported and skipped):
torch (reference; small sizes only), triton, flashinfer (FA2 decode), flashinfer-fa3-decode (FlashInfer's FA3
kernel at one query per request, SM90), flashinfer-fa2 / flashinfer-fa3
(paged prefill; FA3 on SM90 for head dims <= 256), trtllm_mha (XQA decode on SM90/SM120, trtllm-gen on
SM100/SM103; its prefill off Blackwell *is* the flashinfer prefill and is not timed twice),
flashinfer_mla-fa2 / flashinfer_mla-fa3, trtllm_mla (SM100/SM103). Shapes: Llama-3.1-8B (32/8 heads,
d128), Gemma-4-31B global (32/4, d512) and sliding (32/16, d256, window 1024), DeepSeek-V3 absorbed MLA
(128 heads, 576/512); decode and prefill (extend with no cached prefix), several batches and contexts.

Order of work: device limits are measured first (device-to-device copy bandwidth, bf16 8192^3 matmul
rate), then every (backend, shape, mode) is checked against the torch reference on a small case, which
is also where FlashInfer JIT-compiles the variant (seconds each; about a minute per FA3 prefill
variant; progress is printed) -- only variants that some timed case needs are built. A backend that
fails its check is reported and never timed. Reported per case: median time (CUDA events, L2 flushed
before each run), achieved bandwidth (q + needed KV read + output written, over time) with its ratio
to the copy bandwidth for decode, and attention TFLOP/s with its ratio to the matmul rate for prefill.
Writes attention_<gpu>.json and attention_<gpu>.png (when matplotlib imports) to --output-dir.

Shapes, the case builder and byte/FLOP counts are ``benchmarks/attention_cases.py``'s, shared with
``benchmarks/attention_triton.py``.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from attention_cases import SHAPES, Case, kv_bytes_needed  # noqa: E402
from common import gpu_slug, parse_ints, time_cuda, write_result  # noqa: E402

from attnzoo.attention.backends import backend_names, get_backend_class  # noqa: E402
from attnzoo.attention.backends.torch_ref import TorchBackend  # noqa: E402
from attnzoo.errors import AttnzooError  # noqa: E402
from attnzoo.roofline import copy_bandwidth, matmul_tflops  # noqa: E402


@dataclass(frozen=True)
class Variant:
    label: str
    backend: str
    kwargs: tuple[tuple[str, str], ...] = ()
    modes: tuple[str, ...] = ("decode", "extend")
    kinds: tuple[str, ...] = ("mha",)

    def skip_reason(self, cc: tuple[int, int], shape) -> str | None:
        """Why this variant does not apply to ``shape`` on a GPU of capability ``cc`` (None: it does)."""
        if shape.kind not in self.kinds:
            return f"{self.label} does not run {shape.kind.upper()} attention"
        if self.label.endswith("-fa3") and cc != (9, 0):
            return "FA3 runs on SM90 only"
        if self.label in ("flashinfer-fa3", "flashinfer-fa3-decode") and shape.head_dim > 256:
            return "FlashInfer's FA3 kernels do not build for head dim 512"
        if self.label.endswith("-fa3-decode") and cc != (9, 0):
            return "FA3 runs on SM90 only"
        if self.label == "trtllm_mla" and cc not in ((10, 0), (10, 3), (12, 0), (12, 1)):
            return "trtllm_mla runs on SM100/SM103 (trtllm-gen) and SM120/SM121 (XQA-MLA) only"
        return None

    def make(self, pool):
        return get_backend_class(self.backend)(pool, **dict(self.kwargs))


VARIANTS = [
    Variant("torch", "torch", kinds=("mha", "mla")),
    Variant("triton", "triton", kinds=("mha", "mla")),
    Variant("flashinfer", "flashinfer", modes=("decode",)),
    # FlashInfer's FA3 paged kernel at one query per request: the measurable stand-in for the field's FA3 decode.
    Variant("flashinfer-fa3-decode", "flashinfer", (("decode_variant", "fa3"),), modes=("decode",)),
    Variant("flashinfer-fa2", "flashinfer", (("prefill_variant", "fa2"),), modes=("extend",)),
    Variant("flashinfer-fa3", "flashinfer", (("prefill_variant", "fa3"),), modes=("extend",)),
    Variant("trtllm_mha", "trtllm_mha"),
    Variant("flashinfer_mla-fa2", "flashinfer_mla", (("variant", "fa2"),), kinds=("mla",)),
    Variant("flashinfer_mla-fa3", "flashinfer_mla", (("variant", "fa3"),), kinds=("mla",)),
    Variant("trtllm_mla", "trtllm_mla", modes=("decode",), kinds=("mla",)),
]
LABELS = [v.label for v in VARIANTS]

ALL_SHAPES = ["llama3.1-8b", "gemma4-31b-global", "gemma4-31b-sliding", "deepseek-v3-mla"]
# (batches, contexts) per (kind, mode). DeepSeek decode follows its issue: batch up to 128, 1k/8k context.
GRIDS = {
    ("mha", "decode"): ([1, 16, 64, 256], [512, 4096, 16384]),
    ("mla", "decode"): ([1, 16, 64, 128], [1024, 8192]),
    ("mha", "extend"): ([1, 8], [512, 4096, 16384]),
    ("mla", "extend"): ([1, 8], [512, 4096]),
}
QUICK_GRIDS = {
    ("mha", "decode"): ([1, 64], [4096]),
    ("mla", "decode"): ([1, 64], [4096]),
    ("mha", "extend"): ([1], [4096]),
    ("mla", "extend"): ([1], [4096]),
}


def kernel_of(backend, layer, mode: str) -> str:
    """The kernel a backend runs for this layer and phase, when it says (the FlashInfer adapters do)."""
    kernels_for = getattr(backend, "kernels_for", None)
    if kernels_for is None:
        return backend.name
    return kernels_for(layer)["decode" if mode == "decode" else "prefill"]


def check_variant(v: Variant, shape, mode: str, page_size: int, dtype, device) -> tuple[bool, str]:
    """Small case vs the torch reference: relative error <= 1e-2 and no NaN. Builds (JIT) the variant."""
    try:
        case = Case(shape, mode, 3, 300 if mode == "decode" else 160, page_size, dtype, device, seed=1)
        backend = v.make(case.pool)
        plan = backend.prepare(case.meta)
        out = case.run(backend, plan).float()
        ref_be = TorchBackend(case.pool)
        plan = ref_be.prepare(case.meta)
        ref = case.run(ref_be, plan).float()
        kernel = kernel_of(backend, case.layer, mode)
    except AttnzooError as e:
        return False, f"cannot run here: {e}"
    except Exception as e:  # a crashing backend is reported; the others still run
        return False, f"crashed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if out.isnan().any():
        return False, "NaN in the output"
    err = ((out - ref).norm() / ref.norm()).item()
    return err <= 1e-2, f"relative error {err:.2e}; kernel: {kernel}"


def write_chart(rows: list[dict], path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib is not importable: no PNG chart written (pip install matplotlib)")
        return None
    timed = [r for r in rows if "ms" in r]
    panels = sorted({(r["shape"], r["mode"]) for r in timed}, key=lambda p: (ALL_SHAPES.index(p[0]), p[1]))
    if not panels:
        return None
    cols = 2
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(8 * cols, 3.6 * nrows), squeeze=False)
    for ax, (shape, mode) in zip(axes.flat, panels):
        sub = [r for r in timed if r["shape"] == shape and r["mode"] == mode]
        cases = sorted({(r["batch"], r["ctx"]) for r in sub})
        labels = [lab for lab in LABELS if any(r["backend"] == lab for r in sub)]
        width = 0.8 / max(1, len(labels))
        for i, lab in enumerate(labels):
            ys = []
            for c in cases:
                hit = [r for r in sub if r["backend"] == lab and (r["batch"], r["ctx"]) == c]
                ys.append(100 * hit[0]["frac_of_limit"] if hit else 0.0)
            ax.bar([j + i * width for j in range(len(cases))], ys, width, label=lab)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels([f"b{b}\nctx {c}" for b, c in cases], fontsize=8)
        limit = "copy bandwidth" if mode == "decode" else "bf16 matmul rate"
        ax.set_ylabel(f"% of {limit}")
        ax.set_title(f"{shape} {'decode' if mode == 'decode' else 'prefill'}")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few cases per shape (about 2 minutes with a warm "
                    "FlashInfer JIT cache; a cold one adds its compile times)")
    ap.add_argument("--backends", default=",".join(LABELS), help=f"comma-separated labels from: {', '.join(LABELS)}")
    ap.add_argument("--shapes", default=",".join(ALL_SHAPES), help=f"from: {', '.join(ALL_SHAPES)}")
    ap.add_argument("--modes", default="decode,extend")
    ap.add_argument("--batches", default=None, help="override every shape's batch sizes")
    ap.add_argument("--contexts", default=None, help="override every shape's context lengths")
    # 64: the page size every backend here accepts (trtllm_mha's XQA head dims 256/512 and trtllm_mla
    # included), so all rows of one run read the same cache layout.
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--max-extend-tokens", type=int, default=65536, help="skip prefill cases with more new tokens")
    ap.add_argument("--torch-max-tokens", type=int, default=65536, help="time the torch reference only up to this batch*context")
    ap.add_argument("--torch-max-extend-ctx", type=int, default=4096, help="the torch reference materialises [heads, ctx, ctx]")
    ap.add_argument("--memory-fraction", type=float, default=0.6, help="skip cases needing more of the free GPU memory")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--output-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    labels = [b for b in args.backends.split(",") if b]
    shapes = [s for s in args.shapes.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    bad = [x for x in labels if x not in LABELS] + [s for s in shapes if s not in SHAPES] + \
          [m for m in modes if m not in ("decode", "extend")]
    if bad:
        print(f"unknown: {', '.join(bad)}; labels: {', '.join(LABELS)}; shapes: {', '.join(ALL_SHAPES)}; "
              "modes: decode, extend", file=sys.stderr)
        return 2
    if args.quick:
        args.warmup, args.iters = min(args.warmup, 3), min(args.iters, 10)
    grids = QUICK_GRIDS if args.quick else GRIDS
    variants = [v for v in VARIANTS if v.label in labels and v.backend in backend_names()]
    dtype = getattr(torch, args.dtype)
    elt = torch.empty((), dtype=dtype).element_size()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    cc = (props.major, props.minor)
    slug = gpu_slug()
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    copy_gbps = copy_bandwidth(device)
    mm_tflops = matmul_tflops(device)
    log(f"{props.name} (sm{cc[0]}{cc[1]}, {props.multi_processor_count} SMs); torch {torch.__version__}; "
        f"copy {copy_gbps:.0f} GB/s (read + write); bf16 matmul {mm_tflops:.0f} TFLOP/s; page size {args.page_size}")

    def cases_for(shape_name: str, mode: str) -> list[tuple[int, int]]:
        batches, ctxs = grids[(SHAPES[shape_name].kind, mode)]
        batches = parse_ints(args.batches) if args.batches else batches
        ctxs = parse_ints(args.contexts) if args.contexts else ctxs
        return [(b, c) for b in batches for c in ctxs if mode == "decode" or b * c <= args.max_extend_tokens]

    # 1. correctness (and JIT builds) for the variants some case will time
    plan = [(v, s, m) for s in shapes for m in modes for v in variants
            if m in v.modes and cases_for(s, m)]
    checks, ok = [], {}
    for i, (v, s, m) in enumerate(plan, 1):
        why = v.skip_reason(cc, SHAPES[s])
        if v.label == "trtllm_mha" and m == "extend" and cc not in ((10, 0), (10, 3)):
            why = "off SM100/SM103 trtllm_mha prefill runs as flashinfer (timed as flashinfer-fa3/fa2)"
        if why is None:
            log(f"[{i}/{len(plan)}] check {v.label} on {s} {m} (first use may JIT-compile) ...")
            passed, detail = check_variant(v, SHAPES[s], m, args.page_size, dtype, device)
        else:
            passed, detail = False, f"not applicable: {why}"
        ok[(v.label, s, m)] = passed
        checks.append({"backend": v.label, "shape": s, "mode": m, "ok": passed, "detail": detail})
        if why is None:
            log(f"    {'ok' if passed else 'FAILED'}: {detail}")

    # 2. timings
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    rows = []
    head = (f"{'shape':<20} {'mode':<7} {'batch':>5} {'ctx':>6} {'backend':>18} {'ms':>9} {'GB/s':>7} "
            f"{'%copy':>6} {'TFLOP/s':>8} {'%mm':>5}")
    print(head + "\n" + "-" * len(head), flush=True)
    for s in shapes:
        shape = SHAPES[s]
        for m in modes:
            for batch, ctx in cases_for(s, m):
                runnable = [v for v in variants if ok.get((v.label, s, m))]
                if not runnable:
                    continue
                need = kv_bytes_needed(shape, m, batch, ctx, args.page_size, elt)
                free, _ = torch.cuda.mem_get_info()
                if need > args.memory_fraction * free:
                    rows.append({"shape": s, "mode": m, "batch": batch, "ctx": ctx,
                                 "skipped": f"needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"})
                    print(f"{s:<20} {m:<7} {batch:>5} {ctx:>6}  skipped: {rows[-1]['skipped']}", flush=True)
                    continue
                case = Case(shape, m, batch, ctx, args.page_size, dtype, device)
                for v in runnable:
                    if v.label == "torch" and (batch * ctx > args.torch_max_tokens
                                               or (m == "extend" and ctx > args.torch_max_extend_ctx)):
                        continue
                    backend = v.make(case.pool)
                    t0 = time.perf_counter()
                    plan = backend.prepare(case.meta)
                    prepare_ms = (time.perf_counter() - t0) * 1e3
                    slow = v.label == "torch"
                    ms = time_cuda(lambda: case.run(backend, plan), warmup=1 if slow else args.warmup,
                                   iters=max(3, args.iters // 10) if slow else args.iters, flush=flush)
                    gbps = case.bytes_moved() / (ms * 1e-3) / 1e9
                    tflops = case.flops() / (ms * 1e-3) / 1e12
                    frac = gbps / copy_gbps if m == "decode" else tflops / mm_tflops
                    rows.append({
                        "shape": s, "mode": m, "batch": batch, "ctx": ctx, "backend": v.label,
                        "kernel": kernel_of(backend, case.layer, m), "page_size": args.page_size, "ms": ms,
                        "bytes": case.bytes_moved(), "flops": case.flops(), "GBps": gbps, "TFLOPs": tflops,
                        "frac_of_copy": gbps / copy_gbps, "frac_of_matmul": tflops / mm_tflops,
                        "frac_of_limit": frac, "prepare_ms_host": prepare_ms,
                    })
                    print(f"{s:<20} {m:<7} {batch:>5} {ctx:>6} {v.label:>18} {ms:>9.3f} {gbps:>7.0f} "
                          f"{100 * gbps / copy_gbps:>5.0f}% {tflops:>8.1f} {100 * tflops / mm_tflops:>4.0f}%", flush=True)
                    del backend
                del case
                torch.cuda.empty_cache()

    result = {
        "benchmark": "attention",
        "num_sms": props.multi_processor_count,
        "dtype": args.dtype,
        "page_size": args.page_size,
        "copy_bandwidth_GBps": copy_gbps,
        "matmul_bf16_TFLOPs": mm_tflops,
        "limits_note": "decode rows: frac_of_limit = achieved bandwidth / copy bandwidth; "
                       "prefill (extend) rows: attention TFLOP/s / bf16 8192^3 matmul TFLOP/s",
        "shapes": {s: asdict(SHAPES[s]) for s in shapes},
        "checks": checks,
        "rows": rows,
        "args": vars(args),
        "wall_s": time.perf_counter() - t_start,
    }
    json_path = write_result(out_dir / f"attention_{slug}.json", result)
    log(f"wrote {json_path}")
    png = write_chart(rows, out_dir / f"attention_{slug}.png",
                      f"{props.name}: attention backends, bf16, page size {args.page_size}")
    if png:
        log(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
