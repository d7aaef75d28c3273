"""``attnzoo tune MODEL``: time every backend that can run MODEL here, on MODEL's own attention layers,
and write a user policy file (the shipped table's schema) that picks the fastest backend per phase.

A step's attention cost is what the engine pays: one ``prepare`` plus every layer's ``decode`` /
``extend``, so each distinct layer shape is timed once and weighted by how many layers have it. Decode
is timed at a few batch x context points, prefill at a few batch x prompt-length points (no cached
prefix); a backend's score per phase is the geometric mean over the points. Every backend is first
checked against the torch reference on the smallest point; one that disagrees is reported, never picked.
The file carries the numbers (``[measured]``) and its row is the architecture's, for this GPU class:
``load_model(path, policy_file=FILE)`` (or ``--policy FILE``) then uses it.

On CPU only the torch backend runs (and triton under TRITON_INTERPRET=1): small points make that a
test of the machinery, not a measurement.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from attnzoo.errors import AttnzooError, PolicyError

# (batch, context) points per phase. Prefill points are (batch, prompt length), no cached prefix.
GPU_POINTS = {"decode": ((1, 1024), (16, 4096), (64, 4096)), "prefill": ((1, 2048), (4, 4096))}
CPU_POINTS = {"decode": ((1, 32), (2, 64)), "prefill": ((1, 32),)}
PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class LayerShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    sliding_window: int | None
    logit_softcap: float | None
    scale: float
    kind: str
    sinks: bool = False  # attention sinks (timed with random sink logits)

    def describe(self) -> str:
        window = f", window {self.sliding_window}" if self.sliding_window else ""
        sinks = ", sinks" if self.sinks else ""
        return (f"{self.kind} {self.num_heads}/{self.num_kv_heads} heads, q/k {self.head_dim} v {self.v_head_dim}"
                f"{window}{sinks}")

    def layer(self):
        from attnzoo.attention.layer import Attention

        return Attention(0, self.num_heads, self.num_kv_heads, self.head_dim, v_head_dim=self.v_head_dim,
                         scale=self.scale, sliding_window=self.sliding_window, logit_softcap=self.logit_softcap,
                         kind=self.kind, sinks=self.sinks)


def layer_shapes(config) -> dict[LayerShape, int]:
    """The model's distinct attention layer shapes and how many layers have each (built on the meta device)."""
    from attnzoo.models import loader
    from attnzoo.models.registry import model_class

    arch = loader.architecture_of(config)
    counts: dict[LayerShape, int] = {}
    for m in model_class(arch, config).shapes_only(config).attention_layers():
        if m.index_head_dim:
            raise PolicyError(f"{arch} has sparse (NSA) attention layers, which `attnzoo tune` does not time yet",
                              fix="time NSA backends with benchmarks/ scripts, and write the policy file by hand")
        shape = LayerShape(m.num_heads, m.num_kv_heads, m.head_dim, m.v_head_dim, m.sliding_window or None,
                           m.logit_softcap or None, float(m.scale), m.kind, m.sinks is not None)
        counts[shape] = counts.get(shape, 0) + 1
    return counts


class _Case:
    """One layer shape's pool, step metadata and query at (phase, batch, context), pages scattered."""

    def __init__(self, shape: LayerShape, phase: str, batch: int, ctx: int, page_size: int, dtype, device, seed=0):
        from attnzoo.attention.kv_cache import KVPool
        from attnzoo.attention.metadata import ForwardMode, build_metadata

        gen = torch.Generator().manual_seed(seed)
        self.layer, self.phase = shape.layer().to(device), phase
        if self.layer.sinks is not None:
            with torch.no_grad():
                self.layer.sinks.copy_(torch.randn(shape.num_heads, generator=gen))
        pages = -(-ctx // page_size)
        self.pool = KVPool([self.layer.kv_cache_spec()], num_pages=batch * pages + 1, page_size=page_size,
                           dtype=dtype, device=device)
        self.pool.buffer.view(dtype).copy_(torch.randn(self.pool.buffer.view(dtype).shape, generator=gen))
        order = (torch.randperm(batch * pages, generator=gen) + 1).tolist()
        tables = [order[i * pages:(i + 1) * pages] for i in range(batch)]
        decode = phase == "decode"
        self.meta = build_metadata(
            prefix_lens=[ctx - 1 if decode else 0] * batch, q_lens=[1 if decode else ctx] * batch,
            block_tables=tables, page_size=page_size, device=device,
            mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        )
        tokens = batch * (1 if decode else ctx)
        self.q = torch.randn(tokens, shape.num_heads, shape.head_dim, generator=gen).to(device=device, dtype=dtype)

    def backend(self, cls):
        """``cls``'s backend for this phase over the case's pool (a declared substitute's where it has one)."""
        from attnzoo.attention.backends.hybrid import HybridBackend

        return HybridBackend.create(cls.name, cls.name, self.pool).for_step(self.meta)

    def run(self, backend, plan):
        fn = backend.decode if self.phase == "decode" else backend.extend
        return fn(self.layer, self.q, self.meta, plan)


def time_ms(fn, device: torch.device, *, warmup: int = 2, iters: int = 5, flush: torch.Tensor | None = None) -> float:
    """Median milliseconds of ``fn()``: CUDA events on a GPU (``flush`` zeroed before each run to empty the
    L2 cache), wall clock on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        for _ in range(iters):
            if flush is not None:
                flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _page_size_for(config, gpu: str, phase: str, backend: str, dtype) -> int:
    """The page size the policy gives ``backend`` for ``phase`` (raises if it cannot run this model here)."""
    from attnzoo.policy import Overrides, resolve

    d = resolve(config, gpu=gpu, overrides=Overrides(**{f"{phase}_backend": backend}, dtype=dtype))
    return d.page_size


def _check(backend_cls, shape: LayerShape, phase: str, point, page_size: int, dtype, device) -> str | None:
    """None if the backend matches the torch reference on this case, else why not."""
    from attnzoo.attention.backends.torch_ref import TorchBackend

    case = _Case(shape, phase, *point, page_size, dtype, device, seed=1)
    outs = []
    for cls in (backend_cls, TorchBackend):
        be = case.backend(cls)
        outs.append(case.run(be, be.prepare(case.meta)).float())
    out, ref = outs
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    tol = 1e-2 if dtype != torch.float32 else 1e-3
    return None if err <= tol and not out.isnan().any() else f"differs from the torch reference (relative error {err:.1e})"


def tune(model: str, *, device=None, dtype=None, backends: list[str] | None = None, points=None,
         output: str | Path | None = None, warmup: int = 2, iters: int = 5, progress: bool = True) -> dict:
    """Time every runnable backend for MODEL's layers, write the policy file, return the result as a dict."""
    from tqdm import tqdm

    from attnzoo.attention.backends import backend_names, capabilities_of, get_backend_class
    from attnzoo.policy import detect_gpu, gpu_class
    from attnzoo.policy.table import SHIPPED_POLICY, load_table
    from attnzoo.engine.build import _pick_device, _pick_dtype
    from attnzoo.models import loader

    dev = _pick_device(device)
    dt = _pick_dtype(dtype, dev)
    src = loader.resolve_source(model)
    config = loader.load_config(src)
    arch = loader.architecture_of(config)
    family = load_table(SHIPPED_POLICY, shipped=True).family_of(arch)
    gpu = gpu_class(detect_gpu(dev) if dev.type == "cuda" else "cpu")
    shapes = layer_shapes(config)
    points = points or (GPU_POINTS if dev.type == "cuda" else CPU_POINTS)
    dtype_name = str(dt).removeprefix("torch.")
    out_path = Path(output or f"attnzoo_policy_{arch}_{gpu}.toml")
    check_writable(out_path)  # before the timing, which takes minutes

    unknown = [b for b in backends or () if b not in backend_names()]
    if unknown:
        raise PolicyError(f"unknown backend(s) {', '.join(unknown)}", fix=f"use some of: {', '.join(backend_names())}")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev) if dev.type == "cuda" else None
    runnable: dict[tuple[str, str], int] = {}  # (backend, phase) -> page size
    skipped: list[dict] = []
    for name in backends or backend_names():
        if name == "torch" and not backends and dev.type == "cuda":
            skipped.append({"backend": name, "phase": "both", "why": "the reference backend: not timed on a GPU "
                            "unless --backends names it"})
            continue
        for phase in PHASES:
            if not capabilities_of(name).kernels(phase):
                continue
            try:
                runnable[(name, phase)] = _page_size_for(config, gpu, phase, name, dtype_name)
            except AttnzooError as e:
                skipped.append({"backend": name, "phase": phase, "why": str(e).split(" Fix:")[0]})
    jobs = [(name, phase, pt) for (name, phase) in runnable for pt in points[phase]]
    rows: list[dict] = []
    failed: set[tuple[str, str]] = set()
    bar = tqdm(jobs, desc=f"tune {arch} on {gpu}", unit="case", disable=not progress, file=sys.stderr)
    for name, phase, pt in bar:
        if (name, phase) in failed:
            continue
        bar.set_postfix_str(f"{name} {phase} {pt[0]}x{pt[1]}")
        cls, ps = get_backend_class(name), runnable[(name, phase)]
        try:
            if pt == points[phase][0]:
                why = next((w for s in shapes if (w := _check(cls, s, phase, pt, ps, dt, dev))), None)
                if why:
                    raise PolicyError(why, fix="report it; this backend is left out of the choice")
            total, prepare_ms = 0.0, 0.0
            for s, count in shapes.items():
                case = _Case(s, phase, *pt, ps, dt, dev)
                be = case.backend(cls)
                plan = be.prepare(case.meta)
                total += count * time_ms(lambda: case.run(be, plan), dev, warmup=warmup, iters=iters, flush=flush)
                # One prepare per step plans every layer signature: the per-shape planning times add up.
                prepare_ms += time_ms(lambda: be.prepare(case.meta), dev, warmup=1, iters=iters, flush=flush)
        except Exception as e:  # a backend that fails here is reported; the others are still timed
            failed.add((name, phase))
            skipped.append({"backend": name, "phase": phase, "why": f"{type(e).__name__}: {e}".split(" Fix:")[0]})
            continue
        rows.append({"phase": phase, "batch": pt[0], "context": pt[1], "backend": name, "page_size": ps,
                     "ms": round(total + prepare_ms, 4), "prepare_ms": round(prepare_ms, 4)})
    rows = [r for r in rows if (r["backend"], r["phase"]) not in failed]

    best: dict[str, tuple[str, float]] = {}
    for phase in PHASES:
        scores = {}
        for name in {r["backend"] for r in rows if r["phase"] == phase}:
            ms = [r["ms"] for r in rows if r["phase"] == phase and r["backend"] == name]
            if len(ms) == len(points[phase]):
                scores[name] = math.exp(sum(math.log(max(m, 1e-9)) for m in ms) / len(ms))
        if not scores:
            raise PolicyError(f"no backend could be timed for {phase} of {arch} here",
                              fix="see the skipped backends: " + "; ".join(f"{s['backend']}: {s['why']}" for s in skipped))
        best[phase] = min(scores.items(), key=lambda kv: kv[1])

    page = _pair_page_size(config, gpu, best["prefill"][0], best["decode"][0], dtype_name)
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    result = {"model": model, "architecture": arch, "family": family, "gpu": gpu, "device": device_name,
              "dtype": dtype_name, "layer_shapes": {s.describe(): n for s, n in shapes.items()},
              "prefill": best["prefill"][0], "decode": best["decode"][0], "page_size": page,
              "score_ms": {p: round(best[p][1], 4) for p in PHASES}, "rows": rows, "skipped": skipped,
              "versions": _versions(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "file": str(out_path)}
    write_atomic(out_path, _policy_text(result))
    return result


def check_writable(path: Path) -> None:
    """Raise a PolicyError now if ``path`` cannot be written (a missing folder, a read-only place)."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        problem = "is a directory"
    elif not parent.is_dir():
        problem = f"is in {str(parent)!r}, which does not exist"
    elif not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        problem = "is not writable here (read-only file or folder)"
    else:
        return
    raise PolicyError(f"--output {str(path)!r} {problem}",
                      fix="pass --output a file path in an existing, writable folder (mkdir -p the folder first)")


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file in the same folder and os.replace: a reader (or a full disk) never
    sees a truncated policy file in place of the old one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise PolicyError(f"cannot write {str(path)!r} ({e.strerror or e})",
                          fix="free disk space or pass --output a writable place; the old file is unchanged") from None


def _pair_page_size(config, gpu: str, prefill: str, decode: str, dtype_name: str) -> int:
    from attnzoo.policy import Overrides, resolve

    return resolve(config, gpu=gpu, overrides=Overrides(prefill_backend=prefill, decode_backend=decode,
                                                        dtype=dtype_name)).page_size


def _versions() -> dict:
    out = {"torch": torch.__version__}
    for mod in ("triton", "flashinfer"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            out[mod] = None
    return out


def _q(s) -> str:
    return json.dumps(s)  # a TOML basic string: JSON's escapes are TOML's


def _policy_text(r: dict) -> str:
    """The user policy file: header comments, the architecture's row for this GPU, and [measured]."""
    lines = [
        f"# attnzoo tune {r['model']} ({r['architecture']}) on {r['device']} ({r['gpu']}), {r['dtype']}, {r['time']}",
        "# " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
        "# Times: one step's attention over the model's layers (prepare once + every layer), median ms; the",
        "# fastest backend per phase by the geometric mean over the points. Applies to every model of this",
        "# architecture on this GPU class: load_model(path, policy_file=THIS_FILE) or --policy THIS_FILE.",
        "schema = 1",
        "",
        f"[family.{r['family']}.arch.{r['architecture']}.gpu.{r['gpu']}]",
        f"prefill = {_q(r['prefill'])}",
        f"decode = {_q(r['decode'])}",
        f"page_size = {r['page_size']}",
        "reason = " + _q(f"attnzoo tune on {r['device']}: fastest prefill {r['prefill']} "
                         f"({r['score_ms']['prefill']} ms geomean), decode {r['decode']} ({r['score_ms']['decode']} ms)"),
        f"measured_in = {_q(r['file'])}",
        "",
        "[measured]",
        f"model = {_q(r['model'])}",
        f"device = {_q(r['device'])}",
        f"dtype = {_q(r['dtype'])}",
        "layer_shapes = [" + ", ".join(_q(f"{n} x {d}") for d, n in r["layer_shapes"].items()) + "]",
        "rows = [",
    ]
    for row in r["rows"]:
        lines.append("  { " + ", ".join(f"{k} = {_q(v) if isinstance(v, str) else v}" for k, v in row.items()) + " },")
    lines.append("]")
    lines.append("skipped = [")
    for s in r["skipped"]:
        lines.append("  { " + ", ".join(f"{k} = {_q(v)}" for k, v in s.items()) + " },")
    lines.append("]")
    return "\n".join(lines) + "\n"


def format_table(r: dict) -> str:
    """The timings as a table, the chosen backend per phase marked with *."""
    out = [f"{r['architecture']} on {r['device']} ({r['gpu']}, {r['dtype']}): "
           f"prefill {r['prefill']}, decode {r['decode']}, page size {r['page_size']} -> {r['file']}",
           f"{'phase':8} {'batch':>5} {'context':>7}  {'backend':16} {'page':>4} {'ms':>10}"]
    for row in sorted(r["rows"], key=lambda x: (x["phase"], x["batch"], x["context"], x["ms"])):
        mark = "*" if row["backend"] == r[row["phase"]] else " "
        out.append(f"{row['phase']:8} {row['batch']:>5} {row['context']:>7} {mark}{row['backend']:16} "
                   f"{row['page_size']:>4} {row['ms']:>10.4f}")
    out += [f"skipped {s['backend']} ({s['phase']}): {_short(s['why'])}" for s in r["skipped"]]
    return "\n".join(out + (["(the full reasons: --json)"] if r["skipped"] else []))


def _short(why: str, width: int = 80) -> str:
    """The first constraint a skipped backend violates, in one short line (the full text is in --json)."""
    why = why.split(": ", 1)[1] if " cannot run " in why else why
    why = why.split("; ")[0]
    return why if len(why) <= width else why[: width - 3] + "..."


def parse_points(text: str) -> tuple[tuple[int, int], ...]:
    """"1x1024,16x4096" -> ((1, 1024), (16, 4096))."""
    try:
        pts = tuple(tuple(int(v) for v in p.lower().split("x")) for p in text.split(",") if p)
    except ValueError:
        pts = ()
    if not pts or any(len(p) != 2 or min(p) < 1 for p in pts):
        raise PolicyError(f"bad points {text!r}", fix="write BATCHxCONTEXT pairs, e.g. 1x1024,16x4096")
    return pts  # type: ignore[return-value]


def add_subparser(subparsers) -> None:
    p = subparsers.add_parser("tune", help="time every runnable backend on this model's layers and write a policy file",
                              description=__doc__)
    p.add_argument("model", metavar="MODEL", help="local checkpoint dir, .gguf file or cached hub id")
    p.add_argument("--output", default=None, help="policy file to write (default: attnzoo_policy_<arch>_<gpu>.toml)")
    p.add_argument("--backends", default=None, help="comma-separated backends to time (default: every registered one)")
    p.add_argument("--decode-points", default=None, help="BATCHxCONTEXT,... (default: GPU 1x1024,16x4096,64x4096)")
    p.add_argument("--prefill-points", default=None, help="BATCHxLENGTH,... (default: GPU 1x2048,4x4096)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    p.set_defaults(func=_run)


def _run(args) -> int:
    dev_points = None
    if args.decode_points or args.prefill_points:
        dev = GPU_POINTS if torch.cuda.is_available() and args.device != "cpu" else CPU_POINTS
        dev_points = {"decode": parse_points(args.decode_points) if args.decode_points else dev["decode"],
                      "prefill": parse_points(args.prefill_points) if args.prefill_points else dev["prefill"]}
    r = tune(args.model, device=args.device, dtype=args.dtype,
             backends=[b for b in args.backends.split(",") if b] if args.backends else None,
             points=dev_points, output=args.output, warmup=args.warmup, iters=args.iters)
    print(json.dumps(r, indent=2) if args.json else format_table(r))
    return 0
