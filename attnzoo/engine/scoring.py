"""Eval-only passes over the engine: teacher-forced logits of given tokens (``score``, ``teacher_forced``).

Their steps go through ``Runner.run`` as generation's do (tensor-parallel ranks follow them), eagerly and
without cascade (``EAGER``) where a step has a prompt chunk; each sequence gets its own pages.
"""
from __future__ import annotations

import torch

from attnzoo.engine.kv_pages import WindowPages
from attnzoo.engine.runner import EAGER, Step
from attnzoo.errors import KVCacheFullError, RequestError


def _alloc(engine, counts: list[int], what: str) -> list[list[int]]:
    pages = engine.pages
    free = pages.allocator.num_free - engine.scheduler.reserved()
    need = sum(counts)
    if need > free and pages.prefix_cache is not None:
        free += pages.prefix_cache.evict(need - free)
    if need > free:
        raise KVCacheFullError(f"{what} needs {need} free KV pages, {free} free",
                               fix="feed fewer or shorter sequences at once, or give the KV cache more memory")
    return [pages.allocator.alloc(n) for n in counts]


@torch.inference_mode()
def score(engine, token_ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits [len, vocab] float32 for one sequence, in token-budget chunks."""
    if not token_ids:
        raise RequestError("empty token list", fix="pass at least one token id")
    if len(token_ids) > engine.context_len:
        raise RequestError(f"{len(token_ids)} tokens exceed the context limit {engine.context_len}", fix="shorten the input")
    kv = engine.pages
    (pages,) = _alloc(engine, [kv.pages_for(len(token_ids))], f"scoring {len(token_ids)} tokens")
    wp = WindowPages() if kv.window else None
    rows = []
    try:
        kv.check_window_room([len(token_ids)], [len(token_ids)], "scoring")
        for start in range(0, len(token_ids), engine.max_batch_tokens):
            chunk = token_ids[start : start + engine.max_batch_tokens]
            step = Step([start], [len(chunk)], [pages], chunk, rows=None, fixed=EAGER)
            if wp is not None:
                kv.window_advance(wp, start, start + len(chunk))
                step.window_block_tables = [wp.table]
            rows.append(engine.runner.run(step)[0].float())
    finally:
        kv.allocator.free(pages)
        if wp is not None:
            kv.window_drop(wp)
    return torch.cat(rows)


@torch.inference_mode()
def teacher_forced(engine, prompts: list[list[int]], continuations: list[list[int]]):
    """Yield (t, request indices, logits [n, vocab] float32 on the device): the logits predicting
    continuation token t of those requests, fed as generation feeds them: each prompt through the
    prefill backend (one request per step, in token-budget chunks), then the continuations one token
    per step for all requests together through the decode backend (its CUDA graphs where they fit).
    Each request gets its own pages (no prefix sharing), so two engines fed the same inputs run the
    same schedule step for step."""
    if not all(prompts):
        raise RequestError("teacher forcing got an empty prompt", fix="pass at least one prompt token per sequence")
    kv = engine.pages
    need = [kv.pages_for(len(p) + len(c)) for p, c in zip(prompts, continuations)]
    pages = _alloc(engine, need, f"teacher forcing {len(prompts)} sequences")
    wps = [WindowPages() for _ in prompts] if kv.window else None
    try:
        kv.check_window_room([len(p) for p in prompts], [len(p) + len(c) for p, c in zip(prompts, continuations)],
                             "teacher forcing")
        last = []
        for i, prompt in enumerate(prompts):
            for start in range(0, len(prompt), engine.max_batch_tokens):
                chunk = prompt[start : start + engine.max_batch_tokens]
                step = Step([start], [len(chunk)], [pages[i]], chunk, rows=[len(chunk) - 1], fixed=EAGER)
                if wps is not None:
                    kv.window_advance(wps[i], start, start + len(chunk))
                    step.window_block_tables = [wps[i].table]
                logits, _ = engine.runner.run(step)
            last.append(logits.float())
        live = [i for i, c in enumerate(continuations) if c]
        if live:
            yield 0, live, torch.cat([last[i] for i in live])
        for t in range(1, max((len(c) for c in continuations), default=0)):
            live = [i for i in live if len(continuations[i]) > t]
            # Own pages per request: no shared prefix, so the step is graph-replayed wherever it fits.
            step = Step([len(prompts[i]) + t - 1 for i in live], [1] * len(live), [pages[i] for i in live],
                        [continuations[i][t - 1] for i in live], rows=list(range(len(live))))
            if wps is not None:
                for i in live:
                    kv.window_advance(wps[i], len(prompts[i]) + t - 1, len(prompts[i]) + t)
                step.window_block_tables = [wps[i].table for i in live]
            logits, _ = engine.runner.run(step)
            yield t, live, logits.float()
    finally:
        for p in pages:
            kv.allocator.free(p)
        for wp in wps or ():
            kv.window_drop(wp)
