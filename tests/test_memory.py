"""The default KV cache size on a GPU: 85% of the free memory unless a measured step needs more of it."""
import gc

import pytest
import torch

import attnzoo
from attnzoo.engine import memory
from attnzoo.engine.scheduler import MAX_RUNNING_CAP
from helpers import random_prompts, save_checkpoint
from test_llama import tiny_llama

GIB = 1 << 30


def test_a_step_that_fits_the_rest_keeps_85_percent():
    assert memory.default_kv_bytes(100 * GIB, 2 * GIB) == int(100 * GIB * memory.DEFAULT_FRACTION)


def test_a_large_step_shrinks_the_cache_to_leave_it_room():
    # as DeepSeek-V4-Flash on an 80 GB card: a prefill step larger than 15% of what the weights leave free
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
    gc.collect()  # load empties torch's cache: blocks earlier tests left there count as free to it
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    llm = attnzoo.load_model(tmp_path, backend="triton", dtype="bfloat16", max_batch_tokens=256, progress=True)
    err = capfd.readouterr().err
    assert "measuring a step's memory: 256 prompt tokens in 1 prompt(s)" in err and "a step peaks at" in err
    assert llm.engine.pool.nbytes <= memory.DEFAULT_FRACTION * free_before
    # a step of max_batch_tokens runs beside the cache it sized
    outs = llm.generate(random_prompts(160, [250, 24], seed=1), max_new_tokens=4, ignore_eos=True)
    assert [len(o.token_ids) for o in outs] == [4, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_short_context_measures_several_prompts_filling_the_step(tmp_path, capfd):
    """A step holds max_batch_tokens tokens whatever the context: 1000 of them in prompts of at most 511."""
    save_checkpoint(tiny_llama(heads=8, kv_heads=2, head_dim=64, layers=2), tmp_path)  # a 512-token context
    attnzoo.load_model(tmp_path, backend="triton", dtype="bfloat16", max_batch_tokens=1000, progress=True)
    assert "measuring a step's memory: 1000 prompt tokens in 2 prompt(s)" in capfd.readouterr().err


@pytest.mark.parametrize("fraction", ["auto", 0.5, None])
def test_the_profile_step_fills_max_batch_tokens_on_a_pool_of_just_its_pages(tmp_path, monkeypatch, fraction):
    """On the CPU, with the CUDA memory calls stubbed: the measured step runs max_batch_tokens prompt tokens (three
    prompts where the context holds 2047) in one step on its own small pool, windowed layers included."""
    from attnzoo.engine import build
    from attnzoo.engine.load_config import LoadConfig
    from test_gpt_oss import tiny_gpt_oss  # sliding and full layers

    save_checkpoint(tiny_gpt_oss(), tmp_path)
    llm = attnzoo.load_model(tmp_path, backend="torch", dtype="float32", window_kv_fraction=fraction)
    ran = {}

    def fake_peak(engine, lengths, rows, hidden, dtype):
        ran["lengths"], ran["rows"] = lengths, rows
        steps = []
        step = engine.step
        engine.step = lambda: steps.append(1) or step()
        engine.generate([[5] * n for n in lengths], [memory.SamplingParams(max_new_tokens=1, ignore_eos=True)] * len(lengths))
        ran["steps"], ran["pages"] = len(steps), engine.pool.num_pages
        return 3 * GIB

    monkeypatch.setattr(memory, "step_peak_bytes", fake_peak)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (40 * GIB, 80 * GIB))
    cfg = LoadConfig(window_kv_fraction=fraction)
    specs = llm.model.kv_cache_specs()
    kv = build._profiled_kv_bytes(llm.model, specs, llm.pool.page_size, torch.float32, torch.float32, llm.device, cfg,
                                  llm.decision, 2048, 5000, llm.config.hidden_size, lambda msg: None)
    assert ran["lengths"] == [1667, 1667, 1666] and ran["rows"] == min(MAX_RUNNING_CAP, 5000)
    assert ran["steps"] == 1  # all of max_batch_tokens in the one measured step
    assert ran["pages"] <= 5000 // llm.pool.page_size + 3 * 2 + 1  # a pool of just those prompts' pages
    assert kv == memory.default_kv_bytes(40 * GIB, 3 * GIB)


def test_no_room_names_the_step_and_the_fixes(tmp_path, monkeypatch):
    from attnzoo.engine import build
    from attnzoo.engine.load_config import LoadConfig
    from attnzoo.errors import ModelLoadError

    save_checkpoint(tiny_llama(layers=1), tmp_path)
    llm = attnzoo.load_model(tmp_path, backend="torch", dtype="float32")
    monkeypatch.setattr(memory, "step_peak_bytes", lambda *a: 3 * GIB)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (4 * GIB, 80 * GIB))
    with pytest.raises(ModelLoadError, match=r"a step of 256 tokens needs 4\.8 GiB .*kv_cache_tokens"):
        build._profiled_kv_bytes(llm.model, llm.model.kv_cache_specs(), llm.pool.page_size, torch.float32,
                                 torch.float32, llm.device, LoadConfig(), llm.decision, 512, 256, 64, lambda msg: None)
