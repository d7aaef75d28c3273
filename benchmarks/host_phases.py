"""Where the host's time goes in a decode step, without a profiler: each phase of ``Engine.step`` timed with
``time.perf_counter`` by wrapping the functions that run it (no profiler overhead, the step loop as it runs).

At small batches a CUDA-graph step is short on the GPU, and the host has to prepare and launch the next one
inside that time (``Engine`` overlap and early launch); where the host's phases add up to more than the GPU's
step, the step waits on the host. Phases, per decode step (means over ``--steps`` steps after warm-up):

  prepare        Runner.prepare: the metadata (build_metadata), the graph staging and the backend's plan
    metadata       of which build_metadata
    stage          of which DecodeGraphs.stage (static buffers, the plan's refill)
  launch         Runner.launch: input ids, the graph replay and the logits
    replay         of which CUDAGraph.replay (cudaGraphLaunch: its host cost grows with the graph's nodes)
    logits         of which compute_logits (eager, after the graph)
  pick           pick_tokens (sampling: launches only)
  wait           the one sync a step on the tokens' copy (the host idle until they are back)
  step           Engine.step in all; "other" = step - the phases above (bookkeeping, early-launch choice)

Timed from the second step on (the first is the prompt's extend step, with any first-use compiles); each phase
is its mean per call (a step prepares and launches the next, so the timed steps hold one call fewer of those).
The wall per step is between the tokens of the first and the last step reaching the host.

    python benchmarks/host_phases.py --shape dsv2lite [--prompts 1] [--steps 64] [backend]
"""
import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e import SHAPE_NAMES, make_config  # noqa: E402

import attnzoo  # noqa: E402
from attnzoo.engine import cuda_graph, engine as engine_mod, runner as runner_mod  # noqa: E402

PHASES = ("prepare", "metadata", "stage", "launch", "replay", "logits", "pick", "wait", "step")


class Timers:
    """Accumulated host seconds and calls per phase, while ``on``."""

    def __init__(self):
        self.total = defaultdict(float)
        self.calls = defaultdict(int)
        self.on = self.armed = False

    def add(self, phase: str, seconds: float) -> None:
        self.total[phase] += seconds
        self.calls[phase] += 1

    def mean_us(self, phase: str) -> float:
        """Per call: a step prepares and launches the next one, so the timed steps hold one call fewer of those."""
        return self.total[phase] / max(self.calls[phase], 1) * 1e6

    def wrap(self, owner, name: str, phase: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - t)

        setattr(owner, name, timed)


class TimedEvent:
    """The step's token copy event, its ``synchronize`` timed as "wait" (not every event's: the FlashInfer
    backends' plan fence waits inside prepare)."""

    def __init__(self, event, timers: Timers):
        self.event, self.timers = event, timers

    def synchronize(self) -> None:
        t = time.perf_counter()
        self.event.synchronize()
        if self.timers.on:
            self.timers.add("wait", time.perf_counter() - t)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("backend", nargs="?", default=None, help="default: the policy's choice")
    ap.add_argument("--shape", choices=SHAPE_NAMES, default="llama8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=1, help="the decode batch")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=None, help="a JSON file for the numbers")
    args = ap.parse_args(argv)

    cfg, _ = make_config(args.shape, args.layers)
    data = json.loads((Path(__file__).parent / "data" / "gsm8k_8shot_tokens.json").read_text())
    prompts = [data["prefix"] + q for q in data["questions"]][: args.prompts]
    llm = attnzoo.load_model(cfg, load_format="random", backend=args.backend, dtype="bfloat16", device="cuda",
                             max_running=max(args.prompts, 1))
    timers = Timers()
    # wrapped where the engine looks them up: module attributes for functions, classes for methods
    timers.wrap(runner_mod, "build_metadata", "metadata")
    timers.wrap(runner_mod.Runner, "prepare", "prepare")
    timers.wrap(runner_mod.Runner, "launch", "launch")
    timers.wrap(cuda_graph.DecodeGraphs, "stage", "stage")
    timers.wrap(torch.cuda.CUDAGraph, "replay", "replay")
    timers.wrap(type(llm.model), "compute_logits", "logits")
    timers.wrap(engine_mod, "pick_tokens", "pick")
    to_host = runner_mod.Runner.to_host

    def to_host_timed(self, tokens):
        host, done = to_host(self, tokens)
        return host, None if done is None else TimedEvent(done, timers)

    runner_mod.Runner.to_host = to_host_timed
    timers.wrap(engine_mod.Engine, "step", "step")
    # the first step of a run is the prompt's (an eager extend step, with any first-use compiles): timed from
    # the second on, so that every phase is a decode step's
    stepped = engine_mod.Engine.step

    def step_then_time(self):
        out = stepped(self)
        timers.on = timers.armed
        return out

    engine_mod.Engine.step = step_then_time

    n = args.steps + 1
    llm.generate(prompts, max_new_tokens=n, ignore_eos=True)  # pages cached, graphs captured
    torch.cuda.synchronize()
    e = llm.engine
    e.step_log = []
    timers.armed = True
    llm.generate(prompts, max_new_tokens=n, ignore_eos=True)
    torch.cuda.synchronize()
    timers.armed = timers.on = False
    decode = [s["t"] for s in e.step_log]  # when each step's tokens reached the host
    steps = len(decode) - 1
    wall = decode[-1] - decode[0]
    per = {k: timers.mean_us(k) for k in PHASES}
    per["other"] = per["step"] - per["prepare"] - per["launch"] - per["pick"] - per["wait"]
    per["host_busy"] = per["step"] - per["wait"]
    info = llm.info()
    print(f"{args.shape} batch {args.prompts} decode={info['decode_backend']} graphs {e.graph_stats} "
          f"overlap {e.overlap_stats}: {steps} steps, wall {wall / steps * 1e6:.0f} us/step")
    for k in (*PHASES, "other", "host_busy"):
        print(f"  {k:10s} {per[k]:8.1f} us")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "shape": args.shape, "prompts": args.prompts, "steps": steps, "decode_backend": info["decode_backend"],
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "wall_us_per_step": wall / steps * 1e6, "host_us_per_step": per,
            "graph_stats": e.graph_stats, "overlap_stats": e.overlap_stats}, indent=1))


if __name__ == "__main__":
    main()
