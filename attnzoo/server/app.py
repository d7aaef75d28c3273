"""``attnzoo serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the online engine.

Every request's choices are submitted to the ``OnlineEngine``, whose thread owns the model; the handlers
wait on asyncio queues fed from that thread. A client that disconnects cancels its requests (their KV
pages are free at the next step); past ``max_queue`` waiting requests the answer is 503 with Retry-After;
on SIGTERM uvicorn stops accepting connections and lets the open ones finish, then the loop drains.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from attnzoo.engine.online import OnlineEngine
from attnzoo.errors import KVCacheFullError, QueueFullError, RequestError
from attnzoo.server import protocol
from attnzoo.server.metrics import Metrics
from attnzoo.server.protocol import APIError

SWITCH_INTERVAL_S = 0.0005


def create_app(llm, *, model_name: str, api_key: str | None = None, max_queue: int = 1024,
               on_shutdown=None) -> FastAPI:
    """The app; ``on_shutdown`` runs after the loop drained (uvicorn re-raises SIGTERM right after: a caller's
    ``finally`` would not run)."""
    online = OnlineEngine(llm, max_queue=max_queue)
    metrics = Metrics(online)
    online.listen_steps(metrics.step)
    tok = llm.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(online.shutdown, drain=True)
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="attnzoo", lifespan=lifespan)
    app.state.online, app.state.metrics, app.state.bridge = online, metrics, None

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def check_key(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'",
                           type="authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health():
        if online.error is not None:
            return JSONResponse({"status": "error", "error": str(online.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "attnzoo",
                                            "max_model_len": llm.engine.context_len}]}

    async def serve(request: Request, chat: bool):
        check_key(request)
        bridge = app.state.bridge
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None
        parsed = protocol.parse(body, chat=chat, llm=llm, model_name=model_name)
        prompt_only = protocol.echo_only(parsed, body)
        if bridge is None or bridge.loop is not asyncio.get_running_loop():
            bridge = app.state.bridge = _Bridge(asyncio.get_running_loop())
        queue: asyncio.Queue = asyncio.Queue()
        handles, prompts = [], []
        try:
            for prompt, sps in zip(parsed.prompts, parsed.params):
                for sp in sps:
                    idx = len(handles)
                    listener = (lambda ev, idx=idx: bridge.put(queue, (idx, ev)))
                    handles.append(online.submit(prompt, sp, listener))
                    prompts.append(prompt)
        except (QueueFullError, RequestError, KVCacheFullError) as e:
            for h in handles:
                h.cancel()
            if isinstance(e, QueueFullError):
                raise APIError(503, str(e), type="server_error", code="queue_full", headers={"Retry-After": "1"}) from None
            raise APIError(400, str(e), code="context_length_exceeded" if isinstance(e, KVCacheFullError) else None) from None
        times: list[list[float]] = [[] for _ in handles]

        def done(idx: int, c) -> None:
            metrics.finished(handles[idx].arrival, times[idx], len(prompts[idx]), c.finish_reason)

        if parsed.stream:
            return StreamingResponse(_stream(parsed, handles, prompts, queue, times, done, tok, prompt_only),
                                     media_type="text/event-stream")
        results: dict[int, object] = {}
        try:
            while len(results) < len(handles):
                try:
                    idx, ev = await asyncio.wait_for(queue.get(), 0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                if ev.error is not None:
                    raise APIError(500, f"the engine failed: {ev.error}", type="server_error")
                if ev.token is not None:
                    times[idx].append(ev.at)
                if ev.completion is not None:
                    if len(ev.completion.token_ids) > len(times[idx]):
                        times[idx].append(ev.at)
                    results[idx] = ev.completion
                    done(idx, ev.completion)
        finally:
            for h in handles:
                if not h.done:
                    h.cancel()
        choices = [protocol.choice(parsed, i, prompts[i], results[i], tok, prompt_only=prompt_only)
                   for i in range(len(handles))]
        out_tokens = 0 if prompt_only else sum(len(results[i].token_ids) for i in range(len(handles)))
        return protocol.response(parsed, choices, sum(map(len, parsed.prompts)), out_tokens)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _stream(parsed, handles, prompts, queue, times, done, tok, prompt_only):
    """SSE chunks as tokens come out. Text is sent as decoded so far, holding back a trailing partial
    character, and (with stop strings) the last len(stop) - 1 characters, which a stop string may yet cut."""
    n = len(handles)
    ids: list[list[int]] = [[] for _ in range(n)]
    sent = [""] * n
    hold = max((len(s) for s in handles[0].params.stop), default=1) - 1
    usage_out = 0
    detok = [_Detokenizer(tok) for _ in range(n)]

    def _stream_event(i, ev, out: list[str], finished: int) -> tuple[int, bool]:
        """Append event ``ev`` of choice ``i``'s SSE text to ``out``: (choices finished, whether the engine failed)."""
        nonlocal usage_out
        if ev.error is not None:
            out.append(_sse(protocol.APIError(500, f"the engine failed: {ev.error}", type="server_error").body()))
            return finished, True
        if ev.token is not None and not prompt_only:
            times[i].append(ev.at)
            ids[i].append(ev.token)
            text = detok[i].add(ids[i]) if tok is not None else ""
            cut = len(text) - hold if hold else len(text)
            delta = text[len(sent[i]):cut] if cut > len(sent[i]) else ""
            lp = None
            if ev.logprob is not None:
                lp = (protocol.chat_logprobs(tok, [ev.logprob]) if parsed.chat else
                      protocol.completion_logprobs(tok, [ev.logprob], [ev.token], len(sent[i])))
            sent[i] += delta  # a chunk per token, its text possibly empty (held back)
            out.append(_sse(protocol.chunk(parsed, i, delta, None, logprobs=lp)))
        if ev.completion is not None:
            c = ev.completion
            finished += 1
            if len(c.token_ids) > len(times[i]):
                times[i].append(ev.at)
            done(i, c)
            final = "" if prompt_only else (c.text or "")
            usage_out += 0 if prompt_only else len(c.token_ids)
            lp = None
            if c.logprobs and not prompt_only and len(c.logprobs) > len(ids[i]):
                last = c.logprobs[len(ids[i]):]
                lp = (protocol.chat_logprobs(tok, last) if parsed.chat else
                      protocol.completion_logprobs(tok, last, [e.token for e in last], len(sent[i])))
            out.append(_sse(protocol.chunk(parsed, i, final[len(sent[i]):], "length" if prompt_only else c.finish_reason,
                                           logprobs=lp)))
        return finished, False

    try:
        for i in range(n):
            if parsed.chat:
                yield _sse(protocol.chunk(parsed, i, None, None, role=True))
            elif parsed.echo:
                yield _sse(protocol.chunk(parsed, i, tok.decode(prompts[i]) if tok is not None else "", None))
        finished = 0
        while finished < n:
            # Every event already queued goes out in one write: a step's tokens of n choices, or several steps'
            # where the loop fell behind (one SSE event per token all the same).
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            out, failed = [], False
            for i, ev in batch:
                finished, failed = _stream_event(i, ev, out, finished)
                if failed:
                    break
            yield "".join(out)
            if failed:
                break
        if parsed.include_usage:
            p = sum(map(len, parsed.prompts))
            yield _sse({"id": parsed.id, "object": "chat.completion.chunk" if parsed.chat else "text_completion",
                        "created": parsed.created, "model": parsed.model, "choices": [],
                        "usage": {"prompt_tokens": p, "completion_tokens": usage_out, "total_tokens": p + usage_out}})
        yield "data: [DONE]\n\n"
    finally:  # the client went away (the generator is closed) or all is done
        for h in handles:
            if not h.done:
                h.cancel()


class _Bridge:
    """Events from the engine thread to the asyncio loop: queued, with one wake-up of the loop per batch of
    them (a step's tokens for every request) rather than one per token."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list = []

    def put(self, queue: asyncio.Queue, item) -> None:
        with self._lock:
            self._pending.append((queue, item))
            if len(self._pending) > 1:
                return  # a wake-up is already on its way
        self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
        for queue, item in items:
            queue.put_nowait(item)


class _Detokenizer:
    """Text of a growing token list, decoding only its last few tokens per new token (the window before
    ``read`` gives the new tokens their context: leading spaces, merged bytes); a trailing partial UTF-8
    character waits for the next token."""

    def __init__(self, tok):
        self.tok, self.text, self.prefix, self.read = tok, "", 0, 0

    def add(self, ids: list[int]) -> str:
        before = self.tok.decode(ids[self.prefix:self.read], skip_special_tokens=True)
        now = self.tok.decode(ids[self.prefix:], skip_special_tokens=True)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self.prefix, self.read = self.read, len(ids)
        return self.text


def run(llm, *, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
        max_queue: int = 1024, log_level: str = "info") -> None:
    """Serve until SIGTERM/SIGINT; open requests finish first."""
    import uvicorn

    # The engine thread waits on the GIL after every step's device sync while the HTTP thread streams; at
    # Python's 5 ms default switch interval that wait can double a decode step.
    sys.setswitchinterval(SWITCH_INTERVAL_S)

    app = create_app(llm, model_name=model_name, api_key=api_key, max_queue=max_queue, on_shutdown=llm.close)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level)).run()
