"""GLM-5 (MLA + DSA with an interleaved-RoPE indexer and shared top-k layers), Kimi K2.5 and Mistral 4
(DeepSeek-V3 text models under multimodal wrappers and their own names) against transformers on the CPU
(float32, torch backend; GLM-5 also nsa_triton under the interpreter), their checkpoint mappings (MTP
layers, vision towers), placeholder refusal, an FP8 block-scaled GLM-5, TP 2 = TP 1, the policy rows, and
an MLA config whose num_key_value_heads does not divide its heads (transformers' DeepseekV3Config default)."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    DeepseekV3Config, DeepseekV3ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM, Kimi_K25Config,
    Kimi_K25ForConditionalGeneration, Mistral3Config, Mistral3ForConditionalGeneration, Mistral4Config,
    Mistral4ForCausalLM,
)

import attnzoo
from attnzoo.cli import main as policy_main
from attnzoo.errors import ModelLoadError, RequestError
from attnzoo.layers.fp8 import dequantize, quantize_weight
from helpers import assert_matches_hf, random_prompts, save_checkpoint

VOCAB = 160
GPU = torch.cuda.is_available()
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
# Llama 4's query scale grows past original_max_position_embeddings: 4 puts every prompt beyond it.
MISTRAL4_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
                 "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "llama_4_scaling_beta": 1.0}
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            max_position_embeddings=256)
# Layer 2 has no indexer: it attends over layer 1's selection. index_topk 6 < the prompts: selection matters.
GLM = dict(TEXT, n_group=1, topk_group=1, rope_parameters=YARN, index_topk=6, index_head_dim=16, index_n_heads=8,
           index_topk_pattern="FFS")
IMAGE, VIDEO = 150, 151
PROMPTS = random_prompts(140, [7, 21])  # ids below the placeholders


def _sharpen(text_model, seed=1):
    """Decisive routing and indexer scores (the 0.02-std init leaves near ties that float rounding decides)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in text_model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) * 0.5)
                if hasattr(gate, "e_score_correction_bias"):
                    gate.e_score_correction_bias.copy_(torch.rand(gate.weight.shape[0], generator=g) * 0.6 - 0.3)
            idx = getattr(layer.self_attn, "indexer", None)
            if idx is not None:
                for p in (idx.wq_b.weight, idx.wk.weight, idx.weights_proj.weight, idx.k_norm.bias):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return text_model


def tiny_glm5(**kw):
    torch.manual_seed(0)
    hf = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**{**GLM, **kw})).eval()
    _sharpen(hf.model)
    return hf


def tiny_kimi():
    text = DeepseekV3Config(**TEXT, rope_parameters=YARN)
    cfg = Kimi_K25Config(text_config=text.to_dict(), projection_hidden_size=32, image_token_id=IMAGE,
                         video_token_id=VIDEO, vision_config=dict(num_hidden_layers=1, hidden_size=32,
                                                                  intermediate_size=32, num_attention_heads=2))
    torch.manual_seed(0)
    hf = Kimi_K25ForConditionalGeneration(cfg).eval()
    _sharpen(hf.model.language_model)
    return hf


def tiny_mistral4(wrapped: bool):
    text = Mistral4Config(**{**TEXT, "rope_parameters": MISTRAL4_YARN})
    torch.manual_seed(0)
    if not wrapped:
        hf = Mistral4ForCausalLM(text).eval()
        _sharpen(hf.model)
        return hf
    cfg = Mistral3Config(text_config=text.to_dict(), image_token_index=IMAGE, tie_word_embeddings=False,
                         vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, image_size=28, patch_size=14, head_dim=16))
    hf = Mistral3ForConditionalGeneration(cfg).eval()
    _sharpen(hf.model.language_model)
    return hf


@pytest.fixture(scope="module")
def glm5_dir(tmp_path_factory):
    hf = tiny_glm5()
    return save_checkpoint(hf, tmp_path_factory.mktemp("glm5")), hf


def _load(path, **kw):
    return attnzoo.load_model(path, **{"page_size": 4, "backend": "torch", "device": "cpu", **kw})


# ------------------------------------------------------------------------------ GLM-5


def test_glm5_torch_matches_transformers(glm5_dir):
    d, hf = glm5_dir
    assert hf.config.indexer_types == ["full", "full", "shared"]
    llm = _load(d, max_batch_tokens=9)  # the 21-token prompt is prefilled in chunks over a cached prefix
    layers = llm.model.model.layers
    assert layers[2].self_attn.indexer is None and layers[2].self_attn.mla.attn.index_head_dim == 0
    assert llm.info()["decode_backend"] == "torch"
    assert_matches_hf(llm, hf, PROMPTS, steps=8)


def test_glm5_nsa_triton_matches_transformers(glm5_dir):
    d, hf = glm5_dir
    llm = _load(d, backend="nsa_triton", device="cuda" if GPU else "cpu", dtype="float32")
    assert llm.info()["decode_backend"] == "nsa_triton"
    assert_matches_hf(llm, hf, random_prompts(140, [9], seed=2), steps=3)  # 9 > index_topk: selection runs


def test_glm5_mtp_layers_are_skipped_with_a_log_line(glm5_dir, tmp_path, caplog):
    d, hf = glm5_dir
    tensors = load_file(d / "model.safetensors")
    # GLM-5 appends its MTP module as layer num_hidden_layers (78 in the release).
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.3.self_attn.q_a_proj.weight"] = torch.zeros(24, 64)
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="attnzoo"):
        llm = _load(tmp_path)
    assert "skipped the multi-token-prediction layer(s) 3" in caplog.text
    assert torch.equal(llm.logits(PROMPTS[0]), _load(d).logits(PROMPTS[0]))


def test_glm5_bad_indexer_types_are_named():
    cfg = GlmMoeDsaConfig(**{**GLM, "index_topk_pattern": "SFF"})
    with pytest.raises(ModelLoadError, match=r"indexer_types\[0\] is 'shared'"):
        attnzoo.load_model(cfg, load_format="random", device="cpu", backend="torch")


def test_glm5_fp8_block_checkpoint_loads_as_stored(tmp_path):
    """Every projection but the router, lm_head and the float32 weights_proj stored as FP8 with 128x128
    factors (the indexer's wq_b and wk too): equal to the checkpoint dequantized, within FP8 GEMM noise."""
    hf = tiny_glm5()
    hf.model.embed_tokens.weight.data.normal_(0, 1, generator=torch.Generator().manual_seed(1))
    hf.save_pretrained(tmp_path / "hf")
    leaves = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
              "down_proj", "wq_b", "wk")
    fp8, ref = {}, {}
    for name, t in load_file(tmp_path / "hf" / "model.safetensors").items():
        if name.endswith(".weight") and name.split(".")[-2] in leaves:
            w8, s = quantize_weight(t)
            fp8[name], fp8[name + "_scale_inv"], ref[name] = w8, s, dequantize(w8, s)
        else:
            fp8[name] = ref[name] = t
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    for sub, tensors, extra in (("fp8", fp8, {"quantization_config": quant}), ("ref", ref, {})):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "config.json").write_text(json.dumps({**cfg, **extra}))
        save_file(tensors, tmp_path / sub / "model.safetensors")
    llm, want = _load(tmp_path / "fp8"), _load(tmp_path / "ref")
    assert llm.info()["weights"]["format"] == "fp8 block 128x128, e4m3 (checkpoint)"
    assert "wq_b" in llm.info()["weights"]["dequantized_at_load"]
    for prompt in PROMPTS:
        assert (llm.logits(prompt) - want.logits(prompt)).abs().max().item() <= 1e-3


def test_glm5_tensor_parallel_2_equals_1(glm5_dir):
    from test_tensor_parallel import _check_same, _run

    opts = dict(device="cpu", backend="torch", page_size=4, kv_cache_tokens=256)
    ref = _run(attnzoo.load_model(glm5_dir[0], **opts))
    llm = attnzoo.load_model(glm5_dir[0], tensor_parallel_size=2, **opts)
    try:
        got = _run(llm)
    finally:
        llm.close()
    assert got["info"]["decision"]["profile"]["num_heads"] == 2
    _check_same(ref, got, "glm5")


# ------------------------------------------------------------------------------ Kimi K2.5, Mistral 4


@pytest.mark.parametrize("make", [tiny_kimi, lambda: tiny_mistral4(False), lambda: tiny_mistral4(True)],
                         ids=["kimi_k25", "mistral4", "mistral3_wrapper"])
def test_matches_transformers(tmp_path, make, caplog):
    hf = make()
    save_checkpoint(hf, tmp_path)
    with caplog.at_level(logging.INFO, logger="attnzoo"):
        llm = _load(tmp_path, max_batch_tokens=9)
    if hasattr(hf.model, "vision_tower"):
        assert "vision tower/projector tensors (attnzoo serves the text model only)" in caplog.text
    assert_matches_hf(llm, hf, PROMPTS, steps=8)


def test_kimi_names_as_released(tmp_path):
    """The released checkpoint's names (language_model.model.layers.*, vision_tower.encoder.blocks.*) and
    transformers' in-memory ones (model.language_model.*) load alike; the lm_head ties as the outer config says."""
    hf = tiny_kimi()
    save_checkpoint(hf, tmp_path / "saved")
    tensors = load_file(tmp_path / "saved" / "model.safetensors")
    assert any(n.startswith("language_model.model.blocks.") for n in tensors)  # transformers' own save
    cfg = (tmp_path / "saved" / "config.json").read_text()
    ref = _load(tmp_path / "saved").logits(PROMPTS[0])
    for sub, rename in (("released", lambda n: n.replace("language_model.model.blocks.", "language_model.model.layers.")),
                        ("in_memory", lambda n: n.replace("language_model.model.", "model.language_model."))):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "config.json").write_text(cfg)
        save_file({rename(n): t for n, t in tensors.items()}, tmp_path / sub / "model.safetensors")
        assert torch.equal(_load(tmp_path / sub).logits(PROMPTS[0]), ref)


@pytest.mark.parametrize("make, ids", [(tiny_kimi, (IMAGE, VIDEO)), (lambda: tiny_mistral4(True), (IMAGE,))],
                         ids=["kimi_k25", "mistral3_wrapper"])
def test_placeholder_tokens_are_refused(tmp_path, make, ids):
    save_checkpoint(make(), tmp_path)
    llm = _load(tmp_path)
    for i in ids:
        with pytest.raises(RequestError, match=f"token id {i}, an image/video placeholder"):
            llm.generate([[5, i, 7]], max_new_tokens=2)
    assert len(llm.generate([[5, 6, 7]], max_new_tokens=2, ignore_eos=True)[0].token_ids) == 2


def test_mistral3_with_another_text_model_is_refused():
    from transformers import MistralConfig

    cfg = Mistral3Config(text_config=MistralConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1,
                                                   num_attention_heads=4, num_key_value_heads=2).to_dict())
    cfg.architectures = ["Mistral3ForConditionalGeneration"]
    with pytest.raises(ModelLoadError, match="'mistral' text model is not implemented"):
        attnzoo.load_model(cfg, load_format="random", device="cpu", backend="torch")


# ------------------------------------------------------------------------------ issue 34 item 5, policy


def test_mla_config_with_default_kv_heads_loads_and_matches(tmp_path):
    """DeepseekV3Config(num_attention_heads=4) keeps num_key_value_heads=128, a key MLA never reads."""
    kw = {k: v for k, v in TEXT.items() if k != "num_key_value_heads"}
    cfg = DeepseekV3Config(**kw, rope_parameters=YARN)
    assert cfg.num_key_value_heads == 128 and cfg.num_attention_heads == 4
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(cfg).eval()
    _sharpen(hf.model)
    save_checkpoint(hf, tmp_path)
    assert_matches_hf(_load(tmp_path), hf, [PROMPTS[0]], steps=4)
    assert attnzoo.load_model(cfg, load_format="random", device="cpu", backend="torch").generate(
        [[5, 6]], max_new_tokens=1, ignore_eos=True)[0].token_ids


@pytest.mark.parametrize("arch, kind, backend", [
    ("GlmMoeDsaForCausalLM", "NSA", "nsa_triton"), ("Kimi_K25ForConditionalGeneration", "MLA", "flashinfer_mla"),
    ("KimiK25ForConditionalGeneration", "MLA", "flashinfer_mla"), ("Mistral4ForCausalLM", "MLA", "flashinfer_mla"),
    ("Mistral3ForConditionalGeneration", "MLA", "flashinfer_mla"),
])
def test_policy_explain(capsys, arch, kind, backend):
    assert policy_main(["policy", "explain", arch, "--gpu", "sm90", "--assume-installed"]) == 0
    out = capsys.readouterr().out
    assert f"{arch} on sm90: prefill {backend}, decode {backend}" in out and f"model: {kind}," in out
    assert "field: SGLang" in out


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("backend", ["nsa_triton", "nsa_triton_fp8"])
def test_gpu_nsa_backends_match_torch_on_glm5(tmp_path, backend):
    """The GPU NSA backends against the torch reference on a tiny GLM-5 (shared layer included; latent
    128 wide for the fp8 layout), eager and with CUDA graphs: greedy tokens identical, logits close."""
    save_checkpoint(tiny_glm5(kv_lora_rank=128), tmp_path)
    prompts = random_prompts(140, [7, 21, 3], seed=5)
    opts = dict(page_size=4, dtype="float32", max_running=8)
    want = attnzoo.load_model(tmp_path, backend="torch", device="cpu", **opts).generate(
        prompts, max_new_tokens=12, ignore_eos=True, return_logits=True)
    tol = 5e-2 if backend.endswith("fp8") else 1e-3
    for graphs in (False, True):
        llm = attnzoo.load_model(tmp_path, backend=backend, device="cuda", cuda_graph=graphs, **opts)
        got = llm.generate(prompts, max_new_tokens=12, ignore_eos=True, return_logits=True)
        for w, o in zip(want, got):
            assert o.token_ids == w.token_ids, (backend, graphs)
            assert (o.logits - w.logits).abs().max().item() <= tol, (backend, graphs)


def test_e2e_glm5_shape_is_full_width_at_reduced_depth(e2e):
    config, fields = e2e.make_config("glm5", 6)
    assert config.architectures == ["GlmMoeDsaForCausalLM"] and config.num_hidden_layers == 6
    assert config.indexer_types == ["full"] * 6 and config.mlp_layer_types == ["dense"] * 3 + ["sparse"] * 3
    from attnzoo.policy.profile import profile_from_config

    profile = profile_from_config(config)
    assert (profile.kind, profile.num_heads, sorted(profile.head_dims), sorted(profile.v_head_dims)) == \
        ("nsa", 64, [576], [512])
