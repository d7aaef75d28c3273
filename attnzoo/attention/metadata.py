"""Per-step batch metadata: built once per step by the engine, read by every layer.

A step runs either in EXTEND mode (each request brings >= 1 new tokens on top of an optional cached
prefix: prefill, chunked prefill, scoring) or in DECODE mode (each request brings exactly one new token
and has a cached prefix). The prefill backend serves EXTEND steps, the decode backend DECODE steps.

Tokens of all requests are packed into one flat batch: request i owns rows
``q_indptr[i]:q_indptr[i+1]`` of every ``[num_tokens, ...]`` tensor.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass
class BatchMetadata:
    mode: ForwardMode
    page_size: int
    # ---- device tensors (on the model's device) ----
    positions: torch.Tensor  # [num_tokens] int64: absolute position of each new token
    slot_mapping: torch.Tensor  # [num_tokens] int64: page * page_size + offset where its k/v is stored
    q_indptr: torch.Tensor  # [num_reqs + 1] int32: row offsets of each request's new tokens
    seq_lens: torch.Tensor  # [num_reqs] int32: cached prefix + new tokens (the KV length after the store)
    prefix_lens: torch.Tensor  # [num_reqs] int32: tokens already in the cache before this step
    block_tables: torch.Tensor  # [num_reqs, max_pages] int32: page ids per request, padded with 0
    # ---- host copies, for planning without device syncs ----
    seq_lens_cpu: list[int]
    q_lens_cpu: list[int]
    # Last row of each request in the flat batch: where the logits for sampling are taken.
    last_token_rows: torch.Tensor  # [num_reqs] int64, device
    # Leading KV tokens, whole pages, that every request of the step reads from the very same pages (a
    # shared few-shot prefix, shared by the prefix cache), all cached before the step: every new token
    # of the step comes after them and sees all of them. Backends that support cascade attention read
    # them once for the whole batch instead of once per request; the pages are
    # ``block_tables[0, :shared_prefix_len // page_size]``. Host int.
    shared_prefix_len: int = 0
    # Per-backend planned state (wrappers, indptr arrays, ...), filled by Backend.prepare().
    backend_state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens_cpu)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens_cpu)

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE


def build_metadata(
    *,
    prefix_lens: list[int],
    q_lens: list[int],
    block_tables: list[list[int]],
    page_size: int,
    device: torch.device | str,
    mode: ForwardMode | None = None,
    detect_shared_prefix: bool = False,
) -> BatchMetadata:
    """Build the step's metadata on the host, then move it to the device in one go per tensor.

    ``block_tables[i]`` must cover ``prefix_lens[i] + q_lens[i]`` tokens. ``mode`` defaults to DECODE
    when every request adds exactly one token on top of a non-empty prefix, else EXTEND.
    ``detect_shared_prefix``: fill ``shared_prefix_len`` from the block tables.
    """
    if not (len(prefix_lens) == len(q_lens) == len(block_tables)) or not q_lens:
        raise ValueError("prefix_lens, q_lens and block_tables must be non-empty and equally long")
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    for i, (s, bt) in enumerate(zip(seq_lens, block_tables)):
        if len(bt) * page_size < s:
            raise ValueError(f"request {i}: {len(bt)} pages of {page_size} cannot hold {s} tokens")
    if mode is None:
        decode = all(q == 1 for q in q_lens) and all(p > 0 for p in prefix_lens)
        mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND

    positions: list[int] = []
    slots: list[int] = []
    for p, q, bt in zip(prefix_lens, q_lens, block_tables):
        for pos in range(p, p + q):
            positions.append(pos)
            slots.append(bt[pos // page_size] * page_size + pos % page_size)
    indptr = [0]
    for q in q_lens:
        indptr.append(indptr[-1] + q)
    table = _padded_table(block_tables)

    def dev(x, dtype):
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    shared = 0
    if detect_shared_prefix:
        shared = shared_prefix_pages(block_tables, prefix_lens, page_size) * page_size

    return BatchMetadata(
        mode=mode,
        page_size=page_size,
        positions=dev(positions, torch.int64),
        slot_mapping=dev(slots, torch.int64),
        q_indptr=dev(indptr, torch.int32),
        seq_lens=dev(seq_lens, torch.int32),
        prefix_lens=dev(prefix_lens, torch.int32),
        block_tables=table.to(device, non_blocking=True),
        seq_lens_cpu=seq_lens,
        q_lens_cpu=list(q_lens),
        last_token_rows=dev([e - 1 for e in indptr[1:]], torch.int64),
        shared_prefix_len=shared,
    )


def _padded_table(block_tables: list[list[int]]) -> torch.Tensor:
    """[num_reqs, max_pages] int32, padded with page 0. Filled through one flat numpy pass: a nested
    ``torch.tensor`` took 8 ms per step at 1024 requests x 72 pages, on the host, with the GPU idle."""
    lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    table = np.zeros((len(block_tables), int(lens.max())), dtype=np.int32)
    table[np.arange(table.shape[1]) < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(lens.sum()))
    return torch.from_numpy(table)


def shared_prefix_pages(block_tables: list[list[int]], prefix_lens: list[int], page_size: int) -> int:
    """How many leading pages every request's table holds at the same ids (0 for a single request).

    Equal page ids at equal table positions hold the same tokens (the prefix cache shares only full,
    immutable pages), so attention over them is the same computation for every request. Only pages
    wholly within each request's cached prefix count: the pages being written stay per request.
    """
    if len(block_tables) < 2:
        return 0
    n = min(p // page_size for p in prefix_lens)
    first = block_tables[0]
    for bt in block_tables[1:]:
        if n == 0:
            break
        if bt[:n] != first[:n]:  # the common case (all equal) costs one C-speed comparison per request
            n = next(j for j in range(n) if bt[j] != first[j])
    return n
