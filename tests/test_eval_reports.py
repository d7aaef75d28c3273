"""run_eval's report as an engineer reads it: latency distributions, phase throughput, memory, engine state,
provenance, the A/B speed ratio beside the verdict, lm-eval's own files, and the chart."""
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from attnzoo.errors import EvalError
from attnzoo.evals import perf
from attnzoo.evals import report as report_mod
from tests.test_evals import TINY_ARGS, _run, no_model_work, tiny_baseline, tiny_data, tiny_model  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def test_run_reports_latency_throughput_memory_engine_and_provenance(tiny_baseline, tiny_model):
    run = tiny_baseline["run"]
    p = run["performance"]
    recs = run["tasks"]["gsm8k"]["per_question"]
    assert p["ttft_s"]["n"] == 16 and 0 < p["ttft_s"]["p50"] <= p["ttft_s"]["max"] <= run["timing"]["wall_s"]
    assert p["tpot_s"]["n"] == sum(1 for r in recs if r["output_tokens"] > 1) and p["tpot_s"]["mean"] > 0
    th = p["throughput"]
    # tokens fed in: the prompts (less the prefix-cache hits) and every output token but the last
    fed = sum(r["prompt_tokens"] for r in recs) + sum(r["output_tokens"] - 1 for r in recs)
    assert 0 < th["decode_tokens"] <= sum(r["output_tokens"] - 1 for r in recs)
    assert th["prefill_tokens"] + th["decode_tokens"] <= fed and th["prefill_tokens"] > th["decode_tokens"] / 2
    assert th["prefill_tokens_per_s"] > 0 and th["decode_tokens_per_s"] > 0
    assert p["memory"]["host_peak_rss_gib"] > 0
    eng = p["engine"]
    assert eng["kv_cache_tokens"] > 0 and eng["max_running"] >= 1 and eng["cuda_graph"] is None and eng["cascade"]
    git = run["provenance"]["attnzoo_git"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert git["commit"] == head
    ck = run["provenance"]["checkpoint"]
    assert ck["path"] == str(Path(tiny_model).resolve()) and len(ck["content_sha256_edges"]) == 64
    text = report_mod.render(tiny_baseline)
    for needle in ("TTFT", "TPOT", "prefill", "decode", "KV capacity", "max running", head[:12]):
        assert needle in text


def test_content_hash_follows_the_content(tiny_model, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    same = perf.checkpoint_identity(copy)["content_sha256_edges"]
    assert same == perf.checkpoint_identity(Path(tiny_model))["content_sha256_edges"]
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5 if cfg.get("rms_norm_eps") != 1e-5 else 1e-6
    (copy / "config.json").write_text(json.dumps(cfg))
    assert perf.checkpoint_identity(copy)["content_sha256_edges"] != same
    snap = tmp_path / "models--x--y" / "snapshots" / "abc123"
    shutil.copytree(tiny_model, snap)
    assert perf.checkpoint_identity(snap)["revision"] == "abc123"


def test_comparison_states_the_speed_ratio_and_the_chart_draws(tiny_baseline, tmp_path):
    run = tiny_baseline["run"]
    slower = json.loads(json.dumps(run))
    slower["timing"]["output_tokens_per_s"] = run["timing"]["output_tokens_per_s"] / 2
    slower["performance"]["throughput"]["decode_tokens_per_s"] /= 4
    cmp = report_mod.compare_runs(run, slower)
    sp = cmp["speed"]
    assert sp["output_tokens_per_s"]["b_over_a"] == pytest.approx(0.5)
    assert sp["decode_tokens_per_s"]["b_over_a"] == pytest.approx(0.25) and sp["same_device"]
    rep = {"format": 1, "run": run, "run_b": slower, "comparison": cmp}
    assert "speed: B/A = 0.50x" in report_mod.render(rep)
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib not installed")
    chart = tmp_path / "c.png"
    assert report_mod.write_chart(rep, chart) is None and chart.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_fails_before_the_run(no_model_work, tiny_model, tiny_data, monkeypatch):  # noqa: F811
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(EvalError, match="--plot needs matplotlib"):
        _run(["gsm8k", "--model", tiny_model, "--data-dir", tiny_data, "--compare-to", "torch", "--plot", "x.png",
              *TINY_ARGS])


def test_lm_eval_files_are_written(tiny_model, tiny_data, tmp_path):  # noqa: F811
    args = [a if a != "16" else "2" for a in TINY_ARGS]
    rep = _run(["gsm8k", "--model", tiny_model, "--data-dir", tiny_data, "--lm-eval-output", tmp_path / "lm", *args])
    files = rep["run"]["lm_eval_files"]
    folder = Path(files["folder"])
    results = json.loads(next(folder.glob("results_*.json")).read_text())
    assert results["results"]["gsm8k"] and results["attnzoo"]["decision"]["decode_backend"] == "torch"
    samples = next(folder.glob("samples_gsm8k_*.jsonl")).read_text().splitlines()
    assert {json.loads(line)["doc_id"] for line in samples} == {0, 1}  # a line per question and filter
