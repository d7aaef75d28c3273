"""The OpenAI wire format: request bodies read into token prompts and ``SamplingParams``, and the
response bodies built from completions (``/v1/completions`` and ``/v1/chat/completions``)."""
from __future__ import annotations

import numbers
import time
import uuid
from dataclasses import dataclass

from attnzoo.engine.request import Completion
from attnzoo.engine.sampling import SamplingParams, TokenLogprob
from attnzoo.errors import RequestError


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Parsed:
    """One API request, read: its prompts (token ids), one SamplingParams per choice, and how to answer."""

    chat: bool
    prompts: list[list[int]]
    params: list[list[SamplingParams]]  # per prompt, ``n`` of them (seeds seed + i)
    stream: bool
    echo: bool
    logprobs: int | None  # top alternatives per token; None: no logprobs
    include_usage: bool
    id: str
    created: int
    model: str


def _get(body: dict, key: str, kind, default=None):
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind in (int, numbers.Real) and isinstance(value, bool))
    if not ok:
        raise APIError(400, f"'{key}' has the wrong type ({type(value).__name__})", param=key)
    return value


def parse(body, *, chat: bool, llm, model_name: str) -> Parsed:
    """Read a request body (already JSON); raises APIError for what the client got wrong."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{model_name}'", param="model",
                       code="model_not_found")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list of {role, content}", param="messages")
        prompts = [_encode(llm, messages, "messages")]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise APIError(400, "'prompt' must be a string, a list of strings, token ids, or lists of token ids",
                           param="prompt")
        prompts = [_encode(llm, p, "prompt") for p in prompt]
    n = _get(body, "n", int, 1)
    if n < 1 or n > 128:
        raise APIError(400, f"'n' must be in [1, 128], got {n}", param="n")
    echo = bool(_get(body, "echo", bool, False)) and not chat
    if chat:
        logprobs = _get(body, "top_logprobs", int, 0) if _get(body, "logprobs", bool, False) else None
    else:
        logprobs = _get(body, "logprobs", int, None)
    max_tokens = _get(body, "max_completion_tokens", int, None) if chat else None
    max_tokens = _get(body, "max_tokens", int, max_tokens)
    if max_tokens is not None and max_tokens < 0:
        raise APIError(400, f"'max_tokens' must be >= 0, got {max_tokens}", param="max_tokens")
    if max_tokens == 0 and not echo:
        raise APIError(400, "'max_tokens' 0 returns nothing without 'echo'", param="max_tokens")
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    seed = _get(body, "seed", int, None)
    params = []
    for ids in prompts:
        room = llm.engine.context_len - len(ids)
        if room < 1:
            raise APIError(400, f"this model's maximum context length is {llm.engine.context_len} tokens; the prompt "
                           f"has {len(ids)}", param="messages" if chat else "prompt", code="context_length_exceeded")
        limit = max_tokens if max_tokens is not None else (room if chat else 16)
        if limit > room:
            raise APIError(400, f"this model's maximum context length is {llm.engine.context_len} tokens; the prompt "
                           f"has {len(ids)} and {limit} more were asked for", param="max_tokens",
                           code="context_length_exceeded")
        sp = [SamplingParams(
            max_new_tokens=max(limit, 1), temperature=float(_get(body, "temperature", numbers.Real, 1.0)),
            top_p=float(_get(body, "top_p", numbers.Real, 1.0)), top_k=max(_get(body, "top_k", int, 0), 0),
            seed=None if seed is None else seed + i, stop=stop, ignore_eos=_get(body, "ignore_eos", bool, False),
            min_new_tokens=_get(body, "min_tokens", int, 0),
            repetition_penalty=float(_get(body, "repetition_penalty", numbers.Real, 1.0)),
            logprobs=logprobs, prompt_logprobs=logprobs if echo and logprobs is not None else None,
        ) for i in range(n)]
        for p in sp:
            try:
                p.validate()
            except RequestError as e:
                raise APIError(400, str(e)) from None
        params.append(sp)
    options = body.get("stream_options") or {}
    return Parsed(chat=chat, prompts=prompts, params=params, stream=_get(body, "stream", bool, False), echo=echo,
                  logprobs=logprobs, include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
                  id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, created=int(time.time()),
                  model=model_name)


def echo_only(parsed: Parsed, body: dict) -> bool:
    """max_tokens 0 with echo: only the prompt (and its logprobs) comes back (lm-eval's loglikelihood)."""
    return parsed.echo and body.get("max_tokens") == 0


def _encode(llm, prompt, param: str) -> list[int]:
    try:
        return llm._encode(prompt)
    except RequestError as e:
        raise APIError(400, str(e), param=param) from None


# ---------------------------------------------------------------- responses


def _token_text(tok, t: int) -> str:
    return tok.decode([t]) if tok is not None else str(t)


def completion_logprobs(tok, entries: list[TokenLogprob | None], tokens: list[int], offset: int = 0) -> dict:
    """The completions API's logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    texts = [_token_text(tok, t) for t in tokens]
    offsets, at = [], offset
    for s in texts:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": texts,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [None if e is None else {_token_text(tok, t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(tok, entries: list[TokenLogprob]) -> dict:
    return {"content": [{"token": _token_text(tok, e.token), "logprob": e.logprob, "bytes": None,
                         "top_logprobs": [{"token": _token_text(tok, t), "logprob": lp, "bytes": None}
                                          for t, lp in e.top]} for e in entries]}


def choice(parsed: Parsed, index: int, prompt: list[int], c: Completion, tok, *, prompt_only: bool) -> dict:
    """One choice of a non-streamed answer."""
    out_ids = [] if prompt_only else c.token_ids
    text = "" if prompt_only else (c.text or "")  # None: a model served without a tokenizer
    finish = "length" if prompt_only else c.finish_reason
    if parsed.chat:
        ch = {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
              "logprobs": chat_logprobs(tok, c.logprobs or []) if parsed.logprobs is not None else None}
        return ch
    logprobs = None
    prefix = tok.decode(prompt) if parsed.echo and tok is not None else ""
    if parsed.logprobs is not None:
        entries = list(c.prompt_logprobs or []) if parsed.echo else []
        ids = list(prompt) if parsed.echo else []
        if not prompt_only:
            entries += (c.logprobs or [])[: len(out_ids)]
            ids += out_ids
        logprobs = completion_logprobs(tok, entries, ids)
    return {"index": index, "text": prefix + text, "logprobs": logprobs, "finish_reason": finish}


def response(parsed: Parsed, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": parsed.id, "object": "chat.completion" if parsed.chat else "text_completion",
            "created": parsed.created, "model": parsed.model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def chunk(parsed: Parsed, index: int, text: str | None, finish: str | None, *, logprobs: dict | None = None,
          role: bool = False) -> dict:
    """One streamed (SSE) chunk of choice ``index``."""
    if parsed.chat:
        delta = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        c = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        obj = "chat.completion.chunk"
    else:
        c = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        obj = "text_completion"
    return {"id": parsed.id, "object": obj, "created": parsed.created, "model": parsed.model, "choices": [c]}
