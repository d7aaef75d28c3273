"""The one store path (``KVPool.store``, ``kernels.store``): a step's new keys and values written at their slots,
and RoPE applied in the same launch (q and k rotated in place) where the attention layer hands it over.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); every run draws
fresh random inputs, its seed in each failure message.
"""
from __future__ import annotations

import os

import pytest
import torch

from attnzoo.attention.backends.torch_ref import TorchBackend
from attnzoo.attention.kernels.store import store_kv, store_rows
from attnzoo.attention.kv_cache import KVCacheSpec, KVPool
from attnzoo.attention.store_rope import RoPE, overlaps
from attnzoo.attention.layer import Attention, ForwardContext
from attnzoo.attention.metadata import build_metadata
from attnzoo.errors import BackendError
from attnzoo.layers import fused
from attnzoo.layers.fused import rope_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_store_kv_writes_exactly_the_slots(page_size):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    heads, tokens = 2, 11
    num_pages = 2 + -(-2 * tokens // page_size)
    k_cache = torch.full((num_pages, heads, page_size, 40), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.full((num_pages, heads, page_size, 24), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    slots = torch.randperm((num_pages - 1) * page_size, generator=gen)[:tokens] + page_size  # never page 0
    k = torch.randn(tokens, heads, 40, generator=gen)  # float32 rows: the store casts to the cache dtype
    v = torch.randn(tokens, heads, 24, generator=gen).to(torch.bfloat16)
    store_kv(slots.to(DEVICE), k.to(DEVICE), k_cache, v.to(DEVICE), v_cache)
    page, off = slots // page_size, slots % page_size
    # The GPU rounds float32 -> bfloat16 to nearest like torch; Triton's interpreter truncates (< 1 ulp).
    rtol = 0.0 if DEVICE.type == "cuda" else 2.0**-7
    torch.testing.assert_close(k_cache[page, :, off].cpu(), k.to(torch.bfloat16), rtol=rtol, atol=0.0,
                               msg=lambda m: f"{m} (seed {seed})")
    assert torch.equal(v_cache[page, :, off].cpu(), v), f"seed {seed}"
    written = torch.zeros(num_pages, page_size, dtype=torch.bool)
    written[page, off] = True
    assert k_cache.isnan().all(-1).all(1).cpu().eq(~written).all(), "a slot outside slot_mapping was written"


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d,rotary,fp8", [(40, 40, False), (40, 24, False), (40, 40, True), (320, 64, False)])
def test_store_with_rope_rotates_q_and_k_as_fused_rope(interleaved, d, rotary, fp8):
    # The store's RoPE gives fused.rope's q and k (also partial rotary: the channels past R as they are), stores
    # the rotated keys (fp8: their quantized bytes, as the plain store writes them) and leaves the values alone.
    from attnzoo.attention.kv_cache import quantize_fp8
    from attnzoo.layers.fused import rope_ref

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    tokens, heads, q_heads, page_size = 5, 2, 6, 16
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    k_cache = torch.zeros(3, heads, page_size, d, device=DEVICE).to(dtype)
    v_cache = torch.zeros(3, heads, page_size, 24, device=DEVICE).to(dtype)
    slots = torch.tensor([16, 17, 18, 40, 33], device=DEVICE)
    # q, k and v as a fused QKV projection leaves them: views of one buffer's rows
    qkv = torch.randn(tokens, (q_heads + heads) * d + heads * 24, generator=gen).to(torch.bfloat16).to(DEVICE)
    qd, kd, vd = qkv.split([q_heads * d, heads * d, heads * 24], dim=-1)
    qd, kd, vd = qd.view(tokens, q_heads, d), kd.view(tokens, heads, d), vd.view(tokens, heads, 24)
    q, k, v = qd.cpu().clone(), kd.cpu().clone(), vd.cpu().clone()
    pos = torch.arange(tokens)[:, None] * 7.0
    freq = 1.0 / 10000 ** (torch.arange(rotary // 2) / (rotary // 2))
    cos, sin = torch.cat([(pos * freq).cos()] * 2, -1), torch.cat([(pos * freq).sin()] * 2, -1)
    want_q, want_k = rope_ref(q, cos, sin, interleaved), rope_ref(k, cos, sin, interleaved)
    store_kv(slots, kd, k_cache, vd, v_cache, k_scale=0.5, v_scale=0.5,
             rope=RoPE(qd, cos.to(DEVICE), sin.to(DEVICE), interleaved))
    # the GPU rounds float32 -> bfloat16 to nearest; Triton's interpreter truncates (< 1 ulp)
    tol = dict(rtol=0.0, atol=0.0) if DEVICE.type == "cuda" else dict(rtol=2.0**-7, atol=1e-6)
    torch.testing.assert_close(qd.cpu(), want_q, **tol, msg=lambda m: f"q: {m} (seed {seed})")
    torch.testing.assert_close(kd.cpu(), want_k, **tol, msg=lambda m: f"k: {m} (seed {seed})")

    def cached(x):  # what the plain store writes for rows x
        return quantize_fp8(x, 0.5) if fp8 else x

    stored = k_cache[slots // page_size, :, slots % page_size].cpu()
    assert torch.equal(stored.view(torch.uint8), cached(kd.cpu()).view(torch.uint8)), f"keys (seed {seed})"
    values = v_cache[slots // page_size, :, slots % page_size].cpu()
    assert torch.equal(values.view(torch.uint8), cached(v).view(torch.uint8)), f"values (seed {seed})"
    assert torch.equal(vd.cpu(), v), "the values were changed"
    with pytest.raises(BackendError, match="RoPE"):
        store_kv(slots, kd, k_cache, rope=RoPE(qd, cos.to(DEVICE)[:, :3], sin.to(DEVICE)[:, :3]))


def test_pool_store_with_rope_on_cpu_rotates_in_place():
    # The pool's torch path (a CPU pool) rotates q and k in place as the GPU's store kernel does.
    from attnzoo.layers.fused import rope_ref

    gen = torch.Generator().manual_seed(fresh_seed())
    spec = KVCacheSpec(num_kv_heads=2, head_dim=32, v_head_dim=32)
    pool = KVPool([spec], num_pages=4, page_size=16, dtype=torch.float32, device=torch.device("cpu"))
    q, k, v = (torch.randn(3, h, 32, generator=gen) for h in (4, 2, 2))
    cos, sin = torch.rand(3, 32, generator=gen), torch.rand(3, 32, generator=gen)
    want_q, want_k = rope_ref(q, cos, sin), rope_ref(k, cos, sin)
    slots = torch.tensor([16, 17, 18])
    pool.store(0, slots, k, v, rope=RoPE(q, cos, sin))
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(pool.k(0)[1, :, :3].transpose(0, 1), want_k)
    with pytest.raises(BackendError, match="share memory"):
        pool.store(0, slots, k, k, rope=RoPE(q, cos, sin))
    with pytest.raises(BackendError, match="float32"):  # every device refuses what the GPU's kernel would
        pool.store(0, slots, k, v, rope=RoPE(q, cos.double(), sin.double()))
    with pytest.raises(BackendError, match="float32"):
        pool.store(0, slots, k, v, rope=RoPE(q, cos, sin.double()))


def test_rope_problem_checks_each_rows_once(monkeypatch):
    # The layer asks whether the store may rotate its rows, the pool asks again as it stores: the second answer
    # is the first's (the checks cost tens of microseconds of host a layer), but other rows are checked anew.
    qkv = torch.randn(3, 8, 32)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    calls = []
    real = RoPE._problem
    monkeypatch.setattr(RoPE, "_problem", lambda self, k_, v_: calls.append(1) or real(self, k_, v_))
    rope = RoPE(q, torch.rand(3, 32), torch.rand(3, 32))
    assert rope.problem(k, v) is None and rope.problem(k, v) is None and len(calls) == 1
    assert "share memory" in rope.problem(k, k) and len(calls) == 2
    assert rope.problem(k, v) is None and len(calls) == 3
    with pytest.raises(AttributeError):  # frozen: a field changed after the answer would make it stale
        rope.q = q[:, :2]


def test_store_mla_and_indexer_rows():
    # MLA keeps no separate value buffer; NSA's indexer keys have no head axis
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.full((4, 1, 16, 72), float("nan"), device=DEVICE)
    idx_cache = torch.full((4, 16, 32), float("nan"), device=DEVICE)
    slots = torch.tensor([16, 17, 40, 63], device=DEVICE)
    k = torch.randn(4, 1, 72, generator=gen).to(DEVICE)
    idx = torch.randn(4, 32, generator=gen).to(DEVICE)
    store_kv(slots, k, k_cache)
    store_rows(slots, idx, idx_cache)
    assert torch.equal(k_cache[slots // 16, :, slots % 16], k)
    assert torch.equal(idx_cache[slots // 16, slots % 16], idx)
    with pytest.raises(BackendError, match="slots"):
        store_kv(slots[:3], k, k_cache)


def test_overlaps_tells_a_fused_projections_views_apart():
    qkv = torch.zeros(3, (8 + 2 + 2) * 16)
    q, k, v = (x.view(3, -1, 16) for x in qkv.split([128, 32, 32], dim=-1))
    assert not overlaps(k, v) and not overlaps(q, k) and overlaps(k, k)
    assert not overlaps(k[:1], v[:1]) and overlaps(qkv[:, :40].view(3, 2, 20), qkv[:, 30:50].view(3, 1, 20))
    assert not overlaps(torch.zeros(3), torch.zeros(3))
    base = torch.zeros(16)
    assert overlaps(torch.tensor(0.0), torch.tensor(0.0)) is False  # 0-d views of two tensors
    assert overlaps(base[4], base[:8]) and not overlaps(base[8], base[:8])
    a = base.numpy()  # two storages over one memory
    assert overlaps(torch.from_numpy(a), torch.from_numpy(a[8:]))


@pytest.mark.parametrize("route", ["store", "torch_ops", "q_not_strided", "autograd", "v_is_k", "split",
                                   "strided_channels"])
@pytest.mark.parametrize("rotary", [32, 16])
def test_attention_layer_rotates_in_the_store_or_before_it(monkeypatch, route, rotary):
    # Attention(rope=(cos, sin)) gives what rotating q and k first gives, whichever route it takes: the store's
    # launch (q and k rotated in place) where it may, else fused.rope (the caller's q left as it was).
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    t, heads, kv_heads, d = 3, 4, 2, 32
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen).to(DEVICE)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    if route == "strided_channels":  # a q whose channels are every other element: not the kernel's rows
        q = torch.randn(t, heads, 2 * d, generator=gen).to(DEVICE)[..., ::2]
    if route == "v_is_k":  # values from the key projection (Gemma 4's global layers): unrotated, so k stays put
        v = k
    pos = torch.arange(t)[:, None] + 5.0
    freq = 1.0 / 500 ** (torch.arange(rotary // 2) / (rotary // 2))
    cos, sin = (torch.cat([f(pos * freq)] * 2, dim=-1).to(DEVICE) for f in (torch.cos, torch.sin))
    layer = Attention(0, heads, kv_heads, d)

    def run(q, k, v, rope):
        pool = KVPool([layer.kv_cache_spec()], num_pages=4, page_size=16, dtype=torch.float32, device=DEVICE)
        meta = build_metadata(prefix_lens=[0], q_lens=[t], block_tables=[[1]], page_size=16, device=DEVICE)
        backend = TorchBackend(pool)
        ctx = ForwardContext(meta, pool, backend, backend)
        if route == "split":  # piecewise graphs: the layer hands (q, k, v) on, to be attended later
            ctx.split = lambda layer_, q_, k_, v_: layer_.attend(q_, k_, v_, ctx)
        return layer(q, k, v, ctx, rope=rope), pool.k(0)[1, :, :t].transpose(0, 1)

    want_k = rope_ref(k, cos, sin)
    ref_out, ref_k = run(rope_ref(q, cos, sin), want_k, v.clone(), None)  # values as they were, rotated or not
    want_q, q0 = rope_ref(q, cos, sin), q.clone()
    if route == "q_not_strided":
        monkeypatch.setattr(TorchBackend, "strided_query", False)
    if route == "autograd":
        q = q0.clone().requires_grad_()
    with fused.use("torch" if route == "torch_ops" else "triton"), torch.set_grad_enabled(route == "autograd"):
        out, cached = run(q, k, v, (cos, sin))
    msg = lambda m: f"{m} (seed {seed})"  # noqa: E731
    torch.testing.assert_close(out.detach(), ref_out, rtol=1e-5, atol=1e-5, msg=msg)
    torch.testing.assert_close(cached, ref_k, rtol=1e-5, atol=1e-5, msg=msg)
    if route == "store":
        torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6, msg=msg)  # rotated where it lies
    else:
        assert torch.equal(q.detach(), q0), f"a fallback route changed the caller's q (seed {seed})"
