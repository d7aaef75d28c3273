"""Where a server's mixed steps (decode rows beside a prompt chunk) spend their time: host, wait and GPU per step,
and the kernels under the profiler, with the mixed steps captured whole (``engine.mixed_graphs``) or as pieces.

``--decoding`` requests of 64 tokens start decoding, then ``--prompts`` requests of ``--prompt-len`` tokens arrive:
their chunks fill each step's token budget (``max_batch_tokens`` in ``--load-kwargs``) beside the decode rows. The
steps are timed plainly (wall, the engine's host work, its wait for the step's tokens), then profiled.

    python benchmarks/mixed_step_profile.py --load-kwargs '{"piecewise_graph_tokens": 1024, "max_batch_tokens": 1024}'
    python benchmarks/mixed_step_profile.py --pieces ...    # the same steps with the attention eager between pieces
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decode_profile import kind_of  # noqa: E402
from e2e import SHAPE_NAMES, make_config  # noqa: E402

import attnzoo  # noqa: E402
from attnzoo.engine.sampling import SamplingParams  # noqa: E402


def step_times(eng, steps: int) -> dict:
    """Wall, host and wait ms per step over ``steps`` steps, and the rows and new tokens they held."""
    torch.cuda.synchronize()
    eng.step_log = []
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    log, n = eng.step_log, max(len(eng.step_log), 1)
    return {"wall_ms": round(1e3 * (time.perf_counter() - t0) / steps, 2),
            "host_ms": round(1e3 * sum(s["host_s"] for s in log) / n, 2),
            "wait_ms": round(1e3 * sum(s["wait_s"] for s in log) / n, 2),
            "rows": round(sum(s["num_reqs"] for s in log) / n, 1),
            "new_tokens": round(sum(s["new_tokens"] for s in log) / n, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPE_NAMES, default="llama8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--load-kwargs", default='{"piecewise_graph_tokens": 1024, "max_batch_tokens": 1024}')
    ap.add_argument("--decoding", type=int, default=80, help="requests decoding when the prompts arrive")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10, help="steps timed, and profiled (at most 5 of them)")
    ap.add_argument("--pieces", action="store_true", help="set the mixed-step graphs aside: their steps run as pieces")
    ap.add_argument("--rows", type=int, default=20, help="kernels listed")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)

    config, _ = make_config(args.shape, args.layers)
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        llm = attnzoo.load_model(folder, load_format="random", **json.loads(args.load_kwargs))
    llm.warm_up()
    eng = llm.engine
    if args.pieces:
        eng.runner.mixed, eng.runner.mixed_why = None, "off (mixed_step_profile.py --pieces)"
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=10_000, ignore_eos=True)

    def add(n: int, length: int) -> None:
        for _ in range(n):
            eng.add_request(torch.randint(1000, 30000, (length,), generator=gen).tolist(), params)

    add(args.decoding, 64)
    for _ in range(12):  # their prompts in, decoding
        eng.step()
    add(args.prompts, args.prompt_len)
    for _ in range(5):  # the first chunks beside the decode rows: graphs and kernels settle
        eng.step()
    before = dict(eng.graph_stats)
    timed = step_times(eng, args.steps)
    ran = {k: v - before.get(k, 0) for k, v in eng.graph_stats.items() if v != before.get(k, 0)}
    from torch.profiler import ProfilerActivity, profile

    profiled = min(args.steps, 5)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            eng.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    gpu_ms = sum(e.self_device_time_total for e in events) / profiled / 1e3
    kinds: dict[str, float] = {}
    for e in events:
        kinds[kind_of(e.key)] = kinds.get(kind_of(e.key), 0.0) + e.self_device_time_total / profiled / 1e3
    top = sorted(events, key=lambda e: -e.self_device_time_total)[: args.rows]
    res = {"shape": args.shape, "load_kwargs": json.loads(args.load_kwargs), "whole": eng.runner.mixed is not None,
           "steps": timed, "graph_stats": ran, "gpu_ms_per_step": round(gpu_ms, 2),
           "by_kind_ms": {k: round(v, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
           "kernels": [{"name": e.key[:90], "us_per_call": round(e.self_device_time_total / e.count, 1),
                        "calls_per_step": round(e.count / profiled, 1)} for e in top]}
    print(json.dumps({k: v for k, v in res.items() if k != "kernels"}, indent=1))
    for k in res["kernels"]:
        print(f"  {k['us_per_call']:9.1f} us x {k['calls_per_step']:6.1f}  {k['name']}")
    if args.out:
        from common import write_result

        write_result(args.out, {"result": res}, argv=sys.argv[1:] if argv is None else list(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
