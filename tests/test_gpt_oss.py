"""gpt-oss on CPU against transformers: attention sinks, alternating sliding/full layers, YaRN, biases and
the clamped-SwiGLU MoE; the MXFP4 dequantizer; sinks through the Triton kernels; tensor parallel."""
import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM

import attnzoo
import test_cascade_triton as cas
import test_triton_kernels as tk
from helpers import assert_matches_hf, random_prompts, save_checkpoint

VOCAB = 160
WINDOW = 8  # smaller than the prompts: the sliding layers' windows matter


def tiny_gpt_oss(*, layers=2, heads=4, kv_heads=2, experts=4, top_k=2):
    cfg = GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=layers, head_dim=16,
        num_attention_heads=heads, num_key_value_heads=kv_heads, num_local_experts=experts,
        num_experts_per_tok=top_k, sliding_window=WINDOW, max_position_embeddings=2048,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers initialises biases and sinks to zero or near it: make them matter
        for name, p in hf.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 2.0)
            elif "bias" in name:
                p.copy_(torch.randn_like(p) * 0.1)
            elif "experts" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    return hf


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt_oss")
    hf = tiny_gpt_oss()
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    save_checkpoint(hf, d)
    return d, hf


def test_matches_transformers(tiny_dir):
    d, hf = tiny_dir
    llm = attnzoo.load_model(d, page_size=4)
    assert llm.decision.prefill_backend == "torch"
    assert_matches_hf(llm, hf, random_prompts(VOCAB, [5, 21]), steps=10)


# ---------------------------------------------------------------- sinks and windows through the Triton kernels
# (the interpreter on CPU: tiny shapes; tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported)

# name -> (seq_lens, heads, kv_heads, page_size, window, splits, dtype)
SINK_DECODE = {
    "direct-window": ([3, 20], 4, 2, 4, 8, 1, torch.float32),
    "split3-window": ([30, 9], 4, 2, 4, 8, 3, torch.float32),
    "split2-full-bf16": ([25, 40], 4, 2, 16, None, 2, torch.bfloat16),
    "split6-full": ([70, 130], 4, 2, 16, None, 6, torch.float32),  # more splits than the merge's few-split tile
}
# name -> (prefix_lens, q_lens, heads, kv_heads, page_size, window, dtype)
SINK_EXTEND = {
    "prefix-window": ([5, 0], [12, 3], 4, 2, 4, 8, torch.float32),
    "full-bf16": ([9], [10], 4, 2, 16, None, torch.bfloat16),
}
D = 64


def _sinks(heads, gen):
    return (torch.randn(heads, generator=gen) * 3.0).to(tk.DEVICE)  # large: the sink often dominates


@pytest.mark.parametrize("case", SINK_DECODE)
def test_triton_decode_sinks_match_reference(case):
    from attnzoo.attention.kernels.decode import decode_attention
    from attnzoo.attention.reference import attention_reference

    seq_lens, heads, kv_heads, ps, window, splits, dtype = SINK_DECODE[case]
    gen = torch.Generator().manual_seed(1)
    kv = tk.PagedKV(seq_lens, kv_heads=kv_heads, head_dim=D, v_dim=D, page_size=ps, dtype=dtype, gen=gen)
    q = torch.randn(len(seq_lens), heads, D, generator=gen).to(dtype)
    sinks = _sinks(heads, gen)
    out = decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens_t, scale=D**-0.5,
                           sliding_window=window, num_kv_splits=splits, sinks=sinks)
    for i, s in enumerate(seq_lens):
        ref = attention_reference(q[i : i + 1], kv.k[i], kv.v[i], torch.tensor([s - 1]), scale=D**-0.5,
                                  sliding_window=window, sinks=sinks)
        plain = attention_reference(q[i : i + 1], kv.k[i], kv.v[i], torch.tensor([s - 1]), scale=D**-0.5,
                                    sliding_window=window)
        assert tk.rel_err(out[i : i + 1], ref) <= tk.TOL[dtype]
        assert tk.rel_err(plain, ref) > 10 * tk.TOL[dtype]  # the sinks matter here


@pytest.mark.parametrize("case", SINK_EXTEND)
def test_triton_extend_sinks_match_reference(case):
    from attnzoo.attention.kernels.extend import extend_attention
    from attnzoo.attention.reference import attention_reference

    prefix_lens, q_lens, heads, kv_heads, ps, window, dtype = SINK_EXTEND[case]
    gen = torch.Generator().manual_seed(2)
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    kv = tk.PagedKV(seq_lens, kv_heads=kv_heads, head_dim=D, v_dim=D, page_size=ps, dtype=dtype, gen=gen)
    q = torch.randn(sum(q_lens), heads, D, generator=gen).to(dtype)
    sinks = _sinks(heads, gen)
    indptr = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    out = extend_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, indptr,
                           torch.tensor(prefix_lens, dtype=torch.int32), max_q_len=max(q_lens), scale=D**-0.5,
                           sliding_window=window, sinks=sinks)
    start = 0
    for i, (p, n) in enumerate(zip(prefix_lens, q_lens)):
        rows = slice(start, start + n)
        ref = attention_reference(q[rows], kv.k[i], kv.v[i], torch.arange(p, p + n), scale=D**-0.5,
                                  sliding_window=window, sinks=sinks)
        assert tk.rel_err(out[rows], ref) <= tk.TOL[dtype]
        start += n


def test_triton_cascade_decode_sinks_match_reference():
    from attnzoo.attention.kernels.decode import cascade_decode_attention
    from attnzoo.attention.reference import attention_reference

    gen = torch.Generator().manual_seed(3)
    shared, suffix, heads = 16, [1, 7], 4
    kv = cas.SharedPagedKV(shared, suffix, kv_heads=2, head_dim=D, v_dim=D, page_size=4, dtype=torch.float32,
                           mla=False, gen=gen)
    q = torch.randn(len(suffix), heads, D, generator=gen)
    sinks = _sinks(heads, gen)
    out = cascade_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, shared_len=shared,
                                   scale=D**-0.5, num_kv_splits=1, num_shared_splits=2, sinks=sinks)
    for i in range(len(suffix)):
        s = shared + suffix[i]
        ref = attention_reference(q[i : i + 1], kv.k[i], kv.v[i], torch.tensor([s - 1]), scale=D**-0.5, sinks=sinks)
        assert cas.rel_err(out[i : i + 1], ref) <= 1e-5


# ---------------------------------------------------------------- MXFP4 expert weights


def test_mxfp4_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from attnzoo.models.mxfp4 import dequantize_mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)  # [E, N, K/32, 16]
    scales = torch.randint(118, 134, (3, 10, 4), generator=gen, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [E, N, K]
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    assert ours.shape == (3, 10, 128)
    assert torch.equal(ours, ref.transpose(1, 2))


def _mxfp4_pack(w: torch.Tensor):
    """[E, N, K] float -> (blocks, scales): the nearest FP4 codes under a per-32 power-of-two scale."""
    from attnzoo.models.mxfp4 import FP4_VALUES

    e, n, k = w.shape
    g = w.reshape(e, n, k // 32, 32)
    exp = torch.floor(torch.log2(g.abs().amax(-1).clamp_min(2.0**-20) / 6.0)).clamp(-127, 127) + 1
    q = g / torch.exp2(exp)[..., None]
    codes = (q[..., None] - torch.tensor(FP4_VALUES[:8])).abs().argmin(-1) + 8 * (q < 0)
    codes = codes.view(e, n, k // 32, 16, 2).to(torch.uint8)
    return codes[..., 0] | (codes[..., 1] << 4), (exp + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_dirs(tmp_path_factory, tiny_dir):
    """The tiny checkpoint with its experts MXFP4 (*_blocks / *_scales, quant_method "mxfp4"), and its twin
    holding those MXFP4 values dequantized in float32 (no quantization_config)."""
    import json

    from safetensors.torch import load_file, save_file

    from attnzoo.models.mxfp4 import dequantize_mxfp4

    d, _ = tiny_dir
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    src = load_file(next(d.glob("*.safetensors")))
    quant, twin = dict(src), dict(src)
    for name, t in src.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _mxfp4_pack(t.transpose(1, 2).float())  # checkpoint [E, K, N] -> W [E, N, K]
            del quant[name]
            quant[name + "_blocks"], quant[name + "_scales"] = blocks, scales
            twin[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
    cfg = json.loads((d / "config.json").read_text())
    for out, tensors, qc in ((root / "q", quant, {"quant_method": "mxfp4"}), (root / "t", twin, None)):
        out.mkdir()
        save_file(tensors, out / "model.safetensors")
        (out / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": qc} if qc else {})}))
        for f in d.glob("tokenizer*"):
            (out / f.name).write_bytes(f.read_bytes())
    return root / "q", root / "t"


def test_mxfp4_checkpoint_loads_as_its_dequantized_bf16_twin(tiny_dir, mxfp4_dirs):
    """An MXFP4 checkpoint (experts as *_blocks / *_scales) gives the logits of the model whose experts are
    those MXFP4 values in float: the plan pairs the parts, dequantizes and transposes them to the layout."""
    d, _ = tiny_dir
    q_dir, t_dir = mxfp4_dirs
    q_llm, t_llm = attnzoo.load_model(q_dir, page_size=4), attnzoo.load_model(t_dir, page_size=4)
    assert "mxfp4" in q_llm.info()["weights"]["format"]
    assert "dequantized" in q_llm.info()["weights"]["gemm"]
    prompt = random_prompts(VOCAB, [9])[0]
    assert torch.equal(q_llm.logits(prompt), t_llm.logits(prompt))
    assert (q_llm.logits(prompt) - attnzoo.load_model(d, page_size=4).logits(prompt)).abs().max() > 1e-3


def test_mxfp4_experts_kept_as_stored_decode_as_dequantized(mxfp4_dirs, monkeypatch):
    """fp8_weights="mxfp4" keeps the experts as the checkpoint's bytes (uint8 + E8M0 scales): the torch
    reference (which dequantizes per expert) gives the dequantized model's logits exactly, and the fused MoE's
    MXFP4 GEMM (Triton interpreter, Triton attention) its greedy tokens."""
    from attnzoo.errors import ModelLoadError
    from attnzoo.layers import fused
    from attnzoo.layers.moe import MXFP4, fused_moe
    from attnzoo.layers.moe import layer as moe_layer

    q_dir, t_dir = mxfp4_dirs
    prompts = random_prompts(VOCAB, [9], seed=4)
    ref = attnzoo.load_model(q_dir, page_size=4).generate(prompts, max_new_tokens=4, ignore_eos=True,
                                                          return_logits=True)[0]
    kept = attnzoo.load_model(q_dir, page_size=4, fp8_weights="mxfp4")
    experts = kept.model.model.layers[0].mlp.experts
    assert experts.quant == "mxfp4" and experts.w13.dtype == MXFP4 and experts.w2_scale_inv.dtype == MXFP4
    assert "kept as stored" in kept.info()["weights"]["gemm"]
    assert torch.equal(kept.logits(prompts[0]), attnzoo.load_model(t_dir, page_size=4).logits(prompts[0]))
    tri = attnzoo.load_model(q_dir, page_size=4, fp8_weights="mxfp4", backend="triton")
    seen = []  # the weight dtypes the fused MoE was called with
    monkeypatch.setattr(moe_layer, "fused_moe",
                        lambda x, w13, *a, **kw: seen.append(w13.dtype) or fused_moe(x, w13, *a, **kw))
    with fused.use("triton"):
        got = tri.generate(prompts, max_new_tokens=4, ignore_eos=True, return_logits=True)[0]
    assert seen and set(seen) == {MXFP4}
    assert got.token_ids == ref.token_ids
    torch.testing.assert_close(got.logits, ref.logits, rtol=0, atol=1e-3)
    with pytest.raises(ModelLoadError, match="checkpoint is not MXFP4"):
        attnzoo.load_model(t_dir, page_size=4, fp8_weights="mxfp4")


# ---------------------------------------------------------------- tensor parallel, backend choice


def test_tp2_equals_tp1(tiny_dir):
    """TP 2 on CPU (gloo; this process is rank 0 and spawns rank 1): heads, KV heads and sinks split by
    head, experts two per rank (expert parallel), against TP 1."""
    d, _ = tiny_dir
    opts = dict(device="cpu", backend="torch", page_size=4, kv_cache_tokens=256)
    prompts = random_prompts(VOCAB, [5, 13], seed=3)

    def run(llm):
        outs = llm.generate(prompts, max_new_tokens=6, ignore_eos=True, return_logits=True)
        return [o.token_ids for o in outs], [o.logits for o in outs]

    ref_tokens, ref_logits = run(attnzoo.load_model(d, **opts))
    llm = attnzoo.load_model(d, tensor_parallel_size=2, **opts)
    try:
        assert llm.info()["decision"]["profile"]["num_heads"] == 2
        tokens, logits = run(llm)
    finally:
        llm.close()
    assert tokens == ref_tokens
    for a, b in zip(ref_logits, logits):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


def test_explicit_backend_without_sinks_is_refused(tiny_dir):
    from attnzoo.errors import BackendError

    d, _ = tiny_dir
    with pytest.raises(BackendError, match=r"does not support attention sinks.*backends that do: torch, triton"):
        attnzoo.load_model(d, backend="flashinfer")


def test_triton_backend_greedy_equals_torch(tiny_dir):
    """The whole model on the Triton backend (interpreter): sinks and windows in extend and decode."""
    d, _ = tiny_dir
    prompts = random_prompts(VOCAB, [13], seed=5)
    ref = attnzoo.load_model(d, page_size=4).generate(prompts, max_new_tokens=4, ignore_eos=True, return_logits=True)
    got = attnzoo.load_model(d, page_size=4, backend="triton").generate(prompts, max_new_tokens=4, ignore_eos=True,
                                                                       return_logits=True)
    assert got[0].token_ids == ref[0].token_ids
    torch.testing.assert_close(got[0].logits, ref[0].logits, rtol=0, atol=1e-4)


# ---------------------------------------------------------------- the fused MoE with biases and the clamped SwiGLU


def test_moe_biases_and_clamped_swiglu_match_transformers_and_fused():
    """transformers' GptOssExperts is the oracle of the reference path; the Triton path (interpreter on
    CPU) matches the reference, whole and as two expert-parallel shares. Large weights: the clamps bite."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    import test_moe as tm
    from attnzoo.layers.moe import FusedMoE, MoEConfig, fused_moe, moe_reference

    t, k, e, h, i = 9, 2, 4, 32, 16
    cfg = GptOssConfig(num_local_experts=e, hidden_size=h, intermediate_size=i)
    g = torch.Generator().manual_seed(0)
    hf = GptOssExperts(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    ours = FusedMoE(e, h, i, "swiglu_clamped", bias=True, stacked_layout="interleaved_t")
    for name, p in hf.named_parameters():
        ours.load_checkpoint_tensor(name, p.detach())
    x = torch.randn(t, h, generator=g)
    weights, ids = tm.routing(t, k, e, seed=1, device="cpu")
    ref = hf(x, ids, weights)
    got = ours(x, weights, ids)
    assert ((x @ hf.gate_up_proj[0].detach()).abs() > 7).any()  # the clamps bite
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    kw = dict(act="swiglu_clamped", w13_bias=ours.w13_bias.detach(), w2_bias=ours.w2_bias.detach())
    w13, w2 = ours.w13.detach(), ours.w2.detach()
    ref = moe_reference(x, w13, w2, weights, ids, **kw)
    fused = fused_moe(x, w13, w2, weights, ids, config=MoEConfig(16, 16, 16), **kw)
    assert tm.rel_err(fused, ref) < 1e-5
    halves = sum(fused_moe(x, w13[s], w2[s], weights, ids, expert_start=s.start, holds_all_experts=False,
                           config=MoEConfig(16, 16, 16), act="swiglu_clamped", w13_bias=kw["w13_bias"][s],
                           w2_bias=kw["w2_bias"][s]) for s in (slice(0, 2), slice(2, 4)))
    assert tm.rel_err(halves, ref) < 1e-5


def test_benchmark_shape_is_gpt_oss_20b(e2e):
    from attnzoo.policy.profile import profile_from_config

    config, _ = e2e.make_config("gpt-oss-20b", None)
    assert config.architectures == ["GptOssForCausalLM"] and config.num_hidden_layers == 24
    assert (config.num_local_experts, config.num_experts_per_tok, config.sliding_window) == (32, 4, 128)
    assert config.layer_types[:2] == ["sliding_attention", "full_attention"]
    prof = profile_from_config(config)
    assert prof.uses_sinks and prof.uses_sliding_window and prof.num_heads == 64 and prof.num_kv_heads == {8}


# ---------------------------------------------------------------- GPU: every backend that declares sinks


def _sinks_params():
    from attnzoo.attention.backends.capabilities import sinks_backends

    for name in sinks_backends():
        if name != "torch":
            for mode in ("decode", "extend"):
                for window in (None, 48):
                    yield pytest.param(name, mode, window, id=f"{name}-{mode}-{'window' if window else 'full'}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,mode,window", list(_sinks_params()))
def test_gpu_sinks_backends_match_torch(name, mode, window):
    """gpt-oss-like layers (64 heads of 64 over 8 KV heads, sinks, a window or none) on each backend whose
    declared kernel for this phase on this GPU takes sinks, against the torch backend on the same pages."""
    from attnzoo.attention.backends import capabilities_of, get_backend_class
    from attnzoo.attention.backends.capabilities import Shape
    from attnzoo.attention.backends.gpus import gpu_of
    from attnzoo.attention.backends.torch_ref import TorchBackend
    from attnzoo.attention.kv_cache import KVPool
    from attnzoo.attention.layer import Attention
    from attnzoo.attention.metadata import ForwardMode, build_metadata

    if capabilities_of(name).module:
        pytest.importorskip(capabilities_of(name).module)
    dev, dt, ps = torch.device("cuda"), torch.bfloat16, 16
    layer = Attention(0, 64, 8, 64, sliding_window=window, sinks=True).to(dev)
    phase = "decode" if mode == "decode" else "prefill"
    chk = capabilities_of(name).check(phase, Shape.of_layer(layer), gpu=gpu_of(torch.cuda.get_device_capability()))
    if not chk.ok:
        pytest.skip(f"{name} {phase} here: {'; '.join(chk.violations)}")
    with torch.no_grad():
        layer.sinks.copy_(torch.randn(64, device=dev) * 2)
    prefix, q_lens = ([0, 16, 130, 299], [1] * 4) if mode == "decode" else ([0, 19, 64], [37, 5, 90])
    seq = [p + q for p, q in zip(prefix, q_lens)]
    need = [-(-s // ps) for s in seq]
    pool = KVPool([layer.kv_cache_spec()], num_pages=sum(need) + 3, page_size=ps, dtype=dt, device=dev)
    pool.buffer.view(dt).normal_()
    order = (torch.randperm(sum(need) + 2) + 1).tolist()
    tables = [order[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(need))]
    meta = build_metadata(prefix_lens=prefix, q_lens=q_lens, block_tables=tables, page_size=ps, device=dev,
                          mode=ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND)
    q = torch.randn(sum(q_lens), 64, 64, device=dev, dtype=dt)

    def run(backend):
        plan = backend.prepare(meta)
        return (backend.decode if mode == "decode" else backend.extend)(layer, q, meta, plan).float()

    ref = run(TorchBackend(pool))
    out = run(get_backend_class(name)(pool))
    assert not out.isnan().any()
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-2
    plain = layer.sinks
    layer.sinks = None  # without the sinks the answer moves: they were tested
    try:
        assert ((run(TorchBackend(pool)) - ref).norm() / ref.norm()).item() > 5e-2
    finally:
        layer.sinks = plain


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_policy_backends_decode_as_torch(tiny_dir):
    """The tiny model on the GPU in float32 with the policy's backends (and triton) decodes as torch does."""
    from helpers import assert_greedy_close

    d, _ = tiny_dir
    prompts = random_prompts(VOCAB, [5, 21, 40], seed=7)
    ref = attnzoo.load_model(d, device="cuda", dtype="float32", backend="torch").generate(
        prompts, max_new_tokens=12, ignore_eos=True, return_logits=True)
    for backend in (None, "triton"):
        llm = attnzoo.load_model(d, device="cuda", dtype="float32", backend=backend)
        out = llm.generate(prompts, max_new_tokens=12, ignore_eos=True, return_logits=True)
        assert_greedy_close(out, ref, 1e-3, label=f"backend {backend or llm.decision.decode_backend}")
