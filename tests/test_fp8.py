"""FP8 block-quantized checkpoints (DeepSeek-V3's official layout) on CPU: loading equals the dequantized
model, the activation quantization and block GEMM kernels (Triton interpreter) equal the torch reference,
and quantization configs we cannot run are clear errors."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

import attnzoo
from attnzoo.errors import ModelLoadError, WeightError
from attnzoo.layers.fp8 import (
    FP8, GEMM_TRITON, Fp8Format, Fp8Linear, Fp8MergedLinear, act_quant, act_quant_reference, dequantize, quantize_weight, w8a8_block_matmul,
    w8a8_block_matmul_reference, CODE_RMS,
)
from helpers import random_prompts

VOCAB = 160
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# Dims that are not multiples of 128, so blocks at the edges are partial: hidden 200 (K of q_a / kv_a / MLPs,
# N of o_proj and down_proj), intermediate 300, q_lora 136.
TINY_V3 = dict(vocab_size=VOCAB, hidden_size=200, intermediate_size=300, moe_intermediate_size=72, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
               n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=136, kv_lora_rank=64, qk_nope_head_dim=32,
               qk_rope_head_dim=16, v_head_dim=32, n_group=2, topk_group=1, routed_scaling_factor=2.5,
               max_position_embeddings=256)
# What DeepSeek stores in FP8: every linear layer but the router and lm_head.
FP8_LEAVES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _write(path, tensors, config, quant=None):
    path.mkdir(parents=True, exist_ok=True)
    cfg = {**config.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    if quant is not None:
        cfg["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, path / "model.safetensors")
    return path


def _fp8_checkpoint(root, **config):
    """(FP8 checkpoint dir, the same weights dequantized to float32) of a tiny DeepSeek-V3."""
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**{**TINY_V3, **config})).eval()
    g = torch.Generator().manual_seed(1)
    # A residual stream led by the embeddings (as trained models' is, unlike a 0.02-std init) keeps the
    # logits well conditioned, so FP8's ~3% per-GEMM error cannot flip greedy choices wholesale.
    hf.model.embed_tokens.weight.data.normal_(0, 1, generator=g)
    for layer in hf.model.layers:  # decisive routing, as in test_deepseek
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.weight.data = torch.randn(gate.weight.shape, generator=g) * 0.5
    hf.save_pretrained(root / "hf")  # the checkpoint naming (one tensor per expert), which state_dict() is not
    fp8, ref = {}, {}
    for name, t in load_file(root / "hf" / "model.safetensors").items():
        if name.endswith(".weight") and name.split(".")[-2] in FP8_LEAVES:
            w8, s = quantize_weight(t)
            fp8[name], fp8[name + "_scale_inv"] = w8, s
            ref[name] = dequantize(w8, s)
        else:
            fp8[name] = ref[name] = t
    return _write(root / "fp8", fp8, hf.config, QUANT), _write(root / "ref", ref, hf.config)


@pytest.fixture(scope="module")
def v3_fp8(tmp_path_factory):
    return _fp8_checkpoint(tmp_path_factory.mktemp("v3fp8"))


def test_fp8_checkpoint_loads_and_equals_the_dequantized_model(v3_fp8):
    fp8_dir, ref_dir = v3_fp8
    ref = attnzoo.load_model(ref_dir, backend="torch", device="cpu")
    llm = attnzoo.load_model(fp8_dir, backend="torch", device="cpu")
    assert not any(isinstance(m, Fp8Linear) for m in llm.model.modules())  # CPU: dequantized at load
    for prompt in random_prompts(VOCAB, [7, 19]):
        diff = (llm.logits(prompt) - ref.logits(prompt)).abs().max().item()
        assert diff <= 1e-3, diff
    info = llm.info()
    assert info["weights"]["format"] == "fp8 block 128x128, e4m3 (checkpoint)"
    assert info["weights"]["gemm"] == "dequantized to float32 at load: cpu (the reference path)"
    assert "weights format: fp8 block 128x128, e4m3" in llm.decision.explain()
    assert ref.info()["weights"] == {"format": "float32", "gemm": "torch linear (float32)"}


def test_fp8_layers_keep_the_checkpoint_format(v3_fp8):
    """fp8_weights='fp8': the stored layers stay FP8 (float32 emulation of the w8a8 GEMM on CPU), kv_b_proj
    is dequantized (absorbed MLA reads it as a matrix), and greedy tokens equal the dequantized model's."""
    fp8_dir, ref_dir = v3_fp8
    llm = attnzoo.load_model(fp8_dir, backend="torch", device="cpu", fp8_weights="fp8")
    ref = attnzoo.load_model(ref_dir, backend="torch", device="cpu")
    layer = llm.model.model.layers[1]
    attn = layer.self_attn
    gate_up = llm.model.model.layers[0].mlp.gate_up_proj
    for lin in (attn.q_kv_a_proj, attn.q_b_proj, attn.o_proj, layer.mlp.shared_experts.down_proj, gate_up):
        assert isinstance(lin, Fp8Linear) and lin.weight.dtype == FP8 and lin.weight_scale_inv.dtype == torch.float32
    # gate_proj and up_proj (300 rows: 3 blocks each, the last partial) stacked as stored.
    assert isinstance(gate_up, Fp8MergedLinear) and not gate_up.aligned and gate_up.weight_scale_inv.shape == (6, 2)
    experts = layer.mlp.experts  # the stacked (fused) MoE holds the checkpoint's FP8 experts as stored
    assert experts.quant == "fp8" and experts.w13.dtype == FP8 and experts.w2_scale_inv.shape == (4, 2, 1)
    want = load_file(fp8_dir / "model.safetensors")
    for i, part in enumerate(("gate_proj", "up_proj")):
        assert torch.equal(gate_up.weight[300 * i:300 * (i + 1)].view(torch.uint8),
                           want[f"model.layers.0.mlp.{part}.weight"].view(torch.uint8))
        assert torch.equal(gate_up.weight_scale_inv[3 * i:3 * (i + 1)], want[f"model.layers.0.mlp.{part}.weight_scale_inv"])
    assert torch.equal(experts.w13[2, :72].view(torch.uint8),
                       want["model.layers.1.mlp.experts.2.gate_proj.weight"].view(torch.uint8))
    # q_a_proj (136 rows: 2 blocks) and kv_a_proj_with_mqa (80: 1) stacked as stored, one quantization of x.
    q_kv_a = attn.q_kv_a_proj
    assert isinstance(q_kv_a, Fp8MergedLinear) and q_kv_a.weight_scale_inv.shape == (3, 2) and not q_kv_a.aligned
    assert torch.equal(q_kv_a.weight[136:].view(torch.uint8),
                       want["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].view(torch.uint8))
    assert attn.o_proj.weight_scale_inv.shape == (2, 1)
    assert isinstance(attn.kv_b_proj, torch.nn.Linear)  # a float layer (ColumnParallelLinear at TP 1)
    assert torch.equal(attn.kv_b_proj.weight, ref.model.model.layers[1].self_attn.kv_b_proj.weight)
    assert isinstance(llm.model.lm_head, torch.nn.Linear)
    w = llm.info()["weights"]
    # 3 + 3 attention (q/kv_a merged, q_b, o), 2 dense MLP (gate_up, down), 2 shared expert; one stacked MoE
    assert w["gemm"] == "torch emulation (float32, cpu): 10 layers; MoE reference (float32, cpu): 1 layers"
    assert w["dequantized_at_load"] == "2 layers (kv_b_proj) to float32: the model reads the weight of kv_b_proj as a matrix"
    prompts = random_prompts(VOCAB, [5, 12], seed=3)
    got = llm.generate(prompts, max_new_tokens=8, ignore_eos=True)
    want = ref.generate(prompts, max_new_tokens=8, ignore_eos=True)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    # Activation quantization is the only difference: small, but not zero.
    a, b = llm.logits(prompts[0]), ref.logits(prompts[0])
    assert 0 < (a - b).abs().max().item() <= 0.05 * b.abs().max().item()


def test_block_aligned_merged_layers_are_one_fp8_gemm(tmp_path):
    """Parts of whole 128-row blocks (as DeepSeek-V3's 18432 and 2048 are): gate/up is one stacked FP8
    layer whose factors are the checkpoint's, stacked, and the model equals the dequantized one."""
    fp8_dir, ref_dir = _fp8_checkpoint(tmp_path, intermediate_size=256, moe_intermediate_size=128)
    llm = attnzoo.load_model(fp8_dir, backend="torch", device="cpu", fp8_weights="fp8")
    ref = attnzoo.load_model(ref_dir, backend="torch", device="cpu")
    want = load_file(fp8_dir / "model.safetensors")
    for name, rows in (("model.layers.0.mlp", 256), ("model.layers.1.mlp.shared_experts", 128)):
        lin = llm.model.get_submodule(name + ".gate_up_proj")
        assert isinstance(lin, Fp8MergedLinear) and lin.aligned
        assert torch.equal(lin.weight_scale_inv, torch.cat([want[f"{name}.{p}.weight_scale_inv"] for p in ("gate_proj", "up_proj")]))
        assert torch.equal(lin.weight[rows:].view(torch.uint8), want[f"{name}.up_proj.weight"].view(torch.uint8))
    assert llm.info()["weights"]["gemm"] == "torch emulation (float32, cpu): 10 layers; MoE reference (float32, cpu): 1 layers"
    a, b = llm.logits([3, 1, 4, 1, 5, 9, 2, 6]), ref.logits([3, 1, 4, 1, 5, 9, 2, 6])
    assert 0 < (a - b).abs().max().item() <= 0.05 * b.abs().max().item()


def _fake_quant(x, ue8m0):
    """DeepSeek's act_quant written out (the oracle): per token and 128-channel group, scale = amax / 448
    (amax at least 1e-4), rounded up to a power of two under ue8m0; values rounded to e4m3."""
    m, k = x.shape
    xg = torch.nn.functional.pad(x.float(), (0, -k % 128)).view(m, -1, 128)
    s = xg.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448
    if ue8m0:
        s = 2 ** torch.ceil(torch.log2(s))
    return ((xg / s).clamp(-448, 448).to(FP8).float() * s).view(m, -1)[:, :k]


@pytest.mark.parametrize("triton", [False, True])
def test_fp8_linear_honours_ue8m0(triton):
    if triton and torch.cuda.is_available():
        pytest.skip("a Triton-interpreter check on CPU tensors; on a GPU the gpu tests run these kernels on CUDA")
    torch.manual_seed(0)
    x = torch.randn(6, 200) * torch.rand(6, 1) * 5
    w8, s = quantize_weight(torch.randn(136, 200) * 0.1)
    for ue8m0 in (False, True):
        lin = Fp8Linear(200, 136, fmt=Fp8Format(ue8m0=ue8m0))
        lin.weight.data, lin.weight_scale_inv.data = w8, s
        lin.gemm = GEMM_TRITON if triton else lin.gemm
        got, w = lin(x), dequantize(w8, s)
        assert torch.allclose(got, _fake_quant(x, ue8m0) @ w.t(), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got, _fake_quant(x, not ue8m0) @ w.t(), rtol=1e-3, atol=1e-3)


def test_tiny_fp8_v3_with_ue8m0_scales_equals_the_reference(v3_fp8, tmp_path):
    """scale_fmt "ue8m0" (DeepSeek-V3.1/V3.2 configs) reaches every FP8 GEMM, the fused MoE's included: the
    FP8 model (w8a8 emulated on CPU) equals DeepSeek's reference arithmetic written out here, the
    dequantized model with every FP8 layer's input (the experts' too) rounded by act_quant with
    power-of-two scales; the same oracle without ue8m0 is measurably further away."""
    fp8_dir, ref_dir = v3_fp8
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg["quantization_config"] = {**QUANT, "scale_fmt": "ue8m0"}
    ue_dir = tmp_path / "ue8m0"
    ue_dir.mkdir()
    (ue_dir / "config.json").write_text(json.dumps(cfg))
    (ue_dir / "model.safetensors").symlink_to(fp8_dir / "model.safetensors")
    llm = attnzoo.load_model(ue_dir, backend="torch", device="cpu", fp8_weights="fp8")
    assert "ue8m0 scales" in llm.info()["weights"]["format"]
    assert llm.model.model.layers[1].mlp.experts.ue8m0
    ref = attnzoo.load_model(ref_dir, backend="torch", device="cpu")
    mode = {"ue8m0": True}
    for name, mod in ref.model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not name.endswith(("kv_b_proj", "lm_head")):
            mod.register_forward_pre_hook(lambda m, args: (_fake_quant(args[0], mode["ue8m0"]),))
    for layer in ref.model.model.layers[1:]:
        moe = layer.mlp.experts

        def experts(x, weights, ids, add=None, shared=None, moe=moe):  # the per-token, per-expert sum
            add = shared(x) if shared is not None else add  # (+ the shared experts)
            out = torch.zeros_like(x) if add is None else add.clone()
            inter = moe.intermediate
            for t in range(x.shape[0]):
                for w, e in zip(weights[t].tolist(), ids[t].tolist()):
                    gate_up = moe.w13[e] @ _fake_quant(x[t:t + 1], mode["ue8m0"])[0]
                    h = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
                    out[t] += w * (moe.w2[e] @ _fake_quant(h[None], mode["ue8m0"])[0])
            return out
        moe.forward = experts
    prompt = random_prompts(VOCAB, [9], seed=5)[0]
    got, want = llm.logits(prompt), ref.logits(prompt)
    mode["ue8m0"] = False
    other = ref.logits(prompt)
    close = (got - want).abs().max().item()
    assert close <= 1e-4 * want.abs().max().item() and 50 * close < (got - other).abs().max().item(), close


@pytest.mark.parametrize("parts", [{"gate_proj": 256, "up_proj": 256}, {"q_a_proj": 256, "kv_a_proj_with_mqa": 80},
                                   {"q_proj": 136, "k_proj": 64, "v_proj": 64}])
@pytest.mark.parametrize("triton", [False, True])
def test_merged_fp8_layer_equals_its_parts_as_separate_layers(parts, triton):
    if triton and torch.cuda.is_available():
        pytest.skip("a Triton-interpreter check on CPU tensors; on a GPU the gpu tests run these kernels on CUDA")
    """Each part keeps its own block factors: stacked blocks where parts are whole blocks (but the last),
    one GEMM per part where a block would straddle two parts (the third case)."""
    torch.manual_seed(0)
    k = 200
    merged = Fp8MergedLinear(k, parts)
    assert merged.aligned == (len(parts) == 2)  # a partial block is fine at the end only
    x = torch.randn(5, k)
    want, want_w = [], []
    for (name, n), rows, srows in zip(parts.items(), merged.part_rows().values(), merged.scale_rows().values()):
        lin = Fp8Linear(k, n)
        w8, s = quantize_weight(torch.randn(n, k) * 0.1)
        for layer, r, sr in ((lin, slice(None), slice(None)), (merged, rows, srows)):
            layer.weight.data[r] = w8
            layer.weight_scale_inv.data[sr] = s
        lin.gemm = GEMM_TRITON if triton else lin.gemm
        want.append(lin(x))
        want_w.append(lin.dequantized(torch.float32))
    merged.gemm = GEMM_TRITON if triton else merged.gemm
    got = merged(x)
    assert [t.shape[-1] for t in merged.split(got)] == list(parts.values())
    assert torch.allclose(got, torch.cat(want, -1), rtol=1e-5, atol=1e-5)
    assert torch.equal(merged.dequantized(torch.float32), torch.cat(want_w))


def test_random_weight_fp8_model_and_dtype_moves():
    cfg = DeepseekV3Config(**TINY_V3, quantization_config=QUANT, architectures=["DeepseekV3ForCausalLM"])
    llm = attnzoo.load_model(cfg, load_format="random", backend="torch", device="cpu", fp8_weights="fp8")
    lin = llm.model.model.layers[0].self_attn.q_kv_a_proj
    # Random codes +-[1, 1.875] drawn as FP8, one factor per block: nn.Linear's spread, 1 / sqrt(3 * 200).
    codes = lin.weight.float().abs()
    assert isinstance(lin, Fp8Linear) and codes.min() == 1 and codes.max() == 1.875
    assert torch.allclose(lin.weight_scale_inv, torch.full_like(lin.weight_scale_inv, 600**-0.5 / CODE_RMS))
    assert abs(float(lin.dequantized(torch.float32).std()) * 600**0.5 - 1) < 0.02
    gate_up = llm.model.model.layers[0].mlp.gate_up_proj  # parts blocked apart: 3 blocks of rows each
    assert isinstance(gate_up, Fp8MergedLinear) and gate_up.weight_scale_inv.shape == (6, 2)
    assert llm.info()["weights"]["format"] == "fp8 block 128x128, e4m3 (random weights)"
    lin.to(torch.bfloat16)  # model.to(dtype) must not turn codes or factors into bf16 numbers
    assert lin.weight.dtype == FP8 and lin.weight_scale_inv.dtype == torch.float32
    assert len(llm.generate([[5, 6, 7]], max_new_tokens=3, ignore_eos=True)[0].token_ids) == 3


@pytest.mark.parametrize("m,k", [(3, 300), (17, 128), (1, 72)])
@pytest.mark.skipif(torch.cuda.is_available(), reason="a Triton-interpreter check on CPU tensors; on a GPU the gpu tests run these kernels on CUDA")
def test_act_quant_kernel_equals_reference(m, k):
    x = torch.randn(m, k) * torch.rand(m, 1) * 10
    x[0, :5] = 0
    for ue8m0 in (False, True):
        want, ws = act_quant_reference(x, ue8m0=ue8m0)
        got, gs = act_quant(x, ue8m0=ue8m0)
        assert torch.equal(gs, ws) and gs.shape == (m, -(-k // 128))
        if ue8m0:
            assert torch.equal(gs, torch.exp2(torch.log2(gs).round()))
        # Bytes by integer arithmetic (not the interpreter's cast, which drops rounding carries): exact.
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert (want.float() * ws.repeat_interleave(128, 1)[:, :k] - x).abs().max() <= 0.07 * x.abs().max()


@pytest.mark.parametrize("m,n,k,split_k", [(5, 200, 300, 1), (33, 136, 256, 3), (1, 64, 72, None)])
@pytest.mark.skipif(torch.cuda.is_available(), reason="a Triton-interpreter check on CPU tensors; on a GPU the gpu tests run these kernels on CUDA")
def test_block_gemm_kernel_equals_reference(m, n, k, split_k):
    x = torch.randn(m, k)
    w = torch.randn(n, k) * 0.1
    w8, ws = quantize_weight(w)
    x8, xs = act_quant_reference(x)
    want = w8a8_block_matmul_reference(x8, xs, w8, ws)
    got = w8a8_block_matmul(x8, xs, w8, ws, out_dtype=torch.float32, split_k=split_k)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    # ... and the quantized product is the float product within FP8's resolution.
    assert (want - x @ w.t()).abs().max() <= 0.08 * (x @ w.t()).abs().max()


def test_quantize_dequantize_partial_blocks():
    w = torch.randn(130, 260)
    w8, s = quantize_weight(w)
    assert w8.dtype == FP8 and s.shape == (2, 3)
    assert (dequantize(w8, s) - w).abs().max() <= w.abs().max() / 16
    with pytest.raises(WeightError, match=r"scale_inv has shape \(2, 2\)"):
        dequantize(w8, s[:, :2])


@pytest.mark.parametrize("change,field", [
    ({"quant_method": "gptq"}, "quant_method"), ({"fmt": "e5m2"}, "fmt"), ({"weight_block_size": [64, 64]}, "weight_block_size"),
    ({"weight_block_size": None}, "weight_block_size"), ({"activation_scheme": "static"}, "activation_scheme"),
    ({"scale_fmt": "e8m0x"}, "scale_fmt"),
])
def test_unsupported_quantization_configs_are_clear_errors(change, field):
    cfg = DeepseekV3Config(**TINY_V3, quantization_config={**QUANT, **change})
    with pytest.raises(WeightError, match=f"quantization_config.{field}") as e:
        Fp8Format.from_config(cfg)
    assert "weight_block_size" in e.value.fix


def test_bad_fp8_checkpoints_are_clear_errors(tmp_path, v3_fp8):
    fp8_dir, ref_dir = v3_fp8
    cfg = json.loads((fp8_dir / "config.json").read_text())
    tensors = load_file(fp8_dir / "model.safetensors")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "quantization_config": {**QUANT, "weight_block_size": [128, 64]}}))
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(WeightError, match="weight_block_size"):
        attnzoo.load_model(bad, backend="torch", device="cpu")
    # Scales without a quantization_config.
    (bad / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization_config"}))
    with pytest.raises(WeightError, match="no quantization_config"):
        attnzoo.load_model(bad, backend="torch", device="cpu")
    # An FP8 weight without its factors.
    (bad / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in tensors.items() if k != "model.layers.0.self_attn.o_proj.weight_scale_inv"},
              bad / "model.safetensors")
    with pytest.raises(WeightError, match="o_proj.weight has no weight_scale_inv"):
        attnzoo.load_model(bad, backend="torch", device="cpu")
    with pytest.raises(ModelLoadError, match="not FP8 block-quantized"):
        attnzoo.load_model(ref_dir, backend="torch", device="cpu", fp8_weights="fp8")
    with pytest.raises(ModelLoadError, match="fp8_weights"):
        attnzoo.load_model(ref_dir, backend="torch", device="cpu", fp8_weights="int8")



# ----------------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# DeepSeek-V3 linear shapes (N, K): q_a, q_b, kv_a, o, a routed expert's down; and one with partial blocks.
V3_SHAPES = [(1536, 7168), (24576, 1536), (576, 7168), (7168, 16384), (7168, 2048), (200, 300)]


def _needs_fp8_gpu():
    from attnzoo.layers.fp8 import fp8_gemm_supported

    if not fp8_gemm_supported(torch.device("cuda")):
        pytest.skip("this GPU has no FP8 tensor cores (SM89+)")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("m,k", [(1, 7168), (512, 1536), (37, 300)])
def test_act_quant_on_gpu_equals_reference_exactly(m, k, ue8m0):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    want, ws = act_quant_reference(x, ue8m0=ue8m0)
    for column_major in (False, True):
        got, gs = act_quant(x, ue8m0=ue8m0, column_major_scales=column_major)
        assert torch.equal(gs, ws) and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k", V3_SHAPES)
def test_fp8_linear_equals_dequantized_bf16_linear(n, k):
    """Every GEMM path this GPU has (Triton always; torch._scaled_mm blockwise on SM90 where N, K are
    multiples of 128) equals the float32 reference of the same quantized operands, and the bf16 linear of
    the dequantized weight within FP8 activation rounding."""
    _needs_fp8_gpu()
    from attnzoo.layers import fp8

    dev = torch.device("cuda")
    w8, ws = quantize_weight(torch.randn(n, k, device=dev) * 0.02)
    lin = Fp8Linear(k, n, device=dev)
    lin.weight.data.copy_(w8)
    lin.weight_scale_inv.data.copy_(ws)
    chosen = lin.prepare(torch.bfloat16)
    paths = {fp8.GEMM_TRITON, chosen}
    w_bf16 = dequantize(w8, ws, dtype=torch.bfloat16)
    for m in (1, 64, 512):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        x8, xs = act_quant_reference(x)
        ref = w8a8_block_matmul_reference(x8, xs, w8, ws)
        for path in paths:
            lin.prepare(torch.bfloat16)
            lin.gemm = path
            y = lin(x)
            assert y.dtype == torch.bfloat16 and y.shape == (m, n)
            assert _rel(y, ref) <= 1e-2, (path, m)
            assert _rel(y, torch.nn.functional.linear(x, w_bf16)) <= 0.05, (path, m)
    for split_k in (1, 4):  # the split-K reduction the decode batches use
        y = w8a8_block_matmul(x8, xs, w8, ws, out_dtype=torch.float32, split_k=split_k)
        # Same quantized operands; float32 sums in another order (measured 1.3e-4 on an H200).
        assert _rel(y, ref) <= 1e-3


@pytest.mark.gpu
@gpu
def test_tiny_fp8_v3_greedy_equals_dequantized_bf16(v3_fp8):
    """FP8 GEMMs in the whole model (CUDA graphs on for decode) give the greedy tokens of the same
    checkpoint dequantized to bf16 at load."""
    _needs_fp8_gpu()
    fp8_dir, _ = v3_fp8
    llm = attnzoo.load_model(fp8_dir, backend="triton", device="cuda", kv_cache_tokens=4096)
    ref = attnzoo.load_model(fp8_dir, backend="triton", device="cuda", kv_cache_tokens=4096, fp8_weights="dequantize")
    w = llm.info()["weights"]
    assert "triton w8a8 block fp8" in w["gemm"] and "dequantized_at_load" in w
    assert ref.info()["weights"]["gemm"] == "dequantized to bfloat16 at load: fp8_weights='dequantize'"
    assert sum(isinstance(m, Fp8Linear) for m in llm.model.modules()) == 10  # q_a and kv_a merged
    assert "fused MoE, triton w8a8 block fp8: 1 layers" in w["gemm"] and llm.model.model.layers[1].mlp.experts.quant == "fp8"
    assert not any(p.dtype == torch.bfloat16 and p.dim() == 2 and n.endswith("o_proj.weight")
                   for n, p in llm.model.named_parameters())
    prompts = random_prompts(VOCAB, [5, 12, 30, 64], seed=3)
    got = llm.generate(prompts, max_new_tokens=16, ignore_eos=True)
    want = ref.generate(prompts, max_new_tokens=16, ignore_eos=True)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
