"""Time one tensor-parallel rank's random-weight build (``load_model(load_format="random")``'s model
construction), on a CPU or one GPU, without starting a process group.

Rank 0 of ``--tp N`` is built as ``load_model`` builds it (the weight plan, the model's constructor on the
device, the seed), and timed; ``--profile`` adds the top torch calls. The same rank of the full shape is
then built on the meta device (no memory, no time) to count its parameter bytes, and the measured time is
scaled by that ratio: the build is a few passes over each parameter's bytes, so time goes with bytes.

    python benchmarks/random_build.py --shape dsv3 --layers 3 --experts 256 --weights fp8 --tp 8 --device cpu
    python benchmarks/random_build.py --shape dsv3 --weights fp8 --tp 8 --device cuda   # full rank, one H200
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from e2e import FP8_BLOCK_CONFIG, SHAPE_NAMES, make_config  # noqa: E402

from attnzoo.layers.parallel import TPContext  # noqa: E402
from attnzoo.models.weights import plan_weights  # noqa: E402
from attnzoo.models.registry import model_class  # noqa: E402


def config_for(shape: str, layers: int | None, experts: int | None, weights: str):
    config, _ = make_config(shape, layers)
    if experts is not None:
        config.n_routed_experts = experts
        config.n_group = min(config.n_group, experts)
        config.topk_group = min(config.topk_group, config.n_group)
    if layers is not None and getattr(config, "first_k_dense_replace", 0) >= layers:
        config.first_k_dense_replace = 1  # keep MoE layers in a reduced depth
    if weights == "fp8":
        config.quantization_config = dict(FP8_BLOCK_CONFIG)
    return config


def build(config, *, tp: int, device: torch.device, plan_device: torch.device, seed: int = 0):
    """Rank 0 of ``tp``, built as load_model builds it: the plan decides on ``plan_device`` (FP8 layers kept
    on a CPU as on a GPU), the model is constructed on ``device``."""
    cls = model_class(config.architectures[0])
    fp8 = getattr(config, "quantization_config", None) is not None
    plan = plan_weights(config, cls, device=plan_device, dtype=torch.bfloat16, mode="fp8" if fp8 else "auto",
                        checkpoint_names=None)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        torch.manual_seed(seed)
        with torch.device(device):
            return plan.build(functools.partial(cls, tp=TPContext(rank=0, world_size=tp)), config)
    finally:
        torch.set_default_dtype(previous)


def param_bytes(model) -> dict:
    out = {"expert": 0, "dense": 0}
    for name, p in model.named_parameters():
        out["expert" if ".experts." in name else "dense"] += p.numel() * p.element_size()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPE_NAMES, default="dsv3")
    ap.add_argument("--layers", type=int, default=None, help="reduced depth (default: the shape's)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts of the whole layer (default: the shape's)")
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="fp8")
    ap.add_argument("--tp", type=int, default=1, help="build rank 0 of this many (its shard and E/tp experts)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", action="store_true", help="print the top torch calls (cProfile)")
    args = ap.parse_args()

    dev = torch.device(args.device)
    config = config_for(args.shape, args.layers, args.experts, args.weights)
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    model = build(config, tp=args.tp, device=dev, plan_device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    if prof:
        prof.disable()
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated(dev) if dev.type == "cuda"  # the process's, on a CPU
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    have = param_bytes(model)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters() if p.element_size() > 1)
    del model
    full = param_bytes(build(config_for(args.shape, None, None, args.weights), tp=args.tp, device=torch.device("meta"),
                             plan_device=dev))
    scale = sum(full.values()) / sum(have.values())
    out = {"shape": args.shape, "layers": config.num_hidden_layers, "experts": getattr(config, "n_routed_experts", None),
           "weights": args.weights, "tp": args.tp, "device": str(dev), "build_s": round(seconds, 2),
           "param_gib": round(sum(have.values()) / 2**30, 3), "expert_gib": round(have["expert"] / 2**30, 3),
           "peak_gib": round(peak / 2**30, 3), "float_params_finite": finite,
           "full_rank_param_gib": round(sum(full.values()) / 2**30, 2),
           "full_rank_build_s_extrapolated": round(seconds * scale, 1)}
    print(json.dumps(out))
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
