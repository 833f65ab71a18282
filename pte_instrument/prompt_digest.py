"""The prompt digest: a request's prompt named without storing it, so that an evaluation
harness's per-sample log can be joined to the request log (``pte efficiency``).

The digest is SHA-256 (HMAC-SHA-256 under a key, ``PTE_PROMPT_DIGEST_KEY``) of the compact
JSON (UTF-8, no ASCII escaping, no spaces) of

- a chat request: ``["chat", [[role, text], …]]``, one pair per message, where ``text`` is
  the message's content when it is a string, the text of its ``text`` parts joined by
  ``"\\n"`` when it is a list of parts, and ``""`` when it has none;
- a completion request: ``["completion", prompt]`` for each of its prompts (a string, or a
  list of token ids).

Only the roles and text count: two requests that differ only in sampling settings, tools or
images have one digest, and the reader matches them in order. Pure functions, no state.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from typing import Any

DIGEST_HEX = 64  # characters of a digest


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(p["text"])
            for p in content
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        )
    return ""


def canonical_messages(messages: Sequence[Any]) -> list[list[str]]:
    """The (role, text) pairs a chat digest covers; a message that is not an object is skipped."""
    return [[str(m.get("role", "")), _text(m.get("content"))] for m in messages if isinstance(m, dict)]


def key_bytes(key: str | None) -> bytes | None:
    """``PTE_PROMPT_DIGEST_KEY`` as the HMAC key: the variable's own bytes (Python reads a byte
    that is not UTF-8 as a lone surrogate), the same for the server and ``pte efficiency``."""
    return key.encode("utf-8", "surrogateescape") if key else None


def _digest(value: Any, key: bytes | None) -> str:
    data = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
    if key:
        return hmac.new(key, data, hashlib.sha256).hexdigest()
    return hashlib.sha256(data).hexdigest()


def chat_digest(messages: Sequence[Any], key: bytes | None = None) -> str:
    """The digest of a chat request's ``messages``."""
    return _digest(["chat", canonical_messages(messages)], key)


def completion_digest(prompt: str | Sequence[int], key: bytes | None = None) -> str:
    """The digest of one prompt of a completion request (text, or token ids)."""
    return _digest(["completion", prompt if isinstance(prompt, str) else [int(t) for t in prompt]], key)


def _is_tokens(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def request_digests(messages: Any, prompt: Any, key: bytes | None = None) -> tuple[str, ...]:
    """The digests of one HTTP request body's ``messages`` or ``prompt`` field, one per
    prompt it asks for (a completion request may carry several); () when it has neither in
    a form an OpenAI server accepts."""
    if isinstance(messages, list):
        return (chat_digest(messages, key),)
    if isinstance(prompt, str) or (_is_tokens(prompt) and prompt):
        return (completion_digest(prompt, key),)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_tokens(p) for p in prompt):
        return tuple(completion_digest(p, key) for p in prompt)
    return ()
