"""Cascade decode (a prefix shared by the whole batch read once) against plain decode and the torch reference.

As in test_triton_kernels.py: fresh random inputs per run (the seed is in each failure message), a pool
filled with NaN except the tokens some request owns, outputs poisoned with NaN before the call. The
shared prefix sits in the same pages at the start of every request's table; each request owns its
pages after it.
"""
from __future__ import annotations

import pytest
import torch

from attnzoo.attention.backends.torch_ref import TorchBackend, attention_reference
from attnzoo.attention.kernels import decode as dec
from attnzoo.attention.kernels.decode import cascade_decode_attention, decode_attention
from attnzoo.attention.kernels.decode_launch import choose_num_shared_splits
from attnzoo.attention.kv_cache import KVPool, PageAllocator
from attnzoo.attention.layer import Attention, ForwardContext
from attnzoo.attention.metadata import build_metadata
from attnzoo.errors import BackendError
from test_triton_kernels import DEVICE, TOL, fresh_seed, layer_inputs, rel_err


class SharedPagedKV:
    """``shared_len`` keys in pages every request's table starts with, then each request's own keys."""

    def __init__(self, shared_len, suffix_lens, *, kv_heads, head_dim, v_dim, page_size, dtype, mla, gen):
        ps = page_size
        n_shared = shared_len // ps
        own = [-(-n // ps) for n in suffix_lens]
        num_pages = 1 + n_shared + sum(own) + 1  # page 0 (padding) and one page nobody owns
        self.k_cache = torch.full((num_pages, kv_heads, ps, head_dim), float("nan"), dtype=dtype)
        self.v_cache = (self.k_cache[..., :v_dim] if mla else
                        torch.full((num_pages, kv_heads, ps, v_dim), float("nan"), dtype=dtype))
        order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
        shared_pages, order = order[:n_shared], order[n_shared:]
        self.block_tables = torch.zeros(len(suffix_lens), n_shared + max(own) + 1, dtype=torch.int32)

        def fill(pages, n):  # -> k, v of n new tokens written into pages
            k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
            v = k[..., :v_dim] if mla else torch.randn(n, kv_heads, v_dim, generator=gen).to(dtype)
            pos = torch.arange(n)
            ids = torch.tensor(pages, dtype=torch.long)[pos // ps]
            self.k_cache[ids, :, pos % ps] = k
            if not mla:
                self.v_cache[ids, :, pos % ps] = v
            return k, v

        k0, v0 = fill(shared_pages, shared_len)
        self.k, self.v = [], []
        for i, n in enumerate(suffix_lens):
            mine, order = order[: own[i]], order[own[i]:]
            self.block_tables[i, : n_shared + own[i]] = torch.tensor(shared_pages + mine, dtype=torch.int32)
            k, v = fill(mine, n)
            self.k.append(torch.cat([k0, k]).to(DEVICE))
            self.v.append(torch.cat([v0, v]).to(DEVICE))
        self.k_cache, self.block_tables = self.k_cache.to(DEVICE), self.block_tables.to(DEVICE)
        self.v_cache = self.k_cache[..., :v_dim] if mla else self.v_cache.to(DEVICE)
        self.seq_lens = torch.tensor([shared_len + n for n in suffix_lens], dtype=torch.int32, device=DEVICE)


# name -> (shared_len, suffix_lens, heads, kv_heads, head_dim, v_dim, page_size, softcap, splits,
#          shared_splits, dtype, mla, shared-pass launch config)
# Suffix length 1: the request has only the page being written beyond the prefix.
SMALL_TILES = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
CASES = {
    "mha-d64-ps16": (32, [1, 17, 5], 4, 4, 64, 64, 16, None, 1, 1, torch.bfloat16, False, None),
    "gqa4-d128-ps16-softcap-splits": (48, [1, 20, 16], 8, 2, 128, 128, 16, 30.0, 2, 3, torch.bfloat16, False, None),
    "gqa4-d64-ps1-splits": (37, [1, 3], 8, 2, 64, 64, 1, None, 2, 3, torch.bfloat16, False, None),
    # 5 requests x 4 heads = 20 rows: two row blocks of 16, one straddling requests
    "gqa4-d64-rowblocks-fp16-softcap": (32, [1, 2, 9, 16, 4], 8, 2, 64, 64, 16, 20.0, 1, 2, torch.float16,
                                        False, SMALL_TILES),
    "gqa1-d40-v24-ps16": (16, [1, 30], 4, 4, 40, 24, 16, None, 2, 1, torch.bfloat16, False, None),
    # MLA-like: values are a view of the keys' first 64 channels; 80 = 64 + 16 exercises BLOCK_DR
    "mla-80-64-ps16": (32, [2, 10, 1], 16, 1, 80, 64, 16, None, 2, 2, torch.bfloat16, True, None),
    "fp32-gqa4-d64-ps16": (32, [1, 7], 8, 2, 64, 64, 16, None, 1, 2, torch.float32, False, None),
}


@pytest.mark.parametrize("case", CASES)
def test_cascade_matches_plain_decode_and_reference(case):
    shared_len, suffix, heads, kv_heads, d, dv, ps, cap, splits, shared_splits, dtype, mla, cfg = CASES[case]
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    kv = SharedPagedKV(shared_len, suffix, kv_heads=kv_heads, head_dim=d, v_dim=dv, page_size=ps, dtype=dtype,
                       mla=mla, gen=gen)
    batch = len(suffix)
    q = torch.randn(batch, heads, d, generator=gen).to(dtype).to(DEVICE)
    scale = 0.7 * d**-0.5
    out = torch.full((batch, heads, dv), float("nan"), dtype=dtype, device=DEVICE)
    cascade_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, shared_len=shared_len,
                             scale=scale, logit_softcap=cap, num_kv_splits=splits, num_shared_splits=shared_splits,
                             out=out, launch_config=cfg)
    plain = decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale=scale,
                             logit_softcap=cap, num_kv_splits=2)
    assert not out.isnan().any(), f"NaN (seed {seed})"
    assert rel_err(out, plain) <= TOL[dtype], f"cascade vs plain: {rel_err(out, plain):.2e} (seed {seed})"
    for i in range(batch):
        s = shared_len + suffix[i]
        ref = attention_reference(q[i : i + 1], kv.k[i], kv.v[i], torch.tensor([s - 1]), scale=scale,
                                  logit_softcap=cap)
        err = rel_err(out[i : i + 1], ref)
        assert err <= TOL[dtype], f"request {i} (len {s}): relative error {err:.2e} (seed {seed})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_shared_pass_as_gemms_matches_plain_decode(dtype, monkeypatch):
    # The GEMM shared pass (forced: it is chosen on GPUs at thousands of rows), its scores in chunks of one
    # request (three chunks), against plain decode and the reference.
    from attnzoo.attention.kernels import cascade_gemm

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    shared_len, suffix, heads, d, dv = 32, [2, 10, 1], 16, 80, 64
    kv = SharedPagedKV(shared_len, suffix, kv_heads=1, head_dim=d, v_dim=dv, page_size=16, dtype=dtype, mla=True,
                       gen=gen)
    q = torch.randn(len(suffix), heads, d, generator=gen).to(dtype).to(DEVICE)
    ran = []
    monkeypatch.setattr(dec, "shared_pass_kind", lambda *a, **k: "gemm")
    monkeypatch.setattr(cascade_gemm, "CHUNK_SCORE_BYTES", 4 * shared_len * heads)
    monkeypatch.setattr(cascade_gemm, "_row_softmax", _Counted(cascade_gemm._row_softmax, ran))
    out = cascade_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, shared_len=shared_len,
                                   scale=0.1, num_kv_splits=2)
    assert len(ran) == len(suffix), f"the GEMM pass ran in {len(ran)} chunks"
    plain = decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale=0.1, num_kv_splits=2)
    assert not out.isnan().any() and rel_err(out, plain) <= TOL[dtype], f"{rel_err(out, plain):.2e} (seed {seed})"
    for i, n in enumerate(suffix):
        ref = attention_reference(q[i : i + 1], kv.k[i], kv.v[i], torch.tensor([shared_len + n - 1]), scale=0.1)
        assert rel_err(out[i : i + 1], ref) <= TOL[dtype], f"request {i} (seed {seed})"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mla_gemm_shared_pass_on_the_gpu_at_its_batch():
    # DeepSeek's MLA widths at 260 requests x 16 heads (past MIN_ROWS): chosen without being forced, and equal
    # to the Triton shared pass and to plain decode
    from attnzoo.attention.kernels import cascade_gemm
    from attnzoo.attention.kernels.decode_launch import cascade_launch_config

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    suffix = torch.randint(1, 40, (260,), generator=gen).tolist()
    kv = SharedPagedKV(128, suffix, kv_heads=1, head_dim=576, v_dim=512, page_size=64, dtype=torch.bfloat16,
                       mla=True, gen=gen)
    q = torch.randn(len(suffix), 16, 576, generator=gen).to(torch.bfloat16).to(DEVICE)
    assert dec.shared_pass_kind(q, kv.k_cache, kv.v_cache, 128, None) == "gemm"
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    ran = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cascade_gemm, "_row_softmax", _Counted(cascade_gemm._row_softmax, ran))
        out = cascade_decode_attention(*args, shared_len=128, scale=0.04, num_kv_splits=1)
    assert ran, "the GEMM pass did not run"
    tiled = cascade_decode_attention(*args, shared_len=128, scale=0.04, num_kv_splits=1,
                                     launch_config=cascade_launch_config(576, 512, torch.bfloat16))
    plain = decode_attention(*args, scale=0.04, num_kv_splits=2)
    for name, other in (("triton shared pass", tiled), ("plain decode", plain)):
        assert rel_err(out, other) <= 1e-2, f"vs {name}: {rel_err(out, other):.2e} (seed {seed})"


# (own cached tokens after the shared prefix, new tokens) per request: none cached, a part page, past a page
EXTEND_REQS = [(0, 5), (7, 1), (19, 12)]


@pytest.mark.parametrize("dtype,sinks", [(torch.bfloat16, False), (torch.float32, False), (torch.float32, True)])
def test_mla_cascade_extend_matches_plain_extend(dtype, sinks, monkeypatch):
    # An extend step after a shared cached prefix: the prefix as GEMMs for every token (forced: chosen on GPUs at
    # thousands of rows), in chunks of four tokens, then the extend kernel over each request's own keys and the
    # merge; against the plain extend kernel and the reference.
    from attnzoo.attention.kernels import cascade_gemm
    from attnzoo.attention.kernels import extend as ext

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    shared_len, heads, d, dv = 32, 16, 80, 64
    kv = SharedPagedKV(shared_len, [c + n for c, n in EXTEND_REQS], kv_heads=1, head_dim=d, v_dim=dv, page_size=16,
                       dtype=dtype, mla=True, gen=gen)
    new = [n for _, n in EXTEND_REQS]
    q = torch.randn(sum(new), heads, d, generator=gen).to(dtype).to(DEVICE)
    indptr = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    prefix = torch.tensor([shared_len + c for c, _ in EXTEND_REQS], dtype=torch.int32, device=DEVICE)
    sink = torch.randn(heads, generator=gen).to(DEVICE) if sinks else None
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, indptr, prefix)
    ran = []
    monkeypatch.setattr(cascade_gemm, "CHUNK_SCORE_BYTES", 4 * 4 * shared_len * heads)
    monkeypatch.setattr(cascade_gemm, "_row_softmax", _Counted(cascade_gemm._row_softmax, ran))
    out = torch.full((sum(new), heads, dv), float("nan"), dtype=dtype, device=DEVICE)
    ext.cascade_extend_attention(*args, shared_len=shared_len, max_q_len=max(new), scale=0.1, sinks=sink, out=out)
    assert len(ran) == -(-sum(new) // 4), f"the GEMM pass ran in {len(ran)} chunks"
    plain = ext.extend_attention(*args, max_q_len=max(new), scale=0.1, sinks=sink)
    assert not out.isnan().any(), f"NaN (seed {seed})"
    assert rel_err(out, plain) <= TOL[dtype], f"cascade vs plain: {rel_err(out, plain):.2e} (seed {seed})"
    row = 0
    for i, (c, n) in enumerate(EXTEND_REQS):
        pos = torch.arange(shared_len + c, shared_len + c + n)
        ref = attention_reference(q[row : row + n], kv.k[i], kv.v[i], pos, scale=0.1, sinks=sink)
        err = rel_err(out[row : row + n], ref)
        assert err <= TOL[dtype], f"request {i}: relative error {err:.2e} (seed {seed})"
        row += n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mla_cascade_extend_on_the_gpu_at_its_size():
    # DeepSeek's MLA widths, 40 requests of 1-20 new tokens after 1-70 own cached ones, 16 heads: chosen without
    # being forced at >= EXTEND_MIN_ROWS rows, and equal to the plain extend kernel
    from attnzoo.attention.kernels import cascade_gemm
    from attnzoo.attention.kernels import extend as ext

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    own = torch.randint(1, 70, (40,), generator=gen).tolist()
    new = torch.randint(1, 20, (40,), generator=gen).tolist()
    new[0] = cascade_gemm.EXTEND_MIN_ROWS // 16  # enough rows on its own
    kv = SharedPagedKV(128, [c + n for c, n in zip(own, new)], kv_heads=1, head_dim=576, v_dim=512, page_size=64,
                       dtype=torch.bfloat16, mla=True, gen=gen)
    q = torch.randn(sum(new), 16, 576, generator=gen).to(torch.bfloat16).to(DEVICE)
    indptr = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    prefix = torch.tensor([128 + c for c in own], dtype=torch.int32, device=DEVICE)
    assert ext.gemm_cascade(q, kv.k_cache, kv.v_cache, 128, None)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, indptr, prefix)
    out = ext.cascade_extend_attention(*args, shared_len=128, max_q_len=max(new), scale=0.04)
    plain = ext.extend_attention(*args, max_q_len=max(new), scale=0.04)
    assert not out.isnan().any() and rel_err(out, plain) <= 1e-2, f"{rel_err(out, plain):.2e} (seed {seed})"


def test_backend_extend_step_cascades_mla_layers(monkeypatch):
    # An extend step whose requests share 32 cached tokens, through the attention layers: the MLA layer takes
    # the cascade (its choice forced off a GPU), the others the plain kernel; all equal the torch backend.
    from attnzoo.attention.backends.triton import TritonBackend
    from attnzoo.attention.kernels import extend as ext

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16
    layers = [Attention(0, 16, 1, 48, v_head_dim=32, kind="mla"), Attention(1, 8, 2, 64),
              Attention(2, 16, 1, 48, v_head_dim=32, kind="mla", sliding_window=20)]
    pools = [KVPool([layer.kv_cache_spec() for layer in layers], num_pages=16, page_size=16, dtype=dtype,
                    device=DEVICE) for _ in range(2)]
    pools[0].buffer.view(dtype).copy_(torch.randn(pools[0].buffer.view(dtype).shape, generator=gen))
    pools[1].buffer.copy_(pools[0].buffer)
    backends = [TorchBackend(pools[0]), TritonBackend(pools[1])]
    # the claim: a GPU pool with a layer cascade_gemm.layer_qualifies (not these narrow test widths); the
    # layers below are called directly, with the per-layer choice forced
    assert not backends[1].supports_cascade_extend
    wide = Attention(0, 16, 1, 576, v_head_dim=512, kind="mla")
    wide_pool = KVPool([wide.kv_cache_spec()], num_pages=2, page_size=16, dtype=dtype, device=DEVICE)
    assert TritonBackend(wide_pool).supports_cascade_extend == (DEVICE.type == "cuda")
    alloc = PageAllocator(pools[0].num_pages)
    shared = alloc.alloc(2)
    tables = [shared + alloc.alloc(2), shared + alloc.alloc(1), shared + alloc.alloc(2)]
    prefix_lens, q_lens = [32, 40, 45], [6, 3, 2]
    metas = [build_metadata(prefix_lens=prefix_lens, q_lens=q_lens, block_tables=tables, page_size=16,
                            device=DEVICE, detect_shared_prefix=True) for _ in backends]
    assert metas[1].shared_prefix_len == 32 and not metas[1].is_decode
    calls = []
    real = ext.cascade_extend_attention
    monkeypatch.setattr(ext, "gemm_cascade", lambda q, k_cache, *a: k_cache.shape[1] == 1)  # the size rule off
    monkeypatch.setattr(ext, "cascade_extend_attention",
                        lambda *a, **kw: calls.append(kw["shared_len"]) or real(*a, **kw))
    for layer in layers:
        q, k, v = layer_inputs(layer, sum(q_lens), gen, dtype)
        ref, out = (layer(q, k, v, ForwardContext(meta, pool, be, be))
                    for be, meta, pool in zip(backends, metas, pools))
        err = rel_err(out, ref)
        assert not out.isnan().any() and err <= 1e-2, f"layer {layer.layer_id}: rel err {err:.2e} (seed {seed})"
    assert calls == [32], "the MLA layer cascades; the MHA layer and the windowed MLA layer do not"


def test_cascade_extend_is_chosen_for_mla_only_and_rejects_what_it_cannot_run():
    from attnzoo.attention.kernels import cascade_gemm
    from attnzoo.attention.kernels import extend as ext

    cache = torch.empty(4, 1, 16, 576, dtype=torch.bfloat16)  # real storage: the values' pointer is compared
    big = torch.empty(cascade_gemm.EXTEND_MIN_ROWS // 16, 16, 576, dtype=torch.bfloat16, device="meta")
    with pytest.MonkeyPatch.context() as mp:  # the decision's other conditions, off a GPU
        mp.setattr(torch.Tensor, "is_cuda", property(lambda x: True))
        assert ext.gemm_cascade(big, cache, cache[..., :512], 64, None)
        assert not ext.gemm_cascade(big[:-1], cache, cache[..., :512], 64, None)  # too few rows
        assert not ext.gemm_cascade(big, cache, torch.empty_like(cache)[..., :512], 64, None)  # values apart
        assert not ext.gemm_cascade(big, cache, cache[..., :512], cascade_gemm.MAX_SHARED_LEN + 16, None)
    # what the backend checks once per pool: 16-bit, an unscaled cache of the model's dtype, MLA widths
    bf16, f32 = torch.bfloat16, torch.float32
    assert cascade_gemm.layer_qualifies(bf16, bf16, 576, 1, True)
    assert not cascade_gemm.layer_qualifies(bf16, torch.float8_e4m3fn, 576, 1, True)  # an fp8 cache
    assert not cascade_gemm.layer_qualifies(f32, f32, 576, 1, True)
    assert not cascade_gemm.layer_qualifies(bf16, bf16, 576, 1, True, k_scale=0.5)
    assert not cascade_gemm.layer_qualifies(bf16, bf16, 192, 1, True)  # narrow: the Triton passes
    assert not cascade_gemm.layer_qualifies(bf16, bf16, 576, 2, False)  # not MLA
    gen = torch.Generator().manual_seed(0)
    kv = SharedPagedKV(32, [3, 2], kv_heads=2, head_dim=64, v_dim=64, page_size=16, dtype=torch.float32,
                       mla=False, gen=gen)
    q = torch.randn(2, 4, 64, device=DEVICE)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
            torch.tensor([34, 33], dtype=torch.int32, device=DEVICE))
    with pytest.raises(BackendError, match="MLA layers only"):
        ext.cascade_extend_attention(*args, shared_len=32, max_q_len=1, scale=1.0)
    for bad in (0, 8, 16 * 99):
        with pytest.raises(BackendError, match="whole pages"):
            ext.cascade_extend_attention(*args, shared_len=bad, max_q_len=1, scale=1.0)
    mla = SharedPagedKV(32, [3, 2], kv_heads=1, head_dim=80, v_dim=64, page_size=16, dtype=torch.float32,
                        mla=True, gen=gen)
    with pytest.raises(BackendError, match="longer than the GEMM pass"):
        ext.cascade_extend_attention(torch.randn(2, 4, 80, device=DEVICE), mla.k_cache, mla.v_cache,
                                     torch.zeros(2, 1000, dtype=torch.int32, device=DEVICE), *args[4:],
                                     shared_len=16 * 999, max_q_len=1, scale=1.0)


def test_warm_up_compiles_the_gemm_cascade_per_layer_shape_without_writing_the_cache(monkeypatch):
    # A server's warm-up has two short prompts; the GEMM paths are chosen from thousands of rows. warm_up_cascade
    # runs them once per prefix length class of the row softmax, reading only the padding page.
    from attnzoo.attention.backends.triton import TritonBackend
    from attnzoo.attention.kernels import cascade_gemm
    from attnzoo.attention.kernels import extend as ext

    mla = Attention(0, 4, 1, 320, v_head_dim=256, kind="mla")  # the narrowest qualifying width: quick here
    pool = KVPool([mla.kv_cache_spec()], num_pages=4, page_size=64, dtype=torch.bfloat16, device=DEVICE)
    pool.k(0).fill_(float("nan"))  # requests' pages: NaN; only the padding page may be read
    pool.k(0)[0].normal_()
    before = pool.buffer.clone()
    blocks, outs = [], []
    real = ext.cascade_extend_attention
    monkeypatch.setattr(cascade_gemm, "_row_softmax", _Counted(cascade_gemm._row_softmax, blocks))
    monkeypatch.setattr(ext, "cascade_extend_attention", lambda *a, **k: outs.append(real(*a, **k)) or outs[-1])
    calls = ext.warm_up_cascade(pool.k(0), pool.v(0), 4, scale=0.1)
    assert calls == 8 and len(blocks) == 8, "prefixes of 64, 128, ..., 8192 tokens"
    assert all(o.isfinite().all() for o in outs), "the warm-up read a page other than the padding page"
    assert torch.equal(pool.buffer.view(torch.bfloat16).nan_to_num(), before.view(torch.bfloat16).nan_to_num()), \
        "the warm-up wrote into the cache"
    monkeypatch.setattr(ext, "cascade_extend_attention", real)
    narrow = KVPool([Attention(0, 4, 1, 48, v_head_dim=32, kind="mla").kv_cache_spec()], num_pages=2, page_size=16,
                    dtype=torch.bfloat16, device=DEVICE)
    assert ext.warm_up_cascade(narrow.k(0), narrow.v(0), 4, scale=0.1) == 0  # the Triton passes serve it
    # the backend: once per layer shape, not for windowed layers, nothing where no layer qualifies
    seen = []
    monkeypatch.setattr(ext, "warm_up_cascade", lambda k, v, heads, **kw: seen.append(heads) or 1)
    layers = [Attention(0, 8, 1, 320, v_head_dim=256, kind="mla", sliding_window=8),
              Attention(1, 2, 1, 320, v_head_dim=256, kind="mla", logit_softcap=30.0),
              Attention(2, 4, 1, 320, v_head_dim=256, kind="mla"), Attention(3, 4, 1, 320, v_head_dim=256, kind="mla")]
    big = KVPool([layer.kv_cache_spec() for layer in layers], num_pages=4, page_size=64, dtype=torch.bfloat16,
                 device=DEVICE)
    backend = TritonBackend(big)
    backend.supports_cascade_extend = True  # what a GPU pool of these layers claims
    backend.warm_up(layers)
    assert seen == [4], "windowed and softcapped layers never cascade; one call a layer shape"
    backend.supports_cascade_extend = False
    backend.warm_up(layers)
    assert seen == [4]


class _Counted:
    """A Triton kernel whose launches (``kernel[grid](...)``) are recorded."""

    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        self.log.append(grid)
        return self.kernel[grid]


def test_the_gemm_shared_pass_is_chosen_for_mla_at_a_large_batch_only():
    from attnzoo.attention.kernels import cascade_gemm

    cache = torch.empty(4, 1, 16, 576, dtype=torch.bfloat16, device="meta")
    values = cache[..., :512]
    rows = cascade_gemm.MIN_ROWS // 16
    big, small = (torch.empty(n, 16, 576, dtype=torch.bfloat16, device="meta") for n in (rows, rows - 1))
    is_cuda = lambda x: True  # noqa: E731 (the decision's other conditions, off a GPU)
    for q in (big, small):
        assert dec.shared_pass_kind(q, cache, values, 1312, None) == "triton"  # not on a GPU
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "is_cuda", property(is_cuda))
        assert dec.shared_pass_kind(big, cache, values, 1312, None) == "gemm"
        assert dec.shared_pass_kind(small, cache, values, 1312, None) == "triton"  # too few rows
        mp.setattr(cascade_gemm, "MIN_ROWS", cascade_gemm.MIN_ROWS - 16)  # read at the call (benchmark drivers)
        assert dec.shared_pass_kind(small, cache, values, 1312, None) == "gemm"
        mp.undo()
        mp.setattr(torch.Tensor, "is_cuda", property(is_cuda))
        assert dec.shared_pass_kind(big, cache, values, 1312, 30.0) == "triton"  # softcapped
        assert dec.shared_pass_kind(big, cache, values, 1312, None, 0.5, 1.0) == "triton"  # a scaled cache
        assert dec.shared_pass_kind(big, cache, values, cascade_gemm.MAX_SHARED_LEN + 16, None) == "triton"
        assert dec.shared_pass_kind(big.float(), cache.float(), cache.float()[..., :512], 1312, None) == "triton"
        assert dec.shared_pass_kind(big, cache, torch.empty_like(values), 1312, None) == "triton"  # values apart


def test_cascade_rejects_what_it_cannot_run():
    gen = torch.Generator().manual_seed(0)
    kv = SharedPagedKV(32, [1, 2], kv_heads=2, head_dim=64, v_dim=64, page_size=16, dtype=torch.float32,
                       mla=False, gen=gen)
    q = torch.randn(2, 4, 64, device=DEVICE)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    for bad in (0, 8, 16 * 99):  # none, part of a page, beyond the table: decode_attention's job or a bug
        with pytest.raises(BackendError, match="whole pages"):
            cascade_decode_attention(*args, shared_len=bad, scale=1.0)
    with pytest.raises(BackendError, match="splits"):
        cascade_decode_attention(*args, shared_len=32, scale=1.0, num_kv_splits=40, num_shared_splits=40)
    with pytest.raises(BackendError, match="scratch"):
        cascade_decode_attention(*args, shared_len=32, scale=1.0, num_shared_splits=2,
                                 partial=torch.empty(2, 4, 2, 64), lse=torch.empty(2, 4, 2))


def test_shared_split_count_fills_the_gpu_within_limits():
    # few rows: split the prefix; many rows: do not; never more than the merge can take with the suffix's
    assert choose_num_shared_splits(batch=4, num_kv_heads=8, group=4, shared_len=4096, num_sms=132, block_m=64) > 1
    assert choose_num_shared_splits(batch=256, num_kv_heads=8, group=4, shared_len=4096, num_sms=132,
                                    block_m=16) == 1
    assert choose_num_shared_splits(batch=2, num_kv_heads=1, group=1, shared_len=1 << 20, num_sms=132,
                                    block_m=16, max_splits=5) == 5


@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_cascade_through_attention_layer(page_size, monkeypatch):
    from attnzoo.attention.backends.triton import TritonBackend

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16
    layers = [
        Attention(0, 8, 2, 64, logit_softcap=25.0),
        Attention(1, 4, 4, 40, v_head_dim=24, scale=0.3),
        Attention(2, 16, 1, 48, v_head_dim=32, kind="mla"),  # latent 32 + rope 16
        Attention(3, 8, 2, 64, sliding_window=12),  # a window: the plain path
    ]
    pools = [KVPool([layer.kv_cache_spec() for layer in layers], num_pages=96 // page_size + 8,
                    page_size=page_size, dtype=dtype, device=DEVICE) for _ in range(2)]
    pools[0].buffer.view(dtype).copy_(torch.randn(pools[0].buffer.view(dtype).shape, generator=gen))
    pools[1].buffer.copy_(pools[0].buffer)
    backends = [TorchBackend(pools[0]), TritonBackend(pools[1])]
    assert TritonBackend.supports_cascade

    alloc = PageAllocator(pools[0].num_pages)
    shared = alloc.alloc(32 // page_size)
    # request 2 shares one more page with request 0 than request 1 does: the step shares 32 tokens
    tail0 = alloc.alloc(16 // page_size)
    tables = [shared + tail0 + alloc.alloc(1), shared + alloc.alloc(1), shared + tail0 + alloc.alloc(2)]
    prefix_lens = [32 + 16, 32, 32 + 16 + 1]
    metas = [build_metadata(prefix_lens=prefix_lens, q_lens=[1, 1, 1], block_tables=tables, page_size=page_size,
                            device=DEVICE, detect_shared_prefix=True) for _ in backends]
    assert metas[1].shared_prefix_len == 32
    for be, meta in zip(backends, metas):
        be.prepare(meta)

    calls = []
    real = dec.cascade_decode_attention

    def spy(*args, **kw):
        calls.append(kw["shared_len"])
        return real(*args, **kw)

    monkeypatch.setattr(dec, "cascade_decode_attention", spy)
    for layer in layers:
        q, k, v = layer_inputs(layer, 3, gen, dtype)
        ref, out = (layer(q, k, v, ForwardContext(meta, pool, be, be))
                    for be, meta, pool in zip(backends, metas, pools))
        assert not out.isnan().any(), f"layer {layer.layer_id}: NaN (seed {seed})"
        err = rel_err(out, ref)
        assert err <= 1e-2, f"layer {layer.layer_id}: rel err {err:.2e} (seed {seed})"
    assert calls == [32, 32, 32], "layers without a window run cascade, the windowed one does not"

    # A cascade step prepared for a CUDA graph (captured per prefix length) takes the cascade path too, its
    # splits sized for the graphs' longest context.
    assert TritonBackend.supports_cascade_graph and backends[1].cascade_graph_key(metas[1]) == 32
    backends[1].init_graph_state(3, 4 * max(len(t) for t in tables))
    graph_plan = backends[1].prepare_graph(metas[1], capturing=True)
    q = torch.randn(3, 8, 64, generator=gen).to(dtype).to(DEVICE)
    err = rel_err(backends[1].decode(layers[0], q, metas[1], graph_plan),
                  backends[0].decode(layers[0], q, metas[0], backends[0].prepare(metas[0])))
    assert err <= 1e-2 and calls == [32] * 4, f"rel err {err:.2e}, cascade calls {calls} (seed {seed})"
