"""The ``triton`` backend through the shared Attention layer against the torch backend: extend then decode
steps over one pool each (sliding window, softcap, a narrow value width, MLA), its refusal on a CPU without the
interpreter, and a tiny Llama's greedy tokens. Inputs as in test_triton_kernels.py (fresh seeds in failures)."""
from __future__ import annotations

import pytest
import torch

from attnzoo.attention.backends.torch_ref import TorchBackend
from attnzoo.attention.kv_cache import KVCacheSpec, KVPool, PageAllocator
from attnzoo.attention.layer import Attention, ForwardContext
from attnzoo.attention.metadata import ForwardMode, build_metadata
from attnzoo.errors import BackendError
from test_triton_kernels import DEVICE, fresh_seed, layer_inputs, rel_err


def _layers():
    return [
        Attention(0, 8, 2, 64, sliding_window=12, logit_softcap=25.0),
        Attention(1, 4, 4, 40, v_head_dim=24, scale=0.3),
        Attention(2, 16, 1, 48, v_head_dim=32, kind="mla"),  # latent 32 + rope 16
    ]


@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_through_attention_layer_extend_then_decode(page_size):
    from attnzoo.attention.backends.triton import TritonBackend

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16
    layers = _layers()
    specs = [layer.kv_cache_spec() for layer in layers]
    pools = [KVPool(specs, num_pages=64 // page_size * 4 + 8, page_size=page_size, dtype=dtype, device=DEVICE)
             for _ in range(2)]
    backends = [TorchBackend(pools[0]), TritonBackend(pools[1])]
    alloc = PageAllocator(pools[0].num_pages)
    tables: list[list[int]] = [[], [], []]
    lens = [0, 0, 0]

    def step(q_lens):
        for i, n in enumerate(q_lens):
            need = -(-(lens[i] + n) // page_size) - len(tables[i])
            tables[i] += alloc.alloc(need)
        meta_kw = dict(prefix_lens=list(lens), q_lens=q_lens, block_tables=[list(t) for t in tables],
                       page_size=page_size, device=DEVICE)
        metas = [build_metadata(**meta_kw) for _ in backends]
        for be, meta in zip(backends, metas):
            be.prepare(meta)
        tokens = sum(q_lens)
        for layer in layers:
            q, k, v = layer_inputs(layer, tokens, gen, dtype)
            ref, out = (layer(q, k, v, ForwardContext(meta, pool, be, be))
                        for be, meta, pool in zip(backends, metas, pools))
            assert out.shape == (tokens, layer.num_heads * layer.v_head_dim)
            assert not out.isnan().any(), f"layer {layer.layer_id}: NaN (seed {seed})"
            err = rel_err(out, ref)
            assert err <= 1e-2, f"layer {layer.layer_id} {metas[1].mode}: rel err {err:.2e} (seed {seed})"
        for i, n in enumerate(q_lens):
            lens[i] += n
        return metas[1]

    assert step([5, 17, 1]).mode is ForwardMode.EXTEND  # prefill
    assert step([3, 1, 20]).mode is ForwardMode.EXTEND  # chunked prefill over a cached prefix
    for _ in range(3):
        assert step([1, 1, 1]).mode is ForwardMode.DECODE
    assert torch.equal(pools[0].buffer.cpu(), pools[1].buffer.cpu()), "the two pools stored different k/v"


def test_backend_refuses_cpu_without_interpreter(monkeypatch):
    from attnzoo.attention.backends.triton import TritonBackend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pool = KVPool([KVCacheSpec(1, 16, 16)], num_pages=2, page_size=1, dtype=torch.float32, device="cpu")
    with pytest.raises(BackendError, match="backend='torch'"):
        TritonBackend(pool)


def test_tiny_llama_greedy_equals_torch_backend(tmp_path):
    import attnzoo
    from helpers import random_prompts, save_checkpoint
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
    torch.manual_seed(fresh_seed())
    save_checkpoint(LlamaForCausalLM(cfg).eval(), tmp_path)
    prompts = random_prompts(160, [3, 19, 40], seed=fresh_seed())
    outs = {}
    for backend in ("torch", "triton"):
        llm = attnzoo.load_model(tmp_path, backend=backend, page_size=16, dtype=torch.float32)
        assert llm.info()["decision"]["decode_backend"] == backend
        outs[backend] = [c.token_ids for c in llm.generate(prompts, max_new_tokens=8, ignore_eos=True)]
    assert outs["triton"] == outs["torch"]
