"""DeepSeek-V3.2 sparse attention (NSA): tiny checkpoints against transformers (torch and Triton NSA
backends), dense equivalence with DeepSeek-V3 when top-k covers the context, the Triton indexer and
sparse MLA kernels against the torch reference, MLA KV-layout round trips, and a mixed prefill/decode
configuration whose backends read different layouts."""
import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM

import attnzoo
from attnzoo.attention.backends.torch_ref import TorchBackend
from attnzoo.attention.backends.triton import TritonBackend
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.kv_layout import FP8_BLOCK, KVLayout, LayoutCache, pack, unpack
from attnzoo.attention.metadata import ForwardMode, build_metadata
from attnzoo.attention.nsa import (
    NSAAttention, indexer_scores_reference, nsa_backend, positions_to_slots, select_topk, sparse_mla_reference,
    visible_positions,
)
from attnzoo.errors import BackendError, ModelLoadError
from attnzoo.models.deepseek_v32 import DeepseekV32ForCausalLM as DeepseekV32ForCausalLM_ours
from helpers import assert_matches_hf, random_prompts, save_checkpoint

VOCAB = 160
GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
# mscale != mscale_all_dim: the sparse softmax must carry YaRN's scale correction as dense MLA does.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
              first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
              rope_parameters=YARN, max_position_embeddings=256)
INDEXER = dict(index_topk=6, index_head_dim=16, index_n_heads=8)


def _sharpen(hf, seed=1):
    """Wide router and indexer weights: the default init (std 0.02) leaves router scores nearly equal and
    index scores tiny, so float rounding could decide an expert or a selected token."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in hf.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) * 0.5)
                gate.e_score_correction_bias.copy_(torch.rand(gate.weight.shape[0], generator=g) * 0.6 - 0.3)
            idx = getattr(layer.self_attn, "indexer", None)
            if idx is not None:
                for p in (idx.wq_b.weight, idx.wk.weight, idx.weights_proj.weight, idx.k_norm.bias):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                idx.k_norm.weight.copy_(1 + torch.randn(idx.k_norm.weight.shape, generator=g) * 0.3)
    return hf


def tiny_v32(**kw):
    torch.manual_seed(0)
    return _sharpen(DeepseekV32ForCausalLM(DeepseekV32Config(**{**COMMON, **INDEXER, **kw})).eval())


@pytest.fixture(scope="module")
def v32_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dsv32")
    hf = tiny_v32()
    save_checkpoint(hf, d)
    return d, hf


# ------------------------------------------------------------------------------ against transformers


def test_torch_matches_transformers(v32_dir):
    d, hf = v32_dir
    # A 9-token step budget splits the 21-token prompt, so selection also runs over a cached prefix.
    llm = attnzoo.load_model(d, page_size=4, backend="torch", device="cpu", max_batch_tokens=9)
    # index_topk 6 < prompts of 7 and 21 tokens: the indexer drops tokens in prefill and every decode step.
    assert_matches_hf(llm, hf, random_prompts(VOCAB, [7, 21]), steps=24)


def test_triton_matches_transformers(v32_dir):
    d, hf = v32_dir
    llm = attnzoo.load_model(d, page_size=4, backend="nsa_triton", device=DEVICE, dtype="float32")
    assert llm.info()["decode_backend"] == "nsa_triton"
    assert_matches_hf(llm, hf, random_prompts(VOCAB, [7, 21], seed=3), steps=8)


def test_dense_equivalence_with_deepseek_v3(tmp_path, v32_dir):
    """With index_topk >= the context every visible token is selected: V3.2 is DeepSeek-V3 with the same
    weights. With a small index_topk it is not (the selection matters)."""
    _, hf32 = v32_dir
    v3_cfg = DeepseekV3Config(**COMMON, rope_interleave=True)
    hf3 = DeepseekV3ForCausalLM(v3_cfg).eval()
    missing, unexpected = hf3.load_state_dict(hf32.state_dict(), strict=False)
    assert not missing and all(".indexer." in k for k in unexpected)
    save_checkpoint(hf3, tmp_path / "v3")
    save_checkpoint(tiny_v32(index_topk=64), tmp_path / "dense")
    prompt = random_prompts(VOCAB, [30], seed=7)[0]
    v3 = attnzoo.load_model(tmp_path / "v3", backend="torch", device="cpu").logits(prompt)
    dense = attnzoo.load_model(tmp_path / "dense", backend="torch", device="cpu").logits(prompt)
    assert (dense - v3).abs().max().item() <= 1e-5
    sparse = attnzoo.load_model(v32_dir[0], backend="torch", device="cpu").logits(prompt)
    assert (sparse[:6] - v3[:6]).abs().max().item() <= 1e-5  # the first 6 tokens see <= 6 tokens: dense
    assert (sparse[6:] - v3[6:]).abs().max().item() > 1e-2


def test_bf16_model_keeps_indexer_weights_in_float32(v32_dir):
    llm = attnzoo.load_model(v32_dir[0], backend="torch", device="cpu", dtype="bfloat16")
    indexer = llm.model.model.layers[0].self_attn.indexer
    assert indexer.weights_proj.weight.dtype == torch.float32 and indexer.wq_b.weight.dtype == torch.bfloat16
    out = llm.generate([random_prompts(VOCAB, [12])[0]], max_new_tokens=4, ignore_eos=True)[0]
    assert len(out.token_ids) == 4
    # Per token and layer: latent + rope (MLA entry) + the indexer key, in the model dtype.
    assert llm.info()["kv_bytes_per_token"] == (32 + 8 + 16) * 2 * 2
    assert indexer.to(torch.float16).weights_proj.weight.dtype == torch.float32


# ------------------------------------------------------------------------------ selection semantics


def _meta(prefix, new, tables, ps, mode=None):
    return build_metadata(prefix_lens=prefix, q_lens=new, block_tables=tables, page_size=ps, device=DEVICE, mode=mode)


def test_select_topk_and_slots():
    scores = torch.tensor([[0.5, 3.0, float("-inf"), float("-inf")], [1.0, -2.0, 4.0, 0.0]])
    assert select_topk(scores, 3).tolist() == [[1, 0, -1], [2, 0, 3]]
    assert select_topk(scores, 9).shape == (2, 4)  # never wider than the longest context
    meta = build_metadata(prefix_lens=[0, 3], q_lens=[2, 1], block_tables=[[5], [7, 2]], page_size=2, device="cpu")
    assert visible_positions(meta).tolist() == [[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, 3]]
    pos = torch.tensor([[1, -1], [0, 1], [3, 0]], dtype=torch.int32)
    assert positions_to_slots(pos, meta).tolist() == [[11, -1], [10, 11], [5, 14]]


def test_indexer_topk_covers_all_visible_tokens_when_topk_is_large():
    torch.manual_seed(0)
    ps, dim = 4, 16
    index_k = torch.randn(8, ps, dim)
    meta = build_metadata(prefix_lens=[5, 0], q_lens=[3, 6], block_tables=[[3, 1], [6, 2]], page_size=ps, device="cpu")
    q, w = torch.randn(9, 4, dim), torch.randn(9, 4)
    scores = indexer_scores_reference(index_k, q, w, meta, scale=dim**-0.5)
    picked = select_topk(scores, 100)
    vis = visible_positions(meta)
    assert [sorted(p for p in r if p >= 0) for r in picked.tolist()] == [[p for p in r if p >= 0] for r in vis.tolist()]


# ------------------------------------------------------------------------------ Triton kernels


def _paged_case(dtype, seed, *, rank=32, rope=16, dim=16):
    """An EXTEND step of 3 requests (two with a cached prefix) over a shuffled paged pool."""
    g = torch.Generator().manual_seed(seed)
    ps, pages = 4, 12
    prefix, new = [9, 0, 3], [4, 6, 1]
    tables = [[5, 2, 9, 11], [1, 7], [4]]
    meta = _meta(prefix, new, tables, ps, mode=ForwardMode.EXTEND)
    entries = (torch.randn(pages * ps, rank + rope, generator=g) * torch.rand(pages * ps, 1, generator=g) * 4)
    index_k = torch.randn(pages, ps, dim, generator=g).to(dtype).to(DEVICE)
    t = sum(new)
    q_idx = torch.randn(t, 5, dim, generator=g).to(dtype).to(DEVICE)
    weights = torch.randn(t, 5, generator=g).to(DEVICE)
    q = torch.randn(t, 4, rank + rope, generator=g).to(dtype).to(DEVICE)
    return meta, entries.to(dtype).to(DEVICE), index_k, q_idx, weights, q


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_index_scores_kernel(dtype, tol):
    from attnzoo.attention.kernels.nsa import index_scores
    from attnzoo.attention.nsa import token_requests

    meta, _, index_k, q, w, _ = _paged_case(dtype, seed=1)
    ref = indexer_scores_reference(index_k, q, w, meta, scale=0.25)
    got = index_scores(q, w, index_k, meta.block_tables, token_requests(meta), meta.positions,
                       width=meta.max_seq_len, scale=0.25)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert _rel(got[fin], ref[fin]) <= tol


@pytest.mark.parametrize("layout,dtype,tol", [
    (KVLayout.BF16, torch.float32, 1e-5),
    (KVLayout.BF16, torch.bfloat16, 1e-2),
    (KVLayout.FP8_NOPE_SCALED_BF16_ROPE, torch.bfloat16, 1e-2),
])
def test_sparse_mla_kernel(layout, dtype, tol):
    from attnzoo.attention.kernels.nsa import sparse_mla

    rank = 32 if layout is not KVLayout.FP8_NOPE_SCALED_BF16_ROPE else 2 * FP8_BLOCK
    meta, entries, _, _, _, q = _paged_case(dtype, seed=2, rank=rank)
    scale = 0.3
    # 5 of each token's visible positions at most, in a random order, padded with -1.
    scores = torch.rand(q.shape[0], meta.max_seq_len, device=DEVICE).masked_fill(visible_positions(meta) < 0, float("-inf"))
    slots = positions_to_slots(select_topk(scores, 5), meta)
    assert (slots < 0).any() and (slots >= 0).any()
    rows = pack(entries, layout, rank=rank)
    # The reference reads what the layout holds: its entries, decoded by the torch conversion.
    held = unpack(rows, layout, rank=rank, rope=16, dtype=torch.float32)
    ref = sparse_mla_reference(held, q, slots, rank=rank, scale=scale)
    got = sparse_mla(q, rows, slots, layout, rank=rank, scale=scale)
    assert not torch.isnan(got).any() and _rel(got, ref) <= tol


# ------------------------------------------------------------------------------ KV layouts


def _fp8_bound(x, rank):
    """|error| allowed for one fp8 rounding: half an ulp of a 3-bit mantissa, or of the subnormal step
    (the latent in blocks of one scale each, the rope part in bf16)."""
    blocks = x[:, :rank].reshape(x.shape[0], -1, FP8_BLOCK).abs().amax(-1) / 448
    floor = torch.cat([blocks.repeat_interleave(FP8_BLOCK, 1) * 2.0**-10, x[:, rank:].abs() * 2.0**-8], 1)
    return torch.cat([x[:, :rank].abs() * 2.0**-4, torch.zeros_like(x[:, rank:])], 1) + floor


def test_layout_round_trip_torch_and_triton():
    from attnzoo.attention.kernels.kv_layout import pack_rows

    layout, rank, rope = KVLayout.FP8_NOPE_SCALED_BF16_ROPE, 2 * FP8_BLOCK, 64
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, rank + rope, generator=g) * torch.logspace(-3, 1.5, 9)[:, None]
    x[3, :FP8_BLOCK] = 0  # an all-zero block: its scale must not divide by zero
    x = x.bfloat16().float()
    rows = pack(x, layout, rank=rank)
    assert rows.dtype == torch.uint8 and rows.shape == (9, layout.row_bytes(rank, rope, torch.bfloat16))
    back = unpack(rows, layout, rank=rank, rope=rope, dtype=torch.float32)
    assert ((back - x).abs() <= _fp8_bound(x, rank)).all()
    assert (back[3, :FP8_BLOCK] == 0).all()

    # The Triton kernel writes the reference's bytes at the given slots.
    x_dev, out = x.to(DEVICE).bfloat16(), torch.full((12, rows.shape[1]), 77, dtype=torch.uint8, device=DEVICE)
    slots = torch.tensor([11, 0, 5, 3, 7, 1, 9, 2, 6], device=DEVICE)
    pack_rows(x_dev, out, layout, rank=rank, slots=slots)
    assert torch.equal(out[slots].cpu(), rows)
    assert (out[[4, 8, 10]] == 77).all()  # other rows untouched

    # NaN stays NaN where it was, in the fp8 latent and the bf16 rope part (the integer rounding carried the
    # GPU's NaN into the sign; the clamp dropped it)
    x_nan = x_dev.clone()
    x_nan[2, 5] = x_nan[6, rank + 3] = float("nan")
    pack_rows(x_nan, out, layout, rank=rank, slots=slots)
    back = unpack(out[slots].cpu(), layout, rank=rank, rope=rope, dtype=torch.float32)
    assert torch.equal(back.isnan(), x_nan.cpu().isnan())


def test_layout_geometry():
    assert KVLayout.FP8_NOPE_SCALED_BF16_ROPE.row_bytes(512, 64, torch.bfloat16) == 656  # FlashMLA's
    assert KVLayout.BF16.row_bytes(512, 64, torch.bfloat16) == 1152
    with pytest.raises(BackendError, match="blocks of 128"):
        KVLayout.FP8_NOPE_SCALED_BF16_ROPE.row_bytes(32, 8, torch.bfloat16)


# ------------------------------------------------------------------------------ backends and layouts


def test_mixed_prefill_and_decode_layouts(tmp_path):
    """Prefill on the torch backend (bf16 layout), decode on nsa_triton_fp8 (FlashMLA fp8 layout): the
    Decision names the conversion, the decode backend's fp8 copy holds every token (those written by
    prefill too), and greedy output equals the unmixed torch run."""
    hf = tiny_v32(kv_lora_rank=FP8_BLOCK, index_topk=5)
    save_checkpoint(hf, tmp_path)
    prompts = random_prompts(VOCAB, [9, 14], seed=11)
    unmixed = attnzoo.load_model(tmp_path, page_size=4, backend="torch", device="cpu")
    mixed = attnzoo.load_model(tmp_path, page_size=4, prefill_backend="torch", decode_backend="nsa_triton_fp8",
                               device=DEVICE, dtype="float32")
    notes = " ".join(mixed.info()["decision"]["notes"])
    assert "prefill (torch) reads KV layout bf16 and decode (nsa_triton_fp8) reads fp8_nope_scaled_bf16_rope" in notes
    assert "converts each token once, when its layer stores it" in notes

    dec = mixed.engine.decode_backend
    seen: dict[int, list[torch.Tensor]] = {}
    store = dec.kv_copy.store
    dec.kv_copy.store = lambda lid, slots, e: (seen.setdefault(lid, []).append(slots.clone()), store(lid, slots, e))[1]
    want = unmixed.generate(prompts, max_new_tokens=10, ignore_eos=True, return_logits=True)
    got = mixed.generate(prompts, max_new_tokens=10, ignore_eos=True, return_logits=True)
    for w, o in zip(want, got):
        assert o.token_ids == w.token_ids
        assert _rel(o.logits, w.logits) <= 5e-2
    assert set(seen) == {0, 1}
    # Converted when stored, whichever backend ran the step: the prefill step's tokens are in the copy.
    assert seen[0][0].numel() == sum(map(len, prompts))
    # The copy holds the pool's entries within fp8 precision, for every token of the run.
    for lid, steps in seen.items():
        slots = torch.cat(steps)
        rows = dec.kv_copy.view(lid).view(-1, dec.kv_copy.view(lid).shape[-1])[slots].cpu()
        entries = mixed.pool.k(lid).view(-1, FP8_BLOCK + 8)[slots].cpu()
        decoded = unpack(rows, KVLayout.FP8_NOPE_SCALED_BF16_ROPE, rank=FP8_BLOCK, rope=8, dtype=torch.float32)
        bound = _fp8_bound(entries, FP8_BLOCK)
        assert ((decoded - entries).abs() <= bound).all()


def test_backends_declare_the_layout_they_read():
    from attnzoo.attention.backends import backend_names, get_backend_class
    from attnzoo.attention.backends import all_capabilities

    CAPABILITIES = all_capabilities()

    nsa_names = [n for n in backend_names() if "nsa" in CAPABILITIES[n].kinds]
    assert {"torch", "nsa_triton", "nsa_triton_fp8"} <= set(nsa_names)
    for name in nsa_names:
        assert get_backend_class(name).mla_kv_layout.value == CAPABILITIES[name].mla_kv_layout, name


def test_bad_backends_and_configs_are_clear_errors(v32_dir, tmp_path):
    d, _ = v32_dir
    pool = KVPool([None], num_pages=2, page_size=1, dtype=torch.float32, device=DEVICE)
    with pytest.raises(BackendError, match="cannot run sparse \\(NSA\\) attention.*nsa_triton"):
        nsa_backend(TritonBackend(pool))
    assert nsa_backend(TorchBackend(pool)).mla_kv_layout is KVLayout.BF16
    # The fp8 FlashMLA layout stores the latent in blocks of 128: a rank-32 model is refused by the policy.
    with pytest.raises(BackendError, match="nsa_triton_fp8.*head dims"):
        attnzoo.load_model(d, decode_backend="nsa_triton_fp8", device="cpu")
    core = NSAAttention(0, 4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, scale=0.2,
                        index_head_dim=16, index_n_heads=4, index_topk=4)
    small = KVPool([core.attn.kv_cache_spec()], num_pages=2, page_size=4, dtype=torch.float32, device="cpu")
    with pytest.raises(BackendError, match="blocks of 128"):
        LayoutCache(small, KVLayout.FP8_NOPE_SCALED_BF16_ROPE)
    cfg = DeepseekV32Config(**{**COMMON, **INDEXER, "mlp_layer_types": ["sparse", "sparse"]})
    with pytest.raises(ModelLoadError, match="mlp_layer_types"):
        DeepseekV32ForCausalLM_ours(cfg)


def test_kv_sizing_leaves_the_fp8_copy_its_share():
    """nsa_triton_fp8 keeps an fp8 copy of the MLA cache beside the pool: a memory budget holds both (on a
    GPU the pool alone took the budget and the copy then ran out of memory); other backends keep none."""
    from attnzoo.attention.backends.hybrid import HybridBackend
    from attnzoo.engine.build import _capture_oom, _kv_pages

    core = NSAAttention(0, 4, kv_lora_rank=FP8_BLOCK, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        scale=0.2, index_head_dim=16, index_n_heads=4, index_topk=4)
    specs = [core.attn.kv_cache_spec()] * 2
    cpu = torch.device("cpu")
    row = KVLayout.FP8_NOPE_SCALED_BF16_ROPE.row_bytes(FP8_BLOCK, 8, torch.float32)
    assert HybridBackend.copy_bytes_per_token("nsa_triton_fp8", "nsa_triton_fp8", specs, torch.float32, cpu) == 2 * row
    assert HybridBackend.copy_bytes_per_token("nsa_triton", "torch", specs, torch.float32, cpu) == 0
    budget, ps = 1 << 20, 4
    pages, _ = _kv_pages(specs, ps, torch.float32, cpu, None, budget, 512, copy_per_token=2 * row)
    pool = KVPool(specs, num_pages=pages, page_size=ps, dtype=torch.float32, device=cpu)
    copy = LayoutCache(pool, KVLayout.FP8_NOPE_SCALED_BF16_ROPE)
    assert budget - (pool.nbytes // pages + copy.nbytes // pages) < pool.nbytes + copy.nbytes <= budget
    assert _kv_pages(specs, ps, torch.float32, cpu, None, budget, 512)[0] > pages  # the pool alone: more pages
    assert "+ 0.50 GiB of the backend's own copy" in str(_capture_oom(pool, 8, True, copy_bytes=1 << 29))


# ------------------------------------------------------------------------------ CUDA graphs


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("backend", ["nsa_triton", "nsa_triton_fp8"])
def test_cuda_graph_decode_matches_eager(tmp_path, backend):
    """Decode through captured graphs (buckets 1, 2, 4, 8; batches of 1, 3 and 7 requests, so padded rows)
    gives the eager path's greedy tokens and logits: the indexer, top-k (index_topk 6 < every context
    after a few steps) and sparse MLA read the step from the static buffers. The graphs are sized beyond
    index_topk, so they select top-k where eager steps of contexts <= 6 take the dense path: the same
    tokens, summed in another order."""
    save_checkpoint(tiny_v32(kv_lora_rank=FP8_BLOCK), tmp_path)
    common = dict(page_size=4, backend=backend, device="cuda", dtype="float32", max_running=8)
    eager = attnzoo.load_model(tmp_path, cuda_graph=False, **common)
    graph = attnzoo.load_model(tmp_path, cuda_graph=True, **common)
    assert graph.engine.graphs is not None and graph.engine.graphs.buckets == [1, 2, 4, 8]
    for lens in ([3], [7, 21, 2], [5, 9, 14, 30, 1, 11, 6]):
        prompts = random_prompts(VOCAB, lens, seed=len(lens))
        graph.engine.graph_stats = dict.fromkeys(graph.engine.graph_stats, 0)
        want = eager.generate(prompts, max_new_tokens=12, ignore_eos=True, return_logits=True)
        got = graph.generate(prompts, max_new_tokens=12, ignore_eos=True, return_logits=True)
        assert graph.engine.graph_stats["replayed"] == 11  # every decode step (the first token: prefill)
        for w, o in zip(want, got):
            assert o.token_ids == w.token_ids
            assert _rel(o.logits, w.logits) <= 1e-4


def test_graph_state_selects_and_attends_as_eager():
    """Under prepare_graph (a padded bucket, request rows from the backend's static buffer, the host
    lengths of capture time: the graph's longest context) the indexer selects the same tokens and sparse
    MLA gives the same output as an eager decode step."""
    from attnzoo.attention.backends.nsa_triton import NSATritonBackend
    from attnzoo.attention.layer import Attention

    g = torch.Generator().manual_seed(5)
    layer = Attention(0, 4, 1, 48, v_head_dim=32, kind="mla", index_head_dim=16)
    pool = KVPool([layer.kv_cache_spec()], num_pages=12, page_size=4, dtype=torch.float32, device=DEVICE)
    pool.buffer.view(torch.float32).copy_(torch.randn(pool.buffer.view(torch.float32).shape, generator=g))
    be = NSATritonBackend(pool)
    be.init_graph_state(max_batch_size=4, max_pages_per_req=4)
    tables, prefix = [[5, 2, 9], [7]], [9, 3]
    q_idx = torch.randn(3, 5, 16, generator=g).to(DEVICE)
    w = torch.randn(3, 5, generator=g).to(DEVICE)
    q = torch.randn(3, 4, 48, generator=g).to(DEVICE)
    kw = dict(topk=4, scale=0.25)

    eager = _meta(prefix, [1, 1], tables, 4, mode=ForwardMode.DECODE)
    plan = be.prepare(eager)
    pos_e = be.nsa_topk(layer, q_idx[:2], w[:2], eager, plan, **kw)
    out_e = be.nsa_sparse_mla(layer, q[:2], pos_e, eager, plan)

    graph = _meta(prefix + [0], [1, 1, 1], tables + [[0]], 4, mode=ForwardMode.DECODE)  # one padding row
    graph.seq_lens_cpu = [16] * 3  # as at capture: the graph's longest context
    plan = be.prepare_graph(graph, capturing=True)
    assert plan.token_reqs.data_ptr() == be._graph_reqs.data_ptr()
    pos_g = be.nsa_topk(layer, q_idx, w, graph, plan, **kw)
    assert pos_g[:2].tolist() == pos_e.tolist() and (pos_g[2, 1:] == -1).all()
    out_g = be.nsa_sparse_mla(layer, q, pos_g, graph, plan)
    assert _rel(out_g[:2], out_e) <= 1e-6
    with pytest.raises(BackendError, match="decode steps only"):
        be.prepare_graph(_meta([0], [3], [[1]], 4), capturing=False)
