"""Cascade attention for sliding-window layers: the page/window planning of ``cascade_split``, checked on
CPU against the torch reference with a small simulator of FlashInfer's paged attention (page lists, last
page length, queries aligned to the end of each list, window_left and causal masks, log-sum-exp out),
the two partial results merged by their LSE as ``merge_state`` does.
"""
import random

import pytest
import torch

from attnzoo.attention.backends.fi_common import cascade_graph_key, cascade_split, gap_quantum_pages, split_kv_fits_workspace
from attnzoo.attention.backends.torch_ref import attention_reference, gather_kv
from attnzoo.errors import BackendError


def paged_attention(q, k_cache, v_cache, qo_indptr, pages, last_page_len, *, page_size, window_left, causal, scale):
    """FlashInfer's paged prefill/decode semantics in float64: [rows, H, D] out and [rows, H] natural-log LSE.
    Key j' of a list of kv_len keys is visible to query row t of qo_len iff (causal: j' <= kv_len - qo_len + t)
    and (window_left >= 0: j' >= kv_len - qo_len + t - window_left)."""
    out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for r, plist in enumerate(pages):
        lo, hi = qo_indptr[r], qo_indptr[r + 1]
        if hi == lo or not plist:
            continue
        kv_len = (len(plist) - 1) * page_size + last_page_len[r]
        idx = torch.tensor(plist)
        k = gather_kv(k_cache, idx, kv_len).double().repeat_interleave(group, 1)  # [kv, H, D]
        v = gather_kv(v_cache, idx, kv_len).double().repeat_interleave(group, 1)
        s = torch.einsum("thd,khd->htk", q[lo:hi].double(), k) * scale
        qo_len = hi - lo
        pos = torch.arange(qo_len).view(-1, 1) + kv_len - qo_len
        j = torch.arange(kv_len).view(1, -1)
        vis = torch.ones(qo_len, kv_len, dtype=torch.bool)
        if causal:
            vis &= j <= pos
        if window_left >= 0:
            vis &= j >= pos - window_left
        s = s.masked_fill(~vis, float("-inf"))
        m = torch.logsumexp(s, -1)  # [H, t]
        p = torch.exp(s - m[..., None]).nan_to_num(0.0)
        out[lo:hi] = torch.einsum("htk,khd->thd", p, v)
        lse[lo:hi] = m.transpose(0, 1)
    return out, lse


def merge(o_a, s_a, o_b, s_b):
    m = torch.maximum(s_a, s_b)
    wa, wb = torch.exp(s_a - m).nan_to_num(0.0), torch.exp(s_b - m).nan_to_num(0.0)
    return (o_a * wa[..., None] + o_b * wb[..., None]) / (wa + wb)[..., None]


def run_cascade(q, k_cache, v_cache, tables, seq_lens, q_lens, shared_pages, page_size, window, scale, quantum=1):
    """The backend's cascade step, as planned by cascade_split, through the simulator (None: plain)."""
    split = cascade_split(seq_lens, q_lens, shared_pages, page_size, window, quantum_pages=quantum)
    if split is None:
        return None, None
    qo = [0]
    for n in q_lens:
        qo.append(qo[-1] + n)
    extend = any(n > 1 for n in q_lens)
    shared = tables[0][split.shared_start:split.shared_end]
    o_s, l_s = paged_attention(q, k_cache, v_cache, [0, qo[-1]], [shared], [page_size], page_size=page_size,
                               window_left=window - 1 if window else -1, causal=False, scale=scale)
    rest = [t[split.rest_start[i]:split.shared_start] + t[split.shared_end:-(-seq_lens[i] // page_size)]
            for i, t in enumerate(tables)]
    last = [(s - 1) % page_size + 1 for s in seq_lens]
    o_r, l_r = paged_attention(q, k_cache, v_cache, qo, rest, last, page_size=page_size,
                               window_left=split.window_left, causal=extend, scale=scale)
    return merge(o_s, l_s, o_r, l_r), split


def reference(q, k_cache, v_cache, tables, seq_lens, q_lens, page_size, window, scale):
    """The project's torch reference (float32 inside: hence the 2e-6 tolerance; a wrong mask is off by ~0.1)."""
    outs, at = [], 0
    for t, s, n in zip(tables, seq_lens, q_lens):
        pages = torch.tensor(t[: -(-s // page_size)])
        k, v = gather_kv(k_cache, pages, s).double(), gather_kv(v_cache, pages, s).double()
        outs.append(attention_reference(q[at:at + n].double(), k, v, torch.arange(s - n, s), scale=scale,
                                        sliding_window=window))
        at += n
    return torch.cat(outs).double()


def random_step(rng, page_size, shared_tokens, window, extend):
    """Requests sharing the first shared_tokens // page_size pages (a not page-aligned prefix leaves its
    tail page per request), each with its own suffix; decode rows, and prompt chunks when ``extend``."""
    num_reqs = rng.randint(1, 6)
    shared_pages = shared_tokens // page_size
    cached = [shared_tokens + rng.choice([0, 1, rng.randint(0, window), rng.randint(0, 2 * window)]) for _ in range(num_reqs)]
    q_lens = [rng.choice([1, 1, rng.randint(2, window // 2 + 5)]) if extend else 1 for _ in range(num_reqs)]
    seq = [c + n for c, n in zip(cached, q_lens)]
    next_page = 1 + shared_pages
    tables = []
    for s in seq:
        own = -(-s // page_size) - shared_pages
        tables.append(list(range(1, 1 + shared_pages)) + list(range(next_page, next_page + own)))
        next_page += own
    perm = list(range(1, next_page))
    rng.shuffle(perm)  # non-contiguous page ids
    tables = [[perm[p - 1] for p in t] for t in tables]
    return tables, seq, q_lens, shared_pages, next_page


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("extend", [False, True])
def test_windowed_cascade_equals_the_reference(page_size, extend):
    rng = random.Random(page_size * 2 + extend)
    gen = torch.Generator().manual_seed(page_size + extend)
    kinds = {"cascade": 0, "plain": 0}
    for trial in range(40):
        window = rng.choice([8, 20, 37, 64] if page_size == 1 else [33, 77, 150])
        shared_tokens = rng.choice([page_size, 3 * page_size + rng.randint(0, page_size - 1), 2 * window + 5])
        shared_tokens = max(shared_tokens, page_size)
        tables, seq, q_lens, shared_pages, num_pages = random_step(rng, page_size, shared_tokens, window, extend)
        k = torch.randn(num_pages, 1, page_size, 8, generator=gen, dtype=torch.float64)
        v = torch.randn(num_pages, 1, page_size, 8, generator=gen, dtype=torch.float64)
        q = torch.randn(sum(q_lens), 2, 8, generator=gen, dtype=torch.float64)
        out, split = run_cascade(q, k, v, tables, seq, q_lens, shared_pages, page_size, window, 0.3)
        if split is None:
            kinds["plain"] += 1
            assert -(-(max(seq) - window) // page_size) >= shared_pages  # no shared page in every window
            continue
        kinds["cascade"] += 1
        assert split.window_left >= 0
        ref = reference(q, k, v, tables, seq, q_lens, page_size, window, 0.3)
        assert torch.allclose(out, ref, atol=2e-6), (trial, split, seq, q_lens)
    assert kinds["cascade"] >= 10 and kinds["plain"] >= 1, kinds


@pytest.mark.parametrize("extend", [False, True])
def test_global_layer_cascade_equals_the_reference(extend):
    rng = random.Random(7 + extend)
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        tables, seq, q_lens, shared_pages, num_pages = random_step(rng, 16, 16 * rng.randint(1, 5) + 3, 30, extend)
        k = torch.randn(num_pages, 2, 16, 8, generator=gen, dtype=torch.float64)
        v = torch.randn(num_pages, 2, 16, 8, generator=gen, dtype=torch.float64)
        q = torch.randn(sum(q_lens), 4, 8, generator=gen, dtype=torch.float64)
        out, split = run_cascade(q, k, v, tables, seq, q_lens, shared_pages, 16, None, 0.3)
        assert (split.shared_start, split.window_left) == (0, -1)
        assert torch.allclose(out, reference(q, k, v, tables, seq, q_lens, 16, None, 0.3), atol=2e-6)


def test_split_of_the_gsm8k_shape():
    """The 8-shot prefix (1313 tokens: 82 whole pages of 16) under Gemma 4's 1024-token window: the longest
    request fixes where the shared segment starts; each request reads its window minus the gap."""
    seq = [1313 + 150 + 1, 1313 + 250 + 200]
    split = cascade_split(seq, [1, 1], 82, 16, 1024)
    assert split.shared_start == -(-(seq[1] - 1024) // 16) == 47 and split.shared_end == 82
    assert split.rest_start == [(seq[0] - 1024) // 16, (seq[1] - 1024) // 16]
    assert split.window_left == 1023 - 35 * 16
    # A window already past the prefix for one request: no page every query sees, the plain path.
    assert cascade_split([1313 + 1100, 1400], [1, 1], 82, 16, 1024) is None
    assert cascade_split(seq, [1, 1], 0, 16, 1024) is None
    with pytest.raises(BackendError, match="longer than a request's cached prefix"):
        cascade_split([1320, 1400], [10, 1], 82, 16, 1024)


@pytest.mark.parametrize("page_size", [1, 16])
def test_rounded_graph_split_with_padding_rows_equals_the_reference(page_size):
    """A CUDA-graph cascade step: the gap rounded down to a multiple of ``quantum`` pages, and the bucket's
    padding rows (one token after the shared prefix: its pages, then page 0) planned with the real ones.
    The real rows' outputs are the reference's; the padding rows neither move the split nor the key."""
    rng = random.Random(40 + page_size)
    gen = torch.Generator().manual_seed(page_size)
    seen = {"rounded": 0, "plain": 0}
    for trial in range(40):
        window = rng.choice([20, 37, 64] if page_size == 1 else [77, 150, 260])
        quantum = rng.choice([2, 3, gap_quantum_pages(window, page_size)])
        shared_tokens = rng.choice([3 * page_size + rng.randint(0, page_size - 1), 2 * window + 5, window])
        tables, seq, q_lens, shared_pages, num_pages = random_step(rng, page_size, max(shared_tokens, page_size),
                                                                   window, extend=False)
        pad = rng.randint(0, 3)
        P = shared_pages * page_size
        padded_tables = tables + [tables[0][:shared_pages] + [0]] * pad
        padded_seq, padded_q = seq + [P + 1] * pad, q_lens + [1] * pad
        k = torch.randn(num_pages, 1, page_size, 8, generator=gen, dtype=torch.float64)
        v = torch.randn(num_pages, 1, page_size, 8, generator=gen, dtype=torch.float64)
        q = torch.randn(len(padded_seq), 2, 8, generator=gen, dtype=torch.float64)
        out, split = run_cascade(q, k, v, padded_tables, padded_seq, padded_q, shared_pages, page_size, window, 0.3,
                                 quantum=quantum)
        real = cascade_split(seq, q_lens, shared_pages, page_size, window, quantum_pages=quantum)
        assert split == (None if real is None else
                         type(real)(real.shared_start, real.shared_end, real.rest_start + split.rest_start[len(seq):],
                                    real.window_left))
        assert cascade_graph_key(seq, q_lens, shared_pages, page_size, [window]) == \
            cascade_graph_key(padded_seq, padded_q, shared_pages, page_size, [window])
        if split is None:
            seen["plain"] += 1
            continue
        seen["rounded"] += 1
        exact = cascade_split(seq, q_lens, shared_pages, page_size, window)
        assert (split.shared_end - split.shared_start) % quantum == 0 and split.shared_start >= exact.shared_start
        assert 0 <= exact.window_left <= split.window_left
        ref = reference(q[: len(seq)], k, v, tables, seq, q_lens, page_size, window, 0.3)
        assert torch.allclose(out[: len(seq)], ref, atol=2e-6), (trial, split, seq)
        assert torch.isfinite(out).all()  # padding rows too (dropped, but they must not poison anything)
    assert seen["rounded"] >= 10 and seen["plain"] >= 1, seen


def test_graph_keys_take_few_values_over_a_gsm8k_like_run():
    """256 decode steps of a batch over the 82-page 8-shot prefix, window 1024: the exact split's rest
    window_left changes with nearly every page the longest request grows, the graphs' (rounded to 8 pages:
    128 tokens) at most window / 128 times; windowless layers add nothing to the key."""
    assert gap_quantum_pages(1024, 16) == 8 and gap_quantum_pages(128, 16) == 1 and gap_quantum_pages(20, 16) == 1
    tails = [1, 40, 150, 250]
    exact, keys = set(), set()
    for t in range(256):
        seq = [1313 + n + t + 1 for n in tails]
        split = cascade_split(seq, [1] * 4, 82, 16, 1024)
        exact.add(None if split is None else split.window_left)
        keys.add(cascade_graph_key(seq, [1] * 4, 82, 16, [1024]))
    assert len(exact) >= 16 and 2 <= len(keys) <= 1024 // 128, (len(exact), keys)
    assert all(wl is None or (1023 - wl) % 128 == 0 for (_, wl), in keys)
    assert cascade_graph_key(seq, [1] * 4, 82, 16, []) == ()


def test_a_graph_shared_part_splits_the_kv_only_where_its_partials_fit_the_workspace():
    assert split_kv_fits_workspace(1024, 32, 128) and split_kv_fits_workspace(256, 32, 512)
    assert not split_kv_fits_workspace(4096, 32, 512) and not split_kv_fits_workspace(4096, 32, 256)
