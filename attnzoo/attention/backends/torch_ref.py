"""The torch reference backend: exact attention in float32 over the gathered pages.

It is the oracle every other backend is tested against, on CPU and GPU, so it favours plainness over
speed: the whole score matrix materialised, in float32. Requests are still batched: each step's
requests are sorted into a few groups of similar query and context lengths
(``padded_groups``), and each group runs as one padded batch (``padded_attention_reference``), so
on a GPU a step costs a few dozen torch ops per layer however many requests it holds, where one request
at a time would cost dozens per request (benchmarks/torch_ref_step.py).
An fp8 pool is read by dequantizing (value times the pool's per-tensor scale, in float32):
quantize-dequantize, so the fp8 KV cache runs, and is checked, on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from attnzoo.attention.backends.base import CompressedBackend, NSABackend, NSAPlan, StepPlan
from attnzoo.attention.backends.capabilities import ALL_DTYPES, FP8_KV, BackendCapabilities
from attnzoo.attention.backends.gpus import GPUS, Kernel
from attnzoo.attention.compressed_reference import attend_reference, topk_reference
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.metadata import BatchMetadata
from attnzoo.attention.reference import (
    attention_reference,  # noqa: F401  (the per-request oracle; tests import it from here)
    entries_of,
    gather_kv,  # noqa: F401
    indexer_scores_reference,
    padded_attention_reference,
    positions_to_slots,
    select_topk,
    sparse_mla_reference,
)


# Per group, by device type: at most this many gathered key tokens (requests x longest context) and
# query-key pairs (requests x longest chunk x longest context); a request over either is a group of its
# own. A GPU takes large groups (few launches; SmolLM2's keys and values of one in float32: 0.75 GiB),
# a CPU small ones whose float32 copies stay in its caches.
GROUP_BUDGETS = {"cuda": (1 << 19, 1 << 24), "cpu": (1 << 14, 1 << 18)}


def padded_groups(q_lens: list[int], seq_lens: list[int], *, max_keys: int, max_pairs: int) -> list[list[int]]:
    """The step's requests (indices) in groups that run as one padded batch each: longest query first,
    then longest context, so that decode rows (one query) never pad to a prompt chunk's length; a new
    group starts where a request's queries are at most half the group's longest (padding would double
    its work) or the group would pass a budget."""
    groups: list[list[int]] = []
    q_max = kv = 0  # the last group's longest query and context
    for r in np.lexsort((-np.asarray(seq_lens), -np.asarray(q_lens))).tolist():
        if groups:
            n, kv_r = len(groups[-1]) + 1, max(kv, seq_lens[r])
            if 2 * q_lens[r] > q_max and n * kv_r <= max_keys and n * q_max * kv_r <= max_pairs:
                groups[-1].append(r)
                kv = kv_r
                continue
        groups.append([r])
        q_max, kv = q_lens[r], seq_lens[r]
    return groups


@dataclass
class PaddedGroup:
    """Requests run as one padded batch (``padded_attention_reference``)."""

    rows: torch.Tensor  # [b, q_max] int64, device: each padded query's row in the flat batch (padding: its last)
    positions: torch.Tensor  # [b, q_max] int64, device: their absolute positions
    tables: torch.Tensor  # [b, n] int32, device: the requests' page ids, n pages covering kv_len
    window_tables: torch.Tensor | None  # [b, n] int32, device: the window page group's (None: one group)
    kv_len: int  # host: the longest context in the group


@dataclass
class TorchPlan(NSAPlan):
    """The step's groups, made once per step for every layer (NSA layers read the NSAPlan fields)."""

    groups: list[PaddedGroup] = field(default_factory=list)
    # [num_tokens] int64, device: where each flat-batch row's output sits in the groups' padded outputs
    # ([b * q_max] rows each), concatenated in group order.
    unpad: torch.Tensor | None = None


class TorchBackend(NSABackend, CompressedBackend):
    capabilities = BackendCapabilities(
        name="torch",
        description="exact float32-accumulating reference over gathered pages; the correctness oracle",
        kinds=frozenset({"mha", "mla", "nsa", "dsv4"}),
        prefill=(Kernel("torch reference", frozenset(GPUS)),),
        decode=(Kernel("torch reference", frozenset(GPUS)),),
        max_head_dim=1024,
        kv_dtypes=ALL_DTYPES | FP8_KV,
        sliding_window=True,
        logit_softcap=True,
        attention_sinks=True,
        module="torch",
        mla_kv_layout="bf16",  # NSA layers: it reads the pool's own entries
        notes=("fp8_e4m3 KV cache: quantize-dequantize in float32 (per-tensor scales)",),
    )
    splits_mixed_steps = True
    strided_query = True

    def __init__(self, pool: KVPool):
        super().__init__(pool)
        self.require_pool()

    def prepare(self, meta: BatchMetadata) -> TorchPlan:
        """Group the step's requests and build each group's padded rows, positions and pages, on the host
        from the step's host lengths (no device sync), copied to the device once for all layers."""
        q_lens, seq_lens, ps = np.asarray(meta.q_lens_cpu), np.asarray(meta.seq_lens_cpu), meta.page_size
        starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
        dev = meta.block_tables.device

        def to_dev(x):  # non_blocking: from pageable memory it is staged at once, without waiting for the GPU
            return torch.from_numpy(x).to(dev, non_blocking=True)

        groups, unpad, offset = [], np.empty(meta.num_tokens, dtype=np.int64), 0
        max_keys, max_pairs = GROUP_BUDGETS.get(dev.type, GROUP_BUDGETS["cuda"])
        for reqs in padded_groups(meta.q_lens_cpu, meta.seq_lens_cpu, max_keys=max_keys, max_pairs=max_pairs):
            reqs = np.asarray(reqs)
            q_max, kv_len = int(q_lens[reqs].max()), int(seq_lens[reqs].max())
            j = np.minimum(np.arange(q_max), q_lens[reqs, None] - 1)  # [b, q_max]: padding repeats the last query
            rows = starts[reqs, None] + j
            real = np.arange(q_max) < q_lens[reqs, None]
            unpad[rows[real]] = offset + np.flatnonzero(real)
            offset += real.size
            groups.append(PaddedGroup(rows=to_dev(rows), positions=to_dev((seq_lens - q_lens)[reqs, None] + j),
                                      tables=meta.block_tables[idx := to_dev(reqs), : -(-kv_len // ps)],
                                      window_tables=None if meta.window_block_tables is None
                                      else meta.window_block_tables[idx, : -(-kv_len // ps)], kv_len=kv_len))
        return TorchPlan(groups=groups, unpad=to_dev(unpad))

    def _run(self, layer, q: torch.Tensor, meta: BatchMetadata, plan: StepPlan) -> torch.Tensor:
        if not isinstance(plan, TorchPlan):  # a plan another backend made for the same step (tests)
            plan = self.prepare(meta)
        k_cache, v_cache = self.pool.k(layer.layer_id), self.pool.v(layer.layer_id)
        outs = [
            padded_attention_reference(
                q[g.rows], g.positions, k_cache, v_cache,
                g.window_tables if layer.sliding_window and g.window_tables is not None else g.tables, g.kv_len,
                scale=layer.scale,
                k_scale=self.pool.k_scale, v_scale=self.pool.v_scale, sliding_window=layer.sliding_window,
                logit_softcap=layer.logit_softcap, sinks=layer.sinks,
            ).flatten(0, 1)
            for g in plan.groups
        ]
        return torch.cat(outs)[plan.unpad].to(q.dtype)

    def extend(self, layer, q, meta, plan: StepPlan):
        self.check_layer("prefill", layer)
        return self._run(layer, q, meta, plan)

    def decode(self, layer, q, meta, plan: StepPlan):
        self.check_layer("decode", layer)
        return self._run(layer, q, meta, plan)

    # ---- NSA (DeepSeek-V3.2) layers: the reference indexer and sparse MLA (attention/reference.py) ----
    def nsa_topk(self, layer, q, weights, meta, plan: NSAPlan, *, topk, scale):
        scores = indexer_scores_reference(self.pool.index_k(layer.layer_id), q, weights, meta, scale=scale)
        return select_topk(scores, topk)

    def nsa_sparse_mla(self, layer, q, positions, meta, plan: NSAPlan):
        slots = positions_to_slots(positions, meta, plan.token_reqs, plan.shared)
        entries = entries_of(layer, self.pool)
        return sparse_mla_reference(entries, q, slots, rank=layer.v_head_dim, scale=layer.scale).to(q.dtype)

    # ---- compressed (DeepSeek-V4) layers: attention/compressed_reference.py ----
    def dsv4_topk(self, layer, q, weights, meta, plan, *, topk, scale):
        return topk_reference(self.pool.view(layer.layer_id, "index_compressed"), q, weights, meta,
                              rate=layer.compress_rate, topk=topk, scale=scale)

    def dsv4_attend(self, layer, q, sinks, entry_ids, meta, plan):
        self.check_layer("decode" if meta.is_decode else "prefill", layer)
        compressed = self.pool.view(layer.layer_id, "compressed") if layer.compress_rate else None
        return attend_reference(self.pool.k(layer.layer_id), compressed, q, sinks, entry_ids, meta,
                                window=layer.sliding_window, rate=layer.compress_rate, scale=layer.scale)
