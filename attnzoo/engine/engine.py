"""The generation loop: continuous batching over the paged KV cache.

``Engine.step`` runs one step of whatever is queued and running: admission and scheduling
(``scheduler.py``) over the KV pages (``kv_pages.py``), the forward pass (``runner.py``), the tokens
picked, and finished or cancelled requests released. ``generate`` queues a batch and steps until it is
done; the online engine (``online.py``) steps on a thread of its own as requests arrive.

Overlap: the next decode step's host work (metadata, plan, graph staging) is prepared while the GPU runs
this one, before its tokens are read back. With ``early_launch``, a prepared step whose running set
cannot change but by an EOS/stop-string stop (no request ends by length this step, none freed pages
since the last admission) is launched at once on this step's sampled tokens as they lie on the GPU: the
GPU goes from one step to the next without waiting for the host. A request that stops on this step's
token then had one row of the next step computed for nothing; it is dropped from that step's results.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable

import numpy as np
import torch

from attnzoo.attention.backends.hybrid import HybridBackend
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.layer import Attention
from attnzoo.attention.metadata import to_device
from attnzoo.engine import scoring
from attnzoo.engine.kv_pages import KVPages
from attnzoo.engine.request import Completion, Request
from attnzoo.engine.runner import Prepared, Runner, Step, check_cascade, last_rows
from attnzoo.engine.sampling import OVERFLOW, SamplingParams, pick_tokens, token_logprobs
from attnzoo.engine.scheduler import MAX_RUNNING_CAP, Batch, Scheduler
from attnzoo.errors import NumericsError, RequestError

__all__ = ["Completion", "Engine", "MAX_RUNNING_CAP", "check_cascade"]


def _to(target: str, name: str) -> property:
    """An attribute of ``self.<target>``, read and set through the engine (its public knobs and counters)."""
    return property(lambda self: getattr(getattr(self, target), name),
                    lambda self, value: setattr(getattr(self, target), name, value))


class Engine:
    def __init__(
        self,
        model,
        pool: KVPool,
        backends: HybridBackend,
        *,
        tokenizer=None,
        eos_token_ids: set[int] = frozenset(),
        context_len: int,
        max_batch_tokens: int = 4096,
        max_running: int | None = None,
        prefix_caching: bool = True,
        cascade: bool | None = None,
        cascade_min_saved_tokens: int = 32768,
    ):
        self.model = model
        self.pool = pool
        self.backends = backends  # which backend serves a step: the prefill one or the decode one
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.context_len = context_len
        self.max_batch_tokens = max_batch_tokens
        self.device = pool.device
        self.pages = KVPages(pool, max_batch_tokens=max_batch_tokens, prefix_caching=prefix_caching)
        self.scheduler = Scheduler(self.pages, model, context_len=context_len, max_batch_tokens=max_batch_tokens,
                                   max_running=max_running)
        self.runner = Runner(model, pool, backends, prefix_caching=prefix_caching, cascade=cascade,
                             cascade_min_saved_tokens=cascade_min_saved_tokens, max_rows=self.scheduler.max_running)
        self.scheduler.gone = self.runner.gone  # one list: the scheduler adds ended requests, each step sends them
        self.step_log: list[dict] | None = None  # set to [] to record one summary per step (benchmarks)
        self.on_step: Callable[[dict], None] | None = None  # hears each step's summary (the server's metrics)
        # Both hide host work behind an asynchronous device. On a CPU the step runs on the host itself: a step
        # launched early runs to its end before this step's tokens are handed out, a step later.
        self.overlap = self.early_launch = self.device.type != "cpu"
        # A step launched early on the device tokens admits no one, so none is while a request added since the
        # last admission, or one in the online engine's inbox (``arrivals``), waits to join: a chain of early
        # steps could otherwise run until a request ends.
        self.arrivals: Callable[[], bool] | None = None
        self._joined = False
        # prepared: steps prepared ahead; launched: of those, launched as prepared; early: of those, launched
        # before this step's tokens were read back
        self.overlap_stats = {"prepared": 0, "launched": 0, "early": 0}
        self.generated_tokens = 0  # over the engine's life (the server's metrics)
        self._keys = itertools.count()
        self._ahead: tuple[Batch, Prepared] | None = None  # the next decode step, prepared during this one
        self._early: tuple[Batch, torch.Tensor] | None = None  # the next decode step, launched during this one
        self._freed = False  # a request ended since the last admission (its pages may admit others)

    allocator = _to("pages", "allocator")
    window_allocator = _to("pages", "window_allocator")
    prefix_cache = _to("pages", "prefix_cache")
    window = _to("pages", "window")
    max_running = _to("scheduler", "max_running")
    graphs = _to("runner", "graphs")
    graph_stats = _to("runner", "graph_stats")
    tp = _to("runner", "tp")
    cascade = _to("runner", "cascade")
    cascade_extend = _to("runner", "cascade_extend")
    cascade_min_saved_tokens = _to("runner", "cascade_min_saved_tokens")
    cascade_graph_min_saved_tokens = _to("runner", "cascade_graph_min_saved_tokens")
    graph_extend_tokens = _to("runner", "graph_extend_tokens")

    @property
    def prefill_backend(self):
        return self.backends.prefill_backend

    @property
    def decode_backend(self):
        return self.backends.decode_backend

    def enable_cuda_graphs(self, max_batch: int, max_context: int, batch_sizes=None, prune: bool = True) -> None:
        self.runner.enable_cuda_graphs(max_batch, max_context, batch_sizes, prune)

    def check_request(self, prompt: list[int], params: SamplingParams) -> int:
        """Validate one request before any work; returns its max total length."""
        return self.scheduler.check_request(prompt, params)

    def run_step(self, step: Step) -> tuple[torch.Tensor, int]:
        """One forward pass (``Runner.run``): what the other ranks of a tensor-parallel group run."""
        return self.runner.run(step)

    def score(self, token_ids: list[int]) -> torch.Tensor:
        return scoring.score(self, token_ids)

    def teacher_forced(self, prompts: list[list[int]], continuations: list[list[int]]):
        return scoring.teacher_forced(self, prompts, continuations)

    # ---------------------------------------------------------------- requests

    def add_request(self, prompt: list[int], params: SamplingParams, *, keep_logits: bool = False, index: int = 0,
                    arrival: float | None = None, max_len: int | None = None) -> Request:
        """Queue one request (checked first, unless ``max_len`` says it was); it joins the running batch at
        a step where its pages fit."""
        if max_len is None:
            max_len = self.check_request(prompt, params)
        req = Request(next(self._keys), list(prompt), params, max_len, self._generator(params),
                      keep_logits=keep_logits, index=index)
        if arrival is not None:
            req.arrival = arrival
        self.scheduler.waiting.append(req)
        self._joined = True
        return req

    def generate(
        self, prompts: list[list[int]], params: list[SamplingParams], return_logits: bool = False,
        on_finish: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """One Completion per prompt, in input order; ``on_finish(i)`` is called as request i ends."""
        max_lens = [self.check_request(p, sp) for p, sp in zip(prompts, params)]
        t0 = time.perf_counter()
        reqs = [self.add_request(p, sp, keep_logits=return_logits, index=i, arrival=t0, max_len=m)
                for i, (p, sp, m) in enumerate(zip(prompts, params, max_lens))]
        left = len(reqs)
        try:
            while left:
                _, finished = self.step()
                left -= len(finished)
                for req in finished:
                    if on_finish is not None:
                        on_finish(req.index)
        except BaseException:
            self.abort_all()
            raise
        return [r.completion(self.tokenizer) for r in reqs]

    def warm_up(self, tokens: tuple[int, int]) -> dict:
        """Run once each kernel path a server's requests take (extend, decode, and cascade where it is on)
        on two short prompts sharing a prefix, so that no request waits for a just-in-time compile
        (FlashInfer's modules, Triton's kernels). ``tokens``: two valid ids. Returns the graph stats after."""
        runner, a, b = self.runner, *tokens
        saved = runner.cascade_min_saved_tokens, runner.cascade_graph_min_saved_tokens
        if runner.cascade:  # eager cascade at any saving for these steps: no cascade graph slot is spent
            runner.cascade_min_saved_tokens, runner.cascade_graph_min_saved_tokens = 1, float("inf")
        prompt = [a] * (2 * self.pool.page_size + 1)
        try:
            self.generate([prompt, prompt[:-1] + [b]], [SamplingParams(max_new_tokens=4, ignore_eos=True)] * 2)
        finally:
            runner.cascade_min_saved_tokens, runner.cascade_graph_min_saved_tokens = saved
        if runner.tp is not None and runner.tp.leader:  # every rank compiles its own kernels
            runner.tp.publish(("warm_up", {}))
        self.warm_up_backends()
        return dict(runner.graph_stats)

    def warm_up_backends(self) -> None:
        """The backends' own warm-up (paths only large steps take) for the model's attention layers."""
        with torch.inference_mode():
            self.backends.warm_up([m for m in self.model.modules() if isinstance(m, Attention)])

    def abort_all(self) -> None:
        """Drop every queued and running request (an error mid-step): no pages leak, no unwritten cache entry stays."""
        sched = self.scheduler
        for req in list(sched.running):
            sched.remove(req, unfinished=True)
            req.finish = req.finish or "abort"
        for req in sched.waiting:
            req.finish = req.finish or "abort"
        sched.waiting.clear()
        self._ahead = self._early = None

    # ---------------------------------------------------------------- the step

    def step(self) -> tuple[list[Request], list[Request]]:
        """One step: (requests that got a token, requests that ended, released), both possibly empty."""
        sched = self.scheduler
        t_begin = time.perf_counter()
        if self._early is not None:  # launched on the last step's device tokens; nobody could have joined
            batch, logits = self._early
            self._early = None
        else:
            gone = self._reap_cancelled()
            sched.admit()
            self._freed = self._joined = False
            ahead, self._ahead = self._ahead, None
            if not sched.running:
                return [], gone
            if ahead is not None and len(ahead[0].reqs) == len(sched.running) and all(
                    a is r for a, r in zip(ahead[0].reqs, sched.running)):
                batch = ahead[0]
                batch.chunks = [[req.out[-1]] for req in batch.reqs]
                self.overlap_stats["launched"] += 1
                logits = self._launch(batch, ahead[1])
            else:  # first step, or the running set changed (a request stopped early, another joined)
                batch = sched.schedule()
                if not batch.reqs:
                    raise RuntimeError("engine bug: a step with no work")
                logits = self._launch(batch, self.runner.prepare(self._step_of(batch)))
        picked = logits if batch.sample_at is None else logits[batch.sample_at]
        tokens = pick_tokens(picked, batch.sampling_reqs, self.eos)
        # The copy to the host is queued now, before any next step: a read-back queued after an
        # early-launched step would wait for that whole step.
        host, copied = self.runner.to_host(tokens)
        ahead = self._prepare_ahead() if self.overlap else None
        if ahead is not None and self.early_launch and not (self._freed or self._joined or self.arrivals and self.arrivals()):
            self._early = self._launch_early(ahead, batch, tokens)
            if self._early is not None:
                ahead = None
        self._ahead = ahead
        t_wait = time.perf_counter()
        if copied is not None:
            copied.synchronize()  # one sync a step
        t_read = time.perf_counter()
        if batch.spans:
            self._prompt_logprobs(batch, logits)
        updated = []
        for i, (req, token) in enumerate(zip(batch.sampling_reqs, host.tolist())):
            if req.finish:  # stopped on the step before, after this step was launched early
                continue
            if token == OVERFLOW:
                p = req.params
                raise RequestError(
                    f"sampling prompt {req.index} at output token {len(req.out)}: the logits divided by "
                    f"temperature={p.temperature!r} overflow float32 (softmax would be NaN and return token 0)"
                    + ("" if p.repetition_penalty == 1.0 else f"; repetition_penalty={p.repetition_penalty!r} scales them too"),
                    fix="use temperature=0 for greedy decoding, or a temperature of 1e-3 or more",
                )
            if token < 0:
                raise NumericsError(
                    f"the model produced non-finite logits (NaN or inf) for prompt {req.index} at output token "
                    f"{len(req.out)}; generation stopped",
                    fix="check the checkpoint for NaN/inf weights; in float16 try dtype='bfloat16' or 'float32' "
                    "(overflow); compare with backend='torch'",
                )
            req.append(token, self.eos, self.tokenizer)
            if req.keep_logits:
                req.logits.append(picked[i].float().cpu())
            if req.params.logprobs is not None:
                req.logprobs += token_logprobs(picked[i : i + 1], [token], req.params.logprobs)
            if req.cancelled and not req.finish:
                req.finish = "abort"
            updated.append(req)
        self.generated_tokens += len(updated)
        if self.step_log is not None or self.on_step is not None:  # "t": when the step's tokens reached the host
            # host_s: the host's work before it waited for the tokens (wait_s), the next step's early launch
            # included, not the token loop after the read; a step whose wait is ~0 is bound by the host
            summary = {**batch.summary(), "t": time.perf_counter(), "host_s": t_wait - t_begin,
                       "wait_s": t_read - t_wait}
            if self.step_log is not None:
                self.step_log.append(summary)
            if self.on_step is not None:
                self.on_step(summary)
        finished = [r for r in sched.running if r.finish]
        for req in finished:
            sched.remove(req, unfinished=req.finish == "abort")
            self._freed = True
        return updated, finished

    def _reap_cancelled(self) -> list[Request]:
        sched = self.scheduler
        gone = [r for r in itertools.chain(sched.waiting, sched.running) if r.cancelled and not r.finish]
        for req in gone:
            req.finish = "abort"
            sched.remove(req, unfinished=True)
            self._freed = True
        return gone

    def _step_of(self, batch: Batch) -> Step:
        """The step's plain data; where a request asks for prompt logprobs, every row of its prompt chunk
        is computed (``batch.spans``) and the sampled rows are picked out of them (``batch.sample_at``)."""
        q_lens = [len(c) for c in batch.chunks]
        if batch.all_rows:
            ends = np.cumsum(q_lens).tolist()
            rows, sampled = [], set(batch.sample_rows)
            for j, (req, n) in enumerate(zip(batch.reqs, q_lens)):
                if req.wants_prompt_logprobs and req.prefilling:
                    batch.spans.append((req, len(rows), n, req.num_cached))
                    rows += range(ends[j] - n, ends[j])
                elif j in sampled:
                    rows.append(ends[j] - 1)
                if j in sampled:
                    batch.sample_at_host.append(len(rows) - 1)
            batch.sample_at = to_device(batch.sample_at_host, torch.int64, self.device)
        else:
            rows = last_rows(q_lens, batch.sample_rows)
        step = Step([r.num_cached for r in batch.reqs], q_lens, [r.page_table() for r in batch.reqs],
                    ids=None, rows=rows, keys=[r.key for r in batch.reqs])
        if self.pages.window:
            step.window_block_tables = [r.window.table for r in batch.reqs]
        return step

    def _prompt_logprobs(self, batch: Batch, logits: torch.Tensor) -> None:
        for req, start, n, p0 in batch.spans:
            if p0 == 0:
                req.prompt_logprobs.append(None)  # the first token has nothing before it
            k = min(n, len(req.prompt) - 1 - p0)  # rows predicting prompt tokens (the last predicts the output)
            if k > 0:
                req.prompt_logprobs += token_logprobs(logits[start : start + k], req.prompt[p0 + 1 : p0 + 1 + k],
                                                      req.params.prompt_logprobs)

    def _launch(self, batch: Batch, prep: Prepared, ids: torch.Tensor | None = None) -> torch.Tensor:
        logits, batch.shared_prefix_len = self.runner.launch(prep, [t for c in batch.chunks for t in c] if ids is None else ids)
        self.scheduler.advanced(batch)
        return logits

    def _prepare_ahead(self) -> tuple[Batch, Prepared] | None:
        """The next step's host work, done while this step runs on the GPU (its tokens not yet read back),
        where the next step is predictable (``Scheduler.next_decode``). The tokens decide only whether it
        holds (no request stopped otherwise, none joined), and fill its input ids."""
        if self.runner.tp is not None:
            return None
        batch = self.scheduler.next_decode()
        if batch is None:
            return None
        self.overlap_stats["prepared"] += 1
        return batch, self.runner.prepare(self._step_of(batch))

    def _launch_early(self, ahead, batch: Batch, tokens: torch.Tensor):
        """(the next step, its logits) launched on this step's sampled ``tokens`` [rows] still on the GPU, where
        the next step holds every running request (none ends by length now): the running set then changes
        only by a request stopping on the token this step sampled. None where it cannot be launched so."""
        nxt, prep = ahead
        running = self.scheduler.running
        if len(nxt.reqs) != len(running) or len(batch.sampling_reqs) != len(running):
            return None
        row = {id(r): i for i, r in enumerate(batch.sampling_reqs)}
        idx = [row.get(id(r), -1) for r in nxt.reqs]
        if -1 in idx:
            return None
        ids = tokens if idx == list(range(len(idx))) else tokens[to_device(idx, torch.int64, tokens.device)]
        ids = ids.clamp(min=0)  # a non-finite row's -1 raises NumericsError at the sync, not an index fault here
        nxt.chunks = [[-1] for _ in nxt.reqs]  # known on the host after the sync; only their lengths are read
        self.overlap_stats["launched"] += 1
        self.overlap_stats["early"] += 1
        return nxt, self._launch(nxt, prep, ids)

    def _generator(self, sp: SamplingParams) -> torch.Generator | None:
        if sp.greedy:
            return None
        g = torch.Generator(device=self.device)
        g.manual_seed(sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, (1,))))
        return g
