"""Mistral Large 4 (GLM-5's MLA + DSA with NoPE layers, cross-layer latent sharing, LeRoPE, a log-position query
scale, a hidden-state indexer query, softmax routing and a final soft-cap) against transformers on the CPU
(float32; torch backend, and nsa_triton under the interpreter), from the checkpoint transformers saves (Mistral's
tensor names) and from transformers' in-memory names; the vision tower and MTP head skipped, placeholders
refused, a sharing pattern transformers would resolve differently refused, the policy row."""
from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import MistralLarge4Config, MistralLarge4ForConditionalGeneration

import attnzoo
from attnzoo.cli import main as policy_main
from attnzoo.errors import ModelLoadError, RequestError
from helpers import assert_matches_hf, random_prompts, save_checkpoint

GPU = torch.cuda.is_available()
IMAGE = 150
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0}
# Layers 1 and 3 NoPE; layer 2 reads layer 0's latent and layer 1's selection (no indexer), layer 3 reads
# layer 1's latent with an indexer of its own. index_topk 6 < the prompts: the selection matters.
TEXT = dict(vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, max_position_embeddings=256,
            index_topk=6, index_head_dim=16, index_n_heads=8, no_rope_layers=[1, 0, 1, 0, 1],
            kv_source_layers=[0, 1, 0, 1, 4], index_topk_pattern="FFSFF", rope_parameters=YARN)
VISION = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14, head_dim=16)
PROMPTS = random_prompts(140, [7, 21])  # ids below the placeholder


def _config(**text):
    return MistralLarge4Config(text_config={**TEXT, **text}, image_token_index=IMAGE, vision_config=VISION)


def tiny_mistral_large4(**text):
    """Random weights with the learned scales away from their identity init, decisive routing and indexer
    scores (the 0.02-std init leaves near ties), and logits well into the soft-cap's curve."""
    torch.manual_seed(0)
    hf = MistralLarge4ForConditionalGeneration(_config(**text)).eval()
    g = torch.Generator().manual_seed(1)
    lm = hf.model.language_model
    rnd = lambda shape, std: torch.randn(shape, generator=g) * std  # noqa: E731
    with torch.no_grad():
        lm.rotary_emb.alpha.copy_(rnd(lm.rotary_emb.alpha.shape, 0.5))
        for layer in lm.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.copy_(rnd(layer.mlp.gate.weight.shape, 0.5))
            attn, idx = layer.self_attn, layer.self_attn.indexer
            for scaling in [attn.softmax_scaling] + ([idx.softmax_scaling] if idx is not None else []):
                scaling.scale.copy_(torch.rand(scaling.scale.shape, generator=g) * 0.5)
                scaling.bias.copy_(0.5 + torch.rand(scaling.bias.shape, generator=g))
            if idx is not None:
                for p in (idx.wq_b.weight, idx.wk.weight, idx.weights_proj.weight, idx.k_norm.bias,
                          idx.q_input_norm.bias):
                    p.copy_(rnd(p.shape, 0.3))
        hf.lm_head.weight.mul_(20)
    return hf


@pytest.fixture(scope="module")
def ml4_dir(tmp_path_factory):
    hf = tiny_mistral_large4()
    return save_checkpoint(hf, tmp_path_factory.mktemp("ml4")), hf


def _load(path, **kw):
    return attnzoo.load_model(path, **{"page_size": 4, "backend": "torch", "device": "cpu", **kw})


def test_torch_matches_transformers(ml4_dir, caplog):
    d, hf = ml4_dir
    names = load_file(d / "model.safetensors").keys()
    assert {"layers.1.attention.wkv_a_with_mqa.weight", "layers.1.experts.0.w1.weight", "lerope.alpha"} <= names
    assert "layers.2.attention.wkv_a_with_mqa.weight" not in names  # layer 2 reads layer 0's latent
    with caplog.at_level(logging.INFO, logger="attnzoo"):
        llm = _load(d, max_batch_tokens=9)  # the 21-token prompt is prefilled in chunks over a cached prefix
    assert "Mistral Large 4: skipped 15 vision tower/projector tensors" in caplog.text
    layers = [layer.self_attn for layer in llm.model.model.layers]
    assert [a.mla.attn.kv_shared_from for a in layers] == [None, None, 0, 1, None]
    assert [a.mla.attn.index_head_dim for a in layers] == [16, 16, 0, 16, 16]
    assert {a.mla.attn.head_dim for a in layers} == {40}  # NoPE layers keep the entry width (rope zeros)
    assert llm.pool.owns_memory(0) and not llm.pool.owns_memory(3) and llm.pool.index_k(3) is not llm.pool.index_k(1)
    assert_matches_hf(llm, hf, PROMPTS, steps=4)


def test_nsa_triton_matches_transformers(ml4_dir):
    d, hf = ml4_dir
    llm = _load(d, backend="nsa_triton", device="cuda" if GPU else "cpu", dtype="float32")
    assert llm.info()["decode_backend"] == "nsa_triton"
    assert_matches_hf(llm, hf, random_prompts(140, [9], seed=2), steps=2)  # 9 > index_topk: selection runs


def test_in_memory_names_and_mtp_head(ml4_dir, tmp_path, caplog):
    """transformers' in-memory names (model.language_model.*, stacked experts) load alike; the checkpoint's
    multi-token-prediction draft head is skipped with a log line."""
    d, hf = ml4_dir
    tensors = {n: t.contiguous() for n, t in hf.state_dict().items()}
    tensors["mtp_dspark.layers.0.attention.wq.weight"] = torch.zeros(96, 64)
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="attnzoo"):
        llm = _load(tmp_path)
    assert "skipped 1 tensors of the multi-token-prediction draft head" in caplog.text
    with torch.no_grad():
        want = hf(torch.tensor([PROMPTS[0]])).logits[0]
    assert (llm.logits(PROMPTS[0]) - want).abs().max().item() <= 1e-4


def test_tensor_parallel_2_equals_1(ml4_dir):
    """Heads (and their query scales) split over 2 ranks; the indexer, latents and sharing replicated."""
    from test_tensor_parallel import _check_same, _run

    opts = dict(device="cpu", backend="torch", page_size=4, kv_cache_tokens=256)
    ref = _run(attnzoo.load_model(ml4_dir[0], **opts))
    llm = attnzoo.load_model(ml4_dir[0], tensor_parallel_size=2, **opts)
    try:
        got = _run(llm)
    finally:
        llm.close()
    assert got["info"]["decision"]["profile"]["num_heads"] == 2
    _check_same(ref, got, "mistral_large4")


def test_image_placeholder_is_refused(ml4_dir):
    llm = _load(ml4_dir[0])
    with pytest.raises(RequestError, match=f"token id {IMAGE}, an image/video placeholder"):
        llm.generate([[5, IMAGE, 7]], max_new_tokens=2)
    assert len(llm.generate([[5, 6, 7]], max_new_tokens=2, ignore_eos=True)[0].token_ids) == 2


def test_sharing_that_transformers_resolves_otherwise_is_refused():
    # Layer 2 names layer 0, but transformers hands it the latest RoPE producer before it: layer 1.
    cfg = _config(no_rope_layers=[1, 1, 1, 1, 1], kv_source_layers=[0, 1, 0, 1, 4], index_topk_pattern="FFFFF")
    cfg.architectures = ["MistralLarge4ForConditionalGeneration"]
    with pytest.raises(ModelLoadError, match="layer 2 reads the latent of layer 0, but transformers would give it "
                                             "that of layer 1"):
        attnzoo.load_model(cfg, load_format="random", device="cpu", backend="torch")


def test_policy_explain(capsys):
    arch = "MistralLarge4ForConditionalGeneration"
    assert policy_main(["policy", "explain", arch, "--gpu", "sm90", "--assume-installed"]) == 0
    out = capsys.readouterr().out
    assert f"{arch} on sm90: prefill nsa_triton, decode nsa_triton" in out and "model: NSA," in out


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("backend", ["nsa_triton", "nsa_triton_fp8"])
def test_gpu_nsa_backends_match_torch(tmp_path, backend):
    """The GPU NSA backends against the torch reference (latent 128 wide for the fp8 layout, whose copy the
    sharing layers read through their producer's), eager and with CUDA graphs."""
    save_checkpoint(tiny_mistral_large4(kv_lora_rank=128), tmp_path)
    prompts = random_prompts(140, [7, 21, 3], seed=5)
    opts = dict(page_size=4, dtype="float32", max_running=8, kv_cache_tokens=4096)  # each load sizes a small pool
    want = attnzoo.load_model(tmp_path, backend="torch", device="cpu", **opts).generate(
        prompts, max_new_tokens=12, ignore_eos=True, return_logits=True)
    # The tiny model scales logits x20 before the cap, and fp8 noise with them: 20 x the fp8 latent bound 0.1.
    tol = 2.0 if backend.endswith("fp8") else 1e-3
    for graphs in (False, True):
        llm = attnzoo.load_model(tmp_path, backend=backend, device="cuda", cuda_graph=graphs, **opts)
        got = llm.generate(prompts, max_new_tokens=12, ignore_eos=True, return_logits=True)
        for w, o in zip(want, got):
            if backend.endswith("fp8"):  # fp8 noise may flip a later token: the first step only
                assert (o.logits[0] - w.logits[0]).abs().max().item() <= tol, (backend, graphs)
                continue
            assert o.token_ids == w.token_ids, (backend, graphs)
            assert (o.logits - w.logits).abs().max().item() <= tol, (backend, graphs)


def test_pool_sharing_layer_keeps_its_own_indexer_keys():
    """A layer reading another's latent owns only its indexer keys: counted per page, stored alone, and
    its latent views (the pool's and a layout copy's) are the producer's."""
    from attnzoo.attention.kv_cache import KVCacheSpec, KVLayout, KVPool
    from attnzoo.attention.kv_layout import LayoutCache

    own = KVCacheSpec(1, 128 + 64, 128, v_from_k=True, index_head_dim=16)
    specs = [own, KVCacheSpec(1, 192, 128, v_from_k=True, index_head_dim=16, shared_from=0),
             KVCacheSpec(1, 192, 128, v_from_k=True, shared_from=0)]
    assert KVPool.bytes_per_page(specs, 4, torch.float32) == 4 * 4 * (192 + 16 + 16)
    pool = KVPool(specs, num_pages=3, page_size=4, dtype=torch.float32, device="cpu")
    assert pool.k(1) is pool.k(0) and pool.k(2) is pool.k(0) and pool.index_k(1) is not pool.index_k(0)
    slots = torch.tensor([5, 6])
    pool.store(1, slots, None, None, index_k=torch.ones(2, 16))
    assert pool.index_k(1)[1, 1:3].eq(1).all() and pool.index_k(0).eq(0).all() and pool.k(0).eq(0).all()
    with pytest.raises(RuntimeError, match="reads a shared KV cache"):
        pool.store(1, slots, torch.ones(2, 1, 192), None)
    copy = LayoutCache(pool, KVLayout.FP8_NOPE_SCALED_BF16_ROPE)
    assert copy.view(1) is copy.view(0) and copy.view(2) is copy.view(0)
