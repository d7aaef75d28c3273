"""Programmatic dependent launch (PDL) for the Triton kernels of a step, on Hopper (SM90) and later GPUs.

A decode step at small batch is hundreds of short kernels, and between two of them the GPU drains one and
ramps up the next. Launched with PDL, a kernel is scheduled while its predecessor still runs: it waits
(``griddepcontrol.wait``) before it touches memory, then lets its own successor launch, so each launch
overlaps the previous kernel's tail. Inside a CUDA graph the launch attribute becomes a programmatic edge
(benchmarks/pdl_chain.py; results/pdl_batch1_nvidia_h100.txt).

The contract of a kernel that takes it: a ``PDL: tl.constexpr`` argument and, before any load or store,
``attention.kernels.common.prior_done(PDL)``; its launch passes ``**launch_args(x)``. Only index arithmetic
and ``l2_prefetch`` may come before it: a skinny projection asks L2 for its weight while the kernel before
runs. Kernels that skip it (torch's, cuBLAS's) keep the ordinary stream order. Off on CPUs and under Triton's
interpreter, on GPUs before SM90 and on ROCm, and within ``use(False)``.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import torch

_forced_off = False


@contextlib.contextmanager
def use(on: bool) -> Iterator[None]:
    """Within the block, launch with PDL where the GPU has it (True, the default) or never (False)."""
    global _forced_off
    previous, _forced_off = _forced_off, not on
    try:
        yield
    finally:
        _forced_off = previous


@functools.cache
def _supported(index: int) -> bool:
    # NVIDIA's griddepcontrol only: a ROCm GPU's "capability" (9, 4) is not Hopper's.
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(x: torch.Tensor) -> bool:
    """Whether a kernel reading ``x`` (on its device) launches with PDL; never under Triton's interpreter, which
    runs kernels on GPU tensors too but has no grid dependency control."""
    return (x.is_cuda and not _forced_off and os.environ.get("TRITON_INTERPRET") != "1"
            and _supported(x.device.index or 0))


@functools.cache
def sm_count(index: int) -> int:
    """The SMs of CUDA device ``index`` (read once)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_args(x: torch.Tensor, programs: int | None = None) -> dict:
    """The kernel argument and the launch option of a PDL kernel whose inputs live where ``x`` does. A grid of
    ``programs`` past one per SM launches without it: launched early, its first programs wait on SMs its
    predecessor still streams on (Llama-3.1-8B's gate_up and LM head at batch 1, H200:
    results/pdl_multi_wave_nvidia_h200.txt)."""
    on = enabled(x) and (programs is None or programs <= sm_count(x.device.index or 0))
    return {"PDL": on, "launch_pdl": on}
