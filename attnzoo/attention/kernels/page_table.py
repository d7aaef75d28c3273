"""Page-index arrays for vendor kernels, built on the device from the step's block tables.

Two shapes serve every backend:

* FlashInfer-style ragged indices: ``kv_indptr`` [num_reqs + 1] (in pages) and ``kv_indices``
  [total pages] (the page ids of request i at ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``), plus
  ``kv_last_page_len`` (tokens in each request's last page). With page size 1 the page ids are token
  slots. ``page_start`` skips each request's first pages (a sliding window that has moved past them).
* TRT-LLM-style 2-D block tables: [num_reqs, num_cols], request i's page ids first and then
  ``pad_value`` (0: page 0 is reserved for padding in our pool; -1 where a kernel wants a sentinel).
  ``num_cols`` is the kernel's constraint (trtllm_mla wants a multiple of 128 / page_size), so callers
  round with ``padded_block_table_width``.

Page counts come from ``seq_lens`` on the device; sizes that shape a tensor (total pages, column count)
are host ints computed from ``BatchMetadata.seq_lens_cpu``, so nothing here syncs with the device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnzoo.errors import BackendError

# Columns one program copies per iteration. Block tables padded to a multiple of this need no tail
# masking; any width is correct.
PAGE_TABLE_BURST = 64


@triton.jit
def _kv_indices_kernel(
    BT, SEQ_LENS, PAGE_START, KV_INDPTR, KV_INDICES,
    stride_btb,
    PAGE_SIZE: tl.constexpr,
    HAS_START: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    num_pages = tl.cdiv(tl.load(SEQ_LENS + r), PAGE_SIZE)
    first = 0
    if HAS_START:
        first = tl.load(PAGE_START + r)
    dst = tl.load(KV_INDPTR + r)
    for c in range(first, num_pages, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        ok = offs < num_pages
        pages = tl.load(BT + r * stride_btb + offs, mask=ok)
        tl.store(KV_INDICES + dst + (offs - first), pages, mask=ok)


@triton.jit
def _block_table_kernel(
    BT, SEQ_LENS, OUT,
    stride_btb, stride_ob,
    bt_cols, out_cols, pad_value,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    cblk = tl.program_id(1)
    num_pages = tl.cdiv(tl.load(SEQ_LENS + r), PAGE_SIZE)
    offs = cblk * BLOCK + tl.arange(0, BLOCK)
    real = (offs < num_pages) & (offs < bt_cols)
    pages = tl.load(BT + r * stride_btb + offs, mask=real, other=0)
    pages = tl.where(real, pages, pad_value)
    tl.store(OUT + r * stride_ob + offs, pages, mask=offs < out_cols)


def kv_indptr(seq_lens: torch.Tensor, page_size: int, page_start: torch.Tensor | None = None) -> torch.Tensor:
    """[num_reqs] token counts -> [num_reqs + 1] int32 offsets of each request's pages (device op)."""
    pages = torch.div(seq_lens + (page_size - 1), page_size, rounding_mode="floor")
    if page_start is not None:
        pages = pages - page_start
    indptr = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    indptr[1:] = torch.cumsum(pages, 0)
    return indptr


def kv_last_page_len(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """[num_reqs] int32: tokens held by each request's last page (1..page_size)."""
    return ((seq_lens - 1) % page_size + 1).to(torch.int32)


def num_pages_host(seq_lens_cpu: list[int], page_size: int, page_start_cpu: list[int] | None = None) -> int:
    """Total pages of the ragged index array, from the host copy of seq_lens."""
    total = sum(-(-s // page_size) for s in seq_lens_cpu)
    return total - (sum(page_start_cpu) if page_start_cpu else 0)


def create_kv_indices(
    block_tables: torch.Tensor,  # [num_reqs, max_pages] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    indptr: torch.Tensor,  # [num_reqs + 1] int32 from kv_indptr()
    page_size: int,
    *,
    num_indices: int,  # host int: indptr[-1], e.g. num_pages_host(meta.seq_lens_cpu, page_size)
    page_start: torch.Tensor | None = None,  # [num_reqs] int32: first page to include per request
    out: torch.Tensor | None = None,  # [>= num_indices] int32, e.g. a static CUDA-graph buffer
) -> torch.Tensor:  # [num_indices] int32 (a prefix of ``out`` when given)
    num_reqs = block_tables.shape[0]
    if seq_lens.shape[0] != num_reqs or indptr.shape[0] != num_reqs + 1:
        raise BackendError(
            f"kv indices: {num_reqs} block-table rows, {seq_lens.shape[0]} seq lens, {indptr.shape[0]} indptr entries",
            fix="pass one seq len per request and an indptr of num_reqs + 1 entries",
        )
    if out is None:
        out = torch.empty(num_indices, dtype=torch.int32, device=block_tables.device)
    elif out.shape[0] < num_indices:
        raise BackendError(f"kv indices: buffer of {out.shape[0]} for {num_indices} pages",
                           fix="size the static buffer for the largest batch's page count")
    if num_reqs:
        _kv_indices_kernel[(num_reqs,)](
            block_tables, seq_lens, page_start if page_start is not None else seq_lens, indptr, out,
            block_tables.stride(0),
            PAGE_SIZE=page_size, HAS_START=page_start is not None, BLOCK=PAGE_TABLE_BURST,
            num_warps=1,
        )
    return out[:num_indices]


def padded_block_table_width(max_pages: int, multiple: int = 1) -> int:
    """Smallest column count >= max_pages that is a multiple of ``multiple`` (a kernel's constraint)."""
    if multiple < 1:
        raise BackendError(f"block-table column multiple must be >= 1, got {multiple}", fix="pass a positive multiple")
    return max(multiple, -(-max_pages // multiple) * multiple)


def create_block_table(
    block_tables: torch.Tensor,  # [num_reqs, max_pages] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    page_size: int,
    *,
    num_cols: int,
    pad_value: int = 0,
    max_pages: int | None = None,  # host int: the longest request's page count, checked against num_cols
    out: torch.Tensor | None = None,  # [>= num_reqs, num_cols] int32
) -> torch.Tensor:  # [num_reqs, num_cols] int32
    num_reqs = block_tables.shape[0]
    if max_pages is not None and max_pages > num_cols:
        raise BackendError(
            f"block table of {num_cols} columns cannot hold a request of {max_pages} pages",
            fix="size num_cols with padded_block_table_width(max pages, multiple)",
        )
    if out is None:
        out = torch.empty(num_reqs, num_cols, dtype=torch.int32, device=block_tables.device)
    elif out.shape[0] < num_reqs or out.shape[1] != num_cols:
        raise BackendError(f"block table buffer {tuple(out.shape)} does not fit {num_reqs} x {num_cols}",
                           fix="allocate it [max batch, num_cols]")
    if num_reqs and num_cols:
        grid = (num_reqs, triton.cdiv(num_cols, PAGE_TABLE_BURST))
        _block_table_kernel[grid](
            block_tables, seq_lens, out, block_tables.stride(0), out.stride(0),
            block_tables.shape[1], num_cols, pad_value,
            PAGE_SIZE=page_size, BLOCK=PAGE_TABLE_BURST, num_warps=1,
        )
    return out[:num_reqs]
