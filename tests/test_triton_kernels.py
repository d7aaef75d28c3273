"""Triton kernels against the torch reference (the ``triton`` backend through the layer: test_triton_backend.py).

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
triton is imported), on small shapes; with one, the same cases run on the GPU, plus the realistic
shapes marked ``gpu``. Every run draws fresh random inputs (the seed is in each failure message), fills
the pool with NaN except the tokens a request owns, and poisons outputs with NaN before the call, so a
kernel that reads padding or skips a row cannot pass.
"""
from __future__ import annotations

import os

import pytest
import torch

from attnzoo.attention.backends.torch_ref import TorchBackend, attention_reference
from attnzoo.attention.kernels.decode import decode_attention
from attnzoo.attention.kernels.decode_launch import choose_num_kv_splits
from attnzoo.attention.kernels.extend import extend_attention
from attnzoo.attention.kernels.page_table import (
    create_block_table,
    create_kv_indices,
    kv_indptr,
    kv_last_page_len,
    num_pages_host,
    padded_block_table_width,
)
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.layer import Attention
from attnzoo.attention.metadata import build_metadata
from attnzoo.errors import BackendError

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def layer_inputs(layer, n: int, gen: torch.Generator, dtype: torch.dtype):
    """Random (q, k, v) of n tokens for an ``Attention`` layer, on DEVICE; v is None for MLA (values in the key)."""
    def rand(heads, dim):
        return torch.randn(n, heads, dim, generator=gen).to(dtype).to(DEVICE)

    v = None if layer.kind == "mla" else rand(layer.num_kv_heads, layer.v_head_dim)
    return rand(layer.num_heads, layer.head_dim), rand(layer.num_kv_heads, layer.head_dim), v


class PagedKV:
    """Random per-request keys/values scattered over shuffled pages of a NaN-filled pool."""

    def __init__(self, seq_lens, *, kv_heads, head_dim, v_dim, page_size, dtype, mla=False, gen, device=DEVICE):
        self.seq_lens = list(seq_lens)
        self.page_size = ps = page_size
        pages = [-(-s // ps) for s in seq_lens]
        num_pages = sum(pages) + 2  # page 0 (padding) and one page nobody owns
        self.k_cache = torch.full((num_pages, kv_heads, ps, head_dim), float("nan"), dtype=dtype, device=device)
        if mla:
            self.v_cache = self.k_cache[..., :v_dim]  # values are the latent: a strided view, as in KVPool
        else:
            self.v_cache = torch.full((num_pages, kv_heads, ps, v_dim), float("nan"), dtype=dtype, device=device)
        order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
        # one spare column of padding: kernels must stop at each request's own pages
        self.block_tables = torch.zeros(len(seq_lens), max(pages) + 1, dtype=torch.int32)
        self.k, self.v = [], []
        for i, s in enumerate(seq_lens):
            own, order = order[: pages[i]], order[pages[i]:]
            self.block_tables[i, : pages[i]] = torch.tensor(own, dtype=torch.int32)
            k = torch.randn(s, kv_heads, head_dim, generator=gen).to(dtype)
            pos = torch.arange(s)
            page_ids = torch.tensor(own, dtype=torch.long)[pos // ps]
            self.k_cache[page_ids.to(device), :, (pos % ps).to(device)] = k.to(device)
            if mla:
                v = k[..., :v_dim]
            else:
                v = torch.randn(s, kv_heads, v_dim, generator=gen).to(dtype)
                self.v_cache[page_ids.to(device), :, (pos % ps).to(device)] = v.to(device)
            self.k.append(k.to(device))
            self.v.append(v.to(device))
        self.block_tables = self.block_tables.to(device)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)


# name -> (seq_lens, heads, kv_heads, head_dim, v_dim, page_size, window, softcap, splits, dtype, mla)
DECODE_CASES = {
    "mha-d64-ps16-ctx1": ([1, 17, 50], 4, 4, 64, 64, 16, None, None, 1, torch.bfloat16, False),
    "gqa4-d128-ps1-split3": ([33, 70], 8, 2, 128, 128, 1, None, None, 3, torch.bfloat16, False),
    "gqa8-d256-ps64-window-split2": ([100, 5], 8, 1, 256, 256, 64, 32, None, 2, torch.bfloat16, False),
    "gqa8-d512-ps16-softcap": ([40], 8, 1, 512, 512, 16, None, 20.0, 1, torch.bfloat16, False),
    "gqa4-d128-ps16-window-softcap-split4": ([1, 16, 31, 90], 8, 2, 128, 128, 16, 20, 30.0, 4,
                                             torch.bfloat16, False),
    "gqa1-d40-v24-ps64": ([3, 65], 4, 2, 40, 24, 64, None, None, 1, torch.bfloat16, False),
    "gqa8-d48-ps1-split8": ([9, 129], 8, 1, 48, 48, 1, None, None, 8, torch.bfloat16, False),
    # 12 heads: the merge of a few splits takes 16 heads a program, 4 of them past the last
    "gqa3-d64-ps16-12heads-split3": ([40, 70, 6], 12, 4, 64, 64, 16, None, None, 3, torch.bfloat16, False),
    "mla-576-512-ps64-split2": ([65, 7], 16, 1, 576, 512, 64, None, None, 2, torch.bfloat16, True),
    "fp16-gqa4-d64-ps16": ([23, 47], 8, 2, 64, 64, 16, 16, 50.0, 2, torch.float16, False),
    "fp32-mha-d64-ps16": ([23, 47], 2, 2, 64, 64, 16, None, None, 2, torch.float32, False),
}

# name -> (prefix_lens, q_lens, heads, kv_heads, head_dim, v_dim, page_size, window, softcap, dtype, mla)
EXTEND_CASES = {
    "mha-d64-ps16-noprefix": ([0, 0], [1, 37], 4, 4, 64, 64, 16, None, None, torch.bfloat16, False),
    "gqa4-d128-ps1-mixed-prefix": ([5, 0, 20], [9, 1, 30], 8, 2, 128, 128, 1, None, None, torch.bfloat16, False),
    "gqa8-d256-ps64-window": ([40], [50], 8, 1, 256, 256, 64, 16, None, torch.bfloat16, False),
    "gqa8-d512-ps16-softcap": ([17], [20], 8, 1, 512, 512, 16, None, 30.0, torch.bfloat16, False),
    "gqa4-d128-ps16-window-softcap": ([30, 3], [40, 17], 8, 2, 128, 128, 16, 24, 30.0, torch.bfloat16, False),
    "gqa1-d40-v24-ps64": ([0, 70], [66, 5], 4, 2, 40, 24, 64, None, None, torch.bfloat16, False),
    "mla-576-512-ps64": ([10, 0], [12, 3], 16, 1, 576, 512, 64, None, None, torch.bfloat16, True),
    "fp16-gqa4-d64-ps16": ([7], [25], 8, 2, 64, 64, 16, 8, 20.0, torch.float16, False),
    "fp32-gqa4-d64-ps16": ([7, 0], [25, 4], 8, 2, 64, 64, 16, None, None, torch.float32, False),
}


def check_decode(seq_lens, heads, kv_heads, head_dim, v_dim, page_size, window, softcap, splits, dtype, mla):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    kv = PagedKV(seq_lens, kv_heads=kv_heads, head_dim=head_dim, v_dim=v_dim, page_size=page_size,
                 dtype=dtype, mla=mla, gen=gen)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    out = torch.full((len(seq_lens), heads, v_dim), float("nan"), dtype=dtype, device=DEVICE)
    scale = 0.7 * head_dim**-0.5  # not the default: the kernel must use the one it is given
    decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens_t, scale=scale,
                     sliding_window=window, logit_softcap=softcap, num_kv_splits=splits, out=out)
    assert out.dtype == dtype
    for i, s in enumerate(seq_lens):
        ref = attention_reference(q[i : i + 1], kv.k[i], kv.v[i], torch.tensor([s - 1]), scale=scale,
                                  sliding_window=window, logit_softcap=softcap)
        assert not out[i].isnan().any(), f"NaN in request {i} (seed {seed})"
        err = rel_err(out[i : i + 1], ref)
        assert err <= TOL[dtype], f"request {i} (len {s}): relative error {err:.2e} (seed {seed})"


def check_extend(prefix_lens, q_lens, heads, kv_heads, head_dim, v_dim, page_size, window, softcap, dtype, mla):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    kv = PagedKV(seq_lens, kv_heads=kv_heads, head_dim=head_dim, v_dim=v_dim, page_size=page_size,
                 dtype=dtype, mla=mla, gen=gen)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    indptr = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    prefix_t = torch.tensor(prefix_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full((sum(q_lens), heads, v_dim), float("nan"), dtype=dtype, device=DEVICE)
    scale = 1.3 * head_dim**-0.5
    extend_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, indptr, prefix_t, max_q_len=max(q_lens),
                     scale=scale, sliding_window=window, logit_softcap=softcap, out=out)
    start = 0
    for i, (p, n) in enumerate(zip(prefix_lens, q_lens)):
        rows = slice(start, start + n)
        ref = attention_reference(q[rows], kv.k[i], kv.v[i], torch.arange(p, p + n), scale=scale,
                                  sliding_window=window, logit_softcap=softcap)
        assert not out[rows].isnan().any(), f"NaN in request {i} (seed {seed})"
        err = rel_err(out[rows], ref)
        assert err <= TOL[dtype], f"request {i} (prefix {p}, new {n}): relative error {err:.2e} (seed {seed})"
        start += n


@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_matches_reference(case):
    check_decode(*DECODE_CASES[case])


@pytest.mark.parametrize("case", EXTEND_CASES)
def test_extend_matches_reference(case):
    check_extend(*EXTEND_CASES[case])


class _GridSpy:
    """Stands in for a Triton kernel: records each launch's grid, then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("chunked", [False, True])
def test_merge_splits_values_into_chunks_when_few_programs(monkeypatch, chunked):
    # The merge of a batch with fewer (request, head) pairs than SMs takes each head's values in chunks (at most
    # MERGE_CHUNKS, each at least MIN_MERGE_CHUNK wide), a program each: the same output as one program a head,
    # including chunks past a head's values.
    from attnzoo.attention.kernels import decode as dec

    monkeypatch.setattr(dec, "_sms", lambda device: 132 if chunked else 0)
    spy = _GridSpy(dec._decode_stage2)
    monkeypatch.setattr(dec, "_decode_stage2", spy)
    check_decode([40, 9], 16, 1, 576, 320, 16, None, None, 5, torch.bfloat16, True)  # 320 values: a 512 tile
    check_decode([40, 9], 8, 2, 128, 128, 16, None, None, 5, torch.bfloat16, False)
    assert spy.grids == [(2, 16, 4 if chunked else 1), (2, 8, 2 if chunked else 1)]


@pytest.mark.parametrize("splits", [1, 3])
def test_a_row_of_length_zero_gives_zeros_and_leaves_the_others(splits):
    """A mixed-step graph's rows that are not decode rows have length 0 (engine.mixed_graphs): their output is 0,
    written directly or merged from splits that are all empty, never NaN (padding rows store it into page 0)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    kv = PagedKV([20, 9], kv_heads=2, head_dim=32, v_dim=32, page_size=4, dtype=torch.float32, gen=gen)
    q = torch.randn(3, 4, 32, generator=gen).to(DEVICE)
    tables = torch.cat([kv.block_tables, torch.zeros_like(kv.block_tables[:1])])
    lens = torch.tensor([20, 9, 0], dtype=torch.int32, device=DEVICE)
    out, ref = (torch.full((n, 4, 32), float("nan"), device=DEVICE) for n in (3, 2))
    decode_attention(q, kv.k_cache, kv.v_cache, tables, lens, scale=0.2, num_kv_splits=splits, out=out)
    decode_attention(q[:2], kv.k_cache, kv.v_cache, kv.block_tables, lens[:2], scale=0.2, num_kv_splits=splits, out=ref)
    assert out[2].eq(0).all() and torch.equal(out[:2], ref)


def test_split_count_fills_the_gpu_and_respects_limits():
    # a long context at batch 1 splits; a large batch does not; no split is shorter than MIN_TOKENS_PER_SPLIT
    from attnzoo.attention.kernels.decode_launch import MIN_TOKENS_PER_SPLIT as least

    assert choose_num_kv_splits(batch=1, num_kv_heads=8, group=4, max_kv_len=16384, num_sms=132) > 1
    assert choose_num_kv_splits(batch=256, num_kv_heads=8, group=4, max_kv_len=4096, num_sms=132) == 1
    assert choose_num_kv_splits(batch=1, num_kv_heads=1, group=4, max_kv_len=least * 2 - 1, num_sms=132) == 1
    # Gemma-4-31B's sliding layers at batch 1: a 1024-key window, 16 KV heads, fill the GPU (16 splits, not 4)
    assert choose_num_kv_splits(batch=1, num_kv_heads=16, group=2, max_kv_len=1024, num_sms=132) == 16
    # a split reads at least the bytes of the partials it leaves the merge: MLA's many heads take longer splits
    from attnzoo.attention.kernels.decode_launch import min_split_keys

    assert min_split_keys(group=4, v_dim=128, key_bytes=512) == least  # Llama: 2 KB of partials, 512 B a key
    assert min_split_keys(group=128, v_dim=512, key_bytes=1152) == 228  # DeepSeek-V3's absorbed MLA
    assert choose_num_kv_splits(batch=1, num_kv_heads=1, group=128, max_kv_len=2000, num_sms=132, block_h=64,
                                min_split=228) == 8


def test_wave_fill_counts_the_last_waves_empty_slots():
    from attnzoo.attention.kernels.decode_launch import wave_fill

    assert wave_fill(512, 528) == 512 / 528  # one wave, nearly full
    assert wave_fill(576, 528) == 576 / 1056  # 48 programs in a second wave of 528 slots
    assert wave_fill(576, 660) == 576 / 660
    assert wave_fill(1056, 528) == 1.0


@gpu
@needs_cuda
def test_decode_takes_the_narrow_tile_only_where_the_default_spills_a_wave():
    """Llama-8B layer, 64 and 96 requests: the pick follows the compiled kernels' occupancy. Where the default's
    programs fit one wave it stays; where they spill, the pick fills its waves at least 10% better than the
    default would, or is the default. The outputs are the torch reference's (the realistic cases above)."""
    from attnzoo.attention.kernels import decode_launch as how

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tile = lambda c: (c["BLOCK_N"], c["num_stages"], c["num_warps"])  # noqa: E731 - BLOCK_H is not picked
    default = tile(how.decode_launch_config(128, 128, 4, torch.bfloat16))
    picked = {}
    for batch in (64, 96):
        q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch * 64 + 1, 8, 16, 128, device="cuda", dtype=torch.bfloat16)
        tables = torch.arange(1, batch * 64 + 1, device="cuda", dtype=torch.int32).view(batch, 64)
        seq = torch.full((batch,), 1024, dtype=torch.int32, device="cuda")
        how._WAVE_PICKS.clear()
        how._RESIDENT.clear()
        decode_attention(q, k, torch.randn_like(k), tables, seq, scale=0.088)
        (pick,) = how._WAVE_PICKS.values()
        slots = {tile(dict(key[-1])): n * sms for key, n in how._RESIDENT.items() if n is not None}
        programs = batch * 8
        if programs <= slots[default]:
            assert tile(pick) == default
        elif tile(pick) != default:
            assert how.wave_fill(programs, slots[tile(pick)]) > how.WAVE_GAIN * how.wave_fill(programs, slots[default])
        assert len(how._RESIDENT) == 1 + len(how.WAVE_TILES)  # all compiled at first launch: none mid-run
        picked[batch] = (tile(pick), slots)
    if sms == 132 and picked[96][1][default] == 528:  # H100 SXM / H200 with 4 default programs an SM (measured)
        assert picked[96][0][0] == how.WAVE_TILE_N and picked[64][0] == default


def test_kernels_reject_mismatched_shapes():
    k = torch.randn(3, 2, 16, 64)
    with pytest.raises(BackendError, match="disagree"):
        decode_attention(torch.randn(1, 4, 32), k, k, torch.zeros(1, 1, dtype=torch.int32),
                         torch.ones(1, dtype=torch.int32), scale=1.0)
    with pytest.raises(BackendError, match="multiple"):
        extend_attention(torch.randn(1, 3, 64), k, k, torch.zeros(1, 1, dtype=torch.int32),
                         torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                         max_q_len=1, scale=1.0)
    with pytest.raises(BackendError, match="float16, bfloat16 or float32"):
        decode_attention(torch.randn(1, 4, 64).double(), k.double(), k.double(),
                         torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), scale=1.0)


# ---------------------------------------------------------------- store and page tables


def test_ragged_kv_indices_and_padded_block_tables():
    page_size = 4
    seq_lens_cpu = [1, 9, 4, 13]
    tables = [[5], [2, 7, 9], [3], [11, 4, 6, 8]]
    bt = torch.zeros(4, 6, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    bt = bt.to(DEVICE)
    seq_lens = torch.tensor(seq_lens_cpu, dtype=torch.int32, device=DEVICE)

    indptr = kv_indptr(seq_lens, page_size)
    assert indptr.tolist() == [0, 1, 4, 5, 9]
    n = num_pages_host(seq_lens_cpu, page_size)
    out = torch.full((n + 3,), -7, dtype=torch.int32, device=DEVICE)
    idx = create_kv_indices(bt, seq_lens, indptr, page_size, num_indices=n, out=out)
    assert idx.tolist() == [p for t in tables for p in t]
    assert out[n:].tolist() == [-7, -7, -7], "wrote past the ragged array"
    assert kv_last_page_len(seq_lens, page_size).tolist() == [1, 1, 4, 1]

    # a sliding window that moved past each request's first pages
    start_cpu = [0, 1, 0, 2]
    start = torch.tensor(start_cpu, dtype=torch.int32, device=DEVICE)
    indptr = kv_indptr(seq_lens, page_size, page_start=start)
    idx = create_kv_indices(bt, seq_lens, indptr, page_size, page_start=start,
                            num_indices=num_pages_host(seq_lens_cpu, page_size, start_cpu))
    assert idx.tolist() == [5, 7, 9, 3, 6, 8]

    width = padded_block_table_width(4, multiple=128 // 32)
    assert width == 4 and padded_block_table_width(5, 4) == 8 and padded_block_table_width(1, 64) == 64
    for pad in (-1, 0):
        table = create_block_table(bt, seq_lens, page_size, num_cols=8, pad_value=pad, max_pages=4)
        assert table.shape == (4, 8)
        assert table.tolist() == [t + [pad] * (8 - len(t)) for t in tables]
    # narrower than the stored table but wide enough for every request
    assert create_block_table(bt, seq_lens, page_size, num_cols=4, pad_value=-1).tolist() == [
        t + [-1] * (4 - len(t)) for t in tables
    ]
    with pytest.raises(BackendError, match="cannot hold"):
        create_block_table(bt, seq_lens, page_size, num_cols=3, max_pages=4)


# ---------------------------------------------------------------- realistic shapes on the GPU


@gpu
@needs_cuda
@pytest.mark.parametrize("case", [
    # Llama-3.1-8B: 32 q heads, 8 kv heads, d128; natural split choice at batch 16 and long context
    ("llama-b16", [4096, 17, 1000, 3001] * 4, 32, 8, 128, 128, 16, None, None, None, torch.bfloat16, False),
    ("llama-b1-16k", [16384], 32, 8, 128, 128, 64, None, None, None, torch.bfloat16, False),
    # 96 requests: 768 programs, past one wave of the default tile on an H100/H200 (the narrower tile's case)
    ("llama-b96", [1024, 700, 1300] * 32, 32, 8, 128, 128, 16, None, None, None, torch.bfloat16, False),
    # Gemma-4-31B global layers (d512, 4 kv heads) and sliding layers (d256, 16 kv heads, window 1024)
    ("gemma-global", [2048, 5000, 1], 32, 4, 512, 512, 16, None, None, None, torch.bfloat16, False),
    ("gemma-sliding", [3000, 700], 32, 16, 256, 256, 32, 1024, None, None, torch.bfloat16, False),
    # DeepSeek-V3 absorbed MLA: 128 heads on one latent KV head, 576/512
    ("mla-v3", [8192, 333, 1024], 128, 1, 576, 512, 64, None, None, None, torch.bfloat16, True),
    # DeepSeek-V2-Lite at batch 1: 64 splits of a few keys each, the merge in value chunks, keys prefetched
    ("mla-v2lite-b1", [1600], 16, 1, 576, 512, 16, None, None, 64, torch.bfloat16, True),
    ("softcap-fp16-ps1", [1500, 20], 16, 2, 128, 128, 1, None, 50.0, None, torch.float16, False),
])
def test_decode_realistic_shapes_gpu(case):
    name, seq_lens, heads, kv_heads, d, dv, ps, window, cap, splits, dtype, mla = case
    if splits is None:
        splits = choose_num_kv_splits(
            batch=len(seq_lens), num_kv_heads=kv_heads, group=heads // kv_heads, max_kv_len=max(seq_lens),
            num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
            block_h=16 if heads // kv_heads <= 16 else 64,
        )
    check_decode(seq_lens, heads, kv_heads, d, dv, ps, window, cap, splits, dtype, mla)


@gpu
@needs_cuda
@pytest.mark.parametrize("case", [
    ("llama-prefill", [0, 0], [2048, 333], 32, 8, 128, 128, 16, None, None, torch.bfloat16, False),
    ("llama-chunked", [3000, 100], [512, 1], 32, 8, 128, 128, 64, None, None, torch.bfloat16, False),
    ("gemma-global", [1000], [700], 32, 4, 512, 512, 16, None, None, torch.bfloat16, False),
    ("gemma-sliding", [1500, 0], [900, 2000], 32, 16, 256, 256, 32, 1024, None, torch.bfloat16, False),
    ("mla-v3", [500], [64], 128, 1, 576, 512, 64, None, None, torch.bfloat16, True),
    ("softcap-ps1", [200], [300], 16, 2, 64, 64, 1, 128, 30.0, torch.float16, False),
])
def test_extend_realistic_shapes_gpu(case):
    check_extend(*case[1:])


@gpu
@needs_cuda
def test_decode_cuda_graph_replay_follows_metadata():
    """A captured decode reads seq_lens / block tables from the device: refilling them in place and
    replaying gives the attention of the new step."""
    from attnzoo.attention.backends.triton import TritonBackend

    layer = Attention(0, 32, 8, 128)
    page_size, max_pages, batch = 16, 64, 4
    pool = KVPool([layer.kv_cache_spec()], num_pages=batch * max_pages + 1, page_size=page_size,
                  dtype=torch.bfloat16, device=DEVICE)
    pool.buffer.view(torch.bfloat16).normal_()
    backend = TritonBackend(pool)
    backend.init_graph_state(batch, max_pages)
    tables = [list(range(1 + i * max_pages, 1 + (i + 1) * max_pages)) for i in range(batch)]

    def meta_for(lens):
        return build_metadata(prefix_lens=[n - 1 for n in lens], q_lens=[1] * batch, block_tables=tables,
                              page_size=page_size, device=DEVICE)

    static = meta_for([100, 5, 1000, 17])
    plan = backend.prepare_graph(static, capturing=True)
    q = torch.randn(batch, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.decode(layer, q, static, plan)  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.decode(layer, q, static, plan)
    for lens in ([100, 5, 1000, 17], [1024, 300, 2, 999]):
        new = meta_for(lens)
        static.seq_lens.copy_(new.seq_lens)
        backend.prepare_graph(static, capturing=False)
        q.normal_()
        graph.replay()
        ref_be = TorchBackend(pool)
        ref = ref_be.decode(layer, q, new, ref_be.prepare(new))
        assert rel_err(out, ref) <= 1e-2


def test_launch_shrinks_tiles_that_do_not_fit_shared_memory():
    from attnzoo.attention.kernels.common import OutOfResources, launch

    calls = []

    class FakeKernel:  # fits only with one stage and BLOCK_N <= 32, like a d512 tile on a 100 KB GPU
        def __getitem__(self, grid):
            def run(*args, **kw):
                calls.append((grid, kw["num_stages"], kw["BLOCK_N"]))
                if kw["num_stages"] > 1 or kw["BLOCK_N"] > 32:
                    raise OutOfResources(300000, 101376, "shared memory")
            return run

    kernel = FakeKernel()
    cfg = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
    launch(kernel, lambda c: (c["BLOCK_N"],), (torch.zeros(1),), {"X": 1}, cfg, tile_keys=("BLOCK_N",))
    assert calls[-1] == ((32,), 1, 32)
    n = len(calls)
    launch(kernel, lambda c: (c["BLOCK_N"],), (torch.zeros(1),), {"X": 1}, cfg, tile_keys=("BLOCK_N",))
    assert len(calls) == n + 1, "the fitted config is remembered"
    with pytest.raises(OutOfResources):
        launch(kernel, lambda c: (1,), (torch.zeros(1),), {"X": 2}, {"BLOCK_N": 64, "num_stages": 2},
               tile_keys=())  # nothing left to shrink
