"""Token-level evidence that two runs differ: identical generations, first divergence, and teacher forcing.

Accuracy cannot move on a model that is almost never right (SmolLM2-135M: about 1% on GSM8K), so a
paired accuracy test alone cannot tell a harmless backend from a harmful one. Tokens can:

- generations: are run B's output tokens those of run A, and if not, where do they first differ;
- teacher forcing: run A's prompt and generated tokens are fed through both backends exactly as
  generation feeds them (``Engine.teacher_forced``: prompt through the prefill backend, each output
  token through the decode backend), and at every output position we compare the two next-token
  distributions: B's top-1 against A's token, and KL(A || B) in nats. Both backends see the same
  context at every position, so one early divergence cannot make the rest of a sequence incomparable.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from attnzoo.errors import EvalError


@dataclass
class ForcedStats:
    """One question's teacher-forced comparison over run A's output tokens."""

    tokens: int = 0
    top1_b: int = 0  # positions where backend B's argmax is A's token
    top1_a: int = 0  # positions where backend A's own argmax is A's token (its path noise: extend vs decode, batching)
    kl_sum: float = 0.0
    kl_max: float = 0.0
    first_top1_miss: int | None = None  # first position where B's argmax is not A's token

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "top1_agreement_b": self.top1_b / self.tokens if self.tokens else None,
                "top1_agreement_a": self.top1_a / self.tokens if self.tokens else None,
                "kl_mean": self.kl_sum / self.tokens if self.tokens else None, "kl_max": self.kl_max,
                "first_top1_miss": self.first_top1_miss}


@dataclass
class Sequence:
    key: tuple[str, int]  # (task, doc_id)
    prompt: list[int]
    output: list[int]  # run A's generated tokens


@dataclass
class ForcedResult:
    per_question: dict[tuple[str, int], ForcedStats] = field(default_factory=dict)
    skipped: str | None = None  # why nothing (or not everything) was teacher-forced


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix of the other); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _waves(seqs: list[Sequence], budget_tokens: int, page_size: int = 1) -> list[list[Sequence]]:
    """Consecutive groups of ``seqs`` whose KV fits ``budget_tokens``; each sequence holds whole pages,
    so its length counts rounded up to ``page_size``."""
    out: list[list[Sequence]] = [[]]
    used = 0
    for s in seqs:
        n = -(-(len(s.prompt) + len(s.output)) // page_size) * page_size
        if out[-1] and used + n > budget_tokens:
            out.append([])
            used = 0
        out[-1].append(s)
        used += n
    return [w for w in out if w]


def teacher_forced_compare(llm_a, llm_b, seqs: list[Sequence], *, budget_tokens: int) -> ForcedResult:
    """KL(A || B) and top-1 agreement at every output position of ``seqs`` (run A's tokens), the two
    engines stepped in lockstep, ``budget_tokens`` of KV per wave of sequences.

    Tensor parallel: A and B are two models of one group (loaded one after the other with the same
    ``tensor_parallel_size``); rank 0 steps both and the other ranks follow (under torchrun every rank
    calls this and gets rank 0's result)."""
    if llm_a.tp is None and llm_b.tp is None:
        return _compare(llm_a, [llm_b], seqs, budget_tokens)[0]
    if llm_a.tp is None or llm_b.tp is None or llm_a.tp.channel is not llm_b.tp.channel:
        raise EvalError("teacher forcing steps two models in lockstep, and these are not on one tensor-parallel group",
                        fix="load both in this process with the same tensor_parallel_size (the second joins the first's "
                            "group), or both without tensor parallelism")
    with llm_a._lock, llm_b._lock:
        return llm_a.tp.call(lambda: _compare(llm_a, [llm_b], seqs, budget_tokens)[0])


def teacher_forced_compare_many(llm_a, llm_bs: list, seqs: list[Sequence], *, budget_tokens: int,
                                on_wave=None) -> list[ForcedResult]:
    """``teacher_forced_compare`` of several B's against one A, all engines stepped in lockstep: A's
    logits are computed once per step for all of them, and each B's result is the one
    ``teacher_forced_compare(llm_a, llm_b)`` gives. ``on_wave(results)`` is called after each wave of
    sequences with the results so far. Without tensor parallelism (``teacher_forced_compare`` is the
    route for it)."""
    if any(llm.tp is not None for llm in (llm_a, *llm_bs)):
        raise EvalError("teacher forcing several B's at once runs without tensor parallelism",
                        fix="compare one B at a time with teacher_forced_compare")
    return _compare(llm_a, llm_bs, seqs, budget_tokens, on_wave)


def _compare(llm_a, llm_bs: list, seqs: list[Sequence], budget_tokens: int, on_wave=None) -> list[ForcedResult]:
    results = [ForcedResult() for _ in llm_bs]
    page_size = max(llm.engine.pool.page_size for llm in (llm_a, *llm_bs))
    for wave in _waves([s for s in seqs if s.output], budget_tokens, page_size):
        stats = [[ForcedStats() for _ in wave] for _ in llm_bs]
        prompts = [s.prompt for s in wave]
        outs = [s.output for s in wave]
        steps = [llm.engine.teacher_forced(prompts, outs) for llm in (llm_a, *llm_bs)]
        for (t, live, la), *steps_b in zip(*steps):
            target = torch.tensor([outs[i][t] for i in live], device=la.device)
            lpa = torch.log_softmax(la.float(), dim=-1)
            pa = lpa.exp()
            hit_a = (lpa.argmax(-1) == target).tolist()
            for (tb, live_b, lb), stats_b in zip(steps_b, stats):
                if tb != t or live_b != live:
                    raise EvalError("the two engines fed the same sequences took different steps",
                                    fix="report this: Engine.teacher_forced must be deterministic in its schedule")
                lpb = torch.log_softmax(lb.to(la.device).float(), dim=-1)
                # KL(A||B) = sum_v p_A (log p_A - log p_B); terms with p_A = 0 contribute 0.
                kl = (pa * (lpa - lpb)).nan_to_num(0.0).sum(-1).clamp_min(0.0).tolist()  # one sync a step
                hit_b = (lpb.argmax(-1) == target).tolist()
                for j, i in enumerate(live):
                    st = stats_b[i]
                    st.tokens += 1
                    st.top1_b += hit_b[j]
                    st.top1_a += hit_a[j]
                    k = kl[j]
                    st.kl_sum += k
                    st.kl_max = max(st.kl_max, k)
                    if not hit_b[j] and st.first_top1_miss is None:
                        st.first_top1_miss = t
        for res, stats_b in zip(results, stats):
            for s, st in zip(wave, stats_b):
                res.per_question[s.key] = st
        if on_wave is not None:
            on_wave(results)
    return results


def summarize_forced(stats: list[ForcedStats]) -> dict:
    """Token-weighted totals over questions."""
    n = sum(s.tokens for s in stats)
    if not n:
        return {"questions": 0, "tokens": 0}
    return {
        "questions": len(stats), "tokens": n,
        "top1_agreement_b": sum(s.top1_b for s in stats) / n,
        "top1_agreement_a": sum(s.top1_a for s in stats) / n,
        "kl_mean": sum(s.kl_sum for s in stats) / n,
        "kl_max": max(s.kl_max for s in stats),
        "questions_with_top1_miss": sum(1 for s in stats if s.first_top1_miss is not None),
    }


def divergence_summary(positions: list[int | None]) -> dict:
    """Distribution of first-divergence positions (None: identical generation)."""
    diverged = sorted(p for p in positions if p is not None)
    out = {"diverged": len(diverged), "identical": len(positions) - len(diverged)}
    if diverged:
        def q(f):
            return diverged[min(len(diverged) - 1, math.floor(f * len(diverged)))]

        out.update(min=diverged[0], p10=q(0.1), median=q(0.5), p90=q(0.9), max=diverged[-1],
                   mean=sum(diverged) / len(diverged))
    return out
