"""Where the e2e workload's decode steps spend GPU time: torch profiler, by kernel and by kind.

N GSM8K 8-shot prompts on a full-size shape (random weights): the prompts run once so their pages are
cached, then ``--steps`` decode steps at batch N run under the profiler, once per cascade setting.
Each section also times the same steps without the profiler: GPU busy time against wall time shows
what the host costs between kernels (the gap CUDA graphs and host/GPU overlap remove).

    python benchmarks/decode_profile.py flashinfer                          # Llama-3.1-8B, batch 1024
    python benchmarks/decode_profile.py --shape gemma4-31b --prompts 239 --cascade on
    python benchmarks/decode_profile.py --shape dsv4-flash --layers 4 --prompts 1319 --phase extend

``--phase extend`` profiles the prompts' prefill instead: the shared 8-shot prefix is cached (as in e2e.py's run),
each question is not (a distinct marker token ahead of it on every pass), one output token each.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e import SHAPE_NAMES, make_config  # noqa: E402

import attnzoo  # noqa: E402
from attnzoo import pdl  # noqa: E402

# Kernel name fragments -> kind, first match wins (cuBLAS's Hopper GEMMs are "nvjet_*"; Triton's are ours).
# The cascade GEMM pass's cuBLAS products count as GEMMs; its row softmax as attention.
KINDS = (("attention", ("flashinfer", "Prefill", "Decode", "_extend", "attention", "cascade", "merge_state", "xqa",
                        "_row_softmax")),
         ("gemm", ("nvjet", "gemm", "sm90_xmma", "cutlass", "matmul", "_moe", "_skinny")),
         ("norm/rope/act (fused)", ("rms", "norm", "rope", "act_and_mul", "silu", "gelu")),
         ("sampling/logits", ("softmax", "argmax", "topk", "sort", "tanh")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k.lower() in low for k in keys):
            return kind
    return "other elementwise/copies"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("backend", nargs="?", default=None, help="default: the policy's choice")
    ap.add_argument("--shape", choices=SHAPE_NAMES, default="llama8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=1024, help="the decode batch")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--cascade", choices=("both", "on", "off"), default="both")
    ap.add_argument("--rows", type=int, default=18, help="kernels listed per section")
    ap.add_argument("--phase", choices=("decode", "extend"), default="decode")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch without programmatic dependent launch: with it a kernel's time includes its wait "
                         "on the previous one, so per-kernel times overstate")
    ap.add_argument("--load-kwargs", default="{}", help="extra load_model keywords as JSON")
    ap.add_argument("--decode-only", action="store_true",
                    help="also profile the same pass with one output token (its extend steps only) and list each "
                         "kernel's time less that pass's: the decode steps alone, per step")
    ap.add_argument("--by-shape", action="store_true",
                    help="also list the torch ops (mm, bmm, copies, ...) by input shape, the GPU time under each")
    args = ap.parse_args(argv)
    if args.decode_only and args.phase != "decode":
        ap.error("--decode-only subtracts the extend steps from a decode profile: use it with --phase decode")
    with pdl.use(not args.no_pdl):
        profile_shape(args)


def profile_shape(args) -> None:
    cfg, _ = make_config(args.shape, args.layers)
    data = json.loads((Path(__file__).parent / "data" / "gsm8k_8shot_tokens.json").read_text())
    prompts = [data["prefix"] + q for q in data["questions"]][: args.prompts]
    for cascade in {"both": (False, True), "on": (True,), "off": (False,)}[args.cascade]:
        llm = attnzoo.load_model(cfg, load_format="random", backend=args.backend, dtype="bfloat16", device="cuda",
                                 max_running=args.prompts, cascade=cascade, **json.loads(args.load_kwargs))
        e = llm.engine
        llm.generate(prompts[:2], max_new_tokens=4, ignore_eos=True)
        if args.phase == "extend":  # a fresh marker token per pass keeps every question out of the prefix cache
            passes = [[data["prefix"] + [1000 + i] + q for q in data["questions"][: args.prompts]] for i in range(3)]
            n = 1
        else:
            llm.generate(prompts, max_new_tokens=1, ignore_eos=True)  # the prompts' pages are now cached
            passes = [prompts] * 3
            n = args.steps + 1
        llm.generate(passes[0], max_new_tokens=n, ignore_eos=True)  # warm: kernels built, graphs captured
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(passes[1], max_new_tokens=n, ignore_eos=True)
        torch.cuda.synchronize()
        plain_wall = time.perf_counter() - t
        e.step_log = []
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=args.by_shape) as prof:
            t = time.perf_counter()
            llm.generate(passes[2], max_new_tokens=n, ignore_eos=True)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        dec = [s for s in e.step_log if s["new_tokens"] == s["num_reqs"]]
        info = llm.info()
        print(f"\n=== {args.phase} {args.shape} prefill={info['prefill_backend']} decode={info['decode_backend']} cascade={cascade} "
              f"batch {args.prompts}: wall {plain_wall * 1e3:.0f} ms without the profiler ({len(e.step_log)} steps, "
              f"{len(dec)} decode), {wall * 1e3:.0f} ms with it; graphs {e.graph_stats}")
        ka = prof.key_averages()
        kernels = [k for k in ka if k.device_type == torch.autograd.DeviceType.CUDA]  # kernels, memcpys, memsets
        busy = sum(k.self_device_time_total for k in kernels) / 1e3
        by_kind: dict[str, float] = {}
        for k in kernels:
            by_kind[kind_of(k.key)] = by_kind.get(kind_of(k.key), 0.0) + k.self_device_time_total / 1e3
        print(f"GPU kernel time {busy:.0f} ms = {busy / plain_wall / 1e3:.0%} of the unprofiled wall; per decode step "
              f"{busy / max(len(e.step_log), 1):.1f} ms busy, {plain_wall * 1e3 / max(len(e.step_log), 1):.1f} ms wall")
        for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
            print(f"  {kind:28s} {ms:9.1f} ms  {ms / busy:6.1%}")
        print(ka.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=90))
        if args.by_shape:  # which call sites the anonymous aten ops are: their operand shapes, GPU time under each
            ops = [k for k in prof.key_averages(group_by_input_shape=True) if k.key.startswith("aten::")]
            ops.sort(key=lambda k: -k.device_time_total)
            print(f"\n{'op':24s} {'GPU ms':>9s} {'calls':>6s}  input shapes")
            for k in ops[: args.rows]:
                print(f"{k.key:24s} {k.device_time_total / 1e3:9.1f} {k.count:6d}  {str(k.input_shapes)[:140]}")
        if args.decode_only and args.phase == "decode":
            t = time.perf_counter()
            llm.generate(passes[1], max_new_tokens=1, ignore_eos=True)
            torch.cuda.synchronize()
            extend_wall = time.perf_counter() - t
            with profile(activities=[ProfilerActivity.CUDA]) as prof1:
                llm.generate(passes[2], max_new_tokens=1, ignore_eos=True)
                torch.cuda.synchronize()
            print(f"\ndecode steps alone, without the profiler: {(plain_wall - extend_wall) / args.steps * 1e3:.2f} ms "
                  f"a step ({plain_wall * 1e3:.0f} ms with {args.steps} decode steps, {extend_wall * 1e3:.0f} without)")
            print_decode_only(kernel_times(prof), kernel_times(prof1), args.steps, args.rows)
        del llm, e
        torch.cuda.empty_cache()


def kernel_times(prof) -> dict[str, tuple[float, int]]:
    """GPU ms and launches by kernel name."""
    return {k.key: (k.self_device_time_total / 1e3, k.count) for k in prof.key_averages()
            if k.device_type == torch.autograd.DeviceType.CUDA}


def print_decode_only(full: dict, extend: dict, steps: int, rows: int) -> None:
    diff = {name: (ms - extend.get(name, (0.0, 0))[0], n - extend.get(name, (0.0, 0))[1])
            for name, (ms, n) in full.items()}
    total = sum(ms for ms, _ in diff.values())
    by_kind: dict[str, float] = {}
    for name, (ms, _) in diff.items():
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + ms
    print(f"\n--- decode steps alone (the pass less its extend-only twin): {total / steps:.2f} ms of GPU time a step")
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:28s} {ms / steps:8.3f} ms a step  {ms / total:6.1%}")
    print(f"{'kernel':90s} {'ms/step':>8s} {'launches/step':>14s} {'us/launch':>10s}")
    for name, (ms, n) in sorted(diff.items(), key=lambda kv: -kv[1][0])[:rows]:
        print(f"{name[:90]:90s} {ms / steps:8.3f} {n / steps:14.1f} {ms * 1e3 / max(n, 1):10.1f}")


if __name__ == "__main__":
    main()
