"""The server's Prometheus metrics, in a registry of its own (nothing global)."""
from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_STEP = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
_TOKENS = tuple(2 ** i for i in range(15))


class Metrics:
    def __init__(self, online):
        self.online = online
        engine = online.engine
        r = self.registry = CollectorRegistry()
        Gauge("attnzoo_requests_waiting", "requests queued, not yet running", registry=r).set_function(online.num_waiting)
        Gauge("attnzoo_requests_running", "requests in the running batch", registry=r).set_function(online.num_running)
        Gauge("attnzoo_kv_pages_in_use", "KV pages held by requests or the prefix cache", registry=r).set_function(
            engine.pages.in_use)
        Gauge("attnzoo_kv_pages_total", "KV pages in the cache", registry=r).set(engine.pages.allocator.capacity)
        Gauge("attnzoo_prefix_cache_hit_rate", "prompt tokens found in the prefix cache / prompt tokens admitted",
              registry=r).set_function(self._hit_rate)
        Gauge("attnzoo_generation_tokens_per_second", "output tokens per second over the last 10 s",
              registry=r).set_function(self._tokens_per_s)
        self.ttft = Histogram("attnzoo_time_to_first_token_seconds", "arrival to first token", buckets=_LATENCY, registry=r)
        self.tpot = Histogram("attnzoo_time_per_output_token_seconds", "first to last token / (tokens - 1)",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("attnzoo_inter_token_latency_seconds", "between consecutive tokens", buckets=_LATENCY,
                             registry=r)
        self.e2e = Histogram("attnzoo_e2e_request_latency_seconds", "arrival to last token", buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("attnzoo_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("attnzoo_generation_tokens", "output tokens of finished requests", registry=r)
        self.requests = Counter("attnzoo_requests", "finished requests by finish reason", ["finish_reason"], registry=r)
        # Engine steps by kind: "decode" (one new token a request) or "prompt" (prompt chunks in it). A step's time
        # runs from its start to its tokens on the host; its host part is what ran before the wait for them.
        self.step_time = Histogram("attnzoo_engine_step_seconds", "engine step, start to tokens on the host",
                                   ["kind"], buckets=_STEP, registry=r)
        self.step_host = Histogram("attnzoo_engine_step_host_seconds", "engine step's host work before its wait",
                                   ["kind"], buckets=_STEP, registry=r)
        self.step_tokens = Histogram("attnzoo_engine_step_tokens", "new tokens an engine step computes", ["kind"],
                                     buckets=_TOKENS, registry=r)
        self._samples: deque[tuple[float, int]] = deque()

    def _hit_rate(self) -> float:
        s = self.online.engine.scheduler
        return s.cached_tokens / s.admitted_tokens if s.admitted_tokens else 0.0

    def _tokens_per_s(self) -> float:
        now, count = time.perf_counter(), self.online.engine.generated_tokens
        self._samples.append((now, count))
        while len(self._samples) > 2 and now - self._samples[0][0] > 10:
            self._samples.popleft()
        t0, c0 = self._samples[0]
        return (count - c0) / (now - t0) if now > t0 else 0.0

    def finished(self, arrival: float, token_times: list[float], prompt_tokens: int, finish_reason: str) -> None:
        """Observe one finished request (``token_times``: when each output token came out)."""
        self.requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(len(token_times))
        if not token_times:
            return
        self.ttft.observe(token_times[0] - arrival)
        self.e2e.observe(token_times[-1] - arrival)
        for a, b in zip(token_times, token_times[1:]):
            self.itl.observe(b - a)
        if len(token_times) > 1:
            self.tpot.observe((token_times[-1] - token_times[0]) / (len(token_times) - 1))

    def step(self, summary: dict) -> None:
        """Observe one engine step (``Engine.on_step``'s summary), on the engine thread."""
        kind = "decode" if summary["new_tokens"] == summary["num_reqs"] else "prompt"
        self.step_time.labels(kind).observe(summary["host_s"] + summary["wait_s"])
        self.step_host.labels(kind).observe(summary["host_s"])
        self.step_tokens.labels(kind).observe(summary["new_tokens"])

    def text(self) -> bytes:
        return generate_latest(self.registry)
