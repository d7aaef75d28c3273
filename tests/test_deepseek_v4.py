"""DeepSeek-V4 (compressed sparse / heavily compressed / sliding attention, mHC, hash + learned MoE) on CPU
against transformers: float32 logits and greedy tokens over prompts longer than several compression blocks
and the window, so that block completion, eviction from the window and the indexer's top-k all happen."""
import pytest
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

import attnzoo
from helpers import assert_matches_hf, random_prompts, save_checkpoint

VOCAB = 128
# Small rates and window so that short prompts cover many blocks: CSA 4:1, HCA 8:1 (128 in the released
# model), window 12, index_topk 3 (fewer than the entries a 40-token prompt has).
BASE = dict(vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=1,
            head_dim=32, q_lora_rank=16, qk_rope_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=16, index_topk=3,
            sliding_window=12, compress_rate_csa=4, compress_rate_hca=8, hc_mult=2, hc_sinkhorn_iters=4,
            max_position_embeddings=512, swiglu_limit=1.5, routed_scaling_factor=1.5)


def tiny_v4(layer_types, mlp_layer_types, seed=0, **kw):
    cfg = DeepseekV4Config(**{**BASE, "num_hidden_layers": len(layer_types), "layer_types": layer_types,
                              "mlp_layer_types": mlp_layer_types, **kw})
    torch.manual_seed(seed)
    hf = DeepseekV4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # the default init leaves sinks, biases and mHC at neutral values: make them count
        for name, p in hf.named_parameters():
            if any(k in name for k in ("sinks", "position_bias", ".base", "hc_base", "e_score_correction_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("gate.weight") or name.endswith(".fn") or name.endswith("hc_fn"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for layer in hf.model.layers:
            if hasattr(layer.mlp.gate, "tid2eid"):
                layer.mlp.gate.tid2eid.copy_(torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(VOCAB)]))
    return hf


MODELS = {
    # every kind, hash then learned routing
    "all-kinds": (["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
                  ["hash_moe", "moe", "moe"]),
    # HCA at the window's size and CSA with a YaRN compress rope
    "yarn": (["heavily_compressed_attention", "compressed_sparse_attention"], ["hash_moe", "moe"]),
}


@pytest.mark.parametrize("name", MODELS)
def test_matches_transformers(tmp_path, name):
    kinds, mlps = MODELS[name]
    kw = {}
    if name == "yarn":
        kw = dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                   "beta_fast": 32, "beta_slow": 1}, compress_rate_hca=12)
    hf = tiny_v4(kinds, mlps, **kw)
    save_checkpoint(hf, tmp_path)
    llm = attnzoo.load_model(tmp_path, page_size=8, backend="torch", device="cpu")
    assert llm.engine.pool.has_window_group  # window_kv_fraction="auto": V4 layers compress their keys
    # 37 + 12 tokens: past the window (12), CSA's entries (12) past its top-3, HCA's 4 to 6 blocks
    assert_matches_hf(llm, hf, random_prompts(VOCAB, [5, 37] if name == "all-kinds" else [33]), steps=12)


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4")
    save_checkpoint(tiny_v4(*MODELS["all-kinds"]), path)
    return path


def _tokens(llm, prompts, steps):
    return [o.token_ids for o in llm.generate(prompts, max_new_tokens=steps, ignore_eos=True)]


@pytest.mark.parametrize("fraction", ["auto", 0.5])
def test_mixed_batches_window_group_and_prefix_hits_match_one_at_a_time(v4_dir, fraction):
    """Chunked prefill beside decode in one step, a window page group (raw keys and compressor state
    released as the window moves on), and prefix-cache hits ending mid-block (page size 2: a hit at 22
    tokens is inside a CSA block of 4 and an HCA block of 8) give the tokens of one request at a time."""
    prefix = random_prompts(VOCAB, [23], seed=3)[0]
    prompts = [prefix + t for t in random_prompts(VOCAB, [3, 14], seed=4)] + random_prompts(VOCAB, [20], seed=5)
    alone = attnzoo.load_model(v4_dir, page_size=2, backend="torch", device="cpu", prefix_caching=False)
    want = [_tokens(alone, [p], 8)[0] for p in prompts]
    llm = attnzoo.load_model(v4_dir, page_size=2, backend="torch", device="cpu", window_kv_fraction=fraction,
                             max_batch_tokens=12)
    assert llm.engine.pool.has_window_group and llm.engine.pool.window == 12
    assert _tokens(llm, prompts[:1], 8) == want[:1]
    full, wpages = llm.engine.prefix_cache.match(prompts[1])
    assert len(full) == 11  # 22 tokens: mid-block for both rates
    llm.engine.pages.unmatch(full, wpages)
    llm.engine.step_log = []
    assert _tokens(llm, prompts[1:], 8) == want[1:]
    assert any(s["num_reqs"] > 1 and s["new_tokens"] > s["num_reqs"] for s in llm.engine.step_log), \
        "no step mixed a prefill chunk with other requests"
    info = llm.info()["kv_bytes_per_token_by_kind"]
    assert set(info) == {"csa", "hca", "sliding"}


def test_auto_window_group_holds_less_per_context_token_and_info_measures_it(v4_dir):
    """In the same memory, the default pool (window group) holds more context than one group, and
    info()["kv_footprint"] states what its tensors take: the full group only the compressed entries, the
    window group the raw keys and compressor state (as ``kv_bytes_by_kind`` counts them), a plain MLA
    cache of the same depth beside it."""
    kw = dict(page_size=4, backend="torch", device="cpu", kv_cache_memory=2_000_000)
    auto, one = attnzoo.load_model(v4_dir, **kw).info(), attnzoo.load_model(v4_dir, window_kv_fraction=None, **kw).info()
    fa, fo = auto["kv_footprint"], one["kv_footprint"]
    assert fo["window_tokens"] is None and fa["window_tokens"] > 0
    assert fa["bytes_per_context_token"] < fo["bytes_per_context_token"] / 2
    assert fa["context_tokens"] == auto["kv_cache_tokens"] > 2 * one["kv_cache_tokens"]
    kinds = fa["by_kind"].values()
    assert fa["full_group_bytes_per_token"] == sum(k["per_context_token"] for k in kinds)
    assert fa["window_group_bytes_per_token"] == sum(k["per_window_token"] for k in kinds)
    assert fo["full_group_bytes_per_token"] == sum(k["per_context_token"] + k["per_window_token"] for k in kinds)
    assert one["kv_bytes_per_token"] == fo["full_group_bytes_per_token"]  # entries counted as pages of 4 hold them
    assert fa["plain_mla_bytes_per_token"] == 3 * (32 + 8) * 4  # 3 layers of a 32-wide latent + 8 rope, float32
    assert fa["vs_plain_mla"] == fa["bytes_per_context_token"] / fa["plain_mla_bytes_per_token"]
    assert fa["pool_bytes"] <= 2_000_000 and auto["kv_page_groups"]["window_group"]["tokens"] == fa["window_tokens"]
    # max_running by default: as many decoding requests as the window group holds windows of (12 tokens + a page)
    assert auto["max_running"] == auto["kv_page_groups"]["window_group"]["pages"] // 4 < one["max_running"]


def test_auto_window_group_sized_for_max_running_never_stalls(v4_dir):
    """window_kv_fraction="auto" with max_running: a window group of max_running decoding windows and one
    prefill chunk (page size 2, window 12, chunk 12: 2 x 7 + 13 pages); more requests than that run through
    it, waiting for room, with the tokens of one request at a time."""
    from attnzoo.attention.kv_cache import KVCacheSpec, wants_window_group
    from attnzoo.engine.build import _kv_pages

    llm = attnzoo.load_model(v4_dir, page_size=2, backend="torch", device="cpu", kv_cache_tokens=96, max_running=2,
                             max_batch_tokens=12)
    assert llm.engine.window_allocator.capacity == 2 * 7 + 13 and llm.engine.allocator.capacity == 48
    prompts = random_prompts(VOCAB, [20, 31, 9, 26], seed=7)
    alone = attnzoo.load_model(v4_dir, page_size=2, backend="torch", device="cpu", window_kv_fraction=None)
    assert _tokens(llm, prompts, 6) == [_tokens(alone, [p], 6)[0] for p in prompts]
    specs = llm.model.kv_cache_specs()
    assert wants_window_group(specs)
    # sliding-window layers alone (Gemma, gpt-oss) keep one group under "auto"
    sliding = [KVCacheSpec(num_kv_heads=1, head_dim=8, v_head_dim=8, sliding_window=w) for w in (4, None)]
    assert not wants_window_group(sliding)
    assert _kv_pages(sliding, 2, torch.float32, torch.device("cpu"), 64, None, 512, "auto")[1] is None
    assert _kv_pages(sliding, 2, torch.float32, torch.device("cpu"), 64, None, 512, 0.5)[1] == 17


# What a V4 FP8 checkpoint stores in FP8 (DeepSeek's names): the attention projections and every expert.
FP8_LEAVES = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "w1", "w2", "w3")


def test_fp8_checkpoint_loads_as_stored(tmp_path):
    """An FP8 block-quantized V4 checkpoint (attention projections, experts and shared experts in FP8; the
    compressors, indexer keys and router as stored in float) loads: dequantized at load on CPU it equals the
    dequantized checkpoint, and kept FP8 (fp8_weights='fp8', float32 emulation) it decodes the same tokens."""
    import json

    from safetensors.torch import load_file, save_file

    from attnzoo.layers.fp8 import Fp8Linear, dequantize, quantize_weight

    hf = tiny_v4(*MODELS["all-kinds"])
    save_checkpoint(hf, tmp_path / "hf", with_tokenizer=False)
    fp8, ref = {}, {}
    for name, t in load_file(tmp_path / "hf" / "model.safetensors").items():
        if name.endswith(".weight") and name.split(".")[-2] in FP8_LEAVES:
            w8, s = quantize_weight(t)
            fp8[name], fp8[name + "_scale_inv"] = w8, s
            ref[name] = dequantize(w8, s)
        else:
            fp8[name] = ref[name] = t
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    for d, tensors, quant in (("fp8", fp8, True), ("ref", ref, False)):
        (tmp_path / d).mkdir()
        q = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}} if quant else {}
        (tmp_path / d / "config.json").write_text(json.dumps({**cfg, **q}))
        save_file(tensors, tmp_path / d / "model.safetensors")
    want = attnzoo.load_model(tmp_path / "ref", backend="torch", device="cpu")
    deq = attnzoo.load_model(tmp_path / "fp8", backend="torch", device="cpu")
    prompt = random_prompts(VOCAB, [26])[0]
    assert (deq.logits(prompt) - want.logits(prompt)).abs().max().item() <= 1e-4
    kept = attnzoo.load_model(tmp_path / "fp8", backend="torch", device="cpu", fp8_weights="fp8")
    assert sum(isinstance(m, Fp8Linear) for m in kept.model.modules()) >= 3
    assert kept.model.model.layers[0].mlp.experts.quant == "fp8"
    assert _tokens(kept, [prompt], 4) == _tokens(want, [prompt], 4)


def test_dsv4_flash_shape_and_roofline_per_layer_kind():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    e2e = pytest.importorskip("e2e")
    config, _ = e2e.make_config("dsv4-flash", 4)
    assert config.architectures == ["DeepseekV4ForCausalLM"] and (config.head_dim, config.hc_mult) == (512, 4)
    assert config.layer_types == ["heavily_compressed_attention"] * 3 + ["compressed_sparse_attention"]
    from types import SimpleNamespace

    from attnzoo.models.deepseek_v4 import DeepseekV4ForCausalLM as Ours

    cfg = tiny_v4(*MODELS["all-kinds"]).config
    llm = SimpleNamespace(model=Ours(cfg), config=cfg, pool=SimpleNamespace(dtype=torch.bfloat16))  # what it reads
    csa, hca, sliding = e2e.model_profile(llm)["layers"]
    # bf16: raw key 32 x 2, entry 32 x 2, indexer key 16 x 2; CSA state (4 x 32 + 4 x 16) x 2, read twice
    assert (csa["kv_bytes"], csa["compressed_bytes"], csa["index_bytes"], csa["state_bytes"]) == (64, 64, 32, 768)
    assert (hca["rate"], hca["csa_topk"], hca["state_bytes"]) == (8, 0, 2 * 32 * 2) and sliding["rate"] == 0
    bytes_only = {"copy_bytes_per_s": 1.0, "matmul_flops_per_s": float("inf")}
    step = {"num_reqs": 2, "new_tokens": 2, "kv_tokens": 80, "shared_prefix_len": 0, "attn_pairs": 80}

    def alone(layer):
        return e2e.roofline_seconds([step], {"num_experts": 0, "top_k": 0, "dense_bytes": 0, "expert_bytes": 0,
                                             "dense_params": 0, "expert_params": 0, "layers": [layer]}, bytes_only)
    # context 40, window 12: the window, then CSA the top-3 of 10 entries + every indexer key, HCA all 5
    assert alone(sliding) == 64 * 2 * 12
    assert alone(csa) == 64 * 2 * 12 + 64 * 2 * 3 + 768 * 2 + 32 * 2 * 10
    assert alone(hca) == 64 * 2 * 12 + 64 * 2 * 5 + 128 * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check; on a GPU the fused path is the default")
def test_fused_moe_clamps_swiglu_like_the_reference():
    """The fused MoE's act kernel (Triton interpreter) clamps gate and up at swiglu_limit as the reference."""
    from attnzoo.layers.moe import fused_moe, moe_reference

    g = torch.Generator().manual_seed(0)
    x, w13, w2 = (torch.randn(*s, generator=g) for s in ((9, 32), (4, 32, 32), (4, 32, 16)))
    ids = torch.randint(0, 4, (9, 2), generator=g)
    weights = torch.rand(9, 2, generator=g)
    want = moe_reference(x, w13, w2, weights, ids, swiglu_limit=1.5)
    assert (want - moe_reference(x, w13, w2, weights, ids)).abs().max() > 0.1  # the clamp bites
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, swiglu_limit=1.5), want, rtol=1e-5, atol=1e-5)
