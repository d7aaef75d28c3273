"""The step path never builds a device tensor with a blocking copy (``torch.tensor(..., device=...)``): such a
copy waits for every step already queued on the GPU, so a step launched ahead (overlap, early launch) would
gain nothing. Host data goes through ``metadata.to_device`` (non-blocking)."""
import ast
from pathlib import Path

import torch

from attnzoo.attention.metadata import to_device

PKG = Path(__file__).resolve().parents[1] / "attnzoo"
STEP_PATH = ["engine/engine.py", "engine/runner.py", "engine/sampling.py", "engine/scheduler.py", "engine/cuda_graph.py",
             "engine/online.py", "attention/metadata.py", "attention/layer.py", "attention/compressed.py",
             "attention/nsa.py", "attention/backends/flashinfer.py", "attention/backends/flashinfer_plan.py",
             "attention/backends/flashinfer_mla.py", "attention/backends/triton.py"]


def blocking_constructions(source: str) -> list[int]:
    """Lines of ``torch.tensor`` / ``torch.as_tensor`` calls given a ``device``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("tensor", "as_tensor")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and any(k.arg == "device" for k in node.keywords)):
            lines.append(node.lineno)
    return lines


def test_the_checker_finds_a_blocking_construction():
    assert blocking_constructions("import torch\nx = torch.tensor([1], device='cuda')\ny = torch.tensor([1])\n") == [2]


def test_no_blocking_device_tensors_on_the_step_path():
    found = {f: blocking_constructions((PKG / f).read_text()) for f in STEP_PATH if (PKG / f).exists()}
    assert len(found) >= 12, "the step path's files moved: update STEP_PATH"
    assert not {f: ls for f, ls in found.items() if ls}, "use attention.metadata.to_device"


def test_to_device_keeps_values_and_dtype():
    x = to_device([3, 1, 2], torch.int32, "cpu")
    assert x.dtype == torch.int32 and x.tolist() == [3, 1, 2]
