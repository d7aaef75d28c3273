"""A request's state while the engine runs it, and what it returns."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from attnzoo.engine.kv_pages import WindowPages
from attnzoo.engine.sampling import SamplingParams, TokenLogprob


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length", or "abort" (cancelled)
    prompt_token_ids: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [num_new_tokens, vocab] float32, when asked for
    # seconds from the request's arrival (generate(): its start): first token out, last token out
    time_to_first_token: float = 0.0
    latency: float = 0.0
    logprobs: list[TokenLogprob] | None = None  # one per output token (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, None for the first


@dataclass(eq=False)  # compared by identity: the engine's lists hold each request once
class Request:
    key: int  # unique over the engine's life (tensor-parallel ranks key block tables by it)
    prompt: list[int]
    params: SamplingParams
    max_len: int  # prompt + tokens this request may generate (context limit applied)
    generator: torch.Generator | None
    keep_logits: bool = False
    index: int = 0  # its place in the caller's batch (generate's order)
    arrival: float = field(default_factory=time.perf_counter)
    out: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose k/v are in the pool
    reserved: int = 0  # pages promised at admission and not yet allocated
    shared: list[int] = field(default_factory=list)  # prefix pages matched in the cache
    finish: str | None = None
    text: str | None = None  # set when a stop string cut the output
    logits: list[torch.Tensor] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    first_token_at: float = 0.0
    finished_at: float = 0.0
    cancelled: bool = False  # set from any thread; the engine frees the request at its next step
    _table: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32), repr=False)
    window: WindowPages | None = None  # window-group pages (a pool with a window group)

    def page_table(self) -> np.ndarray:
        """``pages`` as int32 for the step's block table. Pages only grow while a request runs, so only
        those added since the last step are converted, not every page every step."""
        n = len(self._table)
        if n < len(self.pages):
            self._table = np.concatenate([self._table, np.asarray(self.pages[n:], dtype=np.int32)])
        return self._table

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def prefilling(self) -> bool:
        return self.num_cached < len(self.prompt)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def append(self, token: int, eos: set[int], tokenizer) -> None:
        """Take one sampled token and decide whether the request ends on it."""
        sp = self.params
        self.out.append(token)
        now = time.perf_counter() - self.arrival
        if len(self.out) == 1:
            self.first_token_at = now
        self.finished_at = now
        if not sp.ignore_eos and token in eos:
            self.finish = "stop"
        elif sp.stop and self._hit_stop(tokenizer):
            self.finish = "stop"
        elif len(self.prompt) + len(self.out) >= self.max_len:
            self.finish = "length"

    def _hit_stop(self, tokenizer) -> bool:
        # A stop string ending at this token lies within its last few tokens: decode only that tail
        # (a token is at least one character, plus slack for tokens that decode to nothing alone).
        window = max(len(s) for s in self.params.stop) + 8
        tail = tokenizer.decode(self.out[-window:], skip_special_tokens=True)
        if not any(s in tail for s in self.params.stop):
            return False
        text = tokenizer.decode(self.out, skip_special_tokens=True)
        self.text = text[: min(text.find(s) for s in self.params.stop if s in text)]
        return True

    def completion(self, tokenizer) -> Completion:
        text = self.text
        if text is None and tokenizer is not None:
            text = tokenizer.decode(self.out, skip_special_tokens=True)
        return Completion(
            text=text, token_ids=self.out, finish_reason=self.finish, prompt_token_ids=self.prompt,
            logits=torch.stack(self.logits) if self.keep_logits and self.logits else None,
            time_to_first_token=self.first_token_at, latency=self.finished_at,
            logprobs=self.logprobs if self.params.logprobs is not None else None,
            prompt_logprobs=self.prompt_logprobs if self.wants_prompt_logprobs else None,
        )
