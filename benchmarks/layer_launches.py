"""Kernel launches of one DeepSeek MoE decoder layer at decode, counted on a CPU.

    TRITON_INTERPRET=1 python benchmarks/layer_launches.py [--shape v2_lite|v3] [--tokens 1]

A small model of the shape's structure (V2-Lite: no q low-rank path, softmax greedy routing over 64
experts, top-6, 2 shared; V3: q low-rank, sigmoid grouped routing over 256 experts in 8 groups, top-8;
tiny widths, bfloat16 as on a GPU) runs one decode step with every fused op on its GPU path
(``fused.use("triton")``: the Triton kernels under the interpreter, the fused MoE included), and the
projections on the skinny kernel as at decode's few rows on a GPU. Counted in
the last layer, per module: Triton launches, plus torch ops that would launch a GPU kernel (views,
allocations and metadata ops are not launches). The attention core (the MLA backend's kernels) is left
out: it is the backend's, not the layer's.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (the Triton kernels run in the interpreter on the CPU)")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import triton.runtime.interpreter as interp  # noqa: E402
from transformers import DeepseekV2Config, DeepseekV3Config  # noqa: E402

import attnzoo  # noqa: E402
from attnzoo.layers import fused, skinny  # noqa: E402

# aten ops that launch no kernel: views, allocations, metadata.
NO_LAUNCH = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select", "split",
    "split_with_sizes", "unsqueeze", "squeeze", "as_strided", "detach", "alias", "empty", "empty_strided",
    "empty_like", "lift_fresh", "unbind", "narrow", "_reshape_alias", "size", "stride", "dim", "is_contiguous",
    "unflatten", "flatten", "chunk", "sym_size", "sym_stride", "sym_numel", "numel", "contiguous",
}
SHAPES = {
    "v2_lite": (DeepseekV2Config, dict(
        q_lora_rank=None, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, topk_method="greedy",
        n_group=1, topk_group=1, routed_scaling_factor=1.0)),
    "v3": (DeepseekV3Config, dict(
        q_lora_rank=48, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True)),
}
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=2, first_k_dense_replace=1, kv_lora_rank=32,
              qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=256)


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.where: list[str] = []  # module path stack; empty: not counting
        self.quiet = 0  # inside a Triton launch or the attention core

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        copies = name != "to" or out is not args[0]  # .to() of a tensor already in that dtype is itself
        if self.where and not self.quiet and name not in NO_LAUNCH and copies:
            self.ops[(self.where[-1], f"torch {name}")] += 1
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="v2_lite", choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=1, help="decode batch (tokens in the step)")
    args = ap.parse_args(argv)
    cls, extra = SHAPES[args.shape]
    config = cls(**COMMON, **extra, architectures=[cls.__name__.replace("Config", "ForCausalLM")])
    counter = Count()
    run = interp.InterpretedFunction.run

    def counted_run(self, *a, **kw):
        if counter.where and not counter.quiet:
            counter.ops[(counter.where[-1], f"triton {self.__name__}")] += 1
        counter.quiet += 1
        try:
            return run(self, *a, **kw)
        finally:
            counter.quiet -= 1

    interp.InterpretedFunction.run = counted_run
    with fused.use("triton"), skinny.use(True):  # decode's few rows take the skinny projections on a GPU
        llm = attnzoo.load_model(config, load_format="random", backend="torch", device="cpu", dtype="bfloat16")
        layer = llm.model.model.layers[-1]
        step = {"n": 0}

        def enter(label):
            def pre(m, a):
                if label == "layer":
                    step["n"] += 1
                if step["n"] == 3:  # the second decode step: the first builds the cached one-token MoE blocks
                    counter.where.append(label)
            return pre

        def leave(label):
            def post(m, a, out):
                if counter.where and counter.where[-1] == label:
                    counter.where.pop()
            return post

        # The layer's own ops (residual adds and norms) and its parts' (to two levels: "mlp.gate").
        parts = [("layer", layer)] + [(n, m) for n, m in layer.named_modules() if n and n.count(".") <= 1]
        for label, mod in parts:
            mod.register_forward_pre_hook(enter(label))
            mod.register_forward_hook(leave(label))
        core = layer.self_attn.mla
        core.register_forward_pre_hook(lambda m, a: setattr(counter, "quiet", counter.quiet + 1))
        core.register_forward_hook(lambda m, a, o: setattr(counter, "quiet", counter.quiet - 1))
        with counter:
            llm.generate([[5, 6, 7, 8]] * args.tokens, max_new_tokens=3, ignore_eos=True)
    interp.InterpretedFunction.run = run
    total = sum(counter.ops.values())
    print(f"{args.shape}: kernel launches in one MoE decoder layer, decode step of {args.tokens} token(s), "
          f"attention core excluded")
    by_module: Counter = Counter()
    for (where, op), n in counter.ops.items():
        by_module[where] += n
    for where, n in sorted(by_module.items()):
        ops = ", ".join(f"{op} x{c}" if c > 1 else op for (w, op), c in sorted(counter.ops.items()) if w == where)
        print(f"  {where:32} {n:3}  {ops}")
    print(f"  {'total':32} {total:3}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
