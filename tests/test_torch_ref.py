"""The torch reference backend in padded groups computes what it computed one request at a time.

The backend used to loop over requests (``attention_reference`` on each one's gathered pages) in
extend steps, and run decode steps as one batch padded to the longest context. It now runs every step
as a few padded groups (``padded_groups`` + ``padded_attention_reference``). Both old paths are kept
here, verbatim in their math, and the new backend must match them on random paged batches: mixed
query and context lengths, shuffled pages, GQA / MHA / MQA, sliding windows, logit softcap, MLA's
values-from-keys cache, an fp8 pool with scales, and any grouping (one request per group, one group).
"""
from __future__ import annotations

import pytest
import torch

from attnzoo.attention.backends import torch_ref
from attnzoo.attention.backends.torch_ref import TorchBackend, padded_groups
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.layer import Attention
from attnzoo.attention.metadata import build_metadata
from attnzoo.attention.reference import attention_reference, dequantize, gather_kv

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LAYERS = [
    Attention(0, 8, 2, 32),  # GQA
    Attention(1, 4, 4, 16, sliding_window=5),  # MHA, a window
    Attention(2, 6, 1, 24, logit_softcap=3.0, scale=0.4),  # MQA, a softcap scores reach
    Attention(3, 4, 2, 16, sliding_window=7, logit_softcap=2.0),
    Attention(4, 8, 1, 40, v_head_dim=32, kind="mla"),  # values: the keys' first 32 channels
]


def old_per_request(pool, layer, q, meta):
    """The backend's extend before padded groups: one request at a time, exactly its context."""
    k_cache, v_cache, ps = pool.k(layer.layer_id), pool.v(layer.layer_id), meta.page_size
    out = torch.empty(q.shape[0], layer.num_heads, layer.v_head_dim, dtype=q.dtype, device=q.device)
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.q_lens_cpu)):
        pages = meta.block_tables[i, : -(-seq_len // ps)]
        k = dequantize(gather_kv(k_cache, pages, seq_len), pool.k_scale)
        v = dequantize(gather_kv(v_cache, pages, seq_len), pool.v_scale)
        o = attention_reference(q[start : start + q_len], k, v, torch.arange(seq_len - q_len, seq_len, device=q.device),
                                scale=layer.scale, sliding_window=layer.sliding_window, logit_softcap=layer.logit_softcap)
        out[start : start + q_len] = o.to(q.dtype)
        start += q_len
    return out


def old_decode(pool, layer, q, meta):
    """The backend's decode before padded groups: every request padded to the longest context."""
    k_cache, v_cache = pool.k(layer.layer_id), pool.v(layer.layer_id)
    b, max_len = q.shape[0], meta.max_seq_len
    pages = meta.block_tables[:, : -(-max_len // meta.page_size)]

    def gather(cache, scale):
        g = dequantize(cache[pages], scale).float()
        return g.transpose(1, 2).reshape(b, g.shape[2], -1, g.shape[-1])[:, :, :max_len]

    k, v = gather(k_cache, pool.k_scale), gather(v_cache, pool.v_scale)
    qg = q.float().view(b, layer.num_kv_heads, -1, q.shape[-1])
    scores = (qg @ k.transpose(-1, -2)) * layer.scale
    if layer.logit_softcap:
        scores = layer.logit_softcap * torch.tanh(scores / layer.logit_softcap)
    kpos = torch.arange(max_len).view(1, -1)
    qpos = (meta.seq_lens.long() - 1).view(-1, 1)
    visible = kpos <= qpos
    if layer.sliding_window:
        visible &= kpos > qpos - layer.sliding_window
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).reshape(b, layer.num_heads, layer.v_head_dim).to(q.dtype)


def _batch(seed, dtype, kv_cache_dtype="auto", page_size=4, decode=False, device="cpu"):
    """A pool of random contents (free slots too: what a mask lets through shows) and one random step."""
    g = torch.Generator().manual_seed(seed)
    n_reqs = 7
    prefix = torch.randint(1, 40, (n_reqs,), generator=g).tolist()
    if decode:
        q_lens = [1] * n_reqs
    else:  # decode rows, short and long chunks, a prompt from scratch
        q_lens = torch.randint(1, 12, (n_reqs,), generator=g).tolist()
        q_lens[0], q_lens[1], prefix[2] = 1, 1, 0
        q_lens[3] = 23
    need = [-(-(p + n) // page_size) for p, n in zip(prefix, q_lens)]
    num_pages = sum(need) + 3
    ids = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # shuffled pages; page 0 only pads tables
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    pool = KVPool([layer.kv_cache_spec() for layer in LAYERS], num_pages=num_pages, page_size=page_size, dtype=dtype,
                  device=device, kv_cache_dtype=kv_cache_dtype, k_scale=0.5, v_scale=2.0)
    raw = pool.buffer.view(pool.kv_dtype)
    raw.copy_((torch.randn(raw.shape, generator=g) * 2).to(pool.kv_dtype))
    meta = build_metadata(prefix_lens=prefix, q_lens=q_lens, block_tables=tables, page_size=page_size, device=device)
    qs = [torch.randn(meta.num_tokens, layer.num_heads, layer.head_dim, generator=g).to(device, dtype) for layer in LAYERS]
    return pool, meta, qs


@pytest.mark.parametrize("budget", ["cpu", "one request per group", "one group"])
@pytest.mark.parametrize("seed", [0, 1])
def test_padded_groups_equal_the_old_per_request_math(monkeypatch, seed, budget):
    if budget != "cpu":
        monkeypatch.setitem(torch_ref.GROUP_BUDGETS, "cpu", (1, 1) if budget == "one request per group" else (1 << 30, 1 << 30))
    for decode in (False, True):
        pool, meta, qs = _batch(seed, torch.float32, decode=decode)
        be = TorchBackend(pool)
        plan = be.prepare(meta)
        if budget == "one group":
            assert len(plan.groups) == 1 if decode else 1 < len(plan.groups) < meta.num_reqs
        for layer, q in zip(LAYERS, qs):
            new = (be.decode if decode else be.extend)(layer, q, meta, plan)
            olds = {"the per-request math": old_per_request(pool, layer, q, meta)}
            if decode:
                olds["the old decode"] = old_decode(pool, layer, q, meta)
            for name, old in olds.items():
                # A few float32 ulps (1.7e-6 measured): matmuls of other shapes sum in another order.
                err = ((new - old).abs() / (old.abs() + 1)).max().item()
                assert err <= 5e-6, f"layer {layer.layer_id}: {err:.2e} from {name} (seed {seed}, {budget})"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_bf16_and_fp8_pools_round_as_before(kv_cache_dtype):
    """In bf16 the outputs are the old ones but for the rare float32 difference that rounds across a bf16
    step; an fp8 pool is dequantized with its scales as before."""
    pool, meta, qs = _batch(3, torch.bfloat16, kv_cache_dtype=kv_cache_dtype)
    be = TorchBackend(pool)
    plan = be.prepare(meta)
    for layer, q in zip(LAYERS, qs):
        if layer.kind == "mla" and kv_cache_dtype != "auto":
            continue  # MLA keeps its own layouts; the pool's fp8 applies to MHA layers
        new, old = be.extend(layer, q, meta, plan).float(), old_per_request(pool, layer, q, meta).float()
        assert (new != old).float().mean() <= 0.01, f"layer {layer.layer_id}"
        assert ((new - old).abs() <= 2 ** -7 * old.abs().clamp_min(1e-2)).all(), f"layer {layer.layer_id}"


def test_padded_groups_split_by_length_and_budget():
    q_lens = [1, 300, 1, 40, 25, 1, 13]
    seq_lens = [900, 400, 50, 60, 1000, 700, 20]
    groups = padded_groups(q_lens, seq_lens, max_keys=1 << 20, max_pairs=1 << 30)
    assert sorted(r for g in groups for r in g) == list(range(7))
    assert groups == [[1], [3, 4], [6], [0, 5, 2]]  # longest first; a new group below half the longest query
    # the key budget: at most 2 decode rows of <= 900 tokens per group
    assert padded_groups([1] * 4, [900, 10, 800, 20], max_keys=1800, max_pairs=1 << 30) == [[0, 2], [3, 1]]
    # the pair budget; a request over it alone is its own group
    assert padded_groups([8, 8, 8], [100, 100, 100], max_keys=1 << 20, max_pairs=1600) == [[0, 1], [2]]
    assert padded_groups([64, 60], [100, 100], max_keys=1 << 20, max_pairs=10) == [[0], [1]]


def test_a_plan_of_another_backend_is_replaced():
    from attnzoo.attention.backends.base import StepPlan

    pool, meta, qs = _batch(4, torch.float32)
    be = TorchBackend(pool)
    assert torch.equal(be.extend(LAYERS[0], qs[0], meta, StepPlan()), be.extend(LAYERS[0], qs[0], meta, be.prepare(meta)))


@gpu
@needs_cuda
def test_gpu_steps_without_host_syncs_equal_the_old_math():
    """On a GPU a step is planned from host lengths and run without one host sync (a sync per layer
    would stall every layer on the GPU's queue), and computes what the per-request math computes."""
    for decode in (False, True):
        pool, meta, qs = _batch(5, torch.float32, decode=decode, device="cuda")
        be = TorchBackend(pool)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            plan = be.prepare(meta)
            outs = [(be.decode if decode else be.extend)(layer, q, meta, plan) for layer, q in zip(LAYERS, qs)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for layer, q, new in zip(LAYERS, qs, outs):
            old = old_per_request(pool, layer, q, meta)
            # TF32 is off for float32 matmuls by default; cuBLAS sums in other orders than the CPU.
            assert ((new - old).abs() / (old.abs() + 1)).max().item() <= 1e-5, f"layer {layer.layer_id}"
