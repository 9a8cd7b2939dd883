"""The interface every data-generation backend implements (:mod:`rlhf_ext.datagen.backends`): a backend answers
:class:`ChatRequest` objects with a :class:`ChatCompletion`, or raises :class:`BackendError` (a request failed after
its retries), :class:`RequestRejected` (this request was refused: not retried in this run) or
:class:`BackendUnavailable` (the run stops). None of them is an answer: only completions are cached, so a failed
sample is attempted again by the next run.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

REQUEST_KINDS = ("prompt", "pair", "response", "judge")


@dataclass(frozen=True)
class ChatRequest:
    """One chat-completion request: ``kind`` (one of :data:`REQUEST_KINDS`), OpenAI-style ``messages``, the sampling
    ``seed`` (sent to the server), ``max_tokens`` / ``temperature``, and the structured ``context`` the messages were
    rendered from (used by model-free backends only)."""

    kind: str
    messages: list[dict[str, str]]
    seed: int
    max_tokens: int
    temperature: float
    context: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ChatCompletion:
    text: str
    finish_reason: str = "stop"


class BackendError(RuntimeError):
    """A request failed after all retries (``reason``: ``server_error``, ``timeout``, ``dropped``, ``bad_body``)."""

    def __init__(self, message: str, reason: str = "error"):
        super().__init__(message)
        self.reason = reason


class RequestRejected(BackendError):
    """The backend refused this particular request (HTTP 4xx; resending it in this run cannot help). Like every
    :class:`BackendError` it is not cached: the next run asks again (the server or the request may have changed)."""

    def __init__(self, message: str):
        super().__init__(message, reason="rejected")


class BackendUnavailable(BackendError):
    """The backend cannot serve any request (unreachable, bad credentials, unknown model). The run stops."""

    def __init__(self, message: str):
        super().__init__(message, reason="unavailable")


class Backend(abc.ABC):
    """The interface: ``start`` once, ``complete`` many times concurrently, ``close`` once."""

    name: ClassVar[str]

    async def start(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Open sessions / load models and check the backend can serve requests."""

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release sessions, threads and models."""

    @abc.abstractmethod
    async def complete(self, request: ChatRequest) -> ChatCompletion:
        """Answer one request (may be called concurrently)."""

    def describe(self) -> dict[str, Any]:
        """What identifies the backend in metadata (never secrets)."""
        return {"backend": self.name}

    def redact(self, text: str) -> str:
        """``text`` without credentials (:func:`redact_secrets`; a backend that holds a key redacts its value too).
        The generator passes everything it persists or prints about a failure through this."""
        return redact_secrets(text)

    async def __aenter__(self) -> Backend:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


REDACTED = "[REDACTED]"


def _keep_redacted(value: str, redacted: str, original: str) -> str:
    return original if value.startswith(REDACTED[:-1]) else redacted


_SECRET_PATTERNS = (
    # credentials in a URL: scheme://user:password@host
    (re.compile(r"(?<=://)[^/\s:@]+:[^/\s@]+@"), lambda m: REDACTED + "@"),
    # an Authorization header or an api-key field echoed back, whatever its scheme: keep the name, drop the value
    (
        re.compile(
            r"(?i)((?:proxy-)?authorization|x-api-key|api[-_]?key|access[-_]?token)(\W{0,3}[:=]\s*[\"']?)"
            r"((?:bearer|basic|token)\s+)?([^\s\"',;&}\]]+)"
        ),
        lambda m: _keep_redacted(m[4], f"{m[1]}{m[2]}{m[3] or ''}{REDACTED}", m[0]),
    ),
    # a bearer token anywhere (8+ characters: "bearer of bad news" stays)
    (re.compile(r"(?i)\b(bearer)\s+([^\s\"',;}\]]{8,})"), lambda m: _keep_redacted(m[2], f"{m[1]} {REDACTED}", m[0])),
    # OpenAI-style secret keys
    (re.compile(r"\bsk-[A-Za-z0-9_\-]{6,}"), lambda m: "sk-" + REDACTED),
)


def redact_secrets(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with credentials replaced by ``[REDACTED]``: every value in ``secrets`` (e.g. the API key), ``Bearer
    ...`` tokens, ``sk-...`` keys, the value of an echoed ``Authorization`` / ``api_key`` field and a URL's
    ``user:password@``. Applied to everything the backends raise, and to everything the generator persists or prints
    about a failure, whatever the server sent back."""
    text = str(text)
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text
