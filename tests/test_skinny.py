"""The skinny projection kernel (attnzoo.layers.skinny) against F.linear: under Triton's interpreter on tiny
shapes without a GPU, at full Llama/Gemma decode shapes with one (marked gpu); and where it is taken."""
import pytest
import torch
import torch.nn.functional as F

import attnzoo
from attnzoo.errors import BackendError
from attnzoo.layers import fused, skinny
from helpers import random_prompts, save_checkpoint
from test_llama import tiny_llama

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.5).to(DEV, dtype)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch(rows, bias, dtype):
    # 300 x 200: neither a multiple of the tiles (masked loads); 256 x 512: whole tiles (unmasked)
    for n, k in ((300, 200), (256, 512)):
        x, w = rand(rows, k, dtype=dtype, seed=1), rand(n, k, dtype=dtype, seed=2)
        b = rand(n, dtype=dtype, seed=3) if bias else None
        with skinny.use(True):
            assert skinny.fits(x, w)
            got = skinny.linear(x, w, b)
        ref = F.linear(x.float(), w.float(), None if b is None else b.float())
        assert got.dtype == dtype and got.shape == (rows, n)
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(got.float(), ref, **tol)


def test_narrow_projections_past_one_row_take_the_swapped_tile():
    # o_proj-sized weights: one row streams 512-wide steps; 2-16 rows the W x^T tile (both checked above)
    one, more = skinny.config_for(4096, 4096, 1), skinny.config_for(4096, 4096, 4)
    assert not one.swap and (one.block_n, one.block_k) == (32, 512)
    assert more.swap and (more.block_m, more.block_n) == (16, 64)
    assert not skinny.config_for(6144, 4096, 4).swap  # wider ones keep their tile at every row count


def test_swapped_tile_in_the_gated_and_per_head_launches():
    # no rule picks these yet; the kernel's swapped product must still hold in every form it has
    kern = skinny._kernels()
    tile = kern.Config(16, 32, 4, 2, swap=True)
    x, w = rand(3, 64, dtype=torch.float32, seed=1), rand(96, 64, dtype=torch.float32, seed=2)
    got = kern.linear(x, w, config=tile, act="silu")
    torch.testing.assert_close(got, fused.act_and_mul_ref(F.linear(x, w), "silu"), rtol=1e-5, atol=1e-4)
    xh, wh = rand(3, 2, 32, dtype=torch.float32, seed=3), rand(2, 48, 32, dtype=torch.float32, seed=4)
    got = kern.batched(xh, wh, torch.empty(3, 2, 48, device=DEV), config=tile)
    torch.testing.assert_close(got, torch.einsum("thk,hnk->thn", xh, wh), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_equals_projection_then_act(act, dtype, bias):
    # 2 x 150 gate/up rows (masked tiles), 2 x 256 (whole): one launch against projection + fused.act_and_mul
    for i, k in ((150, 200), (256, 256)):
        x, w = rand(3, k, dtype=dtype, seed=1), rand(2 * i, k, dtype=dtype, seed=2)
        b = rand(2 * i, dtype=dtype, seed=3) if bias else None
        with skinny.use(True), fused.use("triton"):
            got = skinny.gated(x, w, b, act)
            ref = fused.act_and_mul(skinny.linear(x, w, b), act)
        assert got.shape == (3, i) and got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, ref)
        torch.testing.assert_close(got.float(), fused.act_and_mul_ref(F.linear(x.float(), w.float(), None if b is None
                                   else b.float()), act), rtol=4e-2, atol=4e-2)


def test_gated_follows_the_fused_switch():
    # fused.use("torch") (the unfused reference runs) keeps the activation a torch op of its own
    x, w = rand(2, 64, dtype=torch.float32, seed=1), rand(64, 64, dtype=torch.float32, seed=2)
    with skinny.use(True):
        with fused.use("torch"):
            assert not fused.enabled(x) and not skinny.gates(x, w)
            ref = skinny.gated(x, w, None, "silu")
        with fused.use("triton"):
            assert skinny.gates(x, w)
        torch.testing.assert_close(ref, fused.act_and_mul_ref(F.linear(x, w), "silu"), rtol=1e-5, atol=1e-5)
        with pytest.raises(BackendError, match="unknown gated activation"):
            with fused.use("triton"):
                skinny.gated(x, w, None, "relu")


def test_leading_dims_and_where_it_is_taken():
    w = rand(64, 32, dtype=torch.float32, seed=0)
    x = rand(2, 3, 32, dtype=torch.float32, seed=1)
    with skinny.use(True):
        y = skinny.linear(x, w)
        assert y.shape == (2, 3, 64)
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-4)
        assert not skinny.fits(rand(17, 32, dtype=torch.float32, seed=1), w)  # past 16 rows: cuBLAS
        assert not skinny.fits(x.to(torch.bfloat16), w)  # mixed dtypes
        assert not skinny.fits(rand(1, 64, dtype=torch.float32, seed=1)[:, ::2], w)  # strided along K
        assert not skinny.fits(x, w.t().contiguous().t())  # a transposed weight view
        long_k = rand(8, skinny.MAX_K + 64, dtype=torch.float32, seed=2)
        assert not skinny.fits(rand(1, skinny.MAX_K + 64, dtype=torch.float32, seed=1), long_k)  # cuBLAS's split-K
    with skinny.use(False):
        assert not skinny.fits(x, w)
    if not GPU:  # by default the kernel is a CUDA path: a CPU tensor takes F.linear
        assert not skinny.fits(x, w)


def test_strided_rows_bias_rules_and_limits():
    w, b = rand(48, 32, dtype=torch.float32, seed=0), rand(96, dtype=torch.float32, seed=3)
    x = rand(4, 64, dtype=torch.float32, seed=1)[:, :32]  # rows 64 apart
    with skinny.use(True):
        assert skinny.fits(x, w, b[:48])
        torch.testing.assert_close(skinny.linear(x, w, b[:48]), F.linear(x, w, b[:48]), rtol=1e-5, atol=1e-4)
        assert not skinny.fits(x, w, b[::2])  # a strided bias: F.linear
        torch.testing.assert_close(skinny.linear(x, w, b[::2]), F.linear(x, w, b[::2]))
        assert not skinny.fits(x, w, b[:48].double())
        assert not skinny.fits(x, w.requires_grad_())  # no backward in the kernel
        with torch.no_grad():
            assert skinny.fits(x, w)
        with pytest.raises(ValueError, match="tile holds 16 rows"):
            skinny._kernels().linear(rand(17, 32, dtype=torch.float32, seed=1), w.detach(),
                                     config=skinny.config_for(48, 32, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_matches_bmm_both_weight_layouts(dtype):
    # MLA's two absorptions at toy size: W_UK read along N (unit stride along N, 40 apart along K) into a slot
    # of a wider buffer, and W_UV read along K; 3 heads, N and K no whole tiles in the second
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    w_uk = rand(3, 24, 40, dtype=dtype, seed=1)  # [H, nope, rank]
    q_nope = rand(5, 3, 48, dtype=dtype, seed=2)[..., :24]  # rows and heads strided, unit along K
    buf = torch.full((5, 3, 40 + 8), 7.0, dtype=dtype, device=DEV)
    w_uv = rand(3, 20, 40, dtype=dtype, seed=3)  # [H, v, rank]
    o_lat = rand(2, 3, 40, dtype=dtype, seed=4)
    with skinny.use(True):
        got = skinny.batched(q_nope, w_uk.transpose(1, 2), out=buf[..., :40])
        assert got.data_ptr() == buf.data_ptr()
        values = skinny.batched(o_lat, w_uv)
    ref = torch.einsum("thk,hkn->thn", q_nope.float(), w_uk.float())
    torch.testing.assert_close(buf[..., :40].float(), ref, **tol)
    assert (buf[..., 40:] == 7).all()  # the rope channels beside the slot are left alone
    assert values.shape == (2, 3, 20)
    torch.testing.assert_close(values.float(), torch.einsum("thk,hnk->thn", o_lat.float(), w_uv.float()), **tol)


def test_batched_falls_back_to_bmm_and_keeps_autograd():
    w = rand(2, 16, 8, dtype=torch.float32, seed=1)
    x = rand(3, 2, 8, dtype=torch.float32, seed=2)
    ref = torch.einsum("thk,hnk->thn", x, w)
    calls = []
    kernel = skinny._kernels().batched
    with skinny.use(True):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(skinny._kernels(), "batched", lambda *a, **k: calls.append(1) or kernel(*a, **k))
            skinny.batched(x, w)
            assert calls == [1]  # the kernel took it
            for bad in (rand(17, 2, 8, dtype=torch.float32, seed=3),  # past 16 rows
                        rand(3, 2, 16, dtype=torch.float32, seed=3)[..., ::2]):  # strided along K
                torch.testing.assert_close(skinny.batched(bad, w), torch.einsum("thk,hnk->thn", bad, w))
            grad_w = w.clone().requires_grad_()
            y = skinny.batched(x, grad_w)  # no backward in the kernel: bmm, and autograd records it
            y.sum().backward()
            assert calls == [1] and grad_w.grad is not None
    torch.testing.assert_close(y.detach(), ref, rtol=1e-5, atol=1e-5)
    with skinny.use(False):
        torch.testing.assert_close(skinny.batched(x, w), ref, rtol=1e-5, atol=1e-5)


# (N, K) of batched's tile branches under batched_config: 128 x 64 two N blocks of whole tiles, one K step;
# 48 x 1040 three N blocks and three K steps, masked; 64 x 1024 four N blocks and two K steps, unmasked (EVEN)
BATCHED_TILE_CASES = [(128, 64), (48, 1040), (64, 1024)]


def batched_tiles(n, k):
    c = skinny.batched_config(n, k)
    return -(-n // c.block_n), -(-k // c.block_k), n % c.block_n == 0 and k % c.block_k == 0


def test_batched_tile_cases_cover_the_branches():
    # so that a change of batched_config cannot quietly leave a branch of the kernel untested
    tiles = [batched_tiles(n, k) for n, k in BATCHED_TILE_CASES]
    assert any(k_steps > 1 and even for _, k_steps, even in tiles)  # the unmasked loads past the first K step
    assert any(k_steps > 1 and not even for _, k_steps, even in tiles)  # the masked ones past it
    assert any(n_blocks > 1 and even for n_blocks, _, even in tiles)
    assert any(n_blocks > 1 and not even for n_blocks, _, even in tiles)


@pytest.mark.parametrize("n,k", BATCHED_TILE_CASES)
@pytest.mark.parametrize("layout", ["nk", "kn"])  # W contiguous [H, N, K]; W read along N (MLA's W_UK)
@pytest.mark.parametrize("rows", [1, 3])
def test_batched_tiles_match_einsum(n, k, layout, rows):
    if layout == "nk":
        w = rand(2, n, k, dtype=torch.float32, seed=1)
    else:
        w = rand(2, k, n, dtype=torch.float32, seed=1).transpose(1, 2)
        assert w.stride(1) == 1
    x = rand(rows, 2, k, dtype=torch.float32, seed=2)
    configs = []
    kernel = skinny._kernels().batched
    with skinny.use(True), pytest.MonkeyPatch.context() as mp:
        mp.setattr(skinny._kernels(), "batched", lambda *a, **kw: configs.append(kw["config"]) or kernel(*a, **kw))
        got = skinny.batched(x, w)
    assert configs == [skinny.batched_config(n, k)]  # the kernel ran, with the tiles the coverage test counts
    assert got.shape == (rows, 2, n)
    torch.testing.assert_close(got, torch.einsum("thk,hnk->thn", x, w), rtol=1e-5, atol=1e-4)


def test_dispatch_stays_within_the_kernel_tile():
    for n in (2048, 4096, 8192, 16384):  # each of config_for's classes, at the most rows dispatched
        assert skinny.config_for(n, 4096, skinny.MAX_ROWS).block_m >= skinny.MAX_ROWS
    assert skinny.batched_config(512, 128).block_m >= skinny.MAX_ROWS


def test_describe_names_the_path():
    assert skinny.describe(torch.float32) == "torch linear (float32)"
    assert "skinny Triton kernel at <= 16 rows" in skinny.describe(torch.bfloat16)


def test_tiny_llama_greedy_same_with_and_without(tmp_path, monkeypatch):
    path = save_checkpoint(tiny_llama(), tmp_path)
    llm = attnzoo.load_model(str(path), backend="torch", dtype="float32", device=DEV)
    prompts = random_prompts(160, [9, 5, 12], seed=4)
    with skinny.use(False):
        ref = llm.generate(prompts, max_new_tokens=6)
    calls = []
    kernel = skinny._kernels().linear
    monkeypatch.setattr(skinny._kernels(), "linear", lambda *a, **k: calls.append(k.get("act")) or kernel(*a, **k))
    with skinny.use(True), fused.use("torch"):  # on a GPU the fused ops default to kernels, gated included
        got = llm.generate(prompts, max_new_tokens=6)
    assert calls and set(calls) == {None}  # decode rows took the kernel, the activation a launch of its own
    calls.clear()
    with skinny.use(True), fused.use("triton"):  # the MLP's gate_up and activation as one launch too
        gated = llm.generate(prompts, max_new_tokens=6)
    assert set(calls) == {None, "silu"}
    assert [c.token_ids for c in got] == [c.token_ids for c in gated] == [c.token_ids for c in ref]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_gpu_decode_rows_take_the_kernel():
    w = rand(4096, 4096, dtype=torch.bfloat16, seed=0)
    assert skinny.fits(rand(16, 4096, dtype=torch.bfloat16, seed=1), w)
    assert not skinny.fits(rand(17, 4096, dtype=torch.bfloat16, seed=1), w)
    assert not skinny.fits(rand(1, 4096, dtype=torch.float32, seed=1), w.float())  # float32: cuBLAS


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
                                 (5376, 21504)])
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_gpu_full_shapes_match_cublas(n, k, rows):
    from attnzoo.layers import skinny_kernels

    x, w = rand(rows, k, dtype=torch.bfloat16, seed=5), rand(n, k, dtype=torch.bfloat16, seed=6) * 0.05
    got = skinny_kernels.linear(x, w, config=skinny.config_for(n, k, rows))  # the kernel, whatever fits() decides
    ref = x.float() @ w.float().T
    # both round a float32 sum to bfloat16 once: within a unit or two of the last place
    assert ((got.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-3).float().mean() >= 0.999
    torch.testing.assert_close(got.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("i,k,act", [(14336, 4096, "silu"), (21504, 5376, "gelu_tanh"), (1408, 2048, "silu")])
@pytest.mark.parametrize("rows", [1, 16])
def test_gpu_gated_same_bits_as_unfused(i, k, act, rows):
    x, w = rand(rows, k, dtype=torch.bfloat16, seed=5), rand(2 * i, k, dtype=torch.bfloat16, seed=6) * 0.05
    assert skinny.gates(x, w)
    got = skinny.gated(x, w, None, act)
    ref = fused.act_and_mul(skinny.linear(x, w), act)
    assert (got == ref).float().mean().item() >= 0.999


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("heads", [16, 128])  # DeepSeek-V2-Lite's and V3's heads (nope 128, rank 512, v 128)
@pytest.mark.parametrize("rows", [1, 16])
def test_gpu_batched_mla_shapes_match_bmm(heads, rows, monkeypatch):
    kv_b = rand(heads * 256, 512, dtype=torch.bfloat16, seed=6) * 0.05
    w = kv_b.view(heads, 256, 512)
    w_uk, w_uv = w[:, :128], w[:, 128:]
    q_nope = rand(rows, heads, 192, dtype=torch.bfloat16, seed=5)[..., :128]
    o_lat = rand(rows, heads, 512, dtype=torch.bfloat16, seed=7)
    calls = []
    kernel = skinny._kernels().batched
    monkeypatch.setattr(skinny._kernels(), "batched", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    for x, wt in ((q_nope, w_uk.transpose(1, 2)), (o_lat, w_uv)):
        calls.clear()
        got = skinny.batched(x, wt)
        assert calls == [1]  # the kernel took it: a fallback to bmm would only compare bmm with itself
        ref = torch.bmm(x.transpose(0, 1), wt.transpose(1, 2)).transpose(0, 1)
        exact = torch.einsum("thk,hnk->thn", x.float(), wt.float())
        assert ((got.float() - exact).abs() <= exact.abs() * 2 ** -7 + 1e-3).float().mean() >= 0.999
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_prefetch_bytes_fit_the_row_the_budget_and_the_alignment():
    from attnzoo.layers.skinny_kernels import prefetch_bytes

    w = torch.empty(64, 4096, dtype=torch.bfloat16)
    assert prefetch_bytes(w, 32, 64 * 1024) == 2048  # the budget over 32 rows
    assert prefetch_bytes(w, 32, 1 << 30) == 8192  # at most a row
    assert prefetch_bytes(w, 48, 64 * 1024) == 1360  # whole 16-byte units
    assert prefetch_bytes(w, 32, 0) == 0
    assert prefetch_bytes(torch.empty(64, 12, dtype=torch.bfloat16), 32, 1 << 20) == 0  # 24-byte rows
    shifted = torch.empty(64 * 4096 + 1, dtype=torch.bfloat16)[1:].view(64, 4096)
    assert prefetch_bytes(shifted, 32, 1 << 20) == 0  # rows start 2 bytes off


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("n,k", [(6144, 4096), (6000, 4096), (2800, 2048)])
def test_gpu_prefetch_leaves_the_bits_alone(n, k):
    # also where N is no whole number of tiles (6000 and 2800 over 64-row tiles): the last rows are clamped
    from attnzoo import pdl
    from attnzoo.layers import skinny_kernels

    x, w = rand(3, k, dtype=torch.bfloat16, seed=5), rand(n, k, dtype=torch.bfloat16, seed=6) * 0.05
    if not pdl.enabled(x):
        pytest.skip("the prefetch runs only with PDL (SM90+)")
    c = skinny.config_for(n, k, x.shape[0])  # the 3 rows' tile, as linear() picks it
    want = skinny_kernels.linear(x, w, config=c, prefetch=0)
    for budget in (skinny_kernels.PREFETCH_BUDGET, 1 << 20):
        assert skinny_kernels.prefetch_bytes(w, c.block_n, budget) > 0
        assert torch.equal(skinny_kernels.linear(x, w, config=c, prefetch=budget), want)
