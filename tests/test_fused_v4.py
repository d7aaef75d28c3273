"""DeepSeek-V4's fused ops (hyper-connections, the compressor's gated pooling, RoPE on the trailing pairs): the
Triton kernels against their torch references, on the CPU under the interpreter and at V4-Flash's shapes on a GPU."""
import pytest
import torch
import torch.nn.functional as F

from attnzoo.errors import BackendError
from attnzoo.layers import fused
from test_fused import DEV, DTYPES, GPU, assert_bf16_matches, check, make_norm, randn, tol


def pool_rows(n, rate, dim, overlap, dtype, extra=24, rows=300, seed=0):
    """A pool's state rows (a column slice of wider rows, as CSA's main compressor reads them), n blocks'
    slots into them (any rows, repeats too), their valid mask and the position bias."""
    width = 2 * dim if overlap else dim
    span = 2 * rate if overlap else rate
    wide = randn(rows, 2 * width + extra, dtype=dtype, scale=3.0, seed=seed)
    slots = torch.randint(1, rows, (n, span), generator=torch.Generator().manual_seed(seed)).to(DEV)
    valid = torch.ones(n, span, dtype=torch.bool, device=DEV)
    valid[0, : span // 2] = False  # a first block's missing previous block
    valid[-1, 1::3] = False
    return wide[:, : 2 * width], slots, valid, randn(rate, width, dtype=torch.float32, seed=seed + 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,mixes", [(1, 24), (37, 24), (5, 4)])
def test_hc_project(dtype, t, mixes):
    """DeepSeek-V4's hyper-connection mixes: the streams RMS-normed together, times a float32 matrix, in one
    pass; 4 x 48 channels (no whole number of the kernel's 128-wide K steps), one K slice and several."""
    n, hidden = 4, 48
    streams = randn(t, n, hidden, dtype=dtype, scale=3.0)
    fn = randn(mixes, n * hidden, dtype=torch.float32, seed=1)
    check(lambda: fused.hc_project(streams, fn, 1e-6), torch.float32)  # float32 out: its tolerance
    with fused.use("torch"):
        ref = fused.hc_project(streams, fn, 1e-6)
    assert ref.dtype == torch.float32 and ref.shape == (t, mixes)
    if not GPU:  # one K slice (scaled in the kernel) and two (partials summed in the wrapper)
        from attnzoo.layers import v4_kernels
        for splits in (1, 2):
            got = v4_kernels.hc_project(streams, fn, 1e-6, splits=splits)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(BackendError, match="hc_project got"):
        fused.hc_project(streams, fn[:, 1:], 1e-6)


def test_hc_project_strided_streams_and_row_blocks():
    """Every other row of a wider batch (the row stride is not n H) and 300 rows: several 64-row blocks."""
    n, hidden = 4, 48
    streams = randn(600, n, hidden, dtype=torch.bfloat16, scale=3.0)[::2]
    fn = randn(24, n * hidden, dtype=torch.float32, seed=1)
    check(lambda: fused.hc_project(streams, fn, 1e-6), torch.float32)
    check(lambda: fused.hc_project(streams[:7], fn, 1e-6), torch.float32)


@pytest.mark.parametrize("n,iters,t", [(4, 20, 37), (4, 1, 1), (3, 5, 33)])
def test_hc_weights(n, iters, t):
    """DeepSeek-V4's hyper-connection weights: sigmoid pre/post and the Sinkhorn-projected comb, over a
    row count that is not a multiple of the kernel's block; n = 3 pads the n x n tile to 4 x 4."""
    mixes = randn(t, (2 + n) * n, dtype=torch.float32, scale=2.0)
    scale, base = randn(3, dtype=torch.float32, seed=1) + 1.0, randn((2 + n) * n, dtype=torch.float32, seed=2)
    check(lambda: fused.hc_weights(mixes, scale, base, n=n, iters=iters, eps=1e-6), torch.float32)
    with fused.use("triton"):
        pre, post, comb = fused.hc_weights(mixes, scale, base, n=n, iters=iters, eps=1e-6)
    # after the last column step every column sums to 1 (up to eps)
    torch.testing.assert_close(comb.sum(dim=-2), torch.ones(t, n, device=DEV), rtol=1e-5, atol=1e-5)
    with pytest.raises(BackendError, match="float32 mixes"):
        fused.hc_weights(mixes.bfloat16(), scale, base, n=n, iters=iters, eps=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [4, 3])
def test_hc_collapse_and_mix(dtype, n):
    """The streams collapsed with pre, and a block output spread back with post while comb mixes the
    streams (comb transposed: stream k takes sum_j comb[j, k] stream_j); 700 channels: a partial block."""
    t, hidden = 5, 700
    streams = randn(t, n, hidden, dtype=dtype)
    out = randn(t, hidden, dtype=dtype, seed=1)
    pre = torch.rand(t, n, generator=torch.Generator().manual_seed(2)).to(DEV)
    comb = torch.rand(t, n, n, generator=torch.Generator().manual_seed(3)).to(DEV)
    check(lambda: fused.hc_collapse(streams, pre), dtype)
    check(lambda: fused.hc_mix(streams, pre, comb, out), dtype)
    with fused.use("torch"):  # the reference itself: comb's transpose
        mixed = fused.hc_mix(streams, torch.zeros_like(pre), comb, out).float()
    expect = torch.einsum("tjk,tjh->tkh", comb.to(dtype).float(), streams.float())
    torch.testing.assert_close(mixed, expect, **tol(dtype))
    with pytest.raises(BackendError, match="hc_mix got"):
        fused.hc_mix(streams, pre, comb, out[:, :-1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rate,dim,overlap", [(128, 96, False), (4, 40, True), (6, 16, True)])
def test_gated_pool(dtype, rate, dim, overlap):
    """V4's compressor pooling read from the pool's rows by slot: HCA's span (128), CSA's overlapping 2 x 4
    and 2 x 6 (padded to 16), channels past the kernel's block; invalid positions weigh nothing."""
    rows, slots, valid, bias = pool_rows(5, rate, dim, overlap, dtype)
    pool = dict(dim=dim, rate=rate, overlap=overlap)
    check(lambda: fused.gated_pool(rows, slots, valid, bias, **pool), dtype)
    with fused.use("triton"):
        got = fused.gated_pool(rows, slots, valid, bias, **pool)
        slots[0, : slots.shape[1] // 2] = 0  # an invalid position's row must not count: row 0 is nobody else's
        rows[0] = 1e4
        assert torch.equal(fused.gated_pool(rows, slots, valid, bias, **pool)[0], got[0])
    with pytest.raises(BackendError, match="gated_pool got"):
        fused.gated_pool(rows, slots[:, :-1], valid, bias, **pool)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_tail(dtype):
    """DeepSeek-V4's RoPE (pairs on the trailing channels, kept in place), alone, after a per-head norm
    (with and without scale), in place, and on a [T, D] column slice of a wider projection."""
    t, h, d, r = 5, 6, 48, 8
    x = randn(t, h, d, dtype=dtype, scale=3.0)
    f = randn(t, r, dtype=torch.float32, seed=1)
    cos, sin = f.cos(), f.sin()
    for norm in (None, make_norm(d, dtype, seed=2), make_norm(d, dtype, scale=False)):
        check(lambda: fused.rope_tail(x, cos, sin, norm=norm), dtype)
        check(lambda: fused.rope_tail(x.clone(), cos, sin, norm=norm, in_place=True), dtype)
        wide = randn(t, 3 * d, dtype=dtype, seed=3)
        check(lambda: (fused.rope_tail(wide.clone()[:, d:2 * d], cos, sin, norm=norm, in_place=True),), dtype)
    for impl in ("torch", "triton"):
        with fused.use(impl):
            y = x.clone()
            out = fused.rope_tail(y, cos, -sin, in_place=True)  # un-rotation, in place: y itself
            assert out.data_ptr() == y.data_ptr() and torch.equal(y[..., : d - 2 * r], x[..., : d - 2 * r])
            back = fused.rope_tail(fused.rope_tail(x, cos, sin), cos, -sin)
            torch.testing.assert_close(back, x, **tol(dtype))
    # the textbook form: (x0, x1) -> (x0 c - x1 s, x1 c + x0 s) per pair of the last 2 r channels
    x32 = x.float()
    pairs = x32[..., d - 2 * r:].unflatten(-1, (r, 2))
    c, s_ = cos[:, None], sin[:, None]
    want = torch.stack((pairs[..., 0] * c - pairs[..., 1] * s_, pairs[..., 1] * c + pairs[..., 0] * s_), dim=-1)
    with fused.use("torch"):
        got = fused.rope_tail(x32, cos, sin)
    torch.testing.assert_close(got[..., d - 2 * r:], want.flatten(-2), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 1024, 9000])
def test_gpu_hc_project_v4_flash_shape(tokens):
    """V4-Flash's mixes (4 streams of 4096): K split over many programs at 1 and 1024 rows, one pass at 9000."""
    n, hidden = 4, 4096
    streams = randn(tokens, n, hidden, dtype=torch.bfloat16)
    for rows in ((2 + n) * n, n):  # a block's mixes and the head's
        fn = randn(rows, n * hidden, dtype=torch.float32, seed=4) * hidden**-0.5
        ref = F.linear(F.rms_norm(streams.flatten(1).double(), (n * hidden,), eps=1e-6), fn.double())
        # against float64: a 16,384-term float32 sum strays by ~sqrt(K) eps |y| in any order, past 1e-5 at times
        torch.testing.assert_close(fused.hc_project(streams, fn, 1e-6).double(), ref, rtol=1e-4, atol=5e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 1319])
def test_gpu_rope_tail_v4_flash_shape(tokens):
    """V4-Flash's q (64 heads of 512, weightless per-head norm), its key (a [T, 512] column slice of the merged
    projection, float32 norm weight) and the output's un-rotation in place, 64 rotary channels."""
    f = randn(tokens, 32, dtype=torch.float32, seed=1) * 100
    cos, sin = f.cos(), f.sin()
    q = randn(tokens, 64, 512, dtype=torch.bfloat16, scale=2.0)
    kv = randn(tokens, 1536, dtype=torch.bfloat16, seed=2)[:, 1024:]
    q_norm, kv_norm = make_norm(512, torch.bfloat16, scale=False), make_norm(512, torch.float32, seed=3)
    for x, norm, s, in_place in ((q, q_norm, sin, False), (kv, kv_norm, sin, True), (q, None, -sin, True)):
        with fused.use("torch"):
            ref = fused.rope_tail(x.clone(), cos, s, norm=norm, in_place=in_place)
        got = fused.rope_tail(x.clone(), cos, s, norm=norm, in_place=in_place)
        assert_bf16_matches(got, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 1024])
def test_gpu_hyper_connection_kernels_v4_flash_shape(tokens):
    """DeepSeek-V4-Flash's mHC (4 streams of 4096, 20 Sinkhorn steps): the kernels against the torch
    reference on the GPU, bf16 streams and float32 weights, as the model runs them."""
    n, hidden = 4, 4096
    mixes = randn(tokens, (2 + n) * n, dtype=torch.float32, scale=2.0)
    scale, base = randn(3, dtype=torch.float32, seed=1) + 1.0, randn((2 + n) * n, dtype=torch.float32, seed=2)
    with fused.use("torch"):
        ref = fused.hc_weights(mixes, scale, base, n=n, iters=20, eps=1e-6)
    got = fused.hc_weights(mixes, scale, base, n=n, iters=20, eps=1e-6)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    pre, post, comb = ref
    streams, out = randn(tokens, n, hidden, dtype=torch.bfloat16), randn(tokens, hidden, dtype=torch.bfloat16, seed=3)
    with fused.use("torch"):
        ref_x, ref_s = fused.hc_collapse(streams, pre), fused.hc_mix(streams, post, comb, out)
    assert_bf16_matches(fused.hc_collapse(streams, pre), ref_x)
    # cuBLAS's bf16 batched GEMM at K=4 rounds its own way (a fifth of outputs a unit apart on an H100):
    # the bits against float32 arithmetic with the reference's rounding points, closeness against torch's
    dt, f = torch.bfloat16, torch.float32
    spread = (post.to(dt).to(f).unsqueeze(-1) * out.to(f).unsqueeze(1)).to(dt)
    mixed = torch.matmul(comb.to(dt).to(f).transpose(-1, -2), streams.to(f)).to(dt)
    got = fused.hc_mix(streams, post, comb, out)
    assert_bf16_matches(got, (spread.to(f) + mixed.to(f)).to(dt))
    torch.testing.assert_close(got, ref_s, rtol=2**-7, atol=2**-6 * ref_s.float().std().item())


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rate,dim,overlap", [(128, 512, False), (4, 512, True), (4, 128, True)])  # HCA, CSA, indexer
def test_gpu_gated_pool_v4_flash_shape(rate, dim, overlap):
    """The compressor pooling of a batch-512 decode step (one block per row) against the torch reference."""
    rows, slots, valid, bias = pool_rows(512, rate, dim, overlap, torch.bfloat16, rows=70_000)
    valid[::7, : slots.shape[1] // 2] = False
    pool = dict(dim=dim, rate=rate, overlap=overlap)
    with fused.use("torch"):
        ref = fused.gated_pool(rows, slots, valid, bias, **pool)
    # up to 128 products summed in another order than torch's reduction: some outputs land a bf16 unit apart
    assert_bf16_matches(fused.gated_pool(rows, slots, valid, bias, **pool), ref, min_equal=0.99)
