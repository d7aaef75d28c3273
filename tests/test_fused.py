"""Fused ops (attnzoo.layers.fused) against their torch references, and whole tiny models run fused vs
unfused. Without a GPU the Triton kernels run in Triton's interpreter (tests/conftest.py) on tiny shapes;
with one, on the GPU, plus realistic shapes (marked gpu)."""
import pytest
import torch

import attnzoo
from attnzoo.errors import BackendError
from attnzoo.layers import fused
from attnzoo.models.common import RMSNorm
from helpers import random_prompts, save_checkpoint
from test_deepseek import tiny_v2
from test_deepseek_v4 import MODELS as V4_MODELS, tiny_v4
from test_gemma4 import dense_31b_like, e2b_like
from test_llama import tiny_llama

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype):
    # bfloat16: Triton's interpreter truncates float32 -> bfloat16 (no round-to-nearest), one unit in the
    # last place per rounding point; on a GPU the kernels round as torch does.
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def make_norm(n, dtype, *, offset=0.0, scale=True, eps=1e-6, seed=0):
    norm = RMSNorm(n, eps, offset=offset, with_scale=scale).to(DEV, dtype)
    if scale:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(n, generator=g) + 0.5 - offset)
    return norm


def randn(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


def check(fn, dtype):
    """fn() under the Triton kernels equals fn() under the torch reference."""
    with fused.use("torch"):
        ref = fn()
    with fused.use("triton"):
        got = fn()
    for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
        assert g.dtype == r.dtype and g.shape == r.shape
        torch.testing.assert_close(g, r, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype):
    x = randn(5, 40, dtype=dtype, scale=3.0)
    check(lambda: fused.rms_norm(x, make_norm(40, dtype, offset=1.0)), dtype)  # Gemma-style stored weight - 1
    # Per-head norms on [T, H, D] views of a wider projection output (strided heads), with and without scale.
    heads = randn(5, 3 * 48, dtype=dtype, seed=1)[:, 16:].unflatten(1, (4, 32))
    check(lambda: fused.rms_norm(heads, make_norm(32, dtype)), dtype)
    check(lambda: fused.rms_norm(heads, make_norm(32, dtype, scale=False)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("post_norm", [False, True], ids=["add-norm", "postnorm-add-norm"])
def test_add_rms_norm(dtype, post_norm):
    x, residual = randn(6, 72, dtype=dtype), randn(6, 72, dtype=dtype, scale=4.0, seed=1)
    norm = make_norm(72, dtype, eps=1e-5)
    x_norm = make_norm(72, dtype, seed=2) if post_norm else None
    check(lambda: fused.add_rms_norm(x, residual, norm, x_norm=x_norm), dtype)
    check(lambda: fused.add_rms_norm(x, None, norm, x_norm=x_norm), dtype)  # first layer: no residual yet
    with fused.use("triton"):
        _, s = fused.add_rms_norm(x, residual, norm)
    if dtype == torch.bfloat16 and not GPU:  # the interpreter truncates bf16 stores: one unit at most
        torch.testing.assert_close(s, residual + x, rtol=2**-7, atol=0)
    else:
        assert torch.equal(s, residual + x)  # the add rounds once, as torch's


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_and_mul(dtype, act):
    x = randn(7, 2 * 24, dtype=dtype, scale=4.0)
    check(lambda: fused.act_and_mul(x, act), dtype)
    check(lambda: fused.act_and_mul(x[:0], act), dtype)  # an empty step


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap(dtype):
    """Gemma's final logit soft-cap, float32 out from any input dtype; a length that is not a multiple of
    the kernel's block; +-inf map to +-cap and NaN stays NaN, as torch's tanh does."""
    x = randn(3, 4099, dtype=dtype, scale=60.0)
    x[0, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")], dtype=dtype)
    with fused.use("torch"):
        ref = fused.softcap(x, 30.0)
    with fused.use("triton"):
        got = fused.softcap(x, 30.0)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-5, equal_nan=True)
    assert got[0, :2].tolist() == [30.0, -30.0] and got[0, 2].isnan()
    with fused.use("triton"):
        assert fused.softcap(x[:0], 30.0).shape == (0, 4099)


@pytest.mark.parametrize("vocab", [7, 4099, 9000])
def test_argmax_finite(vocab):
    """Greedy tokens: the first index on ties (within a chunk and across chunks of the kernel), -1 for a row
    with NaN, +inf, or nothing but -inf; -inf entries elsewhere and a strided row view are fine."""
    x = randn(7, vocab, dtype=torch.float32, scale=3.0)
    top = x.max().item() + 1.0
    x[0, [vocab // 2, vocab - 1]] = top  # a tie: the first wins
    x[1, 0] = float("nan")
    x[2, vocab - 1] = float("inf")
    x[3] = float("-inf")
    x[4, : vocab // 2] = float("-inf")
    x[5, [1, vocab - 2]] = top  # the earliest chunk holds the first of the tie
    view = torch.cat([x, x], dim=1)[:, :vocab]  # rows strided past their length
    with fused.use("torch"):
        ref = fused.argmax_finite(view)
    with fused.use("triton"):
        got = fused.argmax_finite(view)
    assert got.dtype == torch.int64 and got.tolist() == ref.tolist()
    assert got[1:4].tolist() == [-1, -1, -1] and got[0] == vocab // 2 and got[5] == 1
    with fused.use("triton"):
        assert fused.argmax_finite(x[:0]).shape == (0,)


try:  # a kernel of the test's own around fused_kernels.rounded (Triton resolves its globals at module level)
    import triton
    import triton.language as tl

    from attnzoo.layers.fused_kernels import rounded

    @triton.jit
    def _round_kernel(X, Y, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(Y + offs, rounded(tl.load(X + offs, mask=offs < n), "bf16"), mask=offs < n)
except ImportError:
    _round_kernel = None


@pytest.mark.skipif(_round_kernel is None, reason="needs Triton")
def test_rounded_to_bf16_keeps_nan_and_inf():
    """The kernels' bf16 rounding (fused_kernels.rounded) rounds to nearest even as torch does, and keeps NaN of
    any payload: the GPU's NaN is 0x7FFFFFFF, whose integer rounding carried into the sign (-0.0, finite logits)."""
    words = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x3F808000,
             0x3F818000, 0x3F80C000, 0x00000001, 0x80000000]
    x = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32).view(torch.float32)
    x = torch.cat([x.to(DEV), randn(53, dtype=torch.float32, scale=100.0)])
    y = torch.empty_like(x)
    _round_kernel[(1,)](x, y, x.numel(), BLOCK=128)
    nan = x.isnan()
    assert nan[:4].all() and y[nan].isnan().all()
    assert torch.equal(y[~nan], x[~nan].to(torch.bfloat16).float())

def rope_inputs(dtype, *, t=5, qh=4, kh=2, d=40, rot=None, seed=0):
    """q and k as views of one qkv projection output (strided rows), cos/sin [t, rot] float32."""
    qkv = randn(t, (qh + 2 * kh) * d, dtype=dtype, seed=seed)
    q, k, _ = qkv.split([qh * d, kh * d, kh * d], dim=-1)
    ang = randn(t, (rot or d) // 2, dtype=torch.float32, scale=3.0, seed=seed + 1)
    emb = torch.cat([ang, ang], dim=-1)
    return q.unflatten(1, (qh, d)), k.unflatten(1, (kh, d)), emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate-half", "interleaved"])
def test_rope(dtype, interleaved):
    q, k, cos, sin = rope_inputs(dtype)  # head dim 40: 20 frequencies, a padded tile
    check(lambda: fused.rope(q, k, cos, sin, interleaved=interleaved), dtype)
    q, k, cos, sin = rope_inputs(dtype, qh=32, kh=8, d=64, seed=3)  # heads spread over several programs
    check(lambda: fused.rope(q, k, cos, sin, interleaved=interleaved), dtype)
    # Partial RoPE (DeepSeek-V3.2's indexer): channels past the rotary dim pass through; no k.
    q, _, cos, sin = rope_inputs(dtype, d=48, rot=16, seed=5)
    check(lambda: fused.rope(q, None, cos, sin, interleaved=interleaved)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate-half", "interleaved"])
@pytest.mark.parametrize("heads,rope,norm", [(2, 16, "weight"), (33, 64, "weight"), (3, 16, "offset"),
                                             (3, 16, "none")])
def test_mla_entry(dtype, interleaved, heads, rope, norm, monkeypatch):
    # kv as a slice of a wider projection output (strided rows), a 40-wide latent (a padded tile); 33 heads of
    # 64-wide q_pe: two programs of q heads after the entry's
    from attnzoo.layers import fused_kernels

    t, rank = 5, 40
    proj = randn(t, heads * (rope + 8) + rank + rope, dtype=dtype, seed=1)
    q_pe = proj[:, :heads * (rope + 8)].view(t, heads, rope + 8)[..., 8:]
    kv = proj[:, heads * (rope + 8):]
    _, _, cos, sin = rope_inputs(dtype, d=rope, seed=2)
    cos, sin = cos[:t], sin[:t]
    norm = make_norm(rank, dtype, seed=3, offset=1.0 if norm == "offset" else 0.0, scale=norm != "none")
    kernel, launches = fused_kernels.mla_entry, []
    monkeypatch.setattr(fused_kernels, "mla_entry", lambda *a, **k: launches.append(1) or kernel(*a, **k))
    check(lambda: fused.mla_entry(q_pe, kv, norm, cos, sin, interleaved=interleaved), dtype)
    assert launches == [1]  # the kernel ran under "triton", not the reference
    buf = torch.full((t, heads, 24 + rope), 7.0, dtype=dtype, device=DEV)  # q_pe into a buffer's last channels
    with fused.use("triton"):
        q_out, _ = fused.mla_entry(q_pe, kv, norm, cos, sin, interleaved=interleaved, q_out=buf[..., 24:])
    assert q_out.data_ptr() == buf[..., 24:].data_ptr() and bool((buf[..., :24] == 7.0).all())
    check(lambda: fused.mla_entry(q_pe, kv, norm, cos, sin, interleaved=interleaved, q_out=buf[..., 24:].clone()), dtype)
    with fused.use("torch"):
        torch.testing.assert_close(q_out, fused.mla_entry(q_pe, kv, norm, cos, sin, interleaved=interleaved)[0])
    q_ref, entry = fused.mla_entry_ref(q_pe, kv, norm, cos, sin, interleaved)
    torch.testing.assert_close(q_ref, fused.rope_ref(q_pe, cos, sin, interleaved))
    torch.testing.assert_close(entry[:, :rank], fused.rms_norm_ref(kv[:, :rank], norm))


def test_mla_absorbed_query_fills_the_rope_slot_buffer():
    from attnzoo.attention.mla import MLAAttention, absorb_query, absorbed_query

    t, h, nope, rank, rope = 3, 4, 8, 16, 8
    mla = MLAAttention(0, h, kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=8,
                       scale=1.0)
    q_nope, w_uk = randn(t, h, nope, dtype=torch.float32), randn(h, nope, rank, dtype=torch.float32, seed=1)
    slot = mla.rope_slot(t, q_nope)
    slot.copy_(randn(t, h, rope, dtype=torch.float32, seed=2))
    want = torch.cat([absorb_query(q_nope, w_uk), slot], dim=-1)
    q = absorbed_query(q_nope, slot, w_uk, in_slot=True)
    assert q.data_ptr() == slot.data_ptr() - rank * 4 and torch.allclose(q, want)  # the slot's own buffer, filled
    # not said to be in its slot: concatenated, whatever its layout (here a caller's [T, H, rank + rope] tensor)
    keep = randn(t, h, rank + rope, dtype=torch.float32, seed=3)
    before = keep.clone()
    q = absorbed_query(q_nope, keep[..., rank:], w_uk)
    assert torch.equal(keep, before) and torch.allclose(q, torch.cat([absorb_query(q_nope, w_uk), keep[..., rank:]], -1))
    with pytest.raises(ValueError, match="rope_slot"):
        absorbed_query(q_nope, slot.contiguous(), w_uk, in_slot=True)
    # autograd records: out= cannot be differentiated, so the concatenation, and the gradient reaches W_UK
    w_grad = w_uk.clone().requires_grad_()
    absorbed_query(q_nope, mla.rope_slot(t, q_nope).copy_(slot), w_grad, in_slot=True).sum().backward()
    assert w_grad.grad is not None


def test_mla_cache_entry_reads_the_fused_entry_in_place():
    from attnzoo.attention.mla import cache_entry

    entry = randn(3, 40 + 16, dtype=torch.float32)
    latent, k_pe = entry.split([40, 16], dim=-1)
    view = cache_entry(latent, k_pe)
    assert view.shape == (3, 1, 56) and view.data_ptr() == entry.data_ptr() and torch.equal(view[:, 0], entry)
    apart = cache_entry(latent.clone(), k_pe.clone())  # two buffers: concatenated
    assert apart.data_ptr() != entry.data_ptr() and torch.equal(apart[:, 0], entry)
    swapped = cache_entry(k_pe, latent[:, :16])  # adjacent the other way round: not the entry
    assert torch.equal(swapped[:, 0], torch.cat([k_pe, latent[:, :16]], dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_with_scale(dtype):
    """Gemma 4's layer end: (x + post_norm(h)) * layer_scalar, then the next layer's input norm."""
    h, x = randn(6, 72, dtype=dtype, scale=3.0), randn(6, 72, dtype=dtype, scale=4.0, seed=1)
    norm, post = make_norm(72, dtype), make_norm(72, dtype, seed=2)
    scalar = torch.tensor([0.37], device=DEV).to(dtype)
    check(lambda: fused.add_rms_norm(h, x, norm, x_norm=post, scale=scalar), dtype)
    check(lambda: fused.add_rms_norm(h, x, norm, scale=scalar), dtype)
    check(lambda: fused.add_rms_norm(h, None, norm, x_norm=post, scale=scalar), dtype)
    with fused.use("torch"):
        _, s = fused.add_rms_norm(h, x, norm, x_norm=post, scale=scalar)
    torch.testing.assert_close(s, (x + fused.rms_norm(h, post)) * scalar, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate-half", "interleaved"])
def test_norm_rope(dtype, interleaved):
    """Per-head q/k/v norms then q/k RoPE in one launch, against the separate ops."""
    t, qh, kh, d = 5, 4, 2, 40
    qkv = randn(t, (qh + 2 * kh) * d, dtype=dtype, scale=3.0)
    q, k, v = (p.unflatten(1, (-1, d)) for p in qkv.split([qh * d, kh * d, kh * d], dim=-1))
    _, _, cos, sin = rope_inputs(dtype, t=t, d=d, seed=1)
    qn, kn = make_norm(d, dtype, offset=1.0, seed=3), make_norm(d, dtype, seed=4)
    vn = make_norm(d, dtype, scale=False)
    check(lambda: fused.norm_rope(q, k, v, cos, sin, q_norm=qn, k_norm=kn, v_norm=vn, interleaved=interleaved), dtype)
    check(lambda: fused.norm_rope(q, k, k, cos, sin, q_norm=qn, k_norm=kn, v_norm=vn), dtype)  # K doubles as V
    check(lambda: fused.norm_rope(q, None, None, cos, sin, q_norm=qn)[0], dtype)  # a KV-sharing layer
    _, _, cos, sin = rope_inputs(dtype, t=t, d=d, rot=16, seed=2)  # partial RoPE: the norm spans all channels
    check(lambda: fused.norm_rope(q, k, v, cos, sin, q_norm=qn, k_norm=kn, v_norm=vn), dtype)
    with fused.use("torch"):
        got = fused.norm_rope(q, k, v, cos, sin, q_norm=qn, k_norm=kn, v_norm=vn)
    want = (fused.rope_ref(fused.rms_norm_ref(q, qn), cos, sin), fused.rope_ref(fused.rms_norm_ref(k, kn), cos, sin),
            fused.rms_norm_ref(v, vn))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    check(lambda: fused.norm_rope(q, k, None, cos, sin, q_norm=qn, k_norm=kn)[:2], dtype)  # QK-norm only (Qwen3)
    with pytest.raises(BackendError, match="v without k"):
        fused.norm_rope(q, None, v, cos, sin, q_norm=qn)


def test_rope_reference_is_rotate_half():
    """The reference against the textbook rotate-half form x * cos + rotate_half(x) * sin."""
    q, _, cos, sin = rope_inputs(torch.float32)
    half = q.shape[-1] // 2
    textbook = q * cos[:, None] + torch.cat([-q[..., half:], q[..., :half]], dim=-1) * sin[:, None]
    torch.testing.assert_close(fused.rope_ref(q, cos, sin), textbook, rtol=1e-6, atol=1e-6)


def test_use_rejects_unknown_implementation():
    with pytest.raises(BackendError, match="unknown fused-op implementation"):
        with fused.use("cuda"):
            pass


# Whole models: every fused op in its place (merged qkv / gate_up projections, residual stream through
# add_and_norm, Gemma's post-norms and per-head norms, interleaved MLA RoPE, partial RoPE, V4's mHC weights).
MODELS = {
    "llama": lambda: tiny_llama(heads=4, kv_heads=2, head_dim=32),
    "gemma4-dense-k_eq_v": dense_31b_like,
    "gemma4-ple-shared-kv": e2b_like,
    "deepseek-v2": lambda: tiny_v2(num_hidden_layers=2),
    "deepseek-v4-hyper-connections": lambda: tiny_v4(*V4_MODELS["all-kinds"]),
}


def generate(path, impl, dtype, steps, backend="torch"):
    with fused.use(impl):  # around loading too: CUDA graphs are captured with the ops of their time
        llm = attnzoo.load_model(path, backend=backend, device=DEV, dtype=dtype, page_size=16)
        prompts = random_prompts(min(160, llm.config_vocab_size), [9], seed=3)
        out = llm.generate(prompts, max_new_tokens=steps, ignore_eos=True, return_logits=True)
    return out[0]


@pytest.mark.parametrize("name", MODELS)
def test_model_fused_equals_reference(tmp_path, name):
    path = save_checkpoint(MODELS[name](), tmp_path)
    ref = generate(path, "torch", "float32", steps=6)
    got = generate(path, "triton", "float32", steps=6)
    assert got.token_ids == ref.token_ids
    assert (got.logits - ref.logits).abs().max().item() < 1e-4


# ----------------------------------------------------------------------------------------------
# GPU: realistic shapes, bf16 models

def assert_bf16_matches(got, ref, min_equal=0.999):
    """Same rounding points as the reference: nearly all bits equal, the rest a bf16 unit or so apart
    (float32 reduction order and exp differ; a unit of a summand can be large next to a small sum)."""
    torch.testing.assert_close(got, ref, rtol=2**-7, atol=2**-6 * ref.float().std().item())
    assert (got == ref).float().mean().item() >= min_equal


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", ["llama-8b", "gemma4-31b"])
@pytest.mark.parametrize("tokens", [1, 1024])
def test_gpu_realistic_shapes(shape, tokens):
    hidden, inter, heads, kv_heads, d = {"llama-8b": (4096, 14336, 32, 8, 128),
                                         "gemma4-31b": (5376, 21504, 32, 4, 512)}[shape]
    dt = torch.bfloat16
    x, residual = randn(tokens, hidden, dtype=dt), randn(tokens, hidden, dtype=dt, scale=8.0, seed=1)
    norm, post = make_norm(hidden, dt), make_norm(hidden, dt, seed=2)
    gate_up = randn(tokens, 2 * inter, dtype=dt, scale=3.0, seed=3)
    q, k, cos, sin = rope_inputs(dt, t=tokens, qh=heads, kh=kv_heads, d=d, seed=4)
    cases = {
        "rms_norm": lambda: fused.rms_norm(x, norm),
        "per_head_norm": lambda: fused.rms_norm(q, make_norm(d, dt)),
        "add_rms_norm": lambda: fused.add_rms_norm(x, residual, norm),
        "postnorm_add_rms_norm": lambda: fused.add_rms_norm(x, residual, norm, x_norm=post),
        "silu_mul": lambda: fused.act_and_mul(gate_up, "silu"),
        "gelu_tanh_mul": lambda: fused.act_and_mul(gate_up, "gelu_tanh"),
        "rope_qk": lambda: fused.rope(q, k, cos, sin),
        "norm_rope_qkv": lambda: fused.norm_rope(q, k, k, cos, sin, q_norm=make_norm(d, dt), k_norm=make_norm(d, dt),
                                                 v_norm=make_norm(d, dt, scale=False)),
        "scaled_postnorm_add_rms_norm": lambda: fused.add_rms_norm(
            x, residual, norm, x_norm=post, scale=torch.tensor([0.6], device=DEV).to(dt)),
    }
    for name, fn in cases.items():
        with fused.use("torch"):
            ref = fn()
        got = fn()
        for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
            assert g.is_cuda and g.shape == r.shape, name
            # Reductions over 4-5k channels in another order move a few percent of bf16 roundings
            # by one unit (97.4% bit-equal measured on an H200); the closeness check above stays tight.
            assert_bf16_matches(g, r, min_equal=0.95)
    logits = randn(tokens, 262144, dtype=dt, scale=40.0, seed=5)  # Gemma 4's vocabulary, float32 out
    with fused.use("torch"):
        ref = fused.softcap(logits, 30.0)
    torch.testing.assert_close(fused.softcap(logits, 30.0), ref, rtol=1e-5, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 64, 1319])
def test_gpu_argmax_finite_full_vocab(rows):
    x = randn(rows, 128256, dtype=torch.float32, scale=3.0, seed=rows)
    x[0, 70000] = x[0, 3] = x.max() + 1  # a tie across chunks
    x[-1, 5] = float("nan") if rows > 1 else x[-1, 5]
    got = fused.argmax_finite(x)
    with fused.use("torch"):
        assert got.tolist() == fused.argmax_finite(x).tolist()
    assert got[0] == 3


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", MODELS)
def test_gpu_greedy_fused_equals_unfused(tmp_path, name):
    """bf16 on the GPU, triton attention with CUDA graphs: fused and unfused give the same tokens."""
    hf = MODELS[name]()
    with torch.no_grad():  # Gemma: unit-scale attention scores, as in helpers.tiny_gemma4
        for n, p in hf.named_parameters():
            if n.endswith("q_norm.weight"):
                p.mul_(p.shape[0] ** -0.5)
    path = save_checkpoint(hf, tmp_path)
    backend = "compressed_triton" if "v4" in name else "triton"  # V4's layers need its compressed attention
    ref = generate(path, "torch", "bfloat16", steps=16, backend=backend)
    got = generate(path, "triton", "bfloat16", steps=16, backend=backend)
    assert got.token_ids == ref.token_ids
