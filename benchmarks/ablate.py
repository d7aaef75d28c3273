"""What each part of a step costs where it runs: e2e.py again with one part of the step left out at a time.

    python benchmarks/ablate.py --out benchmarks/results/ablate_dsv2lite_1prompt --parts stage2,wuv,moe_sum,norm,routed \\
        -- --shape dsv2lite --prompts 1 --hf-prompts 0 --backends triton --cascade off \\
           --load-kwargs '{"cuda_graph_batch_sizes": [1]}'

A profile times kernels one after another, without PDL's overlap and with its own overhead (decode_profile.py
runs with --no-pdl); what a kernel costs inside a CUDA-graph step is what the step loses without it. Each
variant runs e2e.py (the arguments after ``--``) in a process of its own with one part launched as a no-op, its
outputs left as they were: the step's times count, its tokens do not. A part whose garbage reaches the logits
as NaN stops that run (reported, the others go on). The base runs first and last; deltas are against their mean.

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

# name -> (module, attribute: a Triton kernel, or None for a Python patch, what it is)
PARTS = {
    "store": ("attnzoo.attention.kernels.store", "_store_kernel", "the KV store (with the RoPE it applies)"),
    "stage2": ("attnzoo.attention.kernels.decode", "_decode_stage2", "decode's split merge"),
    "norm": ("attnzoo.layers.fused_kernels", "_rms_norm_kernel", "every RMSNorm launch"),
    "mla_entry": ("attnzoo.layers.fused_kernels", "_mla_entry_kernel", "MLA's latent norm, RoPE and cache entry"),
    "act_and_mul": ("attnzoo.layers.fused_kernels", "_act_and_mul_kernel",
                    "dense MLPs' activation, where the gate_up projection does not end in it"),
    "skinny": ("attnzoo.layers.skinny_kernels", "_skinny_kernel", "every skinny projection (small-batch GEMMs)"),
    "moe_act": ("attnzoo.layers.moe_kernels", "act_kernel", "the fused MoE's activation"),
    "moe_sum": ("attnzoo.layers.moe_kernels", "sum_kernel", "the fused MoE's weighted sum (plus the shared experts)"),
    "routed": ("attnzoo.layers.moe.layer", None,
               "the routed experts (grouped GEMMs, activation, sum): the shared experts' output alone"),
    "wuv": ("attnzoo.attention.mla", None, "MLA's latent output times W_UV (MLAAttention's; not NSA layers')"),
}
BASE = "base"


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _skip_routed(self, x, topk_weights, topk_ids, add, add_stream=None):
    import torch

    if add_stream is not None:  # the shared experts' stream still joins the step's
        torch.cuda.current_stream(x.device).wait_stream(add_stream)
    return add if add is not None else torch.zeros_like(x)


def _skip_wuv(o_latent, w_uv):
    return o_latent.new_empty(*o_latent.shape[:2], w_uv.shape[1])


@contextlib.contextmanager
def removed(part: str):
    """Within the block, ``part`` (a key of PARTS) does no work; restored on exit."""
    module_name, attr, _ = PARTS[part]
    module = importlib.import_module(module_name)
    if attr is not None:
        target, name, stand_in = module, attr, _NoLaunch()
    elif part == "routed":
        target, name, stand_in = module.FusedMoE, "_routed", _skip_routed
    else:
        target, name, stand_in = module, "latent_to_values", _skip_wuv
    original = getattr(target, name)
    setattr(target, name, stand_in)
    try:
        yield
    finally:
        setattr(target, name, original)


def parse_parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise SystemExit(f"--parts: {', '.join(unknown) or 'none named'}; choose from {', '.join(PARTS)}")
    return parts


def summarize(runs: list[dict]) -> list[dict]:
    """Rows of (part, TPOT ms, delta against the base runs' mean, decode roofline fraction, error) from the runs'
    ``{"part", "result" (e2e's first result) or "error"}``."""
    base = [r["result"]["tpot_mean_ms"] for r in runs if r["part"] == BASE and "result" in r]
    if not base:
        raise SystemExit("no base run finished: nothing to set the parts against")
    mean = statistics.fmean(base)
    rows = []
    for r in runs:
        row = {"part": r["part"], "what": PARTS[r["part"]][2] if r["part"] in PARTS else "nothing left out"}
        if "result" in r:
            tpot = r["result"]["tpot_mean_ms"]
            row.update(tpot_ms=tpot, delta_ms=tpot - mean, output_tok_per_s=r["result"]["output_tok_per_s"],
                       decode_roofline_fraction=r["result"].get("decode_roofline_fraction"))
        else:
            row["error"] = r["error"]
        rows.append(row)
    return rows


HERE = str(Path(__file__).resolve().parent)


def _child(part: str, e2e_args: list[str]) -> None:
    if HERE not in sys.path:  # run as a script, benchmarks/ is there already
        sys.path.insert(0, HERE)
    import e2e

    with contextlib.nullcontext() if part == BASE else removed(part):
        e2e.main(e2e_args)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    e2e_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="parts:\n" + "\n".join(f"  {n:12s} {w}" for n, (_, _, w) in PARTS.items()))
    ap.add_argument("--out", help="output prefix: PREFIX.json, and PREFIX_<part>.json/.log per run")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--child", help=argparse.SUPPRESS)  # one run, in this process
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.child:
        return _child(args.child, e2e_args)
    if not args.out or "--out" in e2e_args:
        raise SystemExit("pass --out PREFIX before --, and e2e.py's arguments (without --out) after it")
    parts = parse_parts(args.parts)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    for part in [BASE, *parts, BASE]:
        tag = f"{out.name}_{part}_{len(runs)}"
        prefix = out.with_name(tag)
        cmd = [sys.executable, __file__, "--child", part, "--", *e2e_args, "--out", str(prefix)]
        print("$", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        with open(prefix.with_suffix(".log"), "w") as log:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        print(f"  exit {code} after {time.perf_counter() - t0:.0f} s", flush=True)
        if code:
            runs.append({"part": part, "error": f"exit {code}: see {prefix.with_suffix('.log').name}"})
        else:
            runs.append({"part": part, "result": json.loads(prefix.with_suffix(".json").read_text())["results"][0]})
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
