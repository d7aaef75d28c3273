"""Data parallel (issue #37) on CPU, gloo: run_eval over 2 replicas (and 2 replicas x 2 tensor-parallel ranks)
writes the report one replica writes (per-question answers, generated token ids, accuracy); a replica that
dies fails the call within seconds naming its rank."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import attnzoo
from attnzoo.engine.data_parallel import _blocks
from attnzoo.errors import DistributedError, EvalError
from attnzoo.evals import run_eval
from test_evals import _char_tokenizer

REPO = Path(__file__).resolve().parents[1]
GSM8K = Path(os.environ.get("ATTNZOO_GSM8K_DIR", REPO.parent / "shared" / "data" / "gsm8k"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """test_evals' tiny Llama and character tokenizer (4 heads, 2 KV heads: splits over 2 ranks)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, initializer_range=0.2)
    path = tmp_path_factory.mktemp("tiny_llama_dp")
    LlamaForCausalLM(cfg).save_pretrained(path)
    _char_tokenizer().save_pretrained(path)
    return str(path)


def _eval(model: str, out: Path, *extra) -> dict:
    if not (GSM8K / "test.jsonl").is_file():
        pytest.skip(f"no GSM8K data at {GSM8K}")
    argv = ["gsm8k", "--model", model, "--data-dir", GSM8K, "--limit", 20, "--num-fewshot", 1, "--max-new-tokens", 8,
            "--backend", "torch", "--device", "cpu", "--page-size", 16, "--output", out, *extra]
    run_eval.run(run_eval.build_parser().parse_args([str(a) for a in argv]))
    return json.loads(out.read_text())["run"]


def _what_matters(run: dict) -> dict:
    task = run["tasks"]["gsm8k"]
    rows = [{k: r.get(k) for k in ("doc_id", "prompt_hash", "response", "answers", "correct", "output_token_ids")}
            for r in task["per_question"]]
    return {"per_question": rows, "metrics": task["metrics"]}


@pytest.fixture(scope="module")
def one_replica(tiny_model, tmp_path_factory) -> dict:
    return _what_matters(_eval(tiny_model, tmp_path_factory.mktemp("dp1") / "report.json"))


def test_shards_are_contiguous_and_balanced():
    assert _blocks(20, 2) == [(0, 10), (10, 20)]
    assert _blocks(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert _blocks(1, 2) == [(0, 1), (1, 1)]


def test_run_eval_two_replicas_write_the_one_replica_report(tiny_model, one_replica, tmp_path):
    run = _eval(tiny_model, tmp_path / "report.json", "--data-parallel-size", 2)
    assert run["settings"]["data_parallel_size"] == 2 and len(one_replica["per_question"]) == 20
    assert _what_matters(run) == one_replica


def test_run_eval_two_replicas_of_two_ranks(tiny_model, tmp_path):
    """DP 2 x TP 2 (4 processes) against TP 2 alone: the same shards of the same weights."""
    tp = _what_matters(_eval(tiny_model, tmp_path / "tp.json", "--tensor-parallel-size", 2))
    both = _eval(tiny_model, tmp_path / "dp.json", "--tensor-parallel-size", 2, "--data-parallel-size", 2)
    assert both["settings"]["data_parallel_size"] == 2
    assert _what_matters(both) == tp


def test_comparisons_are_refused_before_any_work(tiny_model):
    args = run_eval.build_parser().parse_args(["gsm8k", "--model", tiny_model, "--data-parallel-size", "2",
                                               "--compare-to", "torch"])
    with pytest.raises(EvalError, match="teacher-force on one replica"):
        run_eval.run(args)


def test_a_replica_killed_mid_run_fails_the_call_naming_its_rank(tiny_model):
    llm = attnzoo.load_model(tiny_model, device="cpu", backend="torch", kv_cache_tokens=1024, data_parallel_size=2)
    try:
        prompts = [[1, 40 + i, 50 + i] for i in range(4)]
        want = [o.token_ids for o in llm.generate(prompts, max_new_tokens=4, ignore_eos=True)]
        assert [o.token_ids for o in llm.replicas[1].generate(prompts, max_new_tokens=4, ignore_eos=True)] == want
        # Sampled, one int seed: output i gets seed + i wherever it runs, as on one replica.
        one = attnzoo.load_model(tiny_model, device="cpu", backend="torch", kv_cache_tokens=1024)
        sampled = dict(max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=5, num_return_sequences=2)
        assert [o.token_ids for o in llm.generate(prompts, **sampled)] == \
            [o.token_ids for o in one.generate(prompts, **sampled)]
        pid = llm._ranks.processes[1].pid
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(DistributedError, match=rf"data-parallel rank 1 \(pid {pid}\) was killed by SIGKILL") as e:
            llm.generate(prompts, max_new_tokens=64, ignore_eos=True)
        assert e.value.rank == 1 and time.monotonic() - t0 < 10
        with pytest.raises(DistributedError, match="replicas were stopped"):
            llm.generate(prompts)
    finally:
        llm.close()
