"""The online engine: one thread owns an ``Engine`` and steps it while requests are queued or running;
any other thread submits, cancels and streams requests.

Requests arrive at any time and join the running batch at the next step (``Engine.step`` admits them
as their pages fit, sharing the prefix cache with everything else); a cancelled request is released at
the next step. Under tensor parallelism the loop runs as one long call of rank 0 (``TPGroup.call``):
the other ranks follow each of its steps, as they follow a ``generate``.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from attnzoo.engine.request import Completion, Request
from attnzoo.engine.sampling import SamplingParams, TokenLogprob
from attnzoo.errors import AttnzooError, QueueFullError


@dataclass
class Event:
    """What a request's listener hears, on the engine thread: a token (``token``, ``logprob``), or the end
    (``completion``, its last token included, or ``error`` where the step failed)."""

    token: int | None = None
    logprob: TokenLogprob | None = None
    completion: Completion | None = None
    error: BaseException | None = None
    at: float = field(default_factory=time.perf_counter)


class Handle:
    """A submitted request. ``cancel()`` from any thread; ``result()`` waits for its Completion."""

    def __init__(self, online: "OnlineEngine", prompt: list[int], params: SamplingParams, max_len: int,
                 listener: Callable[[Event], None] | None):
        self.online, self.prompt, self.params, self.max_len = online, prompt, params, max_len
        self.listener = listener
        self.arrival = time.perf_counter()
        self.req: Request | None = None  # set on the engine thread when queued there
        self.cancelled = False
        self.completion: Completion | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()

    def cancel(self) -> None:
        self.cancelled = True
        if self.req is not None:
            self.req.cancelled = True
        self.online._wake()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError("the request did not finish in time")
        if self.error is not None:
            raise self.error
        return self.completion

    def _emit(self, event: Event) -> None:
        if event.completion is not None or event.error is not None:
            self.completion, self.error = event.completion, event.error
        if self.listener is not None:
            self.listener(event)
        if event.completion is not None or event.error is not None:
            self._done.set()


class OnlineEngine:
    def __init__(self, llm, *, max_queue: int = 1024):
        self.llm, self.engine = llm, llm.engine
        self.max_queue = max_queue  # requests waiting for admission (submitted, not yet running)
        self._cv = threading.Condition()
        self._inbox: list[Handle] = []
        self._live: dict[int, Handle] = {}  # request key -> handle, engine thread only
        self._stopping = False
        self._drain = True
        self.error: BaseException | None = None  # what stopped the loop, if anything did
        self.engine.arrivals = lambda: bool(self._inbox)  # read without the lock: a stale answer costs a step
        self._thread = threading.Thread(target=self._run, name="attnzoo-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- any thread

    def submit(self, prompt: list[int], params: SamplingParams,
               listener: Callable[[Event], None] | None = None) -> Handle:
        """Queue a request (checked here, on the caller's thread); ``listener`` hears its events on the
        engine thread (keep it short: hand them over to the caller's thread or loop)."""
        max_len = self.engine.check_request(prompt, params)
        handle = Handle(self, list(prompt), params, max_len, listener)
        with self._cv:
            if self._stopping or not self._thread.is_alive():
                raise QueueFullError("the engine is shutting down", fix="send the request to another server")
            if self.num_waiting() >= self.max_queue:
                raise QueueFullError(f"{self.max_queue} requests are already waiting",
                                     fix="retry later, or raise the server's --max-queue")
            self._inbox.append(handle)
            self._cv.notify()
        return handle

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        """``Engine.generate``'s results through the running loop (alongside whatever else runs)."""
        handles = [self.submit(p, sp) for p, sp in zip(prompts, params)]
        return [h.result() for h in handles]

    def num_waiting(self) -> int:
        return len(self._inbox) + len(self.engine.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def shutdown(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the loop: ``drain`` lets queued and running requests finish first; else they end "abort"."""
        with self._cv:
            self._stopping, self._drain = True, drain
            self._cv.notify()
        self._thread.join(timeout)

    def listen_steps(self, callback: Callable[[dict], None] | None) -> None:
        """``callback`` hears each engine step's summary (``Engine.step``'s, as ``step_log`` records it) on the
        engine thread until the loop ends; None stops it."""
        self.engine.on_step = callback

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    # ---------------------------------------------------------------- the engine thread

    def _run(self) -> None:
        llm = self.llm
        try:
            with llm._lock:  # the engine is this thread's: LLM calls wait for the loop to end
                if llm.tp is not None:
                    llm.tp.call(self._loop)
                else:
                    self._loop()
        except BaseException as e:  # noqa: BLE001 - reported to every request still waiting
            self.error = e
            self._fail_all(e)
        finally:
            self.engine.arrivals = self.engine.on_step = None

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not self._inbox and not engine.scheduler.busy and not self._stopping:
                    self._cv.wait()
                if self._stopping and not self._drain:
                    self._fail_all(None)
                    return
                if self._stopping and not self._inbox and not engine.scheduler.busy:
                    return
                new, self._inbox = self._inbox, []
            for h in new:
                if h.cancelled:
                    h._emit(Event(completion=Completion("", [], "abort", h.prompt)))
                    continue
                h.req = engine.add_request(h.prompt, h.params, arrival=h.arrival, max_len=h.max_len)
                h.req.cancelled = h.cancelled
                self._live[h.req.key] = h
            if not engine.scheduler.busy:
                continue
            try:
                updated, finished = engine.step()
            except AttnzooError as e:  # this step's requests fail; the engine goes on with new ones
                engine.abort_all()
                for h in list(self._live.values()):
                    h._emit(Event(error=e))
                self._live.clear()
                continue
            for req in updated:
                h = self._live.get(req.key)
                if h is not None and not req.finish:  # a last token comes with the completion (a stop string may cut it)
                    h._emit(Event(token=req.out[-1], logprob=req.logprobs[-1] if req.params.logprobs is not None else None))
            for req in finished:
                h = self._live.pop(req.key, None)
                if h is not None:
                    h._emit(Event(completion=req.completion(engine.tokenizer)))

    def _fail_all(self, error: BaseException | None) -> None:
        """End every request not yet done: with ``error``, or (None) as aborted."""
        self.engine.abort_all()
        handles = list(self._live.values()) + self._inbox
        self._live.clear()
        self._inbox = []
        for h in handles:
            if not h.done:
                h._emit(Event(error=error) if error is not None else
                        Event(completion=Completion("", h.req.out if h.req else [], "abort", h.prompt)))
