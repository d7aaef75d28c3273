"""Tensor parallelism: TP=2 against TP=1 (greedy tokens identical, float32 logits within 1e-4) for tiny
Llama (one KV head, replicated), Gemma 4 (k == v global layers with fewer KV heads than ranks, shared-KV
layers, PLE, MoE) and DeepSeek-V3 (MLA + MoE), over both routes: ``load_model(tensor_parallel_size=2)``
from this process (CPU, gloo) and the torchrun route (two processes with torchrun's environment).
The GPU versions (NCCL, CUDA graphs with the collectives captured) need two GPUs."""
from __future__ import annotations

import functools
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from transformers import Gemma4ForCausalLM, LlamaConfig, LlamaForCausalLM

import attnzoo
from attnzoo.policy.profile import profile_from_config, rank_local
from attnzoo.errors import EvalError, ModelLoadError
from attnzoo.layers.fp8 import FP8, Fp8Linear
from attnzoo.layers.parallel import TPContext
from attnzoo.models import loader
from attnzoo.models.weights import plan_weights
from attnzoo.models.registry import model_class
from helpers import random_prompts, save_checkpoint
from test_deepseek import tiny_v3
from test_fp8 import _fp8_checkpoint
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
    return attnzoo.load_model(path, **{**_options(device), **kw})


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


# ---------------------------------------------------------------------------------------- FP8 shards, slice reads

# A tiny FP8 DeepSeek-V3 whose split layers cut into whole 128-blocks at TP 2 (as V3's do at TP 8):
# q_b_proj 2 heads x 128 rows, o_proj / down_proj 256 input features, gate/up 256 rows, shared experts
# 4 x 64. kv_b_proj's 448 rows split at 224, inside a block (it is dequantized anyway: absorbed MLA
# reads it as a matrix), so its shard is dequantized from the blocks that cover it.
FP8_ALIGNED = dict(num_attention_heads=2, qk_nope_head_dim=96, qk_rope_head_dim=32, v_head_dim=128,
                   intermediate_size=256, moe_intermediate_size=64, n_shared_experts=4)
SPLIT_LEAVES = ("q_b_proj", "kv_b_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                "shared_experts", "embed_tokens", "lm_head")


@pytest.fixture(scope="module")
def fp8_v3(tmp_path_factory):
    return _fp8_checkpoint(tmp_path_factory.mktemp("fp8v3"), **FP8_ALIGNED)[0]


class _CountingReader:
    """safetensors' safe_open, logging (tensor name, "whole" or "slice", bytes) of every read."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def keys(self):
        return self.inner.keys()

    def get_tensor(self, key):
        t = self.inner.get_tensor(key)
        self.log.append((key, "whole", t.numel() * t.element_size()))
        return t

    def get_slice(self, key):
        inner, log = self.inner.get_slice(key), self.log

        class Slice:
            get_shape, get_dtype = inner.get_shape, inner.get_dtype

            def __getitem__(self, index):
                t = inner[index]
                log.append((key, "slice", t.numel() * t.element_size()))
                return t

        return Slice()


def _load_rank(path, rank: int, world: int, monkeypatch):
    """Build and load rank ``rank`` of ``world`` in this process (no group: loading only), FP8 layers kept."""
    import safetensors

    src = loader.resolve_source(path)
    config = loader.load_config(src)
    cls = model_class(loader.architecture_of(config))
    plan = plan_weights(config, cls, device=torch.device("cpu"), dtype=torch.float32, mode="fp8",
                        checkpoint_names=loader.checkpoint_tensor_names(src))
    model = plan.build(functools.partial(cls, tp=TPContext(rank=rank, world_size=world)), config)
    log, opener = [], safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: _CountingReader(opener(*a, **k), log))
    model.load_weights(plan.tensors(model, loader.iter_weights(src, config)))
    monkeypatch.setattr(safetensors, "safe_open", opener)
    return model, plan.describe(), log


def _assert_rank_holds_its_cut(model, ref) -> None:
    """Every parameter of a rank is its cut of the unsplit model's (FP8 codes and block factors bit for bit)."""
    params, ref_params, ref_parts = dict(model.named_parameters()), dict(ref.named_parameters()), ref.merged_parts()
    bits = (lambda t: t.view(torch.uint8) if t.dtype == FP8 else t)
    for ckpt, (pname, rows, cut) in model.merged_parts().items():
        ref_name, ref_rows, _ = ref_parts[ckpt]
        want = ref_params[ref_name][ref_rows]
        assert torch.equal(bits(params[pname][rows]), bits(want if cut is None else cut(want))), ckpt
    for name, p in params.items():
        cut = getattr(p, "tp_shard", None)
        if cut is not None:
            assert torch.equal(bits(p), bits(cut(ref_params[name]))), name


def test_fp8_shards_of_whole_blocks_stay_fp8_and_each_rank_reads_its_slices(fp8_v3, monkeypatch):
    ref, _, ref_log = _load_rank(fp8_v3, 0, 1, monkeypatch)
    for rank in range(2):
        model, weights, log = _load_rank(fp8_v3, rank, 2, monkeypatch)
        layer0, layer1 = model.model.layers
        fp8 = [layer1.self_attn.q_b_proj, layer1.self_attn.o_proj, layer0.mlp.gate_up_proj, layer0.mlp.down_proj,
               layer1.mlp.shared_experts.gate_up_proj, layer1.mlp.shared_experts.down_proj]
        assert all(isinstance(m, Fp8Linear) and m.weight.dtype == FP8 for m in fp8)
        assert layer1.self_attn.o_proj.weight_scale_inv.shape == (2, 1)  # 128 of 256 input features: one block
        assert weights["fp8_shards"].startswith("per rank: 8 tensor-parallel layers (down_proj, gate_up_proj, "
                                                "o_proj, q_b_proj)")
        assert weights["dequantized_at_load"] == ("2 layers (kv_b_proj) to float32: the model reads the weight of "
                                                  "kv_b_proj as a matrix")
        assert "split_blocks" not in weights
        _assert_rank_holds_its_cut(model, ref)
        # Split tensors are read as slices, never whole; routed experts of the other rank not at all.
        whole = {key for key, how, _ in log if how == "whole"}
        assert not {k for k in whole if any(leaf in k and "experts." not in k for leaf in SPLIT_LEAVES)}
        mine = range(2 * rank, 2 * rank + 2)
        assert all(int(k.split(".")[5]) in mine for k in whole if ".experts." in k)
        read, total = sum(n for *_, n in log), sum(n for *_, n in ref_log)
        assert read < 0.6 * total, (read, total)


def test_fp8_shards_that_split_a_block_are_dequantized_from_their_blocks(tmp_path, monkeypatch):
    """test_fp8's tiny V3 (300-row gate/up, 96-row q_b): halves begin mid-block, so those layers are
    float on every rank, and each rank's weights are its cut of the whole dequantized layer."""
    path = _fp8_checkpoint(tmp_path)[0]
    ref, _, _ = _load_rank(path, 0, 1, monkeypatch)
    model, weights, _ = _load_rank(path, 1, 2, monkeypatch)
    assert "fp8_shards" not in weights
    assert weights["split_blocks"].startswith(
        "tensor-parallel shards kept float32 (not whole blocks): down_proj (150 of 300 input features per rank, from "
        "150: not whole 128-blocks); gate_up_proj (gate_proj: 150 of 300 output rows per rank, from 150: not whole "
        "128-blocks)")
    assert weights["dequantized_at_load"].startswith("12 layers (down_proj, gate_proj, kv_b_proj, o_proj, q_b_proj, "
                                                     "up_proj) to float32")
    for layer, name in ((0, "mlp.down_proj"), (1, "self_attn.o_proj"), (1, "self_attn.q_b_proj")):
        lin = model.model.layers[layer].get_submodule(name)
        assert not isinstance(lin, Fp8Linear)
        whole = ref.model.layers[layer].get_submodule(name).dequantized(torch.float32)
        torch.testing.assert_close(lin.weight, lin.weight.tp_shard(whole), rtol=0, atol=0)


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
        # The online engine (attnzoo serve's) under TP: its loop is one long rank-0 call the other rank
        # follows; requests arriving one by one give generate()'s tokens, and the model is usable after.
        from attnzoo.engine.online import OnlineEngine
        from attnzoo.engine.sampling import SamplingParams

        assert llm.warm_up()["eager"] >= 1  # attnzoo serve's warm-up: a rank-0 call the other rank follows
        online = OnlineEngine(llm)
        handles = [online.submit(llm._encode(p), SamplingParams(STEPS, ignore_eos=True)) for p in PROMPTS]
        assert [h.result(120).token_ids for h in handles] == ref["tokens"]
        online.shutdown()
        assert [o.token_ids for o in llm.generate(PROMPTS, max_new_tokens=STEPS, ignore_eos=True)] == ref["tokens"]
    finally:
        llm.close()
    assert all(not p.is_alive() for p in llm.tp.workers)


def test_fp8_v3_at_tp2_equals_tp1(fp8_v3):
    """FP8 layers split along whole blocks (gloo, two processes): tokens identical to the unsplit FP8
    model, logits within float32 summation-order noise, and only kv_b_proj (read as a matrix) dequantized."""
    ref = _run(_load(fp8_v3, fp8_weights="fp8"))
    llm = _load(fp8_v3, tensor_parallel_size=2, fp8_weights="fp8")
    try:
        got = _run(llm)
    finally:
        llm.close()
    _check_same(ref, got, "fp8 deepseek_v3")
    weights = got["info"]["weights"]
    assert weights["fp8_shards"].startswith("per rank: 8 tensor-parallel layers")
    assert weights["dequantized_at_load"].startswith("2 layers (kv_b_proj)")
    # 3 + 3 attention (q_a + kv_a merged, q_b, o), dense gate_up / down, shared gate_up / down; one routed MoE
    assert weights["gemm"] == ref["info"]["weights"]["gemm"] == \
        "torch emulation (float32, cpu): 10 layers; MoE reference (float32, cpu): 1 layers"


def test_teacher_forcing_steps_two_models_of_one_group(checkpoints):
    """run_eval --compare-to under tensor parallelism: B (page size 8) joins A's group (page size 4), rank 0
    steps both in lockstep and rank 1 follows each step on the right model; the statistics are TP=1's."""
    from attnzoo.evals import tokens

    path = checkpoints["llama"]
    a, b = _load(path), _load(path, page_size=8)
    outs = [o.token_ids for o in a.generate(PROMPTS, max_new_tokens=STEPS, ignore_eos=True)]
    seqs = [tokens.Sequence(("t", i), p, o) for i, (p, o) in enumerate(zip(PROMPTS, outs))]
    ref = tokens.teacher_forced_compare(a, b, seqs, budget_tokens=20)  # 20 tokens: two waves
    a = _load(path, tensor_parallel_size=2)
    try:
        b = _load(path, tensor_parallel_size=2, page_size=8)
        got = tokens.teacher_forced_compare(a, b, seqs, budget_tokens=20)
        assert b.generate(PROMPTS, max_new_tokens=STEPS, ignore_eos=True)[1].token_ids == outs[1]
        b.close()  # rank 1 drops B; A still runs on both ranks
        assert a.generate(PROMPTS, max_new_tokens=STEPS, ignore_eos=True)[0].token_ids == outs[0]
        with pytest.raises(EvalError, match="not on one tensor-parallel group"):
            tokens.teacher_forced_compare(a, _load(path), seqs, budget_tokens=20)
    finally:
        a.close()
    assert all(not p.is_alive() for p in a.tp.workers)
    assert got.per_question.keys() == ref.per_question.keys()
    for key, st in ref.per_question.items():
        g = got.per_question[key]
        assert (g.tokens, g.top1_a, g.top1_b, g.first_top1_miss) == (st.tokens, st.top1_a, st.top1_b, st.first_top1_miss)
        assert abs(g.kl_sum - st.kl_sum) < 1e-5 and abs(g.kl_max - st.kl_max) < 1e-5


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


def _gpu_spawn_parity(path, name: str, **kw) -> dict:
    """TP=1 in this process, then TP=2 from it (one spawned rank, one model): both on the GPU."""
    ref = _run(_load(path, "cuda", **kw))
    llm = _load(path, "cuda", tensor_parallel_size=2, **kw)
    try:
        got = _run(llm)
        got["graph_steps"] = llm.engine.graph_stats["replayed"]
    finally:
        llm.close()
    _check_same(ref, got, name)
    return got


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_gpu_spawn_route(checkpoints):
    """The spawn route on NCCL, kept small: the tiny Llama, Triton attention (no JIT of other kernels),
    eager decode (no graph capture)."""
    _gpu_spawn_parity(checkpoints["llama"], "llama", backend="triton", cuda_graph=False)


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_gpu_cuda_graphs_capture_the_collectives(checkpoints):
    """Decode steps replay CUDA graphs whose captured NCCL all-reduces and all-gathers meet rank 1's
    replays; greedy tokens equal TP=1 (graphs too)."""
    got = _gpu_spawn_parity(checkpoints["llama"], "llama", backend="triton", cuda_graph=True)
    assert got["info"]["cuda_graph"] is not None
    assert got["graph_steps"] > 0, "no decode step replayed a CUDA graph"


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_gpu_fp8_v3_shards(fp8_v3):
    """FP8 GEMMs on each rank's whole blocks (Triton / cuBLAS blockwise), float32 outputs: TP=2 equals TP=1."""
    got = _gpu_spawn_parity(fp8_v3, "fp8 deepseek_v3", fp8_weights="fp8")
    assert got["info"]["weights"]["fp8_shards"].startswith("per rank: 8 tensor-parallel layers")


def test_a_following_rank_runs_the_backend_warm_up_rank_0_announces(monkeypatch):
    """``Engine.warm_up`` on rank 0 publishes "warm_up": each other rank runs its own backends' warm-up (their
    kernels compile there, not at the first large step) and forgets the block tables, as rank 0's publish does."""
    import types

    import torch.distributed as dist

    from attnzoo.engine import tensor_parallel

    ran = []
    group = types.SimpleNamespace(tables={"a": 1}, window_tables={"a": 2},
                                  engine=types.SimpleNamespace(warm_up_backends=lambda: ran.append(1)))
    channel = object.__new__(tensor_parallel._Channel)
    channel.control, channel.models = None, {0: group}
    queue = [(0, "warm_up", {}), (0, "end", None)]

    def broadcast(box, group=None, group_src=0):
        box[0] = queue.pop(0)

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    assert channel.next() == (0, "end", None)
    assert ran == [1] and not group.tables and not group.window_tables
