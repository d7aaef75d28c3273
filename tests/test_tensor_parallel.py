"""Tensor parallelism: TP=2 against TP=1 (greedy tokens identical, float32 logits within 1e-4) for tiny
Llama (one KV head, replicated), Gemma 4 (k == v global layers with fewer KV heads than ranks, shared-KV
layers, PLE, MoE) and DeepSeek-V3 (MLA + MoE), over both routes: ``load_model(tensor_parallel_size=2)``
from this process (CPU, gloo) and the torchrun route (two processes with torchrun's environment).
The GPU versions (NCCL, CUDA graphs with the collectives captured) need two GPUs."""
from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from transformers import Gemma4ForCausalLM, LlamaConfig, LlamaForCausalLM

import attnzoo
from attnzoo.defaults.profile import profile_from_config, rank_local
from attnzoo.errors import ModelLoadError
from attnzoo.layers.parallel import TPContext
from helpers import random_prompts, save_checkpoint
from test_deepseek import tiny_v3
from test_gemma4 import randomize_scales_, text_config

VOCAB = 160
STEPS = 6
PROMPTS = random_prompts(VOCAB, [5, 13], seed=3)
GPUS = torch.cuda.device_count()


def tiny_llama():
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256, attention_bias=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def tiny_gemma4():
    """Global layers: k == v, one KV head (fewer than the ranks: replicated); sliding layers: 2 KV heads
    (split); layers 4 and 5 read the KV of layers 3 and 2; PLE; an MoE block beside every MLP."""
    cfg = text_config(attention_k_eq_v=True, num_global_key_value_heads=1, num_kv_shared_layers=2,
                      hidden_size_per_layer_input=16, use_double_wide_mlp=True, enable_moe_block=True,
                      num_experts=4, top_k_experts=2, moe_intermediate_size=32, tie_word_embeddings=True)
    torch.manual_seed(2)
    return randomize_scales_(Gemma4ForCausalLM(cfg), seed=2)


MODELS = {"llama": tiny_llama, "gemma4": tiny_gemma4, "deepseek_v3": lambda: tiny_v3(num_hidden_layers=2)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: save_checkpoint(make(), tmp_path_factory.mktemp(name)) for name, make in MODELS.items()}


def _run(llm) -> dict:
    outs = llm.generate(PROMPTS, max_new_tokens=STEPS, ignore_eos=True, return_logits=True)
    return {"tokens": [o.token_ids for o in outs], "logits": [o.logits for o in outs],
            "scored": llm.logits(PROMPTS[1]), "info": llm.info()}


def _check_same(ref: dict, got: dict, name: str) -> None:
    assert got["tokens"] == ref["tokens"], f"{name}: TP=2 greedy tokens differ from TP=1"
    for a, b in zip(ref["logits"], got["logits"]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4, msg=lambda m: f"{name} decode logits: {m}")
    torch.testing.assert_close(got["scored"], ref["scored"], rtol=0, atol=1e-4, msg=lambda m: f"{name} logits(): {m}")


def _options(device: str) -> dict:
    """CPU: the torch reference backend, small pages. GPU: the policy's backends and CUDA graphs, in
    float32 so that TP=2 is held to TP=1 within 1e-4."""
    if device == "cpu":
        return {"device": "cpu", "backend": "torch", "page_size": 4, "kv_cache_tokens": 256}
    return {"device": "cuda", "dtype": "float32", "kv_cache_tokens": 4096, "max_running": 8}


def _load(path, device: str = "cpu", **kw):
    return attnzoo.load_model(path, **_options(device), **kw)


# ---------------------------------------------------------------------------------------- no processes


def test_kv_heads_split_or_replicated():
    # 8 query heads: 4 KV heads split over 2 ranks; over 8 ranks each rank keeps a copy of the one KV
    # head its query head reads (query head r reads KV head r // 2).
    assert [TPContext(rank=r, world_size=2).kv_heads(4, 8) for r in range(2)] == [(0, 2), (2, 2)]
    assert [TPContext(rank=r, world_size=8).kv_heads(4, 8)[0] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ModelLoadError, match="not divisible by tensor_parallel_size 3"):
        TPContext(rank=0, world_size=3).kv_heads(2, 8)
    with pytest.raises(ModelLoadError, match="cannot be replicated evenly"):
        TPContext(rank=0, world_size=4).kv_heads(3, 12)


def test_policy_sees_rank_local_heads():
    """Gemma-4-31B-like: 32 heads, 16 sliding / 4 global KV heads; at TP 8 a rank runs 4 heads over 2 / 1."""
    cfg = text_config(num_attention_heads=32, num_key_value_heads=16, attention_k_eq_v=True,
                      num_global_key_value_heads=4)
    local = rank_local(profile_from_config(cfg, architecture="Gemma4ForCausalLM"), 8)
    assert local.num_heads == 4 and local.num_kv_heads == frozenset({2, 1})
    assert "per rank (tensor parallel 8)" in local.describe()


def test_bad_tensor_parallel_size_is_refused_before_any_process_starts():
    with pytest.raises(ModelLoadError, match="positive integer"):
        attnzoo.load_model(tiny_llama().config, load_format="random", tensor_parallel_size=0)


# ---------------------------------------------------------------------------------------- one process


def test_spawn_route_matches_single_process(checkpoints):
    """load_model(tensor_parallel_size=2) here: this process is rank 0 and spawns rank 1."""
    path = checkpoints["llama"]
    ref = _run(_load(path))
    llm = _load(path, tensor_parallel_size=2)
    try:
        got = _run(llm)
        info = got["info"]
        assert info["tensor_parallel_size"] == 2
        # 4 query heads / 1 KV head: each rank runs 2 query heads over its copy of the KV head.
        assert info["decision"]["profile"]["num_heads"] == 2 and info["decision"]["profile"]["num_kv_heads"] == [1]
        assert info["kv_cache_tokens"] == ref["info"]["kv_cache_tokens"]
        _check_same(ref, got, "llama")
    finally:
        llm.close()
    assert all(not p.is_alive() for p in llm.tp.workers)


# ---------------------------------------------------------------------------------------- torchrun route


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_rank(rank: int, world: int, port: int, paths: dict, out_dir: str, device: str) -> None:
    """What ``torchrun --nproc-per-node 2 script.py`` gives each rank: its environment, then the script,
    which calls load_model and generate on every rank alike."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    results = {}
    for name, path in paths.items():
        llm = _load(path, device)
        res = _run(llm)
        res["info"] = {k: res["info"][k] for k in ("tensor_parallel_size", "decode_backend", "cuda_graph")}
        res["graph_steps"] = llm.engine.graph_stats["replayed"]
        res["routed_expert_weights"] = sum(p.numel() for n, p in llm.model.named_parameters() if ".experts." in n)
        results[name] = res
        del llm
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _torchrun(paths: dict, out_dir, device: str, timeout: float = 600) -> list[dict]:
    ctx = mp.start_processes(_torchrun_rank, args=(2, _free_port(), {k: str(v) for k, v in paths.items()},
                                                   str(out_dir), device), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"torchrun-style ranks did not finish within {timeout} s")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]


def test_torchrun_route_all_families(checkpoints, tmp_path):
    """Every rank runs the same script; rank 1's calls follow rank 0's and return rank 0's results."""
    ranks = _torchrun(checkpoints, tmp_path, "cpu")
    for name, path in checkpoints.items():
        ref = _run(_load(path))
        got = ranks[0][name]
        assert got["info"]["tensor_parallel_size"] == 2
        _check_same(ref, got, name)
        assert ranks[1][name]["tokens"] == got["tokens"]
    # Expert parallel: each rank holds half of the routed experts.
    for name in ("gemma4", "deepseek_v3"):
        full = sum(p.numel() for n, p in _load(checkpoints[name]).model.named_parameters() if ".experts." in n)
        assert ranks[0][name]["routed_expert_weights"] == ranks[1][name]["routed_expert_weights"] == full // 2


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_gpu_torchrun_route_with_cuda_graphs(checkpoints, tmp_path):
    """NCCL, the policy's GPU backends, decode through CUDA graphs with the all-reduces captured."""
    ranks = _torchrun(checkpoints, tmp_path, "cuda")
    for name, path in checkpoints.items():
        ref = _run(_load(path, "cuda"))
        got = ranks[0][name]
        assert got["info"]["decode_backend"] == ref["info"]["decode_backend"]
        if ref["info"]["cuda_graph"] is not None:
            assert got["graph_steps"] > 0, f"{name}: no decode step replayed a CUDA graph"
        _check_same(ref, got, name)


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_gpu_spawn_route(checkpoints):
    path = checkpoints["deepseek_v3"]
    ref = _run(_load(path, "cuda"))
    llm = _load(path, "cuda", tensor_parallel_size=2)
    try:
        _check_same(ref, _run(llm), "deepseek_v3")
    finally:
        llm.close()
