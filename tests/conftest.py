import importlib
import os
import sys

import pytest
import torch

# Tests import their shared helpers as a plain module.
sys.path.insert(0, os.path.dirname(__file__))
# Without a GPU, Triton kernels run through the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def bench_script(monkeypatch):
    """Imports a benchmarks/ script by name the way the scripts import each other: their folder on ``sys.path``
    for this test only. A broken import fails the test rather than skipping it."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    return importlib.import_module


@pytest.fixture
def e2e(bench_script):
    """benchmarks/e2e.py: its shapes and ``make_config``."""
    return bench_script("e2e")
