"""The cascade's shared pass through cuDNN's attention (``kernels.cascade_sdpa``): the copies around the call
(checked on the CPU with torch's CPU flash attention in cuDNN's place), when it is chosen, and on a GPU."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnzoo.attention.backends.torch_ref import attention_reference
from attnzoo.attention.kernels import cascade_sdpa
from attnzoo.attention.kernels import decode as dec
from attnzoo.attention.kernels.decode import cascade_decode_attention, decode_attention
from attnzoo.errors import BackendError
from attnzoo.attention.kernels.decode_launch import (
    WAVE_TILE_N,
    cascade_launch_config,
    cascade_own_launch_config,
    decode_launch_config,
)
from test_cascade_triton import SharedPagedKV
from test_triton_kernels import DEVICE, TOL, fresh_seed, rel_err

# (dtype, kv heads, heads, head dim, page size, requests): a group of 4; of 3 and 5 (not powers of two, masked);
# pages of 4 and of 1 key; more requests than one copy program takes
LAYOUTS = [(torch.bfloat16, 2, 8, 64, 16, 3), (torch.float32, 2, 6, 32, 4, 19), (torch.float32, 1, 5, 16, 1, 2)]


@pytest.mark.parametrize("dtype,kv_heads,heads,d,page_size,batch", LAYOUTS)
def test_the_copies_around_cudnn_write_the_triton_pass_slot(dtype, kv_heads, heads, d, page_size, batch):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    kv = SharedPagedKV(32, [3, 17, 1, 2][:batch] + [2] * (batch - 4), kv_heads=kv_heads, head_dim=d, v_dim=d,
                       page_size=page_size, dtype=dtype, mla=False, gen=gen)
    q = torch.randn(batch, heads, d, generator=gen).to(dtype).to(DEVICE)
    # the Triton pass's slot 2 (after two own splits), and the cuDNN path's into scratch holding a sentinel
    partial = torch.zeros(batch, heads, 3, d, device=DEVICE)
    lse = torch.zeros(batch, heads, 3, device=DEVICE)
    cascade_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, shared_len=32, scale=0.1,
                             num_kv_splits=2, partial=partial, lse=lse,
                             launch_config=cascade_launch_config(d, d, dtype))
    got_p = torch.full_like(partial, 7.0)
    got_l = torch.full_like(lse, 7.0)
    cascade_sdpa.shared_pass(q, kv.k_cache, kv.v_cache, kv.block_tables, got_p, got_l, slot=2, shared_len=32,
                             scale=0.1)
    # cuDNN's output is in q's dtype before the float32 slot: a bf16 rounding of the Triton pass's
    err = rel_err(got_p[:, :, 2], partial[:, :, 2])
    assert err <= (TOL[dtype] if dtype == torch.bfloat16 else 1e-5), f"outputs: {err:.2e} (seed {seed})"
    assert (got_l[:, :, 2] - lse[:, :, 2]).abs().max().item() <= 1e-4, f"log2 LSE (seed {seed})"
    assert (got_p[:, :, :2] == 7.0).all() and (got_l[:, :, :2] == 7.0).all(), "wrote outside its slot"


def test_cascade_with_the_cudnn_pass_matches_plain_decode_and_the_reference(monkeypatch):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    suffix = [1, 20, 16, 5]
    kv = SharedPagedKV(48, suffix, kv_heads=2, head_dim=64, v_dim=64, page_size=16, dtype=torch.bfloat16,
                       mla=False, gen=gen)
    q = torch.randn(len(suffix), 8, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    ran = []
    monkeypatch.setattr(dec, "shared_pass_kind", lambda *a, **k: "cudnn")
    monkeypatch.setattr(cascade_sdpa, "_attend", lambda *a, _f=cascade_sdpa._attend: ran.append(1) or _f(*a))
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    out = cascade_decode_attention(*args, shared_len=48, scale=0.1, num_kv_splits=2)
    assert ran == [1], "the cuDNN pass did not run once"
    plain = decode_attention(*args, scale=0.1, num_kv_splits=2)
    assert rel_err(out, plain) <= TOL[torch.bfloat16], f"{rel_err(out, plain):.2e} (seed {seed})"
    for i, n in enumerate(suffix):
        ref = attention_reference(q[i : i + 1], kv.k[i], kv.v[i], torch.tensor([48 + n - 1]), scale=0.1)
        assert rel_err(out[i : i + 1], ref) <= TOL[torch.bfloat16], f"request {i} (seed {seed})"


def test_the_cudnn_pass_is_chosen_for_mha_in_graphs_at_a_large_batch_only(monkeypatch):
    bf16 = torch.bfloat16
    rows = cascade_sdpa.MIN_ROWS // 32
    big, small = (torch.empty(n, 32, 128, dtype=bf16, device="meta") for n in (rows, rows - 1))
    # caches in memory (meta tensors share one null pointer: values_in_key would call them MLA's)
    cache, values = (torch.empty(4, 8, 16, 128, dtype=bf16) for _ in range(2))

    def kind(q=big, k=cache, v=values, softcap=None, scales=(1.0, 1.0), graph=True):
        return dec.shared_pass_kind(q, k, v, 1312, softcap, *scales, graph=graph)

    assert kind() == "triton"  # not on a GPU
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda x: True))
    monkeypatch.setattr(cascade_sdpa, "cudnn_attention_available", lambda device, shared_len=0: True)
    assert kind() == "cudnn"
    assert kind(graph=False) == "triton"  # an eager step: cuDNN would build a plan for its batch mid-run
    assert kind(q=small) == "triton"  # too few rows
    assert kind(q=torch.empty(rows, 32, 256, dtype=bf16, device="meta")[..., ::2]) == "triton"  # channels apart
    assert kind(softcap=30.0) == "triton"
    assert kind(scales=(0.5, 1.0)) == "triton"  # a scaled (fp8) cache
    assert kind(v=cache) == "triton"  # values in the keys (MLA's latent)

    def caches(d, dtype=bf16):
        return (torch.empty(4, 8, 16, d, dtype=dtype) for _ in range(2))
    assert kind(*[torch.empty(rows, 32, 128, dtype=bf16, device="meta"), *caches(128, torch.float8_e4m3fn)]) == \
        "triton"
    assert kind(torch.empty(rows, 32, 256, dtype=bf16, device="meta"), *caches(256)) == "triton"
    # not a power of two: the copies' tiles
    assert kind(torch.empty(rows, 32, 96, dtype=bf16, device="meta"), *caches(96)) == "triton"
    k, v = (torch.empty(4, 8, 16, 256, dtype=bf16)[..., :128] for _ in range(2))
    assert kind(k=k, v=v) == "triton"  # a page's slots not one run of memory
    assert kind(v=torch.empty(4, 8, 16, 64, dtype=bf16)) == "triton"  # values of another width
    monkeypatch.setattr(cascade_sdpa, "cudnn_attention_available", lambda device, shared_len=0: False)
    assert kind() == "triton"


def test_cudnn_is_asked_for_by_device_version_switches_and_known_faults(monkeypatch):
    gpu = torch.device("cuda", 0)
    assert not cascade_sdpa.cudnn_attention_available(torch.device("cpu"))
    monkeypatch.setattr(cascade_sdpa, "_cudnn_attention", lambda index: True)  # an NVIDIA GPU, torch, cuDNN >= 9.3
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91500)
    assert cascade_sdpa.cudnn_attention_available(gpu, shared_len=4096)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91400)  # faults past 1024 keys in graphs
    assert cascade_sdpa.cudnn_attention_available(gpu, shared_len=1024)
    assert not cascade_sdpa.cudnn_attention_available(gpu, shared_len=1040)
    with sdpa_kernel([SDPBackend.MATH]):  # torch's switch for cuDNN's attention, off
        assert not cascade_sdpa.cudnn_attention_available(gpu, shared_len=16)


def test_the_copies_refuse_scratch_whose_channels_lie_apart():
    q = torch.zeros(2, 8, 16)
    cache = torch.zeros(4, 2, 4, 16)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    strided = torch.zeros(2, 8, 2, 32)[..., ::2]
    with pytest.raises(BackendError, match="not adjacent"):
        cascade_sdpa.shared_pass(q, cache, cache.clone(), tables, strided, torch.zeros(2, 8, 2), slot=1, shared_len=4,
                                 scale=0.1)


def test_the_cascade_stage_1_takes_the_wave_tile_for_narrow_heads_only():
    bf16 = torch.bfloat16
    cfg = cascade_own_launch_config(128, 128, 4, bf16)
    assert cfg == dict(decode_launch_config(128, 128, 4, bf16), BLOCK_N=WAVE_TILE_N, num_stages=2)
    assert cascade_own_launch_config(576, 512, 16, bf16) is None  # MLA: stage 1's default
    assert cascade_own_launch_config(128, 128, 4, torch.float32) is None  # already 32 keys a step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cudnn_pass_on_the_gpu_at_its_batch_in_a_graph():
    # Llama's widths at 520 requests x 32 heads (past MIN_ROWS): chosen in a graph's step, captured in one, and
    # equal to the Triton shared pass and to plain decode
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    suffix = torch.randint(1, 40, (520,), generator=gen).tolist()
    kv = SharedPagedKV(128, suffix, kv_heads=8, head_dim=128, v_dim=128, page_size=16, dtype=torch.bfloat16,
                       mla=False, gen=gen)
    q = torch.randn(len(suffix), 32, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    assert dec.shared_pass_kind(q, kv.k_cache, kv.v_cache, 128, None, graph=True) == "cudnn"
    out = torch.empty_like(q)
    run = lambda: cascade_decode_attention(*args, shared_len=128, scale=0.09, num_kv_splits=1, out=out,  # noqa: E731
                                           graph=True)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    tiled = cascade_decode_attention(*args, shared_len=128, scale=0.09, num_kv_splits=1,
                                     launch_config=cascade_launch_config(128, 128, torch.bfloat16))
    plain = decode_attention(*args, scale=0.09, num_kv_splits=2)
    for name, other in (("triton shared pass", tiled), ("plain decode", plain)):
        assert rel_err(out, other) <= 1e-2, f"vs {name}: {rel_err(out, other):.2e} (seed {seed})"


def test_warm_up_runs_the_copies_once_per_layer_shape_reading_only_the_padding_page(monkeypatch):
    # The engine's warm-up has two short prompts; cuDNN's pass is chosen from thousands of rows in a captured step.
    # The backend's warm-up runs its copies once per layer shape that qualifies, on one request over page 0.
    from attnzoo.attention.backends.triton import TritonBackend
    from attnzoo.attention.kv_cache import KVPool
    from attnzoo.attention.layer import Attention

    layers = [Attention(0, 8, 2, 64, sliding_window=8), Attention(1, 8, 2, 64, logit_softcap=30.0),
              Attention(2, 8, 2, 64), Attention(3, 8, 2, 64)]
    pool = KVPool([layer.kv_cache_spec() for layer in layers], num_pages=4, page_size=16, dtype=torch.bfloat16,
                  device=DEVICE)
    for i in range(len(layers)):  # requests' pages: NaN; only the padding page may be read
        for cache in (pool.k(i), pool.v(i)):
            cache.fill_(float("nan"))
            cache[0].normal_()
    before = pool.buffer.clone()
    seen = []

    def attend(q, k, v, scale):
        seen.append(bool(k.isfinite().all() and v.isfinite().all()))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)

    monkeypatch.setattr(cascade_sdpa, "_attend", attend)
    backend = TritonBackend(pool)
    backend.warm_up(layers)
    assert seen == [], "cuDNN does not run here: nothing to warm up"
    monkeypatch.setattr(cascade_sdpa, "cudnn_attention_available", lambda device, shared_len=0: True)
    backend.warm_up(layers)
    assert seen == [True], "one call for the two plain layers' shape (windowed and softcapped layers never take it)"
    assert torch.equal(pool.buffer.view(torch.bfloat16).nan_to_num(), before.view(torch.bfloat16).nan_to_num()), \
        "the warm-up wrote into the cache"
    fp32 = KVPool([Attention(0, 8, 2, 64).kv_cache_spec()], num_pages=2, page_size=16, dtype=torch.float32,
                  device=DEVICE)
    assert cascade_sdpa.warm_up(fp32.k(0), fp32.v(0), 8, scale=0.1) == 0  # a layer the Triton pass serves
