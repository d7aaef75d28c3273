"""``LoadConfig``: load_model's options as one frozen value, checked when made, read by the loader and the
spawned ranks."""
from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest
import torch

from attnzoo import LoadConfig, load_model
from attnzoo.engine.load_config import either
from attnzoo.errors import ModelLoadError
from test_llama import tiny_llama


def test_fields_are_load_models_keywords_with_the_same_defaults():
    params = inspect.signature(load_model).parameters
    keywords = {n: p.default for n, p in params.items() if n not in ("name_or_path", "config")}
    fields = {f.name: f.default for f in dataclasses.fields(LoadConfig)}
    assert fields == keywords


@pytest.mark.parametrize("kw, needle", [
    (dict(load_format="dummy"), "unknown load_format 'dummy'"),
    (dict(max_running=True), "max_running must be a positive integer, got True"),
    (dict(kv_cache_memory=0), "kv_cache_memory must be a positive integer, got 0"),
    (dict(window_kv_fraction=0), r'window_kv_fraction must be "auto", a number in \(0, 1\] or None'),
    (dict(k_scale=float("nan")), "k_scale must be a positive finite number"),
    (dict(gpu_memory_utilization=0), r"gpu_memory_utilization must be a number in \(0, 1\]"),
    (dict(max_model_len=1), "max_model_len must be an integer >= 2"),
    (dict(seed=2**64), r"seed must be an integer in \[0, 2\*\*64\)"),
    (dict(cuda_graph_batch_sizes=[4, 0]), r"cuda_graph_batch_sizes must be a list of positive integers, got \[4, 0\]"),
    (dict(cascade="yes"), "cascade must be True, False or None"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
    (dict(data_parallel_size=1.5), "data_parallel_size must be a positive integer"),
])
def test_bad_values_are_named_with_a_fix(kw, needle):
    with pytest.raises(ModelLoadError, match=needle) as e:
        LoadConfig(**kw)
    assert "Fix:" in str(e.value)
    with pytest.raises(ModelLoadError, match=needle):  # load_model refuses them before reading anything
        load_model("/nonexistent/checkpoint", **kw)


def test_frozen_pickles_and_replace_checks_again():
    cfg = LoadConfig(dtype=torch.bfloat16, cuda_graph_batch_sizes=iter([1, 2, 4]), tensor_parallel_size=2)
    assert cfg.cuda_graph_batch_sizes == (1, 2, 4)
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # what spawned ranks receive
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]
    with pytest.raises(ModelLoadError, match="seed must be"):
        dataclasses.replace(cfg, seed=-1)


def test_config_or_keywords_not_both():
    assert either(None, LoadConfig(seed=3)) == LoadConfig(seed=3)
    assert either(LoadConfig(seed=3), LoadConfig()) == LoadConfig(seed=3)
    cfg = LoadConfig(load_format="random", backend="torch", page_size=4, max_running=3, progress=False)
    llm = load_model(tiny_llama().config, config=cfg)
    assert llm.info()["max_running"] == 3 and llm.pool.page_size == 4
    with pytest.raises(ModelLoadError, match="config= and the keyword"):
        load_model("/nonexistent/checkpoint", config=LoadConfig(), seed=3, max_running=2)
    with pytest.raises(ModelLoadError, match="must be an attnzoo.LoadConfig"):
        load_model("/nonexistent/checkpoint", config={"seed": 3})
