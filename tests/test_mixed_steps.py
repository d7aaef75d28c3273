"""Mixed steps split in two (``HybridBackend.decode_rows``): a step's leading decode rows run as a decode step on the
decode backend, its prompt chunks as an extend step on the prefill backend. The same tokens and logits as the one
extend step, on dense, MLA, sliding-window and shared-KV models; never where attention is more than the layer's
call (NSA, DeepSeek-V4)."""
import pytest
import torch

import attnzoo
from attnzoo.errors import BackendError
from attnzoo.attention.backends.hybrid import MIXED_SPLIT_MIN_ROWS, HybridBackend, MixedPlan
from attnzoo.attention.metadata import ForwardMode, build_metadata
from helpers import random_prompts, save_checkpoint
from test_llama import tiny_llama
from test_token_rows import _family

GPU = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(tiny_llama(heads=4, kv_heads=2, head_dim=32), tmp_path_factory.mktemp("mixed"))


def test_split_gives_each_part_its_own_requests():
    from dataclasses import fields

    from attnzoo.attention.metadata import BatchMetadata

    meta = build_metadata(prefix_lens=[3, 7, 0, 4], q_lens=[1, 1, 5, 2], block_tables=[[1], [2, 3], [4, 5], [6, 7]],
                          page_size=4, device="cpu", window_block_tables=[[1], [2, 3], [4, 5], [6, 7]])
    head, tail = meta.split(2)
    assert head.mode is ForwardMode.DECODE and tail.mode is ForwardMode.EXTEND
    assert head.seq_lens_cpu == [4, 8] and head.q_indptr.tolist() == [0, 1, 2] and head.positions.tolist() == [3, 7]
    assert head.block_tables.tolist() == [[1, 0], [2, 3]] and head.window_block_tables.tolist() == [[1, 0], [2, 3]]
    assert head.last_token_rows.tolist() == [0, 1] and head.slot_mapping.tolist() == meta.slot_mapping[:2].tolist()
    assert tail.q_lens_cpu == [5, 2] and tail.q_indptr.tolist() == [0, 5, 7]
    assert tail.positions.tolist() == [0, 1, 2, 3, 4, 4, 5] and tail.last_token_rows.tolist() == [4, 6]
    assert tail.block_tables.tolist() == [[4, 5], [6, 7]] and tail.prefix_lens.tolist() == [0, 4]
    assert tail.window_block_tables.tolist() == [[4, 5], [6, 7]]
    assert tail.slot_mapping.tolist() == meta.slot_mapping[2:].tolist()
    assert tail.window_slot_mapping.tolist() == meta.window_slot_mapping[2:].tolist()
    # the second part's tensors start aligned (Triton compiles a variant per pointer alignment)
    assert all(t.data_ptr() % 16 == 0 for t in (tail.prefix_lens, tail.seq_lens, tail.block_tables,
                                                  tail.window_block_tables, tail.q_indptr, tail.positions))
    # every field of the metadata is one split handles: a new field must be added there (and here)
    assert {f.name for f in fields(BatchMetadata)} == {
        "mode", "page_size", "positions", "slot_mapping", "q_indptr", "seq_lens", "prefix_lens", "block_tables",
        "seq_lens_cpu", "q_lens_cpu", "last_token_rows", "shared_prefix_len", "window_block_tables",
        "window_slot_mapping"}
    with pytest.raises(ValueError):
        meta.split(4)  # nothing would be left to extend
    with pytest.raises(ValueError, match="not all one new token"):
        meta.split(3)  # the third request brings 5


class _Splits:
    splits_mixed_steps = True


class _Whole:
    splits_mixed_steps = False


def test_only_leading_decode_rows_past_the_floor_split():
    hb = HybridBackend(_Splits(), _Splits())
    assert hb.mixed_split()[0] is None and "not checked" in hb.mixed_split()[1]
    hb.mixed_refused = None

    def rows(prefix, q, floor=2):
        hb.mixed_min_rows = floor
        return hb.decode_rows(build_metadata(prefix_lens=prefix, q_lens=q, block_tables=[[1, 2, 3]] * len(q),
                                             page_size=4, device="cpu"))

    assert rows([5, 5, 0], [1, 1, 6]) == 2
    assert rows([5, 0, 5], [1, 6, 1]) == 0  # one leading row: under the floor
    assert rows([5, 5, 0], [1, 1, 6], floor=3) == 0
    assert rows([0, 5, 5], [1, 1, 1]) == 0  # a first token without a prefix leads: no decode rows first
    assert rows([5, 5, 5], [1, 1, 1]) == 0  # a decode step is not split
    assert rows([5, 5, 0], [1, 1, 6], floor=None) == 0
    for half in ("prefill_backend", "decode_backend"):  # both backends must declare it
        setattr(hb, half, _Whole())
        assert rows([5, 5, 0], [1, 1, 6]) == 0 and "splits_mixed_steps" in hb.mixed_split()[1]
        setattr(hb, half, _Splits())
    with pytest.raises(BackendError, match="positive integer"):
        hb.mixed_min_rows = 0


def _run(path, backend, min_rows, device="cpu", **kw):
    """Greedy outputs of short prompts decoding while long ones arrive in chunks (a 24-token budget), and how many
    steps ran split; a split step's decode rows reach the decode backend's ``decode`` and never ``extend``."""
    backends = {"prefill_backend": backend[0], "decode_backend": backend[1]} if isinstance(backend, tuple) else \
        {"backend": backend}
    llm = attnzoo.load_model(path, dtype="float32", page_size=4, device=device, max_batch_tokens=24, **backends, **kw)
    llm.engine.graph_extend_tokens = 0  # chunks stay chunks
    hybrid = llm.engine.runner.backends
    hybrid.mixed_min_rows = min_rows
    vocab = getattr(llm.config, "text_config", llm.config).vocab_size
    prompts = random_prompts(vocab, [3, 5, 4, 6, 40, 33], seed=3)
    parts, decoded, extended = [], [], []  # the metadata objects themselves: alive, their ids never reused
    prepare = HybridBackend.prepare
    dec, pre = hybrid.decode_backend, hybrid.prefill_backend

    def spy(self, meta):
        plan = prepare(self, meta)
        if isinstance(plan, MixedPlan):
            parts.append(plan.decode_meta)
        return plan

    def spy_on(backend, name, seen):
        call = getattr(backend, name)
        return lambda layer, q, meta, plan: seen.append(meta) or call(layer, q, meta, plan)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HybridBackend, "prepare", spy)
        mp.setattr(dec, "decode", spy_on(dec, "decode", decoded))
        mp.setattr(pre, "extend", spy_on(pre, "extend", extended))
        outs = llm.generate(prompts, max_new_tokens=8, ignore_eos=True, return_logits=True)
    ids = {name: {id(m) for m in seen} for name, seen in (("parts", parts), ("dec", decoded), ("ext", extended))}
    assert ids["parts"] <= ids["dec"] and not ids["parts"] & ids["ext"]
    return outs, len(parts)


def _same(got, ref, tol=1e-4):
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    for a, b in zip(got, ref):
        assert (a.logits - b.logits).abs().max().item() < tol


def test_the_runner_splits_where_every_attention_is_the_layers_call(tiny_dir):
    llm = attnzoo.load_model(tiny_dir, backend="torch", device="cpu")
    assert llm.info()["mixed_steps"][0] == MIXED_SPLIT_MIN_ROWS


@pytest.mark.parametrize("backend", ["torch", "triton", ("torch", "triton")], ids=["torch", "triton", "torch+triton"])
def test_split_steps_give_the_extend_steps_tokens(tiny_dir, backend):
    (ref, off), (got, on) = (_run(tiny_dir, backend, n) for n in (None, 2))
    assert off == 0 and on >= 2
    _same(got, ref)


@pytest.mark.parametrize("family,backend,window_kv_fraction", [
    ("mla", "torch", None), ("sliding", "torch", 0.5), ("sliding", "triton", 0.5), ("shared_kv", "torch", 0.5)])
def test_split_steps_in_mla_sliding_and_shared_kv_models(tmp_path, family, backend, window_kv_fraction):
    save_checkpoint(_family(family), tmp_path)
    kw = {} if window_kv_fraction is None else {"window_kv_fraction": window_kv_fraction}  # 0.5: a window page group
    (ref, _), (got, on) = (_run(tmp_path, backend, n, **kw) for n in (None, 2))
    assert on >= 2
    _same(got, ref)


@pytest.mark.parametrize("family", ["nsa", "v4_sliding"])
def test_never_split_where_attention_is_more_than_the_layers_call(tmp_path, family):
    from test_piecewise import load_beyond_the_layer

    llm = load_beyond_the_layer(family, tmp_path)
    rows, why = llm.info()["mixed_steps"]
    assert rows is None and ("nsa layers" if family == "nsa" else "runs its own forward") in why
    with pytest.raises(BackendError, match="cannot be split here"):
        llm.engine.runner.backends.mixed_min_rows = 2


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_split_steps_on_gpu(tiny_dir):
    (ref, off), (got, on) = (_run(tiny_dir, "triton", n, device="cuda") for n in (None, 2))
    assert off == 0 and on >= 2
    _same(got, ref, tol=1e-3)
