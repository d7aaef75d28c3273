"""Qwen3 and Qwen3-MoE end to end on CPU against transformers (QK-norm with GQA; routed experts with
norm_topk_prob, dense layers from mlp_only_layers / decoder_sparse_step), and Qwen3-MoE at TP 2 = TP 1."""
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import attnzoo
from helpers import assert_matches_hf, random_prompts, save_checkpoint
from test_tensor_parallel import _check_same, _load, _run

VOCAB = 160


def _randomize_norms_(model, seed):
    """transformers initialises norms to 1; random values make the test see q_norm / k_norm."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
    return model.eval()


def tiny_qwen3(**kw):
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=False, **kw)
    torch.manual_seed(0)
    return _randomize_norms_(Qwen3ForCausalLM(cfg), 0)


def tiny_qwen3_moe(**kw):
    """Layer 0 dense (mlp_only_layers), layers 1 and 3 sparse, layer 2 dense (decoder_sparse_step 2)."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=3,
                norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[0], max_position_embeddings=512,
                initializer_range=0.1)
    base.update(kw)
    torch.manual_seed(1)
    return _randomize_norms_(Qwen3MoeForCausalLM(Qwen3MoeConfig(**base)), 1)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_checkpoint(tiny_qwen3_moe(), tmp_path_factory.mktemp("qwen3moe"))


@pytest.mark.parametrize("name,make", [
    ("qwen3", tiny_qwen3),
    ("qwen3-sliding", lambda: tiny_qwen3(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    ("qwen3-moe", tiny_qwen3_moe),
    ("qwen3-moe-unnormalized", lambda: tiny_qwen3_moe(norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=1)),
])
def test_matches_transformers(tmp_path, name, make):
    hf = make()
    llm = attnzoo.load_model(save_checkpoint(hf, tmp_path), backend="torch", page_size=4)
    assert llm.info()["architecture"] == type(hf).__name__
    assert_matches_hf(llm, hf, random_prompts(VOCAB, [7, 21], seed=5), steps=32)


def test_moe_layers_follow_the_config(moe_dir):
    from attnzoo.layers.moe import FusedMoE

    llm = attnzoo.load_model(moe_dir, backend="torch")
    sparse = [isinstance(getattr(layer.mlp, "experts", None), FusedMoE) for layer in llm.model.model.layers]
    assert sparse == [False, True, False, True]


def test_moe_tp2_equals_tp1(moe_dir):
    """Expert parallel (4 of 8 experts per rank) and split attention heads, gloo, two processes."""
    ref = _run(_load(moe_dir))
    llm = _load(moe_dir, tensor_parallel_size=2)
    try:
        got = _run(llm)
    finally:
        llm.close()
    assert got["info"]["tensor_parallel_size"] == 2
    _check_same(ref, got, "qwen3_moe")
