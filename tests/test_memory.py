"""The default KV cache size on a GPU: 85% of the free memory unless a measured step needs more of it."""
import pytest
import torch

import attnzoo
from attnzoo.engine import memory
from helpers import random_prompts, save_checkpoint
from test_llama import tiny_llama

GIB = 1 << 30


def test_a_step_that_fits_the_rest_keeps_85_percent():
    assert memory.default_kv_bytes(100 * GIB, 2 * GIB) == int(100 * GIB * memory.DEFAULT_FRACTION)


def test_a_large_step_shrinks_the_cache_to_leave_it_room():
    # DeepSeek-V4-Flash on an 80 GB card: ~27 GiB free after the weights, a multi-GiB prefill step
    free, step = 27 * GIB, 5 * GIB
    kv = memory.default_kv_bytes(free, step)
    assert kv < int(free * memory.DEFAULT_FRACTION)
    assert free - kv == int(memory.STEP_MARGIN * step) + memory.HEADROOM


def test_no_room_is_not_a_cache():
    assert memory.default_kv_bytes(2 * GIB, 2 * GIB) <= 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_default_sizing_measures_a_step_and_leaves_it_room(tmp_path, capfd):
    save_checkpoint(tiny_llama(heads=8, kv_heads=2, head_dim=64, layers=2), tmp_path)
    free_before = torch.cuda.mem_get_info()[0]
    llm = attnzoo.load_model(tmp_path, backend="triton", dtype="bfloat16", max_batch_tokens=256, progress=True)
    err = capfd.readouterr().err
    assert "measuring a step's memory: a 256-token prefill" in err and "a step peaks at" in err
    assert llm.engine.pool.nbytes <= memory.DEFAULT_FRACTION * free_before
    # a step of max_batch_tokens runs beside the cache it sized
    outs = llm.generate(random_prompts(160, [250, 24], seed=1), max_new_tokens=4, ignore_eos=True)
    assert [len(o.token_ids) for o in outs] == [4, 4]
