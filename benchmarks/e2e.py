"""End-to-end throughput on the GSM8K-shaped workload: attnzoo's engine per backend vs transformers.

Workload: 1319 prompts = an 8-shot prefix + each GSM8K test question (pre-tokenised by
make_gsm8k_tokens.py), 256 output tokens each with EOS ignored, on a full-size model shape
(``--shape``: Llama-3.1-8B by default, Gemma-4-31B text, DeepSeek-V2-Lite, ...) with random bf16 weights
on one GPU. Reports output tokens/s, time to first token, time per output token, peak memory, KV
capacity, the ratio to transformers (batched ``generate`` on a subset in the same run; Llama only) and
the ratio to a roofline estimate of the same schedule (per step: weights + KV bytes read over the
measured copy bandwidth, or FLOPs over the measured matmul rate, whichever is larger). MoE weights count
only the experts a step can touch (expected distinct experts for its tokens), sliding-window layers only
the window each request can see, sparse (NSA, ``--shape dsv32`` / ``glm5``) layers only the tokens the
indexer selects (at most index_topk per request) plus the indexer keys it scores. Backend "default" is the
policy's choice for the shape on this GPU.

Backends with a cascade path run twice (``--cascade both``): plain, every request reading its own copy
of the shared few-shot prefix, and cascade, the prefix read once per step (by sliding-window layers: the
part of it inside every request's window). Each run's roofline
counts the KV bytes its own path must read (``roofline_fraction``); ``roofline_plain_s`` is the plain
path's estimate for the same schedule, so cascade runs can be set against what plain reading allows.
``decode_roofline_fraction`` is the decode steps' alone (their roofline over their wall): the per-token figure a
batch-1 latency target names, without the prompt's prefill. ``roofline_serial_fraction`` sets the run against a
second bound: per step, the weights (bytes or GEMM FLOPs)
and the attention (KV bytes or its FLOPs) each at its own limit, added, as kernels that run one after the
other can at best do (a large batch's compute-bound GEMMs do not hide its KV reads).

    python benchmarks/e2e.py --out benchmarks/results/e2e_h100 [--shape llama8b] [--backends default,triton] [--quick]

The vLLM peer on the same workload and shapes, in the same run: benchmarks/peer_vllm.py.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from common import git_sha, source_hash, versions  # noqa: E402
from gemma4 import GEMMA4_31B  # noqa: E402  (google/gemma-4-31B-it's text model)

from attnzoo import pdl  # noqa: E402
from attnzoo.layers import fused, skinny  # noqa: E402
from attnzoo.roofline import device_limits, model_profile, roofline_seconds, step_kinds  # noqa: E402

LLAMA_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
LLAMA_70B = dict(LLAMA_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8)
# deepseek-ai/DeepSeek-V2-Lite (16B): MLA rank 512, 64 routed experts top-6, 2 shared, layer 0 dense.
DSV2_LITE = dict(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
    first_k_dense_replace=1, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0,
    n_group=1, topk_group=1, max_position_embeddings=163840, rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
)
# deepseek-ai/DeepSeek-V3 (671B): 61 layers (3 dense), 256 routed experts top-8 in 8 groups, MLA. Use --layers.
DSV3 = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
    first_k_dense_replace=3, n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5,
    max_position_embeddings=163840, rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
)
# deepseek-ai/DeepSeek-V3.2-Exp: DeepSeek-V3 plus the sparse-attention indexer (64 heads of 128, top-2048). Use --layers.
DSV32 = dict(DSV3, index_topk=2048, index_head_dim=128, index_n_heads=64)
# zai-org/GLM-5 (744B): MLA (64 heads, nope 192 + rope 64, values 256) + the DSA indexer (32 heads of 128,
# top-2048, interleaved RoPE), 78 layers (3 dense), 256 routed experts top-8 in one group. Use --layers
# (full width, reduced depth: --layers 6 keeps 3 dense + 3 MoE layers).
GLM5 = dict(
    vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=78,
    num_attention_heads=64, num_key_value_heads=64, kv_lora_rank=512, q_lora_rank=2048, qk_nope_head_dim=192,
    qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
    first_k_dense_replace=3, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    max_position_embeddings=202752, rms_norm_eps=1e-5, index_topk=2048, index_head_dim=128, index_n_heads=32,
)
# openai/gpt-oss-20b: 24 layers alternating sliding (128) and full, attention sinks, 32 experts top-4 with biases
# and the clamped SwiGLU, YaRN. Random weights in the model dtype: the checkpoint's MXFP4 experts are
# dequantized at load by default (models/mxfp4.py), so bf16 experts are what attnzoo runs for the real model too;
# --weights mxfp4 keeps random experts MXFP4 (fp8_weights="mxfp4": the fused MoE's w4a16 path).
GPT_OSS_20B = dict(
    vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, head_dim=64,
    num_attention_heads=64, num_key_value_heads=8, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
    max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
    swiglu_limit=7.0, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
)
# Qwen/Qwen3-30B-A3B: 48 layers, all MoE (128 routed experts top-8, renormalised, no shared expert), GQA 32/4
# heads of 128 with QK-norm.
QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
)
# deepseek-ai/DeepSeek-V4-Flash: 43 layers of shared-KV MQA (64 heads of 512, window 128), CSA (4:1, indexer
# 64 heads of 128, top-512) and HCA (128:1) layers, mHC (4 streams), 256 routed experts top-6 (the first 3
# layers hash-routed). transformers' config defaults; its default layer schedule (2 HCA, then CSA/HCA
# interleaved) is cut to the depth. Use --layers.
DSV4_FLASH = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64,
    num_key_value_heads=1, head_dim=512, q_lora_rank=1024, qk_rope_head_dim=64, n_routed_experts=256,
    num_experts_per_tok=6, n_shared_experts=1, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128,
    index_topk=512, sliding_window=128, hc_mult=4, max_position_embeddings=1048576,
)
DEEPSEEK_SHAPES = {  # shape -> (fields, transformers config class name, architecture)
    "dsv2lite": (DSV2_LITE, "DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "dsv3": (DSV3, "DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "dsv32": (DSV32, "DeepseekV32Config", "DeepseekV32ForCausalLM"),
    "glm5": (GLM5, "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
    "dsv4-flash": (DSV4_FLASH, "DeepseekV4Config", "DeepseekV4ForCausalLM"),
}


def make_config(shape: str, layers: int | None):
    """A transformers config (architectures set) for a named full-size shape, optionally fewer layers."""
    import transformers

    if shape in ("llama8b", "llama70b"):
        fields = dict(LLAMA_8B if shape == "llama8b" else LLAMA_70B)
        if layers:
            fields["num_hidden_layers"] = layers
        config, arch = transformers.LlamaConfig(**fields), "LlamaForCausalLM"
    elif shape == "gemma4-31b":
        n = layers or GEMMA4_31B["num_hidden_layers"]
        fields = dict(GEMMA4_31B, num_hidden_layers=n, layer_types=[
            "full_attention" if (i + 1) % 6 == 0 or i == n - 1 else "sliding_attention" for i in range(n)])
        config, arch = transformers.Gemma4TextConfig(**fields), "Gemma4ForCausalLM"
    elif shape == "gpt-oss-20b":
        n = layers or GPT_OSS_20B["num_hidden_layers"]
        fields = dict(GPT_OSS_20B, num_hidden_layers=n,
                      layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)])
        config, arch = transformers.GptOssConfig(**fields), "GptOssForCausalLM"
    elif shape == "qwen3-30b-a3b":
        fields = dict(QWEN3_30B_A3B, num_hidden_layers=layers or QWEN3_30B_A3B["num_hidden_layers"])
        config, arch = transformers.Qwen3MoeConfig(**fields), "Qwen3MoeForCausalLM"
    elif shape in DEEPSEEK_SHAPES:
        base, cls, arch = DEEPSEEK_SHAPES[shape]
        fields = dict(base)
        if layers:
            fields["num_hidden_layers"] = layers
        config = getattr(transformers, cls)(**fields)
    else:
        raise SystemExit(f"unknown shape {shape!r}")
    config.architectures = [arch]
    return config, fields


# The official DeepSeek-V3 checkpoints' quantization_config (float8_e4m3fn weights, a scale per 128x128 block).
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
SHAPE_NAMES = ("llama8b", "llama70b", "gemma4-31b", "gpt-oss-20b", "qwen3-30b-a3b", *DEEPSEEK_SHAPES)


WARM_UP_MARKER = 7  # any token id: it only has to differ from every prompt's first page


def warm_up(llm, prompts, full: bool = True) -> dict:
    """The first generate (two prompts, 4 tokens: the kernels' JIT happens here), timed, and a check that
    the first decode step's logits are finite: a run on NaNs would still report tokens/s. ``full``: then
    every prompt behind a marker token (so no page of it matches the measured run's), 2 tokens each: the
    extend and decode shapes the measured run takes compile here (a first run on a fresh machine measured
    its Triton compiles otherwise)."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts[:2], max_new_tokens=4, ignore_eos=True, return_logits=True)
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    first = torch.stack([o.logits[1] for o in outs])  # logits[0]: the prefill's; [1]: the first decode step's
    res = {"first_generate_s": round(time.perf_counter() - t0, 2),
           "first_decode_logits_finite": bool(torch.isfinite(first).all()),
           "first_decode_logits_absmax": round(float(first.abs().max()), 3),
           "first_decode_logits_std": round(float(first.std()), 3)}
    print(f"first generate (JIT included): {res['first_generate_s']} s; first decode logits finite: "
          f"{res['first_decode_logits_finite']} (max |logit| {res['first_decode_logits_absmax']}, "
          f"std {res['first_decode_logits_std']})", flush=True)
    if not res["first_decode_logits_finite"]:
        raise SystemExit("the first decode step's logits are not all finite: the numbers would be measured on NaNs")
    if len(prompts) <= 2:
        # The measured run finds these prompts' pages cached and extends only their tails: that extend's shapes
        # (a MoE tile of its own, say) compile here, not in the measured first token.
        llm.generate(prompts, max_new_tokens=1, ignore_eos=True)
    if full and len(prompts) > 2:
        t0 = time.perf_counter()
        runner = llm.engine.runner
        saved = runner.cascade_graph_min_saved_tokens
        # no cascade graphs here: they are capped, and the marker's prefix would spend slots the measured run
        # needs; eager cascade steps run, so that their kernels (extend's and decode's) compile here
        runner.cascade_graph_min_saved_tokens = float("inf")
        try:
            llm.generate([[WARM_UP_MARKER] + list(p) for p in prompts], max_new_tokens=2, ignore_eos=True)
        finally:
            runner.cascade_graph_min_saved_tokens = saved
        cache = llm.engine.pages.prefix_cache
        if cache is not None:  # the measured run starts as before: only the first two prompts' pages cached
            cache.evict(cache.evictable())
            cache.evict_window(cache.evictable_window())
            llm.generate(prompts[:2], max_new_tokens=1, ignore_eos=True)
        # what a server's warm-up adds (LLM.warm_up): the backends' paths only captured steps take, such as the
        # copies around cuDNN's cascade shared pass, which no eager step here runs
        llm.engine.warm_up_backends()
        if llm.device.type == "cuda":
            torch.cuda.synchronize()
        res["full_warm_up_s"] = round(time.perf_counter() - t0, 2)
        print(f"warm-up over all {len(prompts)} prompts: {res['full_warm_up_s']} s", flush=True)
    return res


def timed_generate(llm, prompts, new_tokens: int) -> tuple[list, float, float]:
    """The measured generate, on fresh step and graph counters: (outputs, wall seconds, start time)."""
    llm.engine.graph_stats = dict.fromkeys(llm.engine.graph_stats, 0)
    llm.engine.step_log = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    return outs, time.perf_counter() - t0, t0


def load_timings(llm, load_s: float) -> dict:
    """load_model's phases (this process's rank), printed as they are the first thing a short GPU call needs."""
    timings = {"load_s": round(load_s, 2), **llm.info()["load_timings"]}
    print(f"load_model: {json.dumps(timings)}", flush=True)
    return timings


def run_transformers(config, prompts, new_tokens, batch_size) -> dict:
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
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


def run_attnzoo(config, prompts, new_tokens, backend, max_running, limits, cascade: bool | None,
                extra: dict | None = None, dry_run: bool = False, overlap: bool = True,
                capture_after: int | None = None, early_launch: bool = True, full_warm_up: bool = True) -> dict:
    """One engine run of the workload. backend "default": the policy's choice; max_running None: the engine's.
    ``dry_run``: load and warm up only (the timings of each phase, the logits check)."""
    import attnzoo

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    kwargs = {"progress": True, **(extra or {})}  # progress: each load phase's line in the log, as it ends
    if max_running is not None:
        kwargs["max_running"] = max_running
    t_load = time.perf_counter()
    llm = attnzoo.load_model(config, load_format="random", backend=None if backend == "default" else backend,
                             dtype="bfloat16", device="cuda", cascade=cascade, **kwargs)
    timings = load_timings(llm, time.perf_counter() - t_load)
    # Warm-up: kernels compile here, the cascade ones too (two requests sharing the prefix).
    llm.engine.overlap, llm.engine.early_launch = overlap, early_launch
    if capture_after is not None and llm.engine.graphs is not None:
        llm.engine.graphs.capture_after = capture_after
    threshold, llm.engine.cascade_min_saved_tokens = llm.engine.cascade_min_saved_tokens, 1
    timings.update(warm_up(llm, prompts, full=full_warm_up))
    llm.engine.cascade_min_saved_tokens = threshold
    if dry_run:
        info = llm.info()
        return {"engine": "attnzoo", "backend": f"attnzoo prefill={info['prefill_backend']} decode={info['decode_backend']}",
                "dry_run": True, **timings, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
                "kv_cache_tokens": info["kv_cache_tokens"], "weights": info["weights"],
                "kv_footprint": info["kv_footprint"]}
    outs, wall, t0 = timed_generate(llm, prompts, new_tokens)
    n_out = sum(len(o.token_ids) for o in outs)
    assert len(outs) == len(prompts) and all(len(o.token_ids) == new_tokens for o in outs)
    info = llm.info()
    fp = info["kv_footprint"]
    if "vs_plain_mla" in fp:
        print(f"KV bytes per context token: {fp['bytes_per_context_token']:.0f} measured, a plain MLA cache "
              f"{fp['plain_mla_bytes_per_token']} ({fp['vs_plain_mla']:.3f}x)", flush=True)
    prof = model_profile(llm)
    roof = roofline_seconds(llm.engine.step_log, prof, limits)
    roof_plain = roofline_seconds(llm.engine.step_log, prof, limits, shared_once=False)
    roof_serial = roofline_seconds(llm.engine.step_log, prof, limits, serial=True)
    ttft = [o.time_to_first_token for o in outs]
    tpot = [(o.latency - o.time_to_first_token) / (len(o.token_ids) - 1) for o in outs]
    steps = llm.engine.step_log
    by_kind = step_kinds(steps, t0=t0, prof=prof, limits=limits)
    graphs = llm.engine.graphs
    res = {
        "engine": "attnzoo",
        "backend": f"attnzoo prefill={info['prefill_backend']} decode={info['decode_backend']}"
                   + (" cascade" if llm.engine.cascade else ""),
        "backend_arg": backend, "decision": info["decision"].get("reason") if isinstance(info.get("decision"), dict) else None,
        "cascade": info["cascade"], "cascade_steps": llm.engine.graph_stats["cascade"],
        "graph_steps": llm.engine.graph_stats["replayed"],
        "cascade_graph_steps": llm.engine.graph_stats["cascade_replayed"],
        # captured while generating (inside wall_s), warm-up steps included: cascade ones, and plain ones of a
        # batch's exact size (DecodeGraphs.exact_from)
        "cascade_graphs": sum(c is not None for _, c in graphs.on_demand) if graphs is not None else 0,
        "exact_graphs": sum(c is None for _, c in graphs.on_demand) if graphs is not None else 0,
        "on_demand_capture_s": round(graphs.capture_s, 2) if graphs is not None else 0,
        "graph_batch_sizes": graphs.buckets if graphs is not None else None,
        "graph_pruned_buckets": graphs.pruned if graphs is not None else None,
        "capture_after": graphs.capture_after if graphs is not None else None,
        "overlap": llm.engine.overlap, "early_launch": llm.engine.early_launch,
        "overlap_stats": dict(llm.engine.overlap_stats),
        "page_size": info["page_size"], "prompts": len(prompts), "output_tokens": n_out, "wall_s": wall,
        "output_tok_per_s": n_out / wall, "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": statistics.median(ttft),
        "tpot_mean_ms": 1e3 * statistics.mean(tpot), "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "steps": len(steps), "decode_steps": sum(1 for st in steps if st["new_tokens"] == st["num_reqs"]),
        "max_running": llm.engine.max_running, "max_batch_seen": max(st["num_reqs"] for st in steps),
        "kv_cache_tokens": info["kv_cache_tokens"], "kv_bytes_per_token": info["kv_bytes_per_token"],
        "roofline_s": roof, "roofline_fraction": roof / wall, "roofline_plain_s": roof_plain,
        "roofline_serial_s": roof_serial, "roofline_serial_fraction": roof_serial / wall, **by_kind,
        "decode_roofline_fraction": (by_kind["decode_roofline_s"] / by_kind["decode_wall_s"]
                                     if by_kind["decode_wall_s"] > 0 else None),
        "weights_gib": (prof["dense_bytes"] + prof["expert_bytes"]) / 2**30,
        "prefix_cache_pages": len(llm.engine.prefix_cache) if llm.engine.prefix_cache is not None else 0,
        **timings,
    }
    # kv_footprint: the pool's bytes per context token, measured, against a plain MLA cache (MLA-family shapes)
    for key in ("weights", "kv_cache_dtype", "tensor_parallel_size", "kv_page_groups", "kv_footprint"):
        if key in info:
            res[key] = info[key]
    del llm
    return res


def print_table(results: list[dict]) -> None:
    print(f"\n{'engine':58s} {'tok/s':>9s} {'x HF':>6s} {'TTFT s':>7s} {'TPOT ms':>8s} {'peak GiB':>8s} "
          f"{'KV tok':>9s} {'roofline':>8s} {'plain roof':>10s} {'decode roof':>11s}")
    nan = float("nan")
    for r in results:
        plain = r["roofline_plain_s"] / r["wall_s"] if "roofline_plain_s" in r else nan
        print(f"{r['backend'][:58]:58s} {r['output_tok_per_s']:9.0f} {r.get('vs_transformers', nan):6.2f} "
              f"{r.get('ttft_mean_s', nan):7.2f} {r.get('tpot_mean_ms', nan):8.1f} "
              f"{r.get('peak_mem_gib', nan):8.1f} {r.get('kv_cache_tokens', 0):9d} "
              f"{r.get('roofline_fraction', nan):8.2f} {plain:10.2f} {r.get('decode_roofline_fraction') or nan:11.2f}")


def load_prompts(n: int | None) -> tuple[list[list[int]], dict]:
    data = json.loads((Path(__file__).parent / "data" / "gsm8k_8shot_tokens.json").read_text())
    return [data["prefix"] + q for q in data["questions"]][:n], data


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output path prefix: writes PREFIX.json and PREFIX.png")
    ap.add_argument("--shape", choices=SHAPE_NAMES, default="llama8b")
    ap.add_argument("--backends", default="default", help="comma-separated; 'default' = the policy's choice")
    ap.add_argument("--prompts", type=int, default=1319)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--hf-prompts", type=int, default=256, help="prompts for the transformers baseline (0: none)")
    ap.add_argument("--hf-batch", type=int, default=128)
    ap.add_argument("--max-running", type=int, default=None, help="default: the engine's (sized from the KV cache)")
    ap.add_argument("--layers", type=int, default=None, help="reduce depth (default: the shape's full depth)")
    ap.add_argument("--quick", action="store_true", help="200 prompts, 64 HF prompts")
    ap.add_argument("--cascade", choices=("both", "on", "off", "auto"), default="auto",
                    help="backends with a cascade path: the engine's choice (auto), plain and cascade (both), or one")
    ap.add_argument("--hf-baseline", default=None, metavar="JSON",
                    help="reuse the transformers result of an earlier run (its JSON) instead of measuring it")
    ap.add_argument("--weights", choices=("bf16", "fp8", "mxfp4"), default="bf16",
                    help="fp8: DeepSeek-V3's block-scaled FP8 format (quantization_config as in the official checkpoints); "
                         "mxfp4: MoE experts kept MXFP4 as gpt-oss's checkpoints store them (fp8_weights='mxfp4')")
    ap.add_argument("--load-kwargs", default="{}", help="extra load_model keywords as JSON, e.g. '{\"page_size\": 64}'")
    ap.add_argument("--no-overlap", action="store_true",
                    help="prepare each step only after the previous one's tokens are back (Engine.overlap off)")
    ap.add_argument("--no-early-launch", action="store_true",
                    help="with overlap, launch a prepared step only after this step's tokens are read back "
                         "(Engine.early_launch off)")
    ap.add_argument("--short-warm-up", action="store_true",
                    help="warm up on two prompts only (not every prompt once more behind a marker token)")
    ap.add_argument("--capture-after", type=int, default=None,
                    help="capture a cascade graph on the N-th decode step in a row that asks for it "
                         "(DecodeGraphs.capture_after; default: the engine's)")
    ap.add_argument("--unfused", action="store_true",
                    help="the fused ops' torch references instead of their Triton kernels (attnzoo.layers.fused)")
    ap.add_argument("--no-skinny", action="store_true",
                    help="every dense projection by cuBLAS, also at decode's few rows (attnzoo.layers.skinny off)")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch the Triton kernels without programmatic dependent launch (attnzoo.pdl off)")
    ap.add_argument("--dry-run", action="store_true",
                    help="load and warm up only: print each load phase's time, the first generate's (JIT) and the "
                         "logits check, no workload, no transformers baseline")
    ap.add_argument("--index-topk", type=int, default=None,
                    help="dsv32, glm5: tokens the indexer selects per query (the model's 2048 exceeds every context of "
                         "this workload, where selection keeps them all; a smaller value measures the sparse path)")
    args = ap.parse_args(argv)
    config, cfg = make_config(args.shape, args.layers)
    if args.index_topk is not None:
        if "index_topk" not in cfg:
            raise SystemExit("--index-topk applies to the sparse-attention shapes (dsv32, glm5)")
        config.index_topk = cfg["index_topk"] = args.index_topk
    if args.weights == "fp8":
        config.quantization_config = cfg["quantization_config"] = dict(FP8_BLOCK_CONFIG)
    if args.weights == "mxfp4":
        config.quantization_config = cfg["quantization_config"] = {"quant_method": "mxfp4"}
    if args.quick:
        args.prompts, args.hf_prompts = 200, min(args.hf_prompts, 64)
    prompts, data = load_prompts(args.prompts)

    limits = {} if args.dry_run else device_limits()  # the roofline's: a dry run has none to compute
    if limits:
        print(f"device {torch.cuda.get_device_name()}: copy {limits['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
              f"bf16 matmul {limits['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    results = []
    hf = None
    if args.hf_baseline:
        hf = next(r for r in json.loads(Path(args.hf_baseline).read_text())["results"] if r["backend"].startswith("transformers"))
        hf["reused_from"] = args.hf_baseline
    elif args.hf_prompts and not args.dry_run:
        hf = run_transformers(config, prompts[: args.hf_prompts], args.new_tokens, args.hf_batch)
    if hf is not None:
        print(json.dumps(hf), flush=True)
        results.append(hf)
    from attnzoo.attention.backends import get_backend_class

    extra = json.loads(args.load_kwargs)
    if args.weights == "mxfp4":
        extra.setdefault("fp8_weights", "mxfp4")
    for b in args.backends.split(","):
        modes = [None]
        if b != "default" and get_backend_class(b).supports_cascade:
            modes = {"both": [False, True], "on": [True], "off": [False], "auto": [None]}[args.cascade]
        elif b == "default" and args.cascade != "auto":
            modes = {"both": [False, None], "on": [None], "off": [False]}[args.cascade]
        for cascade in modes:
            with (skinny.use(False) if args.no_skinny else contextlib.nullcontext(),
                  pdl.use(False) if args.no_pdl else contextlib.nullcontext(),
                  fused.use("torch") if args.unfused else contextlib.nullcontext()):
                r = run_attnzoo(config, prompts, args.new_tokens, b, args.max_running, limits, cascade, extra,
                                args.dry_run, overlap=not args.no_overlap, capture_after=args.capture_after,
                                early_launch=not args.no_early_launch, full_warm_up=not args.short_warm_up)
            if args.no_skinny:
                r["backend"] += " cuBLAS-only"
            if args.no_pdl:
                r["backend"] += " no-PDL"
            if args.unfused:
                r["backend"] += " unfused"
            if hf is not None and not args.dry_run:
                r["vs_transformers"] = r["output_tok_per_s"] / hf["output_tok_per_s"]
            print(json.dumps(r), flush=True)
            results.append(r)

    meta = {"device": torch.cuda.get_device_name(), **versions(), "git_sha": git_sha(), "source_hash": source_hash(), "shape": args.shape,
            "model": f"{args.shape}-shaped, random {args.weights} weights", "config": cfg,
            "workload": f"{len(prompts)} GSM8K 8-shot prompts ({len(data['prefix'])}-token shared prefix), "
                        f"{args.new_tokens} output tokens each, EOS ignored", "limits": limits}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    if args.dry_run:
        return results
    print_table(results)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.barh([r["backend"][:40] for r in results], [r["output_tok_per_s"] for r in results])
        ax.set_xlabel("output tokens/s")
        ax.set_title(f"GSM8K-shaped workload, {args.shape} shape, {meta['device']}")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        print("matplotlib not installed: no PNG chart")
    return results


if __name__ == "__main__":
    main()
