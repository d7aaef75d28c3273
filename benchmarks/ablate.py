"""What each part of a step costs where it runs: e2e.py again with one part of the step left out at a time.

    python benchmarks/ablate.py --out benchmarks/results/ablate_dsv2lite_1prompt --parts stage2,wuv,moe_sum,norm,routed \\
        -- --shape dsv2lite --prompts 1 --backends triton --cascade off \\
           --load-kwargs '{"cuda_graph_batch_sizes": [1]}'

A profile times kernels one after another, with its own overhead and without the graph's overlap (decode_profile.py
is run with --no-pdl); what a part costs inside a CUDA-graph step is what the step loses without it. Each run is
e2e.py (the arguments after ``--``, which must name one backend and one cascade mode; no transformers baseline is
run) in a process of its own, with one part doing nothing: its outputs are left as they were, so the step's times
count and its tokens do not. A part whose garbage reaches the logits as NaN stops its run (reported; the others go
on), and a part the model never called is reported as such rather than as a delta. The base runs first and last;
deltas are against their mean, so parts worth less than the base runs' spread read as noise.

Parts (``--help`` lists them): a Triton kernel launched as a no-op, or a Python function that returns without
computing. Not offered: decode's stage 1 (its launch reads the kernel's occupancy) and the routers (garbage expert ids
would be read out of bounds).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

BASE = "base"
HERE = str(Path(__file__).resolve().parent)
RUN_TIMEOUT_S = 1800


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing; ``calls`` counts the launches."""

    def __init__(self):
        self.calls = 0

    def __getitem__(self, grid):
        def skipped(*args, **kwargs):
            self.calls += 1
        return skipped


class _Returns:
    """Stands in for a Python function (or method): counts its calls and returns ``make(*args)``."""

    def __init__(self, make):
        self.make, self.calls = make, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.make(*args, **kwargs)

    def __get__(self, obj, owner=None):  # a method's stand-in gets its instance, as the method did
        return self if obj is None else lambda *args, **kwargs: self(obj, *args, **kwargs)


def _shared_output_only(self, x, topk_weights, topk_ids, add, add_stream=None):
    import torch

    if add_stream is not None:  # the shared experts' stream still joins the step's
        torch.cuda.current_stream(x.device).wait_stream(add_stream)
    return add if add is not None else torch.zeros_like(x)


def _values_unprojected(o_latent, w_uv):
    return o_latent.new_empty(*o_latent.shape[:2], w_uv.shape[1])


def _kernel(module: str, attr: str):
    return lambda: (importlib.import_module(module), attr, _NoLaunch())


# name -> (what it is, () -> (object, attribute, stand-in)); every target is looked up where it is called, at call time
PARTS = {
    "store": ("the KV store (with the RoPE it applies)", _kernel("attnzoo.attention.kernels.store", "_store_kernel")),
    "stage2": ("decode's split merge", _kernel("attnzoo.attention.kernels.decode", "_decode_stage2")),
    "norm": ("RMSNorm launches of their own (not the norms inside MLA's entry, RoPE or DeepSeek-V4's kernels)",
             _kernel("attnzoo.layers.fused_kernels", "_rms_norm_kernel")),
    "mla_entry": ("MLA's latent norm, RoPE and cache entry", _kernel("attnzoo.layers.fused_kernels", "_mla_entry_kernel")),
    "act_and_mul": ("dense MLPs' activation, where the gate_up projection does not end in it",
                    _kernel("attnzoo.layers.fused_kernels", "_act_and_mul_kernel")),
    "skinny": ("every skinny projection (small-batch GEMMs)", _kernel("attnzoo.layers.skinny_kernels", "_skinny_kernel")),
    "moe_act": ("the fused MoE's activation", _kernel("attnzoo.layers.moe_kernels", "act_kernel")),
    "moe_sum": ("the fused MoE's weighted sum (plus the shared experts)", _kernel("attnzoo.layers.moe_kernels", "sum_kernel")),
    "routed": ("the routed experts (grouped GEMMs, activation, sum): the shared experts' output alone",
               lambda: (importlib.import_module("attnzoo.layers.moe.layer").FusedMoE, "_routed",
                        _Returns(_shared_output_only))),
    "wuv": ("MLA's latent output times W_UV (MLAAttention's; not NSA layers')",
            lambda: (importlib.import_module("attnzoo.attention.mla"), "latent_to_values", _Returns(_values_unprojected))),
}


@contextlib.contextmanager
def removed(part: str):
    """Within the block, ``part`` (a key of PARTS) does no work; yields its stand-in (``calls`` counts what it
    replaced); restored on exit."""
    target, name, stand_in = PARTS[part][1]()
    original = getattr(target, name)
    setattr(target, name, stand_in)
    try:
        yield stand_in
    finally:
        setattr(target, name, original)


def parse_parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise SystemExit(f"--parts: {', '.join(unknown) or 'none named'}; choose from {', '.join(PARTS)}")
    return parts


def attnzoo_result(payload: dict) -> dict:
    """e2e.py's one attnzoo result (its transformers baseline, if any, left aside)."""
    ours = [r for r in payload["results"] if str(r.get("backend", "")).startswith("attnzoo")]
    if len(ours) != 1:
        raise SystemExit(f"e2e.py wrote {len(ours)} attnzoo results; ablate.py compares one: pass one backend "
                         "(--backends NAME) and one cascade mode (--cascade on, off or auto)")
    return ours[0]


def summarize(runs: list[dict]) -> list[dict]:
    """Rows of (part, TPOT ms, delta against the base runs' mean, decode roofline fraction, error) from the runs'
    ``{"part", "log", "result" (e2e's attnzoo result) or "error", "calls" (the stand-in's; parts only)}``."""
    base = [r["result"]["tpot_mean_ms"] for r in runs if r["part"] == BASE and "result" in r]
    if not base:
        raise SystemExit("no base run finished, nothing to set the parts against: see "
                         + ", ".join(r["log"] for r in runs if r["part"] == BASE))
    mean = statistics.fmean(base)
    rows = []
    for r in runs:
        row = {"part": r["part"], "what": PARTS[r["part"]][0] if r["part"] in PARTS else "nothing left out",
               "log": r["log"]}
        if "result" in r and r.get("calls", 1) == 0:
            row["error"] = "the model never called it: nothing was left out"
        elif "result" in r:
            tpot = r["result"]["tpot_mean_ms"]
            row.update(tpot_ms=tpot, delta_ms=tpot - mean, output_tok_per_s=r["result"]["output_tok_per_s"],
                       decode_roofline_fraction=r["result"].get("decode_roofline_fraction"))
        else:
            row["error"] = r["error"]
        rows.append(row)
    return rows


def _child(part: str, e2e_args: list[str], prefix: str) -> None:
    if HERE not in sys.path:  # e2e.py imports its neighbours as top-level modules
        sys.path.insert(0, HERE)
    import e2e

    # the baseline's prompts would be paid by every run and compared by none
    argv = [*e2e_args, "--hf-prompts", "0", "--out", prefix]
    if part == BASE:
        return e2e.main(argv)
    with removed(part) as stand_in:
        e2e.main(argv)
    Path(prefix + ".calls").write_text(str(stand_in.calls))


def run_one(part: str, e2e_args: list[str], runs_dir: Path, index: int) -> dict:
    """One e2e.py run in its own process with ``part`` left out: {"part", "log", "result" | "error", "calls"}."""
    prefix = str(runs_dir / f"{index}_{part}")  # no dot: e2e.py writes PREFIX.json through with_suffix
    cmd = [sys.executable, __file__, "--child", part, "--child-out", prefix, "--", *e2e_args]
    log = prefix + ".log"
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            code = f"timeout after {RUN_TIMEOUT_S} s"
    print(f"  exit {code} after {time.perf_counter() - t0:.0f} s", flush=True)
    run = {"part": part, "log": log}
    if code != 0:
        return {**run, "error": f"exit {code}: see {log}"}
    try:
        run["result"] = attnzoo_result(json.loads(Path(prefix + ".json").read_text()))
    except FileNotFoundError:
        return {**run, "error": f"e2e.py wrote no {prefix}.json: see {log}"}
    if part != BASE:
        run["calls"] = int(Path(prefix + ".calls").read_text())
    return run


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, e2e_args = argv[:split], argv[split + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="parts:\n" + "\n".join(f"  {n:12s} {w}" for n, (w, _) in PARTS.items()))
    ap.add_argument("--out", help="PREFIX.json: the table; each run's JSON, PNG and log under PREFIX_runs/")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--child", help=argparse.SUPPRESS)  # one run, in this process
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(own)
    if args.child:
        return _child(args.child, e2e_args, args.child_out)
    if not args.out or not e2e_args or "--out" in e2e_args:
        raise SystemExit("pass --out PREFIX, then -- and e2e.py's arguments without --out, e.g. "
                         "-- --shape dsv2lite --prompts 1 --backends triton --cascade off")
    parts = parse_parts(args.parts)
    out = Path(args.out)
    runs_dir = out.parent / f"{out.name}_runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    runs = [run_one(part, e2e_args, runs_dir, i) for i, part in enumerate([BASE, *parts, BASE])]
    rows = summarize(runs)
    from common import write_result  # benchmarks/ is on the path of a script run

    write_result(out, {"e2e_args": e2e_args, "rows": rows})
    print(f"\n{'part':12s} {'TPOT ms':>8s} {'delta':>8s} {'decode roof':>11s}  what")
    for r in rows:
        if "error" in r:
            print(f"{r['part']:12s} {'-':>8s} {'-':>8s} {'-':>11s}  {r['what']}: {r['error']}")
        else:
            frac = r["decode_roofline_fraction"]
            print(f"{r['part']:12s} {r['tpot_ms']:8.3f} {r['delta_ms']:+8.3f} "
                  f"{'-' if frac is None else f'{frac:.3f}':>11s}  {r['what']}")


if __name__ == "__main__":
    main()
