"""Where kernels run: the GPU classes the policy table names, and the kernel families a backend declares
over them (``Kernel``; the rest of a backend's limits are in ``capabilities.py``).

GPU classes are compute capabilities as the policy table names them: "sm80" (A100), "sm89" (L40S/4090),
"sm90" (H100/H200), "sm100" (B200/GB200), "sm103" (B300/GB300), "sm120" (RTX PRO 6000 / 5090), and "cpu".
"""
from __future__ import annotations

import os
from dataclasses import dataclass

GPUS: tuple[str, ...] = ("cpu", "sm80", "sm89", "sm90", "sm100", "sm103", "sm120")
CUDA_GPUS = frozenset(GPUS) - {"cpu"}
# Compute capability -> the class whose rows and capabilities apply.
GPU_CLASSES = {(8, 0): "sm80", (8, 6): "sm80", (8, 7): "sm80", (8, 9): "sm89", (9, 0): "sm90",
               (10, 0): "sm100", (10, 3): "sm103", (12, 0): "sm120", (12, 1): "sm120"}
ANY_CUDA = frozenset(CUDA_GPUS)


def gpu_set(*names: str) -> frozenset[str]:
    """A set of GPU classes, each checked to be one the policy knows."""
    unknown = set(names) - set(GPUS)
    assert not unknown, unknown
    return frozenset(names)


def gpu_of(cc: tuple[int, int]) -> str:
    """The GPU class of a compute capability; "smXY" as is when no class covers it (then nothing runs it)."""
    return GPU_CLASSES.get(tuple(cc), f"sm{cc[0]}{cc[1]}")


def gpu_label(gpu: str) -> str:
    """How messages name a class: every compute capability in it ("sm120" -> "SM120/SM121")."""
    ccs = [f"SM{a}{b}" for (a, b), c in GPU_CLASSES.items() if c == gpu]
    return "/".join(ccs) or gpu.upper()


@dataclass(frozen=True)
class Kernel:
    """One kernel family a backend uses for a phase, and where it runs.

    A phase lists its kernels in order of preference; the first whose GPUs and head dims fit the model
    serves it. ``runs_as`` names the backend whose kernel actually runs (trtllm_mha prefill off
    Blackwell runs FlashInfer's prefill), so the Decision can say so.
    """

    name: str
    gpus: frozenset[str]
    excluded_head_dims: frozenset[int] = frozenset()
    runs_as: str | None = None
    # (variable, value) that must be set in the environment for this kernel to run (Triton on CPU).
    requires_env: tuple[str, str] | None = None
    # (head dim d, group g): layers with head dim above d need at most g query heads per KV head (XQA).
    max_group_above: tuple[int, int] | None = None
    # KV page sizes this kernel takes; None: what the backend's page_sizes say.
    page_sizes: frozenset[int] | None = None
    # Query-head counts it runs; None: any the backend allows (XQA-MLA builds for 128 heads only).
    num_heads: frozenset[int] | None = None
    # GPUs where this kernel does not read an fp8 KV cache (the backend's kv_dtypes say whether any does).
    no_fp8_kv_gpus: frozenset[str] = frozenset()
    note: str = ""
    label: str = ""  # short name for messages ("XQA-MLA"); default: name
    variant: str | None = None  # what the backend passes its library to select this kernel (backend="xqa")
    # Whether it takes attention sinks; None: what the backend's attention_sinks says (trtllm_mha's
    # prefill off Blackwell runs FlashInfer's, which takes none).
    sinks: bool | None = None

    def env_ok(self) -> bool:
        return self.requires_env is None or os.environ.get(self.requires_env[0]) == self.requires_env[1]


def triton_kernels(name: str) -> tuple[Kernel, Kernel]:
    """A Triton kernel family: on CUDA GPUs, and on the CPU under ``TRITON_INTERPRET=1`` (tests only)."""
    return (Kernel(name, CUDA_GPUS),
            Kernel(f"{name} (interpreter)", gpu_set("cpu"), requires_env=("TRITON_INTERPRET", "1"),
                   note="CPU runs the Triton interpreter: for tests only, very slow"))
