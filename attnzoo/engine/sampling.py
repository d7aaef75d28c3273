"""Sampling parameters and the token sampler (greedy, or seeded temperature / top-k / top-p)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from attnzoo.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}", fix="pass max_new_tokens >= 1")
        if not self.temperature >= 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}", fix="use 0 for greedy or a positive value")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", fix="use 1.0 to disable nucleus sampling")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0, got {self.top_k!r}", fix="use 0 to disable top-k")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings", fix="remove empty entries from stop=")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """Tokens [n] for logits [n, vocab] float32, one row per request, without a host sync.

    Temperature, top-k and top-p are applied per row on the whole batch at once; the draw is
    argmax(probs / E) with E ~ Exp(1) from each request's own generator, which samples from probs and
    keeps a seeded request's tokens independent of what else is in the batch.
    """
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev, dtype=torch.float32)
    logits = logits / temp[:, None]
    if any(p.top_k for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=dev)
        k_max = min(max(p.top_k for p in params), logits.shape[-1])
        kth = torch.topk(logits, k_max, dim=-1).values.gather(1, (top_k.clamp(1, k_max) - 1)[:, None])
        logits = logits.masked_fill((top_k[:, None] > 0) & (logits < kth), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float32)
        sorted_p, order = torch.sort(probs, descending=True, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing the line included)
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= top_p[:, None]
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    noise = torch.stack([torch.empty(logits.shape[-1], device=dev).exponential_(generator=g) for g in generators])
    return (probs / noise).argmax(dim=-1)
