"""Gemma 4 end to end on CPU against transformers: dense (31B-like), PLE + shared KV (E2B-like), MoE
(26B-A4B-like), KV sharing in the pool, tower skipping and multimodal rejection, the triton backend."""
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig
from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig

import attnzoo
from attnzoo.errors import RequestError
from helpers import assert_matches_hf, random_prompts, save_checkpoint

VOCAB = 160
S, F = "sliding_attention", "full_attention"
# Small window so that prompts (7 and 21 tokens) plus 32 decode steps cross it many times.
WINDOW = 8


def text_config(**kw):
    base = dict(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64, intermediate_size=96,
        num_hidden_layers=6, layer_types=[S, S, F, S, S, F], num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, global_head_dim=64, sliding_window=WINDOW, final_logit_softcapping=3.0,
        hidden_size_per_layer_input=0, max_position_embeddings=512, initializer_range=0.1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    base.update(kw)
    return Gemma4TextConfig(**base)


def randomize_scales_(model, seed=0):
    """transformers initialises norms and scalars to 1; random values make the test see them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tensors = list(model.named_parameters()) + list(model.named_buffers())
        for name, t in tensors:
            if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")) or (t.dim() == 1 and "norm" in name):
                t.copy_(torch.empty(t.shape).uniform_(0.5, 1.5, generator=g))
    return model.eval()


def dense_31b_like():
    """Gemma4ForConditionalGeneration with a vision tower; global layers 64-wide, 1 KV head, k == v."""
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16, position_embedding_size=64)
    cfg = Gemma4Config(
        text_config=text_config(attention_k_eq_v=True, num_global_key_value_heads=1).to_dict(),
        vision_config=vision.to_dict(), image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, audio_token_id=VOCAB - 3,
    )
    torch.manual_seed(0)
    return randomize_scales_(Gemma4ForConditionalGeneration(cfg))


def e2b_like():
    """Per-layer embeddings; layers 4 (sliding) and 5 (full) reuse the KV of layers 3 and 2."""
    cfg = text_config(num_key_value_heads=1, hidden_size_per_layer_input=16, num_kv_shared_layers=2,
                      use_double_wide_mlp=True)
    torch.manual_seed(1)
    return randomize_scales_(Gemma4ForCausalLM(cfg), seed=1)


def moe_26b_like():
    cfg = text_config(attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True, num_experts=4,
                      top_k_experts=2, moe_intermediate_size=32, tie_word_embeddings=False)
    torch.manual_seed(2)
    return randomize_scales_(Gemma4ForCausalLM(cfg), seed=2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, make in (("dense", dense_31b_like), ("e2b", e2b_like), ("moe", moe_26b_like)):
        hf = make()
        out[name] = (hf, save_checkpoint(hf, tmp_path_factory.mktemp(name)))
    # Converted checkpoints keep k/v weights on KV-sharing layers; loading must skip them.
    path = out["e2b"][1] / "model.safetensors"
    tensors = load_file(path)
    for name in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
        tensors[f"model.layers.4.self_attn.{name}"] = tensors[f"model.layers.3.self_attn.{name}"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("name,page_size", [("dense", 16), ("e2b", 4), ("moe", 16)])
def test_matches_transformers(checkpoints, name, page_size):
    hf, path = checkpoints[name]
    llm = attnzoo.load_model(path, backend="torch", page_size=page_size)
    assert_matches_hf(llm, hf, random_prompts(VOCAB, [7, 21], seed=5), steps=32)


def test_shared_kv_layers_own_no_memory(checkpoints):
    llm = attnzoo.load_model(checkpoints["e2b"][1], backend="torch", page_size=4, kv_cache_tokens=64, window_kv_fraction=0.5)
    assert [llm.pool.owns_memory(i) for i in range(6)] == [True] * 4 + [False] * 2
    assert llm.pool.k(4) is llm.pool.k(3) and llm.pool.v(5) is llm.pool.v(2)
    # Producers only: sliding layers 0, 1, 3 (1 KV head x 32) and full layer 2 (1 KV head x 64), k + v, fp32.
    per_token = (3 * 1 * 32 + 1 * 1 * 64) * 2 * 4
    assert llm.info()["kv_bytes_per_token"] == per_token
    assert llm.info()["kv_layers_with_memory"] == 4
    # The pool holds the producers' pages and nothing else (up to 256-byte alignment of its 8 k/v slabs):
    # the full layer's for every full-group page, the sliding ones' for every window-group page.
    full, window = 1 * 64 * 2 * 4, 3 * 1 * 32 * 2 * 4
    assert llm.pool.in_window_group(4) and not llm.pool.in_window_group(5)  # as their producers 3 and 2
    data = llm.pool.page_size * (full * llm.pool.num_pages + window * llm.pool.num_window_pages)
    assert data <= llm.pool.nbytes < data + 8 * 256
    groups = llm.info()["kv_page_groups"]
    assert (groups["full"]["kv_bytes_per_token"], groups["window_group"]["kv_bytes_per_token"]) == (full, window)
    assert groups["full"]["tokens"] == 64 and groups["window_group"]["tokens"] == 32  # window_kv_fraction=0.5


def test_mixed_head_dims_in_one_pool(checkpoints):
    llm = attnzoo.load_model(checkpoints["dense"][1], backend="torch", page_size=16)
    assert tuple(llm.pool.k(0).shape[1:]) == (2, 16, 32)  # sliding: 2 KV heads x 32
    assert tuple(llm.pool.k(2).shape[1:]) == (1, 16, 64)  # global: 1 KV head x 64
    assert llm.info()["kv_bytes_per_token"] == (4 * 2 * 32 + 2 * 1 * 64) * 2 * 4


def test_released_config_format(checkpoints, tmp_path):
    """The released config.json names global_head_dim / num_global_key_value_heads instead of the
    per_layer_config transformers writes; both must build the same model."""
    hf, path = checkpoints["dense"]
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    text = cfg["text_config"]
    assert text.pop("per_layer_config", None) is not None  # the format this test rewrites
    text.update(global_head_dim=64, num_global_key_value_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = attnzoo.load_model(tmp_path, backend="torch")
    prompt = random_prompts(VOCAB, [11], seed=3)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (llm.logits(prompt) - ref).abs().max().item() <= 1e-4


def test_batch_equals_one_at_a_time(checkpoints):
    llm = attnzoo.load_model(checkpoints["e2b"][1], backend="torch", page_size=4)
    prompts = random_prompts(VOCAB, [3, 19, 9], seed=7)
    batched = llm.generate(prompts, max_new_tokens=8, ignore_eos=True)
    single = [llm.generate([p], max_new_tokens=8, ignore_eos=True)[0] for p in prompts]
    assert [c.token_ids for c in batched] == [c.token_ids for c in single]


def test_towers_skipped_with_one_log_line_and_multimodal_rejected(checkpoints, caplog):
    with caplog.at_level(logging.INFO, logger="attnzoo"):
        llm = attnzoo.load_model(checkpoints["dense"][1], backend="torch")
    lines = [r.getMessage() for r in caplog.records if "tower" in r.getMessage()]
    assert len(lines) == 1 and "vision/audio tower tensors" in lines[0]
    assert all("vision" not in n for n, _ in llm.model.named_parameters())
    with pytest.raises(RequestError, match="image/audio/video placeholder"):
        llm.generate([[5, 6, VOCAB - 1, 7]], max_new_tokens=2)
    assert llm.engine.allocator.num_free == llm.engine.allocator.capacity  # nothing leaked


def test_triton_backend_matches_transformers(checkpoints):
    from attnzoo.attention.backends import backend_names

    if "triton" not in backend_names():
        pytest.skip("the triton attention backend is not registered in attnzoo.attention.backends")
    hf, path = checkpoints["e2b"]
    llm = attnzoo.load_model(path, backend="triton", page_size=4)
    assert llm.info()["decode_backend"] == "triton"
    assert_matches_hf(llm, hf, random_prompts(VOCAB, [13], seed=9), steps=12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a Triton-interpreter check on CPU tensors; on a GPU the gpu tests run these kernels on CUDA")
def test_moe_fused_path_equals_per_expert_reference():
    # CUDA (eager and CUDA graphs) runs the fused kernels: here through the Triton interpreter.
    from attnzoo.layers.moe import FusedMoE, MoEConfig, fused_moe

    torch.manual_seed(0)
    moe = FusedMoE(num_experts=6, hidden=16, intermediate=8, act="gelu_tanh", init_std=0.3)
    x = torch.randn(9, 16)
    experts = torch.stack([torch.randperm(6)[:2] for _ in range(9)])  # [T, k], distinct per token
    weights = torch.rand(9, 2)
    routed = moe(x, weights, experts)  # the per-expert reference on CPU
    fused = fused_moe(x, moe.w13, moe.w2, weights, experts, act="gelu_tanh", config=MoEConfig(16, 16, 16))
    torch.testing.assert_close(fused, routed, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(fused_moe(x, moe.w13, moe.w2, weights, experts.flip(1), act="gelu_tanh"), routed,
                              atol=1e-3)
