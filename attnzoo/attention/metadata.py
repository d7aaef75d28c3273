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
from dataclasses import dataclass

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
    # A pool with a window page group (``KVPool.has_window_group``): that group's page ids per request, in
    # the same columns as ``block_tables`` (token t in column t // page_size), 0 where the page was released
    # (wholly before the window of every query of the request) and in padding; and the slots of this
    # step's tokens in that group. Layers with a sliding window read and write these
    # (``block_tables_for`` / ``slot_mapping_for``). None: one group, every layer uses the fields above.
    window_block_tables: torch.Tensor | None = None  # [num_reqs, max_window_cols] int32, device
    window_slot_mapping: torch.Tensor | None = None  # [num_tokens] int64, device

    def block_tables_for(self, window: int | None) -> torch.Tensor:
        """The block tables a layer with this sliding window (None: none) reads."""
        return self.window_block_tables if window and self.window_block_tables is not None else self.block_tables

    def slot_mapping_for(self, window: int | None) -> torch.Tensor:
        """Where a layer with this sliding window (None: none) stores the step's tokens."""
        return self.window_slot_mapping if window and self.window_slot_mapping is not None else self.slot_mapping

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

    def leading_decode_rows(self) -> int:
        """How many leading requests bring one token on a cached prefix: the decode rows a mixed step starts with
        (the scheduler puts them first)."""
        n = 0
        for q, s in zip(self.q_lens_cpu, self.seq_lens_cpu):
            if q != 1 or s < 2:
                break
            n += 1
        return n

    def split(self, n: int) -> "tuple[BatchMetadata, BatchMetadata]":
        """(the first ``n`` requests as a DECODE step, the rest as an EXTEND step): the first's tensors are views of
        this step's, the second's small device copies (a view from an odd offset changes a pointer's alignment,
        which Triton compiles a kernel variant for, mid-run). Each of the first ``n`` requests must bring one token
        on a cached prefix, and no prefix may be shared (``shared_prefix_len`` 0): neither part claims one."""
        if not 0 < n < self.num_reqs or self.shared_prefix_len:
            raise ValueError(f"split({n}) of a step of {self.num_reqs} requests (shared prefix {self.shared_prefix_len})")
        if any(q != 1 for q in self.q_lens_cpu[:n]) or any(s < 2 for s in self.seq_lens_cpu[:n]):
            raise ValueError(f"split({n}): the first {n} requests are not all one new token on a cached prefix")

        def part(reqs: slice, rows: slice, q_indptr: torch.Tensor, last_rows: torch.Tensor, mode) -> BatchMetadata:
            def cut(x, at):
                return None if x is None else x[at] if at.start == 0 else x[at].clone()

            return BatchMetadata(
                mode=mode, page_size=self.page_size, positions=cut(self.positions, rows),
                slot_mapping=cut(self.slot_mapping, rows), q_indptr=q_indptr, seq_lens=cut(self.seq_lens, reqs),
                prefix_lens=cut(self.prefix_lens, reqs), block_tables=cut(self.block_tables, reqs),
                seq_lens_cpu=self.seq_lens_cpu[reqs], q_lens_cpu=self.q_lens_cpu[reqs], last_token_rows=last_rows,
                window_block_tables=cut(self.window_block_tables, reqs),
                window_slot_mapping=cut(self.window_slot_mapping, rows),
            )

        # the first part's rows are its requests, one each
        head = part(slice(0, n), slice(0, n), self.q_indptr[: n + 1], self.last_token_rows[:n], ForwardMode.DECODE)
        tail = part(slice(n, None), slice(n, None), self.q_indptr[n:] - n, self.last_token_rows[n:] - n,
                    ForwardMode.EXTEND)
        return head, tail


def to_device(data, dtype: torch.dtype, device) -> torch.Tensor:
    """Host data (a list, a numpy array) as a tensor on ``device``, without waiting for the stream: a
    blocking copy holds the host until every step already queued has run, which undoes launching ahead."""
    return torch.as_tensor(data, dtype=dtype).to(device, non_blocking=True)


def build_metadata(
    *,
    prefix_lens: list[int],
    q_lens: list[int],
    block_tables: list[list[int]],
    page_size: int,
    device: torch.device | str,
    mode: ForwardMode | None = None,
    detect_shared_prefix: bool = False,
    window_block_tables: list | None = None,
) -> BatchMetadata:
    """Build the step's metadata on the host, then move it to the device in one go per tensor.

    ``block_tables[i]`` must cover ``prefix_lens[i] + q_lens[i]`` tokens. ``mode`` defaults to DECODE
    when every request adds exactly one token on top of a non-empty prefix, else EXTEND.
    ``detect_shared_prefix``: fill ``shared_prefix_len`` from the block tables.
    ``window_block_tables``: a window page group's tables (``BatchMetadata.window_block_tables``), whose
    entries at the pages this step writes must be live (non-zero).
    """
    if not (len(prefix_lens) == len(q_lens) == len(block_tables)) or not q_lens:
        raise ValueError("prefix_lens, q_lens and block_tables must be non-empty and equally long")
    # numpy over the whole batch: per-token Python loops cost milliseconds per step at 1000+ requests,
    # on the host, with the GPU idle.
    p_arr, q_arr = np.asarray(prefix_lens, dtype=np.int64), np.asarray(q_lens, dtype=np.int64)
    seq_arr = p_arr + q_arr
    seq_lens = seq_arr.tolist()
    table, lens = _padded_table(block_tables)
    short = np.flatnonzero(lens * page_size < seq_arr)
    if short.size:
        i = int(short[0])
        raise ValueError(f"request {i}: {lens[i]} pages of {page_size} cannot hold {seq_lens[i]} tokens")
    if mode is None:
        decode = bool((q_arr == 1).all() and (p_arr > 0).all())
        mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND

    indptr = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_arr, out=indptr[1:])
    req = np.repeat(np.arange(len(q_lens)), q_arr)  # the request of each new token
    positions = np.arange(int(indptr[-1])) + (p_arr - indptr[:-1])[req]
    slots = table[req, positions // page_size].astype(np.int64) * page_size + positions % page_size

    def dev(x, dtype):
        return to_device(x, dtype, device)

    wtable = wslots = None
    if window_block_tables is not None:
        wtable, wlens = _padded_table(window_block_tables)
        wpages = np.zeros(len(slots), dtype=np.int64)
        inside = positions // page_size < wlens[req]
        wpages[inside] = wtable[req[inside], positions[inside] // page_size]
        if not wpages.all():
            i = int(req[np.argmin(wpages)])
            raise ValueError(f"request {i}: its window-group table has no live page for a token this step writes")
        wslots = wpages * page_size + positions % page_size

    shared = 0
    if detect_shared_prefix:
        n = shared_prefix_pages(block_tables, p_arr, page_size, table=table)
        if n and wtable is not None:
            # Window-group columns every request still holds must hold the same pages too (the prefix
            # cache may hold another writer's window page of the same tokens); a column released by some
            # request is outside its window, so no cascade reads it as shared (fi_common.cascade_split).
            w = wtable[:, :n]
            same = ((w[1:] == w[0]).all(axis=0)) | ~(w != 0).all(axis=0)
            n = n if same.all() else int(np.argmin(same))
        shared = n * page_size

    return BatchMetadata(
        mode=mode,
        page_size=page_size,
        positions=dev(positions, torch.int64),
        slot_mapping=dev(slots, torch.int64),
        q_indptr=dev(indptr, torch.int32),
        seq_lens=dev(seq_arr, torch.int32),
        prefix_lens=dev(p_arr, torch.int32),
        block_tables=torch.from_numpy(table).to(device, non_blocking=True),
        seq_lens_cpu=seq_lens,
        q_lens_cpu=list(q_lens),
        last_token_rows=dev(indptr[1:] - 1, torch.int64),
        shared_prefix_len=shared,
        window_block_tables=None if wtable is None else torch.from_numpy(wtable).to(device, non_blocking=True),
        window_slot_mapping=None if wslots is None else dev(wslots, torch.int64),
    )


def _padded_table(block_tables) -> tuple[np.ndarray, np.ndarray]:
    """([num_reqs, max_pages] int32 padded with page 0, [num_reqs] lengths). Filled through one flat
    numpy pass, since a nested ``torch.tensor`` costs a Python object per page every step. Tables given
    as int32 arrays (the engine keeps one per request) are concatenated without touching Python ints."""
    lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    table = np.zeros((len(block_tables), int(lens.max())), dtype=np.int32)
    if isinstance(block_tables[0], np.ndarray):
        flat = np.concatenate(block_tables)
    else:
        flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(lens.sum()))
    table[np.arange(table.shape[1]) < lens[:, None]] = flat
    return table, lens


def shared_prefix_pages(block_tables, prefix_lens: list[int], page_size: int, table: np.ndarray | None = None) -> int:
    """How many leading pages every request's table holds at the same ids (0 for a single request).

    Equal page ids at equal table positions hold the same tokens (the prefix cache shares only full,
    immutable pages), so attention over them is the same computation for every request. Only pages
    wholly within each request's cached prefix count: the pages being written stay per request.
    ``table``: the padded table of ``block_tables``, where the caller has it.
    """
    if len(block_tables) < 2:
        return 0
    n = int(np.min(prefix_lens)) // page_size
    if n == 0:
        return 0
    if table is None:
        table = _padded_table(block_tables)[0]
    same = (table[1:, :n] == table[0, :n]).all(axis=0)  # within every request's table: n <= its length
    return n if same.all() else int(np.argmin(same))
