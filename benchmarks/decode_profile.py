"""Where the e2e workload's batch-1024 decode steps spend GPU time: torch profiler, plain vs cascade.

1024 GSM8K 8-shot prompts on the Llama-3.1-8B shape (random weights); the prompts are run once so their
pages are cached, then 17 tokens each are generated under the profiler (16 decode steps at batch 1024).

    python benchmarks/decode_profile.py flashinfer
"""
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e import LLAMA_8B  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

import attnzoo  # noqa: E402

cfg = LlamaConfig(**LLAMA_8B); cfg.architectures = ["LlamaForCausalLM"]
data = json.loads((Path(__file__).parent / "data" / "gsm8k_8shot_tokens.json").read_text())
prompts = [data["prefix"] + q for q in data["questions"]][:1024]
backend = sys.argv[1]
for cascade in (False, True):
    llm = attnzoo.load_model(cfg, load_format="random", backend=backend, dtype="bfloat16", device="cuda", max_running=1024, cascade=cascade)
    e = llm.engine
    e.cascade_min_saved_tokens = 1
    llm.generate(prompts[:2], max_new_tokens=4, ignore_eos=True)
    llm.generate(prompts, max_new_tokens=1, ignore_eos=True)  # prompt pages now cached
    e.step_log = []
    torch.cuda.synchronize()
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        llm.generate(prompts, max_new_tokens=17, ignore_eos=True)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    dec = [s for s in e.step_log if s["new_tokens"] == s["num_reqs"]]
    print(f"\n=== {backend} cascade={cascade}: wall {wall*1e3:.0f} ms, {len(e.step_log)} steps ({len(dec)} decode), graph {e.graph_stats}")
    ka = prof.key_averages()
    cuda_total = sum(k.self_device_time_total for k in ka) / 1e3
    print(f"GPU kernel time total {cuda_total:.0f} ms")
    print(ka.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=70))
    del llm, e; torch.cuda.empty_cache()
