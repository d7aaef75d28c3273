"""The tiny Llama the reliability and first-contact tests share: its transformers model, its checkpoint folder and
the model loaded on the torch backend (module-scoped in each test module that imports them)."""
from __future__ import annotations

import pytest

import attnzoo
from helpers import save_checkpoint
from test_llama import tiny_llama


@pytest.fixture(scope="module")
def hf_model():
    return tiny_llama(kv_heads=2, heads=4)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, hf_model):
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("rel_llama"))


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return attnzoo.load_model(tiny_dir, backend="torch", dtype="float32", page_size=4, progress=False)
