"""The serving workload without HTTP: bench_serving's prompts driven through ``OnlineEngine`` in-process, a
closed loop of ``--max-concurrency`` requests, with the engine's per-step log broken down by step kind.

Set beside ``serve_peer.py`` on one machine, the difference is what the HTTP server and its client cost;
the step breakdown says where the engine's own time goes (decode-only steps against steps that also carry
prompt chunks, and how many prompt tokens those carry), and on a GPU e2e.py's roofline of the same steps
(``attnzoo.roofline``) says how far each kind is from what it must read and compute; ``balanced_s``, the same work
spread over the fewest steps that emit its tokens (every step a share of the prompts beside the decode rows),
how far a better schedule could go.

    python benchmarks/online_load.py --shape llama8b --dataset random --max-concurrency 100 --num-prompts 250
"""
from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving  # noqa: E402
from common import run_meta  # noqa: E402

import attnzoo  # noqa: E402
from attnzoo.engine.online import OnlineEngine  # noqa: E402
from attnzoo.engine.sampling import SamplingParams  # noqa: E402
from attnzoo.roofline import balanced_seconds, device_limits, model_profile, roofline_seconds, step_kinds  # noqa: E402


DRIVE_TIMEOUT_S = 600  # the longest wait for the next request to finish


def drive(online: OnlineEngine, prompts, concurrency: int) -> tuple[list[dict], float]:
    """Keep ``concurrency`` requests in flight until all are done: per request its TTFT, latency, tokens."""
    done: queue.Queue = queue.Queue()
    stats: list[dict] = [{} for _ in prompts]

    def submit(i: int) -> None:
        p, n = prompts[i]
        t0 = time.perf_counter()
        stats[i]["t0"] = t0

        def listener(ev, i=i):
            if "ttft" not in stats[i] and (ev.token is not None or ev.completion is not None):
                stats[i]["ttft"] = ev.at - t0
            if ev.completion is not None or ev.error is not None:
                stats[i]["latency"] = ev.at - t0
                stats[i]["tokens"] = len(ev.completion.token_ids) if ev.completion is not None else 0
                stats[i]["error"] = None if ev.error is None else repr(ev.error)
                done.put(i)

        online.submit(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), listener)

    t0 = time.perf_counter()
    nxt = min(concurrency, len(prompts))
    for i in range(nxt):
        submit(i)
    for _ in range(len(prompts)):
        done.get(timeout=DRIVE_TIMEOUT_S)  # a lost event fails the run instead of hanging it
        if nxt < len(prompts):
            submit(nxt)
            nxt += 1
    return stats, time.perf_counter() - t0


def step_breakdown(log: list[dict], t0: float) -> dict:
    """Time between consecutive steps' read-backs, summed by kind: decode-only, or with prompt tokens."""
    kinds: dict[str, dict] = {}
    last = t0
    for s in log:
        dt, last = s["t"] - last, s["t"]
        kind = "decode" if s["new_tokens"] == s["num_reqs"] else "mixed"
        k = kinds.setdefault(kind, {"steps": 0, "s": 0.0, "rows": 0, "new_tokens": 0, "host": 0.0, "wait": 0.0})
        k["steps"] += 1
        k["s"] += dt
        k["host"] += s.get("host_s", 0.0)
        k["wait"] += s.get("wait_s", 0.0)
        k["rows"] += s["num_reqs"]
        k["new_tokens"] += s["new_tokens"]
    for k in kinds.values():
        k["ms_per_step"] = round(1e3 * k["s"] / k["steps"], 2)
        # the engine's host work per step, and its wait for the step's tokens (~0: the host is the bottleneck)
        k["host_ms_per_step"] = round(1e3 * k.pop("host") / k["steps"], 2)
        k["wait_ms_per_step"] = round(1e3 * k.pop("wait") / k["steps"], 2)
        k["rows_per_step"] = round(k.pop("rows") / k["steps"], 1)
        k["new_tokens_per_step"] = round(k.pop("new_tokens") / k["steps"], 1)
        k["s"] = round(k["s"], 3)
    return kinds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--load-kwargs", default="{}", help="JSON: more load_model keywords")
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--graph-extend-tokens", type=int, default=None,
                    help="Engine.graph_extend_tokens (0: off; default: the engine's)")
    ap.add_argument("--mixed-min-rows", type=int, default=None,
                    help="fewest decode rows a mixed step splits off (HybridBackend.mixed_min_rows; 0: never; "
                         "default: the runner's)")
    ap.add_argument("--whole-steps", choices=("on", "off"), default="on",
                    help="off: the mixed-step graphs (engine.mixed_graphs) set aside, their steps run as pieces")
    bench_serving.add_args(ap, server=False)
    args = ap.parse_args(argv)
    from e2e import make_config  # after the path insert: e2e imports the benchmarks' helpers

    config, _ = make_config(args.shape, args.layers)
    # measured before the weights and the KV cache take the GPU's memory, as e2e.py does
    load_kwargs = json.loads(args.load_kwargs)
    on_gpu = torch.cuda.is_available() and str(load_kwargs.get("device", "cuda")).startswith("cuda")
    limits = device_limits() if on_gpu else None
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        llm = attnzoo.load_model(folder, load_format="random", **load_kwargs)
    llm.warm_up()
    if args.graph_extend_tokens is not None:
        llm.engine.graph_extend_tokens = args.graph_extend_tokens
    if args.whole_steps == "off" and llm.engine.runner.mixed is not None:
        llm.engine.runner.mixed, llm.engine.runner.mixed_why = None, "off (online_load.py --whole-steps off)"
    if args.mixed_min_rows is not None:
        llm.engine.runner.backends.mixed_min_rows = args.mixed_min_rows or None
    prompts = bench_serving.make_prompts(args)
    online = OnlineEngine(llm, max_queue=len(prompts))  # the whole closed loop may wait at once
    warm, prompts = prompts[: args.warmup], prompts[args.warmup:]
    drive(online, [(p, 4) for p, _ in warm], len(warm) or 1)
    llm.engine.step_log = []
    t_start = time.perf_counter()
    stats, wall = drive(online, prompts, args.max_concurrency or len(prompts))
    log, llm.engine.step_log = llm.engine.step_log, None
    online.shutdown()
    errors = [s["error"] for s in stats if s.get("error")]
    tokens = sum(s.get("tokens", 0) for s in stats)
    roofline = {}
    if limits is not None:  # e2e.py's roofline over this run's steps: what a step of each kind must read and compute
        prof = model_profile(llm)
        roofline = {"roofline_s": round(roofline_seconds(log, prof, limits), 3),
                    **{k: round(v, 3) for k, v in step_kinds(log, t0=t_start, prof=prof, limits=limits).items()}}
        roofline["roofline_fraction"] = round(roofline["roofline_s"] / wall, 3)
        # the same work with every step carrying its share of the prompts beside the decode rows
        roofline["balanced_s"] = round(balanced_seconds(log, prof, limits, output_tokens=tokens,
                                                        rows=args.max_concurrency or len(prompts)), 3)
        roofline["balanced_fraction"] = round(roofline["balanced_s"] / wall, 3)
    ttfts = [s["ttft"] for s in stats if "ttft" in s]
    tpots = [(s["latency"] - s["ttft"]) / (s["tokens"] - 1) for s in stats if s.get("tokens", 0) > 1]
    res = {"shape": args.shape, "layers": args.layers, "dataset": args.dataset, "num_prompts": len(prompts),
           "max_concurrency": args.max_concurrency, "wall_s": round(wall, 3), "errors": errors[:5],
           "output_tok_per_s": round(tokens / wall, 1),
           "ttft_ms_mean": round(1e3 * statistics.fmean(ttfts), 1) if ttfts else None,
           "tpot_ms_mean": round(1e3 * statistics.fmean(tpots), 2) if tpots else None,
           "steps": step_breakdown(log, t_start), "roofline": roofline,
           "overlap": dict(llm.engine.overlap_stats), "graph_stats": dict(llm.engine.graph_stats), "backends": {k: llm.info()[k] for k in ("prefill_backend", "decode_backend")}}
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": run_meta(argv=sys.argv[1:] if argv is None else list(argv)), "result": res}, indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
