"""vLLM's offline engine on the GSM8K-shaped workload of e2e.py, for any model shape (run in vLLM's own process).

The shape comes as JSON written by peer_vllm.py: ``{"config_class": "LlamaConfig", "fields": {...},
"architecture": "LlamaForCausalLM"}``. The config is built here, with the transformers that vLLM's overlay
imports, so a config saved by a newer transformers never has to be read by an older one. Weights are
vLLM's dummy weights in bf16; every prompt = the 8-shot prefix + one question; 256 tokens, EOS ignored,
greedy; vLLM's defaults otherwise (prefix caching, torch.compile, CUDA graphs).

    python3 vllm_offline.py WORKLOAD.json --shape-json SHAPE.json --out vllm.json [--attn-backend FLASHINFER]
        [--max-num-seqs 1024] [--kv-cache-dtype fp8] [--prompts N]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

# No network, no usage reports; FlashInfer's sampler is never needed for greedy decoding.
for _k, _v in {"VLLM_USE_FLASHINFER_SAMPLER": "0", "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}.items():  # what_ran() travels to the worker pickled
    os.environ.setdefault(_k, _v)


def what_ran(worker):
    """Inside vLLM's worker (collective_rpc): the attention backends and KV blocks actually used."""
    import torch

    mr = worker.model_runner
    backends = sorted({g.backend.get_name() for gs in getattr(mr, "attn_groups", []) for g in gs})
    return {"gpu": torch.cuda.get_device_name(), "attention_backends": backends,
            "num_gpu_blocks": worker.cache_config.num_gpu_blocks, "block_size": worker.cache_config.block_size}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", help="gsm8k_8shot_tokens.json (keys: prefix, questions)")
    ap.add_argument("--shape-json", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--attn-backend", default="auto", help="vLLM's attention backend name; auto = vLLM's own choice")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-model-len", type=int, default=None)
    args = ap.parse_args()

    shape = json.load(open(args.shape_json))
    data = json.load(open(args.workload))
    prompts = [data["prefix"] + q for q in data["questions"]][: args.prompts]

    import transformers
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    config = getattr(transformers, shape["config_class"])(**shape["fields"])
    config.architectures = [shape["architecture"]]
    config.dtype = "bfloat16"
    model_dir = tempfile.mkdtemp(prefix="vllm_shape_")
    config.save_pretrained(model_dir)

    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              enable_prefix_caching=True, gpu_memory_utilization=args.gpu_memory_utilization,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype,
              disable_log_stats=False,  # per-request metrics (TTFT, TPOT)
              attention_config=None if args.attn_backend == "auto" else {"backend": args.attn_backend})
    tp = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    greedy = dict(ignore_eos=True, temperature=0.0, detokenize=False)
    llm.generate(tp[:2], SamplingParams(max_tokens=4, **greedy), use_tqdm=False)  # warm-up, as e2e.py does

    t0 = time.perf_counter()
    outs = llm.generate(tp, SamplingParams(max_tokens=args.new_tokens, **greedy), use_tqdm=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    if n_out != len(prompts) * args.new_tokens:
        raise SystemExit(f"vLLM returned {n_out} tokens, expected {len(prompts) * args.new_tokens}")
    res = {"engine": f"vLLM {vllm.__version__}", "shape": shape.get("name"), "prompts": len(prompts),
           "output_tokens": n_out, "wall_s": wall, "output_tok_per_s": n_out / wall, "max_num_seqs": args.max_num_seqs,
           "kv_cache_dtype": args.kv_cache_dtype, "attn_backend_arg": args.attn_backend,
           "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outs),
           "transformers": transformers.__version__, "python": sys.version.split()[0]}
    ms = [o.metrics for o in outs if getattr(o, "metrics", None) is not None]
    if ms:
        res["ttft_mean_s"] = statistics.mean(m.first_token_latency for m in ms)
        res["tpot_mean_ms"] = 1e3 * statistics.mean(
            (m.last_token_ts - m.first_token_ts) / max(m.num_generation_tokens - 1, 1) for m in ms)
    try:
        res.update(llm.collective_rpc(what_ran)[0])
    except Exception as e:  # informative only: vLLM's log names the backends too
        res["probe_error"] = repr(e)
    print(json.dumps(res, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
