"""The store kernel's grouped heads (``kernels.store.heads_per_program``): a program that stores or rotates several
heads writes the bits a program per head writes, for every kind of row the store takes, and the launch groups heads
only where a step leaves programs to spare.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); every run draws
fresh random inputs, its seed in each failure message.
"""
from __future__ import annotations

import os

import pytest
import torch

from attnzoo.attention.kernels import store
from attnzoo.attention.kernels.store import heads_per_program, store_kv
from attnzoo.attention.kv_cache import quantize_fp8
from attnzoo.attention.store_rope import RoPE
from attnzoo.errors import BackendError
from attnzoo.layers.fused import rope_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOKENS, PAGE, PAGES = 3, 16, 3
SLOTS = torch.tensor([16, 33, 18])  # never page 0, so an unwritten page stays as filled


def _case(kind: str, heads: int, q_heads: int, seed: int) -> dict:
    """Rows and NaN-filled caches for one store: bf16 rows (their cast to a bf16 cache exact) as views of a fused
    QKV projection's buffer, the value cache a strided view (of ``v_base``) as MLA's and NSA's are."""
    gen = torch.Generator().manual_seed(seed)
    d, dv = 32, 24
    fp8 = kind.endswith("fp8")
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    case = dict(kind=kind, heads=heads, q_heads=q_heads, d=d, dv=dv, scale=0.5 if fp8 else 1.0, rope=None,
                qkv=torch.randn(TOKENS, (q_heads + heads) * d + heads * dv, generator=gen).to(torch.bfloat16),
                k_cache=torch.full((PAGES, heads, PAGE, d), float("nan")).to(dtype),
                v_base=torch.full((PAGES, heads, PAGE, 2 * dv), float("nan")).to(dtype))
    if kind.startswith("rope"):
        rotary = 16 if kind == "rope_partial" else d
        pos = torch.arange(TOKENS)[:, None] * 5.0 + 3.0
        freq = 1.0 / 10000 ** (torch.arange(rotary // 2) / (rotary // 2))
        case["rope"] = (torch.cat([(pos * freq).cos()] * 2, -1), torch.cat([(pos * freq).sin()] * 2, -1),
                        kind == "rope_interleaved")
    return case


def _views(case: dict, qkv: torch.Tensor, k_cache: torch.Tensor, v_base: torch.Tensor) -> dict:
    heads, q_heads, d, dv = case["heads"], case["q_heads"], case["d"], case["dv"]
    q, k, v = qkv.split([q_heads * d, heads * d, heads * dv], dim=-1)
    mla = case["kind"] == "mla"
    return dict(qkv=qkv, q=q.view(TOKENS, q_heads, d), k=k.view(TOKENS, heads, d), k_cache=k_cache, v_base=v_base,
                v=None if mla else v.view(TOKENS, heads, dv), v_cache=None if mla else v_base[..., ::2])


def _store(case: dict, per_prog: int | None) -> dict:
    """Stores a fresh device copy of the case's rows into a fresh copy of its caches: -> the copies' views."""
    c = _views(case, *(case[name].clone().to(DEVICE) for name in ("qkv", "k_cache", "v_base")))
    rope = None
    if case["rope"] is not None:
        cos, sin, interleaved = case["rope"]
        rope = RoPE(c["q"], cos.to(DEVICE), sin.to(DEVICE), interleaved)
    store_kv(SLOTS.to(DEVICE), c["k"], c["k_cache"], c["v"], c["v_cache"], k_scale=case["scale"],
             v_scale=case["scale"], rope=rope, heads_per_prog=per_prog)
    return c


def _bytes(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "rope", "rope_interleaved", "rope_partial", "rope_fp8", "mla"])
@pytest.mark.parametrize("heads,q_heads", [(4, 8), (3, 5)])
def test_grouped_heads_store_the_bits_of_a_program_per_head(kind, heads, q_heads):
    # Whole caches compared (the NaN fill included): a masked tail head must write nothing past the last head.
    seed = int.from_bytes(os.urandom(4), "little")
    case = _case(kind, heads, q_heads, seed)
    one = _store(case, 1)
    for per_prog in (2, 4, 8):
        got = _store(case, per_prog)
        for name in ("qkv", "k_cache", "v_base"):
            assert torch.equal(_bytes(got[name]), _bytes(one[name])), \
                f"{name} with {per_prog} heads a program (seed {seed})"
    # and the program per head against torch: RoPE as rope_ref, then the plain store's cast or quantization
    ref = _views(case, case["qkv"], case["k_cache"], case["v_base"])
    k, q = ref["k"], ref["q"]
    if case["rope"] is not None:
        cos, sin, interleaved = case["rope"]
        k, q = rope_ref(k, cos, sin, interleaved), rope_ref(q, cos, sin, interleaved)
        # the GPU rounds float32 -> bfloat16 to nearest; Triton's interpreter truncates (< 1 ulp)
        tol = dict(rtol=0.0, atol=0.0) if DEVICE.type == "cuda" else dict(rtol=2.0**-7, atol=1e-6)
        torch.testing.assert_close(one["q"].cpu(), q, **tol, msg=lambda m: f"q: {m} (seed {seed})")
        torch.testing.assert_close(one["k"].cpu(), k, **tol, msg=lambda m: f"k: {m} (seed {seed})")
        k = one["k"].cpu()  # what was stored is the rows as rotated
    else:
        assert torch.equal(one["qkv"].cpu(), case["qkv"]), f"rows changed without RoPE (seed {seed})"

    def cached(x):
        return quantize_fp8(x, case["scale"]) if kind.endswith("fp8") else x

    page, off = SLOTS // PAGE, SLOTS % PAGE
    assert torch.equal(_bytes(one["k_cache"].cpu()[page, :, off]), _bytes(cached(k))), f"keys (seed {seed})"
    if ref["v"] is not None:
        assert torch.equal(_bytes(one["v_cache"].cpu()[page, :, off]), _bytes(cached(ref["v"]))), \
            f"values (seed {seed})"
    written = torch.zeros(PAGES, PAGE, dtype=torch.bool)
    written[page, off] = True
    unwritten = one["k_cache"].cpu().float().isnan().all(-1).all(1)
    assert unwritten.eq(~written).all(), f"a slot outside the slots was written (seed {seed})"


def test_heads_per_program_groups_only_with_programs_to_spare(monkeypatch):
    assert store.MIN_PROGRAMS == 512 and store.MAX_HEADS_PER_PROG == 8
    assert heads_per_program(1, 8, 32) == 1  # batch 1: 40 programs side by side
    assert heads_per_program(12, 8, 32) == 1  # 480 programs
    assert heads_per_program(26, 8, 32) == 2  # 1,040 programs, 520 by two heads, 260 by four
    assert heads_per_program(64, 8, 32) == 4
    assert heads_per_program(1319, 8, 32) == 8  # 52,760 programs, 6,595 by eight heads
    assert heads_per_program(1319, 8) == 8  # without RoPE's query heads
    assert heads_per_program(10**6, 1) == 1  # one head: grouping would not save a program
    assert heads_per_program(10**6, 3, 5) == 8  # ceil(3/8) + ceil(5/8) = 2 programs a token, from 8
    # the module's constants are read at each call (a bound default once froze one)
    monkeypatch.setattr(store, "MIN_PROGRAMS", 1)
    assert heads_per_program(1, 8, 32) == 8
    monkeypatch.setattr(store, "MAX_HEADS_PER_PROG", 2)
    assert heads_per_program(1, 8, 32) == 2


def test_one_head_a_program_keeps_its_warps():
    # a batch-1 launch is as it was before grouping; grouped tiles get a warp per 512 elements, at most four
    assert [store._warps(1, w) for w in (40, 128, 256, 320, 576, 1024)] == [1, 1, 1, 2, 2, 2]
    assert [store._warps(g, 128) for g in (2, 4, 8)] == [1, 1, 2] and store._warps(8, 512) == 4


def test_store_kv_launches_the_grouping_chosen_at_the_call(monkeypatch):
    launches = []
    real = store._store_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, kwargs["HEADS_PER_PROG"]))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(store, "_store_kernel", Spy())
    case = _case("rope", 3, 5, seed=0)
    _store(case, None)
    monkeypatch.setattr(store, "MIN_PROGRAMS", 1)
    _store(case, None)
    _store(case, 2)
    assert launches == [((TOKENS, 8), 1), ((TOKENS, 2), 8), ((TOKENS, 5), 2)]
    with pytest.raises(BackendError, match="power of two"):
        _store(case, 3)
