"""DeepSeek-V2/V3 (MLA, MoE) on CPU against transformers, and the absorbed MLA form against the expanded one."""
import pytest
import torch
from safetensors.torch import save_file
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

import attnzoo
from attnzoo.attention.backends import backend_names
from attnzoo.attention.backends.torch_ref import TorchBackend
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.layer import ForwardContext
from attnzoo.attention.metadata import ForwardMode, build_metadata
from attnzoo.attention.mla import MLAAttention, absorb_query, latent_to_values, split_kv_b
from attnzoo.attention.reference import attention_reference, gather_kv
from attnzoo.errors import ModelLoadError, WeightError
from attnzoo.layers.moe import FusedMoE, fused_moe
from attnzoo.models.deepseek_v2 import DeepseekV3ForCausalLM as DeepseekV3ForCausalLM_ours
from helpers import assert_matches_hf, random_prompts, save_checkpoint

VOCAB = 160
# The parity tests are CPU tests (float32 against transformers on CPU); the triton one also runs on a GPU.
GPU = torch.cuda.is_available()
# V2-Lite's YaRN: mscale == mscale_all_dim, so cos/sin stay unscaled and only the softmax scale grows.
YARN_V2 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
           "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
# mscale != mscale_all_dim: YaRN scales cos/sin (attention factor) and the softmax scale differently.
YARN_V3 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
           "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
              num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256)


def _sharpen_routing(hf, seed=1):
    """The default init (std 0.02) makes router scores nearly equal, so float rounding could flip a
    choice between two implementations; wide router weights (and a real correction bias) keep every
    choice decisive."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in hf.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None:
                continue
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) * 0.5)
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(torch.rand(gate.weight.shape[0], generator=g) * 0.6 - 0.3)
    return hf


def tiny_v2(**kw):
    cfg = DeepseekV2Config(**{**COMMON, "n_shared_experts": 2, **kw})
    torch.manual_seed(0)
    return _sharpen_routing(DeepseekV2ForCausalLM(cfg).eval())


def tiny_v3(**kw):
    cfg = DeepseekV3Config(**{**COMMON, "n_shared_experts": 1, "q_lora_rank": 24, "n_group": 4, "topk_group": 2,
                              "routed_scaling_factor": 2.5, "rope_parameters": YARN_V3, **kw})
    torch.manual_seed(0)
    return _sharpen_routing(DeepseekV3ForCausalLM(cfg).eval())


MODELS = {
    # V2-Lite-like: no q low-rank path, group-limited greedy routing, plain RoPE.
    "v2-noqlora-grouped": (lambda: tiny_v2(q_lora_rank=None, topk_method="group_limited_greedy", n_group=4,
                                           topk_group=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), 16),
    # V2 with q_lora, greedy routing, YaRN, biases on the attention and dense/shared MLPs.
    "v2-qlora-greedy-yarn": (lambda: tiny_v2(q_lora_rank=24, topk_method="greedy", routed_scaling_factor=1.5,
                                             rope_parameters=YARN_V2, attention_bias=True, mlp_bias=True), 1),
    # V3-like: sigmoid routing with correction bias, n_group 4 / topk_group 2, YaRN, interleaved RoPE.
    "v3-sigmoid-yarn": (lambda: tiny_v3(), 64),
    # V3 with rotate-half RoPE (rope_interleave False), no q_lora, no renormalisation of the top-k weights.
    "v3-rotate-half": (lambda: tiny_v3(rope_interleave=False, q_lora_rank=None, norm_topk_prob=False), 16),
}


def _count_expert_calls(llm) -> dict[str, int]:
    """Per (layer, expert), how many tokens were routed to it."""
    counts = {}
    for name, mod in llm.model.named_modules():
        if isinstance(mod, FusedMoE):
            for e in range(mod.num_experts):
                counts[f"{name}.{e}"] = 0

            def record(m, args, n=name):
                for e in args[2].flatten().tolist():
                    counts[f"{n}.{e}"] += 1
            mod.register_forward_pre_hook(record)
    return counts


@pytest.mark.parametrize("name", MODELS)
def test_matches_transformers(tmp_path, name):
    build, page_size = MODELS[name]
    hf = build()
    save_checkpoint(hf, tmp_path)
    llm = attnzoo.load_model(tmp_path, page_size=page_size, backend="torch", device="cpu")
    calls = _count_expert_calls(llm)
    assert_matches_hf(llm, hf, random_prompts(VOCAB, [7, 21]), steps=32)
    unused = [n for n, c in calls.items() if c == 0]
    assert calls and not unused, f"experts never routed to: {unused}"


def test_triton_matches_transformers(tmp_path):
    if "triton" not in backend_names():
        pytest.skip("the triton backend is not registered in attnzoo/attention/backends/__init__.py")
    hf = tiny_v3(num_hidden_layers=2)
    save_checkpoint(hf, tmp_path)
    # float32 on the GPU too: the check is against transformers' float32 logits.
    llm = attnzoo.load_model(tmp_path, page_size=16, backend="triton", device="cuda" if GPU else "cpu", dtype="float32")
    assert llm.info()["decode_backend"] == "triton"
    assert_matches_hf(llm, hf, random_prompts(VOCAB, [7, 21]), steps=32)


def test_absorptions_on_the_skinny_kernel_match_transformers(tmp_path, monkeypatch):
    # MLA's two per-head products at decode's few rows take skinny.batched (W_UK read along N, W_UV along K; the
    # query's into its buffer's slot): the same greedy tokens as transformers
    from attnzoo.layers import skinny, skinny_kernels

    hf = tiny_v2(q_lora_rank=None, num_hidden_layers=2)
    save_checkpoint(hf, tmp_path)
    llm = attnzoo.load_model(tmp_path, page_size=16, backend="torch", device="cuda" if GPU else "cpu", dtype="float32")
    calls = []
    kernel = skinny_kernels.batched
    monkeypatch.setattr(skinny_kernels, "batched", lambda *a, **k: calls.append(a[1].stride()) or kernel(*a, **k))
    with skinny.use(True):
        assert_matches_hf(llm, hf, random_prompts(VOCAB, [7, 5]), steps=6)
    assert {s[1] == 1 for s in calls} == {True, False}  # both absorptions ran on the kernel


def test_triton_cascade_extend_matches_plain(tmp_path, monkeypatch):
    """MLA extend steps after a cached shared prefix, through the engine (prompt tails in chunks beside decode
    rows): the prefix as GEMMs for every new token, then the extend kernel over each request's own keys (forced:
    chosen on GPUs at thousands of rows), give the tokens and logits of the same backend without it."""
    from attnzoo.attention.kernels import extend as ext

    save_checkpoint(tiny_v2(q_lora_rank=None, num_hidden_layers=2), tmp_path)
    kw = dict(page_size=4, backend="triton", device="cuda" if GPU else "cpu", dtype="float32", max_batch_tokens=10)
    ref, llm = attnzoo.load_model(tmp_path, **kw), attnzoo.load_model(tmp_path, **kw)
    ref.engine.graph_extend_tokens = llm.engine.graph_extend_tokens = 0  # extend steps, not token rows, on a GPU
    ref.engine.cascade_extend = False
    llm.engine.cascade_extend, llm.engine.cascade_min_saved_tokens = True, 1
    calls = []
    real = ext.cascade_extend_attention
    monkeypatch.setattr(ext, "gemm_cascade", lambda q, k_cache, *a: k_cache.shape[1] == 1)  # the size rule off
    monkeypatch.setattr(ext, "cascade_extend_attention",
                        lambda *a, **k: calls.append(k["shared_len"]) or real(*a, **k))
    prefix = random_prompts(VOCAB, [21], seed=11)[0]
    prompts = [prefix + p for p in random_prompts(VOCAB, [9, 2, 14, 5, 1], seed=12)]
    a = ref.generate(prompts, max_new_tokens=5, ignore_eos=True, return_logits=True)
    assert not calls
    b = llm.generate(prompts, max_new_tokens=5, ignore_eos=True, return_logits=True)
    assert calls and set(calls) == {20}, f"cascade extend calls: {calls}"  # the prefix's 5 full pages
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    for x, y in zip(a, b):
        assert (x.logits - y.logits).abs().max().item() < 1e-3


@pytest.mark.skipif(GPU, reason="a Triton-interpreter check on CPU tensors; on a GPU the gpu tests run these kernels on CUDA")
def test_fused_moe_equals_per_expert_reference():
    """The fused path (CUDA eager and CUDA graphs; the Triton interpreter here) computes the reference's sum."""
    moe = DeepseekV3ForCausalLM_ours(tiny_v3(num_hidden_layers=2).config).model.layers[1].mlp
    torch.nn.init.normal_(moe.gate.weight, std=0.5)
    torch.nn.init.normal_(moe.experts.w13, std=0.2)
    x = torch.randn(9, 64)
    weights, ids = moe.gate(x)
    e = moe.experts
    torch.testing.assert_close(fused_moe(x, e.w13, e.w2, weights, ids, act="silu"), e(x, weights, ids),
                               rtol=1e-5, atol=1e-6)


def test_chunked_prefill_over_a_cached_prefix_matches_transformers(tmp_path):
    hf = tiny_v3(num_hidden_layers=2)
    save_checkpoint(hf, tmp_path)
    # A 6-token budget splits prompts into chunks: absorbed prefill also runs over a cached prefix.
    llm = attnzoo.load_model(tmp_path, page_size=4, backend="torch", max_batch_tokens=6, device="cpu")
    assert_matches_hf(llm, hf, random_prompts(VOCAB, [7, 21], seed=5), steps=8)


def mla_expanded(q_nope, q_pe, latent, k_pe, w_uk, w_uv, q_positions, *, scale):
    """One sequence, contiguous, in the reference models' expanded form: per-head keys [S, H, nope + rope]
    and values [S, H, v] from the latents, then plain attention (keys at positions 0..S-1)."""
    k_nope = torch.einsum("sr,hnr->shn", latent, w_uk)
    v = torch.einsum("sr,hvr->shv", latent, w_uv)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, w_uk.shape[0], -1)], dim=-1)
    return attention_reference(torch.cat([q_nope, q_pe], dim=-1), k, v, q_positions, scale=scale).to(q_nope.dtype)


def mla_absorbed(q_nope, q_pe, latent, k_pe, w_uk, w_uv, q_positions, *, scale):
    """The same sequence in the absorbed form the attention layer runs (MQA over [latent | k_pe])."""
    q = torch.cat([absorb_query(q_nope, w_uk), q_pe], dim=-1)
    kv = torch.cat([latent, k_pe], dim=-1)[:, None]
    o = attention_reference(q, kv, kv[..., : latent.shape[-1]], q_positions, scale=scale)
    return latent_to_values(o.to(q_nope.dtype), w_uv)


def _mla_step(dtype, seed=0):
    """Random MLA inputs for a 2-request EXTEND step (one with a cached prefix) over a paged pool."""
    heads, rank, nope, rope, vdim, ps = 4, 64, 32, 16, 32, 4
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    core = MLAAttention(0, heads, kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                        v_head_dim=vdim, scale=(nope + rope) ** -0.5)
    pool = KVPool([core.attn.kv_cache_spec()], num_pages=12, page_size=ps, dtype=dtype, device="cpu")
    prefix, new = [5, 0], [4, 7]
    tables = [[3, 7, 1], [9, 2]]
    meta = build_metadata(prefix_lens=prefix, q_lens=new, block_tables=tables, page_size=ps, device="cpu",
                          mode=ForwardMode.EXTEND)
    pre = build_metadata(prefix_lens=[0], q_lens=[5], block_tables=[tables[0]], page_size=ps, device="cpu")
    pool.store(0, pre.slot_mapping, rnd(5, 1, rank + rope), None)
    t = sum(new)
    inputs = dict(q_nope=rnd(t, heads, nope), q_pe=rnd(t, heads, rope), latent=rnd(t, rank), k_pe=rnd(t, rope),
                  kv_b_weight=rnd(heads * (nope + vdim), rank) * rank**-0.5)
    inputs = {k: v.to(dtype) for k, v in inputs.items()}
    return core, pool, meta, inputs


def _run(core, pool, meta, inputs, backend):
    return core(**inputs, ctx=ForwardContext(meta, pool, backend, backend))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_absorbed_and_expanded_agree(dtype, tol):
    """The paged absorbed step (what every backend runs) against both one-sequence forms over the same
    cached context: the reference models' expanded form and the absorbed one."""
    core, pool, meta, inputs = _mla_step(dtype)
    absorbed = _run(core, pool, meta, inputs, TorchBackend(pool))
    assert not torch.isnan(absorbed).any()
    w_uk, w_uv = split_kv_b(inputs["kv_b_weight"], core.num_heads, core.qk_nope_head_dim)
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.q_lens_cpu)):
        rows = slice(start, start + q_len)
        ctx_entries = gather_kv(pool.k(0), meta.block_tables[i, : -(-seq_len // meta.page_size)], seq_len)[:, 0]
        args = (inputs["q_nope"][rows], inputs["q_pe"][rows], ctx_entries[:, :64], ctx_entries[:, 64:], w_uk, w_uv,
                torch.arange(seq_len - q_len, seq_len))
        a = mla_absorbed(*args, scale=core.scale)
        e = mla_expanded(*args, scale=core.scale)
        assert _rel(a, e) <= tol
        assert _rel(absorbed[rows].view_as(e), e) <= tol
        start += q_len


def test_bf16_absorbed_matches_float32():
    core32, pool32, meta32, inputs32 = _mla_step(torch.float32, seed=3)
    core16, pool16, meta16, inputs16 = _mla_step(torch.bfloat16, seed=3)
    ref = _run(core32, pool32, meta32, inputs32, TorchBackend(pool32))
    assert _rel(_run(core16, pool16, meta16, inputs16, TorchBackend(pool16)), ref) <= 1e-2


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dsv3")
    save_checkpoint(tiny_v3(num_hidden_layers=2), d)
    return d


@pytest.mark.parametrize("dtype,elt", [("float32", 4), ("bfloat16", 2)])
def test_kv_bytes_per_token_is_one_latent_entry(v3_dir, dtype, elt):
    llm = attnzoo.load_model(v3_dir, dtype=dtype, backend="torch", device="cpu")
    info = llm.info()
    # (kv_lora_rank + qk_rope_head_dim) x dtype bytes x layers: no per-head keys, no separate values.
    assert info["kv_bytes_per_token"] == (32 + 8) * elt * 2
    assert info["kv_layers_with_memory"] == 2
    assert info["kv_footprint"]["plain_mla_bytes_per_token"] == info["kv_bytes_per_token"]  # V3 is the plain MLA cache
    router = llm.model.model.layers[1].mlp.gate
    # float32 whatever the model dtype: the router scores in float32 without a cast per call.
    assert router.e_score_correction_bias.dtype == torch.float32 and router.weight.dtype == torch.float32
    out = llm.generate([[5, 9, 11, 40]], max_new_tokens=4, ignore_eos=True)[0]
    assert len(out.token_ids) == 4
    assert router.to(torch.float16).e_score_correction_bias.dtype == torch.float32


def test_extra_mtp_layers_are_skipped_and_fp8_is_refused(tmp_path, v3_dir):
    for f in v3_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    # V3 checkpoints carry the multi-token-prediction module as layer num_hidden_layers.
    save_file({"model.layers.2.self_attn.kv_b_proj.weight": torch.zeros(4, 4)}, tmp_path / "mtp.safetensors")
    ref = attnzoo.load_model(v3_dir, backend="torch", device="cpu").logits([5, 9, 11])
    assert torch.equal(attnzoo.load_model(tmp_path, backend="torch", device="cpu").logits([5, 9, 11]), ref)
    save_file({"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1, 1)}, tmp_path / "fp8.safetensors")
    with pytest.raises(WeightError, match="FP8"):
        attnzoo.load_model(tmp_path, backend="torch", device="cpu")


def test_bad_configs_are_clear_errors(tmp_path):
    hf = tiny_v2(q_lora_rank=None, topk_method="greedy", num_hidden_layers=2)
    hf.config.topk_method = "noaux_tc"
    save_checkpoint(hf, tmp_path)
    with pytest.raises(ModelLoadError, match="topk_method"):
        attnzoo.load_model(tmp_path, backend="torch", device="cpu")
