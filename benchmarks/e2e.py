"""End-to-end throughput on the GSM8K-shaped workload: attnzoo's engine per backend vs transformers.

Workload: 1319 prompts = an 8-shot prefix + each GSM8K test question (pre-tokenised by
make_gsm8k_tokens.py), 256 output tokens each with EOS ignored, on a Llama-3.1-8B-shaped model with
random bf16 weights on one GPU. Reports output tokens/s, time to first token, time per output token,
peak memory, the ratio to transformers (batched ``generate``, measured on a subset in the same run),
and the ratio to a roofline estimate of the same schedule (per step: weights + KV bytes read over the
measured copy bandwidth, or FLOPs over the measured matmul rate, whichever is larger).

Backends with a cascade path run twice (``--cascade both``): plain, every request reading its own copy
of the shared few-shot prefix, and cascade, the prefix read once per decode step. Each run's roofline
counts the KV bytes its own path must read (``roofline_fraction``); ``roofline_plain_s`` is the plain
path's estimate for the same schedule, so cascade runs can be set against what plain reading allows.

    python benchmarks/e2e.py --out benchmarks/results/e2e_h100 [--backends triton,flashinfer] [--quick]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from attention import matmul_tflops  # noqa: E402
from attention_triton import copy_bandwidth, versions  # noqa: E402

LLAMA_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)


def device_limits() -> dict:
    """Measured device-to-device copy bandwidth (read + write bytes) and bf16 matmul rate."""
    return {"copy_bytes_per_s": copy_bandwidth("cuda") * 1e9, "matmul_flops_per_s": matmul_tflops("cuda") * 1e12}


def roofline_seconds(steps: list[dict], *, weight_bytes: int, params: int, kv_bytes_per_token: int,
                     layers: int, q_heads: int, head_dim: int, limits: dict, shared_once: bool = True) -> float:
    """``shared_once``: a step's shared prefix (``shared_prefix_len``, cascade steps) is read once, not per request."""
    total = 0.0
    for s in steps:
        kv_tokens = s["kv_tokens"] - (s["shared_prefix_len"] * (s["num_reqs"] - 1) if shared_once else 0)
        bytes_moved = weight_bytes + kv_tokens * kv_bytes_per_token
        flops = 2 * params * s["new_tokens"] + 4 * layers * q_heads * head_dim * s["attn_pairs"]
        total += max(bytes_moved / limits["copy_bytes_per_s"], flops / limits["matmul_flops_per_s"])
    return total


def run_transformers(config, prompts, new_tokens, batch_size) -> dict:
    from transformers import LlamaForCausalLM

    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    torch.cuda.reset_peak_memory_stats()
    out_tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device="cuda")  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device="cuda")
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        out_tokens += (out.shape[1] - width) * len(chunk)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"backend": "transformers generate (sdpa, static batches of %d)" % batch_size, "prompts": len(prompts),
            "output_tokens": out_tokens, "wall_s": wall, "output_tok_per_s": out_tokens / wall, "peak_mem_gib": peak / 2**30}


def run_attnzoo(config, prompts, new_tokens, backend, max_running, limits, cascade: bool | None) -> dict:
    import attnzoo

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    llm = attnzoo.load_model(config, load_format="random", backend=backend, dtype="bfloat16", device="cuda",
                             max_running=max_running, cascade=cascade)
    # Warm-up: kernels compile here, the cascade ones too (two requests sharing the prefix).
    threshold, llm.engine.cascade_min_saved_tokens = llm.engine.cascade_min_saved_tokens, 1
    llm.generate(prompts[:2], max_new_tokens=4, ignore_eos=True)
    llm.engine.cascade_min_saved_tokens = threshold
    llm.engine.graph_stats = dict.fromkeys(llm.engine.graph_stats, 0)
    llm.engine.step_log = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    n_out = sum(len(o.token_ids) for o in outs)
    assert len(outs) == len(prompts) and all(len(o.token_ids) == new_tokens for o in outs)
    params = sum(p.numel() for p in llm.model.parameters())
    info = llm.info()
    shape = dict(weight_bytes=params * 2, params=params, kv_bytes_per_token=info["kv_bytes_per_token"],
                 layers=config.num_hidden_layers, q_heads=config.num_attention_heads, head_dim=config.head_dim,
                 limits=limits)
    roof = roofline_seconds(llm.engine.step_log, **shape)
    roof_plain = roofline_seconds(llm.engine.step_log, shared_once=False, **shape)
    ttft = [o.time_to_first_token for o in outs]
    tpot = [(o.latency - o.time_to_first_token) / (len(o.token_ids) - 1) for o in outs]
    res = {
        "backend": f"attnzoo prefill={info['prefill_backend']} decode={info['decode_backend']}"
                   + (" cascade" if llm.engine.cascade else ""),
        "cascade": info["cascade"], "cascade_steps": llm.engine.graph_stats["cascade"],
        "graph_steps": llm.engine.graph_stats["replayed"],
        "page_size": info["page_size"], "prompts": len(prompts), "output_tokens": n_out, "wall_s": wall,
        "output_tok_per_s": n_out / wall, "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": statistics.median(ttft),
        "tpot_mean_ms": 1e3 * statistics.mean(tpot), "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "steps": len(llm.engine.step_log), "max_running": max_running,
        "kv_cache_tokens": info["kv_cache_tokens"], "roofline_s": roof, "roofline_fraction": roof / wall,
        "roofline_plain_s": roof_plain,
        "prefix_cache_pages": len(llm.engine.prefix_cache) if llm.engine.prefix_cache is not None else 0,
    }
    del llm
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output path prefix: writes PREFIX.json and PREFIX.png")
    ap.add_argument("--backends", default="triton")
    ap.add_argument("--prompts", type=int, default=1319)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--hf-prompts", type=int, default=256, help="prompts for the transformers baseline")
    ap.add_argument("--hf-batch", type=int, default=128)
    ap.add_argument("--max-running", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=None, help="reduce depth (default: the full 32)")
    ap.add_argument("--quick", action="store_true", help="200 prompts, 64 HF prompts")
    ap.add_argument("--cascade", choices=("both", "on", "off"), default="both",
                    help="backends with a cascade path: run plain and cascade (both), or one of them")
    ap.add_argument("--hf-baseline", default=None, metavar="JSON",
                    help="reuse the transformers result of an earlier run (its JSON) instead of measuring it")
    args = ap.parse_args()
    from transformers import LlamaConfig

    cfg = dict(LLAMA_8B)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    if args.quick:
        args.prompts, args.hf_prompts = 200, 64
    data = json.loads((Path(__file__).parent / "data" / "gsm8k_8shot_tokens.json").read_text())
    prompts = [data["prefix"] + q for q in data["questions"]][: args.prompts]

    limits = device_limits()
    print(f"device {torch.cuda.get_device_name()}: copy {limits['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 matmul {limits['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    results = []
    if args.hf_baseline:
        hf = next(r for r in json.loads(Path(args.hf_baseline).read_text())["results"] if r["backend"].startswith("transformers"))
        hf["reused_from"] = args.hf_baseline
    else:
        hf = run_transformers(config, prompts[: args.hf_prompts], args.new_tokens, args.hf_batch)
    print(json.dumps(hf), flush=True)
    results.append(hf)
    from attnzoo.attention.backends import get_backend_class

    for b in args.backends.split(","):
        modes = [None]
        if get_backend_class(b).supports_cascade:
            modes = {"both": [False, True], "on": [True], "off": [False]}[args.cascade]
        for cascade in modes:
            r = run_attnzoo(config, prompts, args.new_tokens, b, args.max_running, limits, cascade)
            r["vs_transformers"] = r["output_tok_per_s"] / hf["output_tok_per_s"]
            print(json.dumps(r), flush=True)
            results.append(r)

    meta = {"device": torch.cuda.get_device_name(), **versions(), "model": "Llama-3.1-8B-shaped, random bf16 weights", "config": cfg,
            "workload": f"{len(prompts)} GSM8K 8-shot prompts ({len(data['prefix'])}-token shared prefix), "
                        f"{args.new_tokens} output tokens each, EOS ignored", "limits": limits}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))

    print(f"\n{'engine':58s} {'tok/s':>9s} {'x HF':>6s} {'TTFT s':>7s} {'TPOT ms':>8s} {'peak GiB':>8s} "
          f"{'roofline':>8s} {'plain roof':>10s}")
    nan = float("nan")
    for r in results:
        plain = r["roofline_plain_s"] / r["wall_s"] if "roofline_plain_s" in r else nan
        print(f"{r['backend'][:58]:58s} {r['output_tok_per_s']:9.0f} {r.get('vs_transformers', 1.0):6.2f} "
              f"{r.get('ttft_mean_s', nan):7.2f} {r.get('tpot_mean_ms', nan):8.1f} "
              f"{r['peak_mem_gib']:8.1f} {r.get('roofline_fraction', nan):8.2f} {plain:10.2f}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.barh([r["backend"][:40] for r in results], [r["output_tok_per_s"] for r in results])
        ax.set_xlabel("output tokens/s")
        ax.set_title(f"GSM8K-shaped workload, Llama-3.1-8B shape, {meta['device']}")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        print("matplotlib not installed: no PNG chart")


if __name__ == "__main__":
    main()
