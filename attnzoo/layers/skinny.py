"""Dense projections (y = x W^T + b) of the layers built on ``parallel.Linear`` (column/row-parallel, merged,
the LM head): at decode's few rows the skinny Triton kernel (``skinny_kernels``), cuBLAS (``F.linear``) else.

At 1-16 rows a projection only streams its weight, and cuBLAS's GEMV-shaped kernels leave bandwidth on the
table on the small ones (a split-K pass plus a reduction kernel) and on the LM head; the Triton kernel reads
W in one pass (benchmarks/skinny_gemm.py, results/README.md). It is taken on CUDA for bfloat16/float16
weights with the activation's dtype; ``use(False)`` turns it off (cuBLAS-only comparisons), ``use(True)``
takes it for float32 too and runs it on a CPU under ``TRITON_INTERPRET=1``. ``batched`` runs it once per head
in one launch (MLA's absorptions).
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.nn.functional as F

from attnzoo.errors import BackendError
from attnzoo.lazy import optional_module
from attnzoo.layers import fused

MAX_ROWS = 16  # rows that take the kernel: at most the rows of config_for's tiles (past it cuBLAS was faster)
MAX_K = 16384  # past it one program streams too long a row: cuBLAS's split-K won (Gemma-4-31B down_proj, H200)
DTYPES = (torch.bfloat16, torch.float16)
_forced: bool | None = None


@contextlib.contextmanager
def use(on: bool) -> Iterator[None]:
    """Within the block, take the skinny kernel wherever its shapes allow (True) or never (False)."""
    global _forced
    previous, _forced = _forced, bool(on)
    try:
        yield
    finally:
        _forced = previous


def _kernels():
    return optional_module("attnzoo.layers.skinny_kernels")


def _runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel's dtype, device, autograd and ``use`` conditions."""
    # float32 only when asked for (the CPU tests): its cuBLAS path is not bandwidth-starved the same way
    dtypes = (*DTYPES, torch.float32) if _forced else DTYPES
    if _forced is False or x.dtype != weight.dtype or weight.dtype not in dtypes:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False  # the kernel has no backward
    if not x.is_cuda and not (_forced is True and os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    return _kernels() is not None


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``linear(x, weight, bias)`` takes the skinny kernel (shapes, dtypes, device, autograd, ``use``)."""
    if bias is not None and (bias.dtype != weight.dtype or not bias.is_contiguous()):
        return False
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or x.stride(-1) != 1:
        return False
    if not weight.is_contiguous() or x.numel() // max(x.shape[-1], 1) > MAX_ROWS or x.numel() == 0:
        return False
    return weight.shape[1] <= MAX_K and _runs(x, weight)


def config_for(n: int, k: int, m: int):
    """The tile config for an [n, k] weight and ``m`` rows of x, by its output features
    (benchmarks/skinny_gemm.py): up to 4096 (o_proj, down_proj, MLA's small projections) one row takes 32 W rows
    with 512-wide steps along K, so that each of the few programs keeps long reads in flight, and 2-16 rows
    take 64 x 128 tiles of W x^T, six stages deep (the one-row tile, where Triton specialises M == 1, was up to
    1.3x slower past one row); to 8192 64 x 128 tiles six stages deep; wider ones 64 x 256."""
    sk = _kernels()
    if n <= 4096:
        return sk.Config(32, 512, 4, 3) if m <= 1 else sk.Config(64, 128, 4, 6, swap=True)
    return sk.Config(64, 128, 4, 6) if n <= 8192 else sk.Config(64, 256, 4, 3)


def batched_config(n: int, k: int):
    """Tiles of a per-head projection (``batched``): the whole of a short K in one step (MLA's 128 and 512)
    and about 16 KB of W a program, so that one head's few outputs still spread over several programs."""
    block_k = min(512, max(16, 1 << (k - 1).bit_length()))
    return _kernels().Config(max(16, min(64, 8192 // block_k)), block_k, 4, 2)


def batched(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head products x[:, h] @ weight[h]^T: x [T, H, K], weight [H, N, K] (any strides) -> [T, H, N] (into
    ``out``, a view of unit stride along N, where given). The skinny kernel, one launch for all heads, where
    ``linear``'s conditions hold for each head (W unit-strided along N or K); torch.bmm else."""
    t, h, k = x.shape
    n = weight.shape[1]
    shapes_fit = (0 < t <= MAX_ROWS and k <= MAX_K and weight.dim() == 3 and weight.shape[::2] == (h, k)
                  and 1 in weight.stride()[1:] and x.stride(2) == 1
                  and (out is None or (out.shape == (t, h, n) and out.device == x.device and out.stride(2) == 1
                                       and out.dtype == x.dtype)))
    if not (shapes_fit and _runs(x, weight)):
        _check_interpreter(x)
        if out is None:  # no out=: autograd records this product (the reference models' training checks)
            return torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1)
        return torch.bmm(x.transpose(0, 1), weight.transpose(1, 2), out=out.transpose(0, 1)).transpose(0, 1)
    out = x.new_empty(t, h, n) if out is None else out
    return _kernels().batched(x, weight, out, config=batched_config(n, k))


def _check_interpreter(x: torch.Tensor) -> None:
    if _forced is True and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise BackendError("skinny.use(True) on a CPU needs Triton's interpreter",
                           fix="set TRITON_INTERPRET=1 before triton is imported, or leave skinny.use alone")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), by the skinny kernel where ``fits``."""
    if not fits(x, weight, bias):
        _check_interpreter(x)
        return F.linear(x, weight, bias)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    y = _kernels().linear(x2, weight, bias, config=config_for(n, k, x2.shape[0]))
    return y.view(*x.shape[:-1], n)


def gates(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``gated`` runs one launch: ``fits``, and the fused ops run as kernels (not under
    ``fused.use("torch")``, the unfused reference)."""
    return fits(x, weight, bias) and fused.enabled(x)


def gated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    """act(gate) * up of a gated MLP's stacked gate_up projection (``weight`` [2I, K]: gate rows, then up):
    one skinny launch where ``gates``, else the projection (``linear``) and ``fused.act_and_mul``, rounded at
    the same points (the projection's output, the activation, the product)."""
    if not gates(x, weight, bias):
        _check_interpreter(x)
        return fused.act_and_mul(linear(x, weight, bias), act)
    fused.check_gated_act(act)
    n2, k = weight.shape
    c = config_for(n2, k, 1)  # the m=1 rule at any row count (no other measured gated): half its rows of gate, of up
    y = _kernels().linear(x.reshape(-1, k), weight, bias, config=c._replace(block_n=c.block_n // 2), act=act)
    return y.view(*x.shape[:-1], n2 // 2)


def describe(dtype: torch.dtype) -> str:
    """How unquantized projections in ``dtype`` are computed (a model's ``info()``)."""
    name = str(dtype).replace("torch.", "")
    if dtype not in DTYPES or _kernels() is None:
        return f"torch linear ({name})"
    return f"torch linear ({name}); skinny Triton kernel at <= {MAX_ROWS} rows on CUDA"
