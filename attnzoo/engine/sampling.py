"""Sampling parameters and the token sampler (greedy, or seeded temperature / top-k / top-p)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from attnzoo.attention.metadata import to_device
from attnzoo.errors import RequestError
from attnzoo.layers import fused


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
# Token id ``sample`` returns for a row whose scaled logits overflowed (never a real token).
OVERFLOW = -2


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0  # EOS is masked until this many tokens are out
    repetition_penalty: float = 1.0  # transformers' rule over prompt and output tokens; 1 = off
    # Log-probabilities (of the raw logits) of each output token with its best N alternatives; None: none
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token (the whole prompt is computed)

    def validate(self) -> None:
        _integer("max_new_tokens", self.max_new_tokens, 1)
        _real("temperature", self.temperature, 0.0, "use 0 for greedy or a positive finite value")
        _real("top_p", self.top_p, 0.0, "use a value in (0, 1]; 1.0 disables nucleus sampling")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", fix="use 1.0 to disable nucleus sampling")
        _integer("top_k", self.top_k, 0, "use 0 to disable top-k")
        if self.seed is not None:
            _integer("seed", self.seed, 0)
            if self.seed >= 2**64:
                raise RequestError(f"seed {self.seed} does not fit a 64-bit generator seed", fix="pass a seed below 2**64")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError(f"stop strings must be non-empty strings, got {list(self.stop)!r}",
                               fix="pass stop='text' or stop=['a', 'b'] without empty entries")
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be True or False, got {self.ignore_eos!r}", fix="pass a bool")
        _integer("min_new_tokens", self.min_new_tokens, 0)
        if self.min_new_tokens > self.max_new_tokens:
            raise RequestError(f"min_new_tokens={self.min_new_tokens} exceeds max_new_tokens={self.max_new_tokens}",
                               fix="lower min_new_tokens or raise max_new_tokens")
        _real("repetition_penalty", self.repetition_penalty, 0.0, "use a positive value; 1.0 turns it off")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _integer(name, getattr(self, name), 0, f"pass {name}=N with 0 <= N <= 20, or None")
                if getattr(self, name) > 20:
                    raise RequestError(f"{name} must be at most 20, got {getattr(self, name)}", fix="ask for 20 or fewer")
        if self.repetition_penalty == 0:
            raise RequestError("repetition_penalty must be > 0, got 0", fix="use a positive value; 1.0 turns it off")
        for name in ("temperature", "repetition_penalty"):
            # Both are applied to float32 logits: past float32's range they become inf (and 0 * inf NaN).
            if getattr(self, name) > _FLOAT32_MAX:
                raise RequestError(f"{name}={getattr(self, name)!r} is beyond float32's range, where the logits are "
                                   "scaled by it", fix=f"pass {name} below 3.4e38")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """Tokens [n] for logits [n, vocab] (any float dtype, scaled in float32), one row per request, without a host
    sync.

    Temperature, top-k and top-p are applied per row on the whole batch at once; the draw is
    argmax(probs / E) with E ~ Exp(1) from each request's own generator, which samples from probs and
    keeps a seeded request's tokens independent of what else is in the batch.

    A row whose logits / temperature is not finite (a tiny temperature overflows float32: softmax would
    be NaN and argmax token 0) comes back as ``OVERFLOW``; the engine names it at the step's sync.
    """
    dev = logits.device
    temp = to_device([p.temperature for p in params], torch.float32, dev)
    logits = logits.float() / temp[:, None]
    # max propagates NaN and sees +inf; checked on the values softmax reads, after the division.
    finite = torch.isfinite(logits.max(dim=-1).values)
    if any(p.top_k for p in params):
        top_k = to_device([p.top_k for p in params], torch.int64, dev)
        k_max = min(max(p.top_k for p in params), logits.shape[-1])
        kth = torch.topk(logits, k_max, dim=-1).values.gather(1, (top_k.clamp(1, k_max) - 1)[:, None])
        logits = logits.masked_fill((top_k[:, None] > 0) & (logits < kth), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = to_device([p.top_p for p in params], torch.float32, dev)
        sorted_p, order = torch.sort(probs, descending=True, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing the line included)
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= top_p[:, None]
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    noise = torch.stack([torch.empty(logits.shape[-1], device=dev).exponential_(generator=g) for g in generators])
    return torch.where(finite, (probs / noise).argmax(dim=-1), OVERFLOW)


def pick_tokens(logits: torch.Tensor, reqs, eos_ids) -> torch.Tensor:
    """The next token of each row of ``logits`` [rows, vocab] (row i: request ``reqs[i]``), on the device
    and without a host sync: greedy rows by argmax, the others by ``sample``, after ``process_logits``;
    -1 where the raw logits' top value is not finite (``fused.argmax_finite``: an O(rows) check that comes
    back with the tokens). The logits may be in any float dtype: greedy rows read them as they are (argmax of
    bf16 values is that of their exact float32 copy, the first index on ties in both), the rest in float32."""
    tokens = fused.argmax_finite(logits)  # -1: a non-finite row
    scores = process_logits(logits, reqs, eos_ids)
    rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if scores is logits and not rows:
        return tokens
    finite = tokens >= 0
    if scores is not logits:
        tokens = scores.argmax(dim=-1)
    if rows:
        chosen = [reqs[i] for i in rows]
        at = to_device(rows, torch.int64, tokens.device)
        tokens[at] = sample(scores[at], [r.params for r in chosen], [r.generator for r in chosen])
    return torch.where(finite, tokens, -1)


@dataclass
class TokenLogprob:
    """A token's log-probability under the model (its raw logits), and the best ``top`` of its position."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(logits: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprob]:
    """Log-probabilities of ``targets`` (one per row of ``logits`` [n, vocab]) and each row's ``top`` best."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    got = logp.gather(1, to_device(targets, torch.int64, logp.device)[:, None])[:, 0].tolist()
    if top:
        values, ids = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
        best = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        best = [[] for _ in targets]
    return [TokenLogprob(t, g, b) for t, g, b in zip(targets, got, best)]


def _integer(name: str, value, low: int, fix: str | None = None) -> None:
    # bool is an int subclass: True would silently mean 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise RequestError(f"{name} must be an integer >= {low}, got {value!r}", fix=fix or f"pass {name}=N with N >= {low}")


def _real(name: str, value, low: float, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < low:
        raise RequestError(f"{name} must be a finite number >= {low:g}, got {value!r}", fix=fix)


def needs_processing(reqs) -> bool:
    """Whether any request of the step asks for repetition_penalty or min_new_tokens (see ``process_logits``)."""
    return any(r.params.repetition_penalty != 1.0 or len(r.out) < r.params.min_new_tokens for r in reqs)


def process_logits(logits: torch.Tensor, reqs, eos_ids) -> torch.Tensor:
    """transformers' repetition penalty and min-new-tokens EOS mask, batched over the rows that ask for them.

    ``reqs`` holds one request per row (``.params``, ``.prompt``, ``.out``). The penalty divides the
    positive and multiplies the negative logits of every token already in the prompt or the output
    (RepetitionPenaltyLogitsProcessor); rows with fewer than ``min_new_tokens`` output tokens cannot pick
    an EOS token. Returns ``logits`` itself when no row asks for either (no copy, no kernel), else a float32 copy.
    """
    if not needs_processing(reqs):
        return logits
    # a copy even of float32 logits: the rows are changed in place below; float32 as the penalty was always applied
    logits = logits.to(torch.float32, copy=True)
    dev = logits.device
    rep = [i for i, r in enumerate(reqs) if r.params.repetition_penalty != 1.0]
    if rep:
        seen = [reqs[i].prompt + reqs[i].out for i in rep]
        width = max(len(h) for h in seen)
        # Pad with the row's own first token: scattering the same value twice changes nothing.
        ids = to_device([h + h[:1] * (width - len(h)) for h in seen], torch.int64, dev)
        rows = to_device(rep, torch.int64, dev)
        penalty = to_device([reqs[i].params.repetition_penalty for i in rep], logits.dtype, dev)[:, None]
        sub = logits[rows]
        got = sub.gather(1, ids)
        got = torch.where(got < 0, got * penalty, got / penalty)
        logits[rows] = sub.scatter(1, ids, got)
    early = [i for i, r in enumerate(reqs) if len(r.out) < r.params.min_new_tokens]
    if early and eos_ids:
        rows = to_device(early, torch.int64, dev)[:, None]
        logits[rows, to_device(sorted(eos_ids), torch.int64, dev)[None, :]] = float("-inf")
    return logits
