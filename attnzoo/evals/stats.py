"""Paired comparison of two runs over the same questions.

Both runs answer the same questions, so the question-to-question variance cancels: only the
discordant pairs (right in one run, wrong in the other) carry information about a difference.
That makes the paired test far more sensitive than comparing two accuracies against a fixed band.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

from scipy import stats as _scipy

NO_DIFFERENCE = "no detectable difference"
CHANGES_ACCURACY = "backend B changes accuracy"
_Z95 = float(_scipy.norm.ppf(0.975))  # two-sided 95% normal quantile


@dataclass
class PairedResult:
    n: int
    both_correct: int
    only_a: int  # correct in run A, wrong in run B
    only_b: int  # wrong in run A, correct in run B
    both_wrong: int
    accuracy_a: float
    accuracy_b: float
    difference: float  # accuracy_b - accuracy_a
    ci95: tuple[float, float]  # for the difference
    mcnemar_p: float  # exact two-sided, on the discordant pairs

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ci95"] = list(self.ci95)
        return d


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value: under H0 each discordant pair is a fair coin (scipy's exact
    binomial test on the discordant pairs); 1.0 when there are none (nothing speaks against H0)."""
    if only_a < 0 or only_b < 0:
        raise ValueError("discordant counts must be non-negative")
    m = only_a + only_b
    if m == 0:
        return 1.0
    return float(min(1.0, _scipy.binomtest(min(only_a, only_b), m, 0.5).pvalue))


def paired_difference_ci(both_correct: int, only_a: int, only_b: int, both_wrong: int) -> tuple[float, float]:
    """95% interval for accuracy_b - accuracy_a on paired outcomes (Agresti & Min, 2005).

    The plain Wald interval collapses to a single point when there are no discordant pairs; adding
    one half to each cell of the 2x2 table keeps the interval honest for small counts.
    """
    a, b, c, d = (x + 0.5 for x in (both_correct, only_a, only_b, both_wrong))
    n = a + b + c + d
    diff = (c - b) / n
    var = ((b + c) - (c - b) ** 2 / n) / n**2
    half = _Z95 * math.sqrt(max(var, 0.0))
    return max(-1.0, diff - half), min(1.0, diff + half)


def paired_compare(correct_a: Sequence[bool], correct_b: Sequence[bool]) -> PairedResult:
    """Compare two runs question by question (same questions, same order)."""
    if len(correct_a) != len(correct_b):
        raise ValueError(f"paired runs differ in length: {len(correct_a)} vs {len(correct_b)}")
    if not correct_a:
        raise ValueError("no paired outcomes to compare")
    n = len(correct_a)
    both = sum(1 for x, y in zip(correct_a, correct_b) if x and y)
    only_a = sum(1 for x, y in zip(correct_a, correct_b) if x and not y)
    only_b = sum(1 for x, y in zip(correct_a, correct_b) if y and not x)
    neither = n - both - only_a - only_b
    acc_a = (both + only_a) / n
    acc_b = (both + only_b) / n
    return PairedResult(
        n=n, both_correct=both, only_a=only_a, only_b=only_b, both_wrong=neither,
        accuracy_a=acc_a, accuracy_b=acc_b, difference=acc_b - acc_a,
        ci95=paired_difference_ci(both, only_a, only_b, neither),
        mcnemar_p=mcnemar_exact(only_a, only_b),
    )


def wilson_interval(p: float, n: int) -> tuple[float, float]:
    """95% Wilson interval for a proportion p of n (for charts: unlike the Wald interval it stays inside
    [0, 1] and does not collapse at p = 0), from scipy's binomial test."""
    if n <= 0:
        return 0.0, 1.0
    ci = _scipy.binomtest(round(p * n), n).proportion_ci(confidence_level=0.95, method="wilson")
    # Clamped to hold p: a chart's error bar refuses a bound 1e-17 past it.
    return max(0.0, min(p, float(ci.low))), min(1.0, max(p, float(ci.high)))


def verdict(results: dict[str, PairedResult], alpha: float = 0.05) -> tuple[str, float]:
    """One verdict over several metrics (e.g. strict-match and flexible-extract).

    Bonferroni: each metric is tested at alpha / number of metrics, so the chance of a false alarm
    over all of them stays at most alpha. Returns the verdict and the per-metric threshold.
    """
    if not results:
        raise ValueError("no metrics to judge")
    threshold = alpha / len(results)
    changed = any(r.mcnemar_p < threshold for r in results.values())
    return (CHANGES_ACCURACY if changed else NO_DIFFERENCE), threshold
