"""Greedy parity of a tiny model at tensor parallel N against TP 1 (the check behind a full-size TP run).

Builds a tiny random checkpoint with transformers (DeepSeek-V3: MLA + MoE with sigmoid routing and
groups; or Llama), runs the same prompts at TP 1 and TP N through ``load_model(tensor_parallel_size=N)``
(spawned ranks; gloo on CPU, NCCL on GPUs, float32), and records whether the greedy tokens are identical
and how far the decode logits are apart. Heads, experts and the vocabulary are sized to split over N.

    python benchmarks/tp_parity.py --tp 8 --device cpu --out benchmarks/results/tp_parity_dsv3_tp8_cpu.json
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import attnzoo  # noqa: E402
from common import write_result  # noqa: E402


def tiny_checkpoint(arch: str, tp: int, directory: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    if arch == "dsv3":
        cfg = transformers.DeepseekV3Config(
            vocab_size=20 * tp, hidden_size=64, intermediate_size=12 * tp, moe_intermediate_size=32,
            num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=tp, num_key_value_heads=tp,
            n_routed_experts=2 * tp, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
            q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            routed_scaling_factor=2.5, max_position_embeddings=256)
        model = transformers.DeepseekV3ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=20 * tp, hidden_size=64, intermediate_size=12 * tp,
                                       num_hidden_layers=2, num_attention_heads=tp, num_key_value_heads=1,
                                       max_position_embeddings=256)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # random routing biases/weights large enough that experts really differ
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    model.save_pretrained(directory)
    return directory


def run(path: Path, tp: int, device: str, prompts, steps: int) -> dict:
    opts = dict(device=device, dtype="float32", kv_cache_tokens=1024, max_running=8)
    if device == "cpu":
        opts.update(backend="torch", page_size=4)
    llm = attnzoo.load_model(path, tensor_parallel_size=tp, **opts)
    try:
        outs = llm.generate(prompts, max_new_tokens=steps, ignore_eos=True, return_logits=True)
        return {"tokens": [o.token_ids for o in outs], "logits": [o.logits for o in outs], "info": llm.info()}
    finally:
        if tp > 1:
            llm.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--arch", choices=("dsv3", "llama"), default="dsv3")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 20 * args.tp, (n,), generator=g).tolist() for n in (5, 13, 9)]
    with tempfile.TemporaryDirectory() as d:
        path = tiny_checkpoint(args.arch, args.tp, Path(d))
        t0 = time.perf_counter()
        ref = run(path, 1, args.device, prompts, args.steps)
        got = run(path, args.tp, args.device, prompts, args.steps)
        wall = time.perf_counter() - t0
    diff = max((a - b).abs().max().item() for a, b in zip(ref["logits"], got["logits"]))
    res = {"arch": args.arch, "tensor_parallel_size": args.tp, "device": args.device,
           "tokens_identical": ref["tokens"] == got["tokens"], "max_abs_logit_diff": diff,
           "tokens_tp1": ref["tokens"], "tokens_tpN": got["tokens"], "wall_s": wall,
           "decision_tpN": {k: got["info"]["decision"].get(k) for k in ("prefill_backend", "decode_backend", "page_size")},
           }
    write_result(args.out, res)
    print(f"{args.arch} TP {args.tp} vs TP 1 on {args.device}: greedy tokens identical: {res['tokens_identical']}, "
          f"max |logit diff| {diff:.2e} ({wall:.0f} s)")
    if not res["tokens_identical"] or diff > 1e-4:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
