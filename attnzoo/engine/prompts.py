"""Checks of text prompts and chat messages before they reach the tokenizer (named errors, not the
tokenizer's TypeError or a list printed into the prompt)."""
from __future__ import annotations

from attnzoo.errors import RequestError


def valid_text(text: str, what: str) -> str:
    """``text`` when it is valid Unicode; a lone surrogate (bytes decoded with surrogateescape, a broken
    UTF-16 pair) has no UTF-8 form, and the tokenizer would fail on it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{what} holds a lone surrogate {text[e.start]!r} at character {e.start}, which is not "
                           "valid Unicode text", fix="pass valid text, e.g. text.encode('utf-8', 'replace').decode()"
                           ) from None
    return text


def chat_message(j: int, m: dict) -> dict:
    """Message ``j`` with its content as one string: the OpenAI list-of-parts form is accepted for text
    parts (joined with newlines, as vLLM does); other parts (images, audio) are refused by name."""
    content = m.get("content")
    if not isinstance(m.get("role"), str) or not isinstance(content, (str, list, tuple)):
        raise RequestError(f"chat message {j} ({m!r}) needs a 'role' string and a 'content'",
                           fix="pass messages like {'role': 'user', 'content': 'Hi!'}")
    if isinstance(content, (list, tuple)):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"chat message {j}, content part {k} ({part!r}) is not a text part; attnzoo's "
                                   "models read text only", fix="pass content as a string, or as parts like "
                                   "{'type': 'text', 'text': '...'}")
            texts.append(part["text"])
        content = "\n".join(texts)
    return {**m, "content": valid_text(content, f"chat message {j}")}
