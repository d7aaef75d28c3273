"""evals/ without a model: the paired statistics on synthetic outcomes (exact McNemar, interval, verdict,
false-alarm rate, power), the comparison of two reports, the token-level helpers and the verdict's float32 noise
floor."""
from __future__ import annotations

import math
import random

import pytest

from attnzoo.errors import EvalError
from attnzoo.evals import report as report_mod
from attnzoo.evals import stats, tokens


def test_mcnemar_exact_values():
    assert stats.mcnemar_exact(0, 0) == 1.0
    assert stats.mcnemar_exact(0, 6) == stats.mcnemar_exact(6, 0) == pytest.approx(2 / 64)
    assert stats.mcnemar_exact(1, 9) == pytest.approx(2 * (1 + 10) / 1024)  # C(10,0) + C(10,1)
    assert stats.mcnemar_exact(5, 5) == 1.0
    # Against the binomial tail computed the slow way.
    m, k = 40, 13
    tail = sum(math.exp(math.lgamma(m + 1) - math.lgamma(i + 1) - math.lgamma(m - i + 1) - m * math.log(2)) for i in range(k + 1))
    assert stats.mcnemar_exact(k, m - k) == pytest.approx(2 * tail, rel=1e-9)
    with pytest.raises(ValueError):
        stats.mcnemar_exact(-1, 2)


def test_paired_interval_and_counts():
    a = [True] * 30 + [False] * 20 + [True] * 10 + [False] * 40
    b = [True] * 30 + [False] * 20 + [False] * 10 + [False] * 40
    r = stats.paired_compare(a, b)
    assert (r.n, r.both_correct, r.only_a, r.only_b, r.both_wrong) == (100, 30, 10, 0, 60)
    assert r.accuracy_a == 0.4 and r.accuracy_b == 0.3 and r.difference == pytest.approx(-0.1)
    lo, hi = r.ci95
    assert lo < -0.1 < hi < 0  # the interval excludes 0: the drop is real
    same = stats.paired_compare(a, a)
    assert same.mcnemar_p == 1.0 and same.difference == 0.0
    lo, hi = same.ci95
    assert lo < 0 < hi and hi - lo < 0.05  # no discordant pairs: narrow, but never a single point
    with pytest.raises(ValueError):
        stats.paired_compare([True], [True, False])


def _synthetic_pairs(rng: random.Random, n: int, acc: float, flip_a_to_wrong: float, flip_b_to_right: float):
    """Run A right with probability acc; B copies A, except that it loses a right answer with
    probability flip_a_to_wrong and fixes a wrong one with probability flip_b_to_right."""
    a = [rng.random() < acc for _ in range(n)]
    b = [(x and rng.random() >= flip_a_to_wrong) or (not x and rng.random() < flip_b_to_right) for x in a]
    return a, b


def test_verdict_same_computation_synthetic():
    rng = random.Random(0)
    # Identical answers (what two backends computing the same thing give): never a difference.
    a, _ = _synthetic_pairs(rng, 200, 0.4, 0, 0)
    verdict, _ = stats.verdict({"strict": stats.paired_compare(a, a), "flexible": stats.paired_compare(a, a)})
    assert verdict == stats.NO_DIFFERENCE
    # Float rounding flips a few answers both ways at random: the false-alarm rate stays below alpha.
    alarms = 0
    trials = 400
    for _ in range(trials):
        a, b = _synthetic_pairs(rng, 200, 0.4, 0.05, 0.05 * 0.4 / 0.6)  # symmetric in expectation
        v, _ = stats.verdict({"m": stats.paired_compare(a, b)}, alpha=0.05)
        alarms += v == stats.CHANGES_ACCURACY
    assert alarms / trials <= 0.05


def test_verdict_perturbed_backend_synthetic():
    rng = random.Random(1)
    # A perturbed backend loses 15% of the right answers and fixes almost none. On 400 questions the
    # paired test catches it in nearly every trial, while the anchors' fixed 8% accuracy band would
    # accept it in nearly every trial (the drop is about 5 points).
    caught = band_accepts = 0
    trials = 200
    for _ in range(trials):
        a, b = _synthetic_pairs(rng, 400, 0.4, 0.15, 0.01)
        r = stats.paired_compare(a, b)
        band_accepts += abs(r.difference) <= 0.08
        v, threshold = stats.verdict({"strict": r, "flexible": r})
        assert threshold == 0.025
        caught += v == stats.CHANGES_ACCURACY
    assert caught / trials >= 0.95
    assert band_accepts / trials >= 0.9


def _fake_run(answers: list[str], gold: list[str], prompts=None, label="x") -> dict:
    recs = [
        {"doc_id": i, "prompt_hash": (prompts or [f"p{j}" for j in range(len(answers))])[i],
         "answers": {"flexible-extract": a}, "correct": {"flexible-extract": a == g}, "response": a}
        for i, (a, g) in enumerate(zip(answers, gold))
    ]
    return {"label": label, "decision": {"prefill_backend": "torch", "decode_backend": "torch", "page_size": 16},
            "tasks": {"gsm8k": {"per_question": recs}}}


def test_compare_runs_on_reports():
    gold = [str(i) for i in range(20)]
    a = _fake_run(gold, gold)
    b = _fake_run(gold[:10] + ["x"] * 10, gold)
    cmp = report_mod.compare_runs(a, b)
    (m,) = cmp["metrics"]
    assert (m["only_a"], m["only_b"], m["answers_agree"]) == (10, 0, 10)
    assert cmp["accuracy_verdict"] == stats.CHANGES_ACCURACY and cmp["verdict"] == report_mod.CHANGES_ANSWERS
    assert cmp["token_level"]["answers_changed"] == 10
    same = report_mod.compare_runs(a, a)
    assert same["accuracy_verdict"] == stats.NO_DIFFERENCE and same["verdict"] == report_mod.TOKEN_IDENTICAL
    with pytest.raises(EvalError, match="different questions"):
        report_mod.compare_runs(a, _fake_run(gold[:5], gold[:5]))
    with pytest.raises(EvalError, match="different prompts"):
        report_mod.compare_runs(a, _fake_run(gold, gold, prompts=[f"q{j}" for j in range(20)]))


def test_token_helpers():
    assert tokens.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert tokens.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert tokens.first_difference([1, 2], [1, 2, 3]) == 2
    d = tokens.divergence_summary([None, 3, 10, None, 1])
    assert (d["identical"], d["diverged"], d["min"], d["median"], d["max"]) == (2, 3, 1, 3, 10)
    lo, hi = stats.wilson_interval(0.0, 100)
    assert abs(lo) < 1e-12 and 0 < hi < 0.05
    lo, hi = stats.wilson_interval(0.5, 100)
    assert 0.39 < lo < 0.5 < hi < 0.61
    # The interval holds p, rounding included (at p = 0, n = 3 the lower bound came out 1e-17 above 0,
    # and the chart's error bar refused it as negative).
    assert all(lo <= p <= hi for n in range(1, 300) for p in (0.0, 1.0) for lo, hi in [stats.wilson_interval(p, n)])


def test_teacher_forcing_waves_count_whole_pages():
    """A wave must fit the KV budget in pages: 239 sequences of 1100 tokens each overflowed a budget sized
    in tokens by rounding (each sequence holds whole pages)."""
    from attnzoo.evals.tokens import Sequence, _waves

    seqs = [Sequence(key=("gsm8k", i), prompt=[1] * 1000, output=[2] * 100) for i in range(239)]
    budget, ps = 262144, 16
    waves = _waves(seqs, budget, ps)
    assert sum(len(w) for w in waves) == 239
    for w in waves:
        assert sum(-(-(len(s.prompt) + len(s.output)) // ps) for s in w) <= budget // ps


def test_verdict_states_the_float32_noise_floor():
    gold = [str(i) for i in range(4)]
    ids = {"output_token_ids": [1, 2, 3]}
    a, b = (_fake_run(gold, gold) for _ in range(2))
    for run in (a, b):
        run["dtype"] = "float32"
        for r in run["tasks"]["gsm8k"]["per_question"]:
            r.update(ids)

    def forced(kl):
        per = {("gsm8k", i): tokens.ForcedStats(tokens=3, top1_b=3, top1_a=3, kl_sum=3 * kl, kl_max=kl) for i in range(4)}
        return tokens.ForcedResult(per_question=per)

    tiny = report_mod.compare_runs(a, b, forced=forced(3e-8))
    assert tiny["verdict"] == report_mod.WITHIN_ROUNDING and "noise floor" in tiny["verdict_reason"]
    # Above the floor, or for bf16 runs, a non-zero KL is reported as a logit-level difference.
    assert report_mod.compare_runs(a, b, forced=forced(1e-4))["verdict"] == report_mod.LOGIT_LEVEL_ONLY
    a["dtype"] = b["dtype"] = "bfloat16"
    assert report_mod.compare_runs(a, b, forced=forced(3e-8))["verdict"] == report_mod.LOGIT_LEVEL_ONLY
    assert report_mod.compare_runs(a, b, forced=forced(0.0))["verdict"] == report_mod.TOKEN_IDENTICAL
