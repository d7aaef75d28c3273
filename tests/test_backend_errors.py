"""Asking for a FlashInfer backend where FlashInfer cannot be imported is a clear error naming the extra.

FlashInfer is hidden through ``sys.modules`` (a None entry makes ``import flashinfer`` fail), so these
tests mean the same on a machine that has it installed.
"""
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import attnzoo
from attnzoo.attention.backends import backend_names, get_backend_class
from attnzoo.attention.kv_cache import KVCacheSpec, KVPool
from attnzoo.errors import BackendError
from helpers import save_checkpoint

FLASHINFER_BACKENDS = ["flashinfer", "trtllm_mha", "flashinfer_mla", "trtllm_mla"]


@pytest.fixture
def no_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)


def test_flashinfer_backends_are_registered():
    assert set(FLASHINFER_BACKENDS) <= set(backend_names())


@pytest.mark.parametrize("name", FLASHINFER_BACKENDS)
def test_constructing_without_flashinfer_names_the_extra(no_flashinfer, name):
    spec = KVCacheSpec(num_kv_heads=1, head_dim=576, v_head_dim=512, v_from_k=True) if "mla" in name else \
        KVCacheSpec(num_kv_heads=2, head_dim=128, v_head_dim=128)
    pool = KVPool([spec], num_pages=4, page_size=64, dtype=torch.bfloat16, device="cpu")
    cls = get_backend_class(name)  # importing the adapter module needs no FlashInfer
    with pytest.raises(BackendError) as err:
        cls(pool)
    msg = str(err.value)
    assert f"{name!r} attention backend needs FlashInfer" in msg
    assert 'pip install "attnzoo[flashinfer]"' in msg


@pytest.mark.parametrize("name", ["flashinfer", "trtllm_mha"])
def test_load_model_with_a_flashinfer_backend_without_flashinfer(no_flashinfer, tmp_path, name):
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64)
    save_checkpoint(LlamaForCausalLM(cfg), tmp_path)
    with pytest.raises(BackendError) as err:
        attnzoo.load_model(tmp_path, backend=name, device="cpu", page_size=16)
    assert "attnzoo[flashinfer]" in str(err.value)
