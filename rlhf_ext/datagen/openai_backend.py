"""The ``openai`` backend, :class:`OpenAIBackend`: an OpenAI-compatible ``/v1/chat/completions`` endpoint (``vllm
serve``, OpenAI, TGI ...) through ``openai.AsyncOpenAI``. The API key, read from ``$api_key_env`` when the session
starts, is sent only in the ``Authorization`` header; it, ``Bearer ...`` and ``sk-...`` tokens are redacted from every
error message, whatever the server echoes back (:func:`~rlhf_ext.datagen.chat.redact_secrets`), and from every ``repr``.
"""

from __future__ import annotations

import asyncio
import contextvars
import email.utils
import json
import math
import os
import random
import re
import time
from collections.abc import Iterable
from typing import Any

from rlhf_ext.datagen.chat import (
    REDACTED,
    Backend,
    BackendError,
    BackendUnavailable,
    ChatCompletion,
    ChatRequest,
    RequestRejected,
    redact_secrets,
)

RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _retry_after_seconds(headers: Any) -> float | None:
    """The server's ``Retry-After-Ms`` / ``Retry-After`` (seconds or an HTTP date) in seconds, or ``None``."""
    if headers is None:
        return None
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            try:
                seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
            except (TypeError, ValueError, IndexError, OverflowError):
                continue
        if math.isfinite(seconds):
            return max(0.0, seconds)
    return None


_UNKNOWN_FIELD = re.compile(
    r"(?i)extra|not permitted|not allowed|unknown|unrecogni[sz]ed|unsupported|not supported|unexpected|no such"
)


def _refuses_field(message: str, field: str) -> bool:
    """An HTTP 400 message that says the server does not know ``field`` (not that its value is wrong)."""
    return field in message and _UNKNOWN_FIELD.search(message) is not None


class MalformedResponse(ValueError):
    """A 200 answer that is not an OpenAI chat completion (not JSON, no ``choices``, a string ``message`` ...)."""


#: the request field that carries the token limit: newer OpenAI servers want the first, older vLLM servers the second
TOKEN_LIMIT_PARAMS = ("max_completion_tokens", "max_tokens")
_ATTEMPTS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("rlhf_ext_openai_attempts", default=None)


def _client_class():
    """``openai.AsyncOpenAI`` with the retry delay of :meth:`OpenAIBackend._retry_delay` (the client decides *whether*
    to retry)."""
    import openai

    class _Client(openai.AsyncOpenAI):
        rlhf_retry_delay: Any = None

        def _calculate_retry_timeout(self, remaining_retries, options, response_headers=None):  # noqa: ANN001
            if self.rlhf_retry_delay is None:
                return super()._calculate_retry_timeout(remaining_retries, options, response_headers)
            done = options.get_max_retries(self.max_retries) - remaining_retries
            return self.rlhf_retry_delay(done, response_headers)

    _Client.__name__ = _Client.__qualname__ = "AsyncOpenAI"  # the User-Agent names the class
    return _Client


class OpenAIBackend(Backend):
    """Asynchronous client for an OpenAI-compatible chat-completions server (see the module docstring).

    Built on ``openai.AsyncOpenAI`` (its retry loop, timeouts, connection pool and the environment's proxies, read
    when the backend starts: a local server behind a proxy setting needs ``NO_PROXY=127.0.0.1,localhost``). The token
    limit goes out as ``max_completion_tokens``, or ``max_tokens`` from the first HTTP 400 naming that field on.

    Args:
        api_base: URL up to ``/v1`` (e.g. ``http://localhost:8000/v1``).
        model: served model name; ``None`` picks the only model ``GET /models`` lists.
        api_key_env: environment variable holding the key (unset or empty: no ``Authorization`` header).
        max_concurrency: requests in flight at once (a semaphore and the connection pool).
        timeout: seconds per attempt (connect, send and each wait for the answer's bytes).
        max_retries: retries after the first attempt.
        backoff_base / backoff_max: the k-th retry waits ``uniform(0, min(backoff_max, backoff_base * 2**k))``
            seconds, or the server's ``Retry-After`` (up to two minutes; a longer one fails the request).
    """

    name = "openai"

    def __init__(
        self,
        api_base: str = "http://localhost:8000/v1",
        model: str | None = None,
        api_key_env: str = "OPENAI_API_KEY",
        max_concurrency: int = 256,
        timeout: float = 120.0,
        max_retries: int = 5,
        backoff_base: float = 0.5,
        backoff_max: float = 20.0,
    ):
        self.api_base, self.model, self.api_key_env = api_base.rstrip("/"), model, api_key_env
        self.max_concurrency, self.timeout, self.max_retries = max_concurrency, timeout, max_retries
        self.backoff_base, self.backoff_max = backoff_base, backoff_max
        self.token_limit_param = TOKEN_LIMIT_PARAMS[0]
        self._client = None
        self._semaphore: asyncio.Semaphore | None = None
        self._secrets: tuple[str, ...] = ()
        self._extra_headers: dict[str, Any] | None = None
        self._jitter = random.Random()
        self.stats = {"requests": 0, "attempts": 0, "retries": 0, "failed": 0}

    def __repr__(self) -> str:
        return f"OpenAIBackend(api_base={self.api_base!r}, model={self.model!r}, api_key_env={self.api_key_env!r})"

    def redact(self, text: str) -> str:
        return redact_secrets(text, self._secrets)

    async def start(self) -> None:
        import openai

        key = os.environ.get(self.api_key_env, "")
        self._secrets = (key,) if key else ()
        # the client's connection pool holds max_concurrency connections; trust_env (httpx's default) reads the
        # proxy variables now
        limits = type(openai.DEFAULT_CONNECTION_LIMITS)(
            max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency
        )
        http_client = openai.DefaultAsyncHttpxClient(limits=limits)
        self._client = _client_class()(
            api_key=key or "unused",
            base_url=self.api_base,
            timeout=self.timeout,
            max_retries=self.max_retries,
            http_client=http_client,
        )
        # no key: no Authorization header at all (a local server without --api-key)
        omit = getattr(openai, "Omit", None) or openai._types.Omit  # exported from openai 2
        self._extra_headers = None if key else {"Authorization": omit()}
        del key
        self._client.rlhf_retry_delay = self._retry_delay
        self._semaphore = asyncio.Semaphore(self.max_concurrency)
        self.token_limit_param = TOKEN_LIMIT_PARAMS[0]
        try:
            await self._check_server()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    # ------------------------------------------------------------------------------------------------ messages
    def _proxy_note(self) -> str:
        """Which proxy from the environment a request to ``api_base`` goes through ('' when none)."""
        from urllib.parse import urlsplit
        from urllib.request import getproxies, proxy_bypass_environment

        parts = urlsplit(self.api_base)
        proxies = getproxies()
        proxy = proxies.get(parts.scheme) or proxies.get("all")
        if not proxy or proxy_bypass_environment(parts.hostname or "", proxies):
            return ""
        return (
            f" through the proxy {self.redact(proxy)} ({parts.scheme.upper()}_PROXY in the environment; "
            f"NO_PROXY={parts.hostname} bypasses it)"
        )

    def _auth_message(self, status: int) -> str:
        where = f"${self.api_key_env}" if self._secrets else f"${self.api_key_env} (it is unset)"
        return f"the server at {self.redact(self.api_base)} rejected the credentials (HTTP {status}); check {where}"

    def _server_message(self, response: Any) -> str:
        """One redacted line from an error response: its ``error.message`` (or ``message``/``detail``) or its text."""
        try:
            text = response.text
        except Exception:  # noqa: BLE001 - a body that cannot be decoded says nothing useful
            text = ""
        detail: Any = text
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        if isinstance(body, dict):
            err = body.get("error")
            if isinstance(err, dict):
                detail = err.get("message") or err
            else:
                detail = err or body.get("message") or body.get("detail") or body
        detail = detail if isinstance(detail, str) else json.dumps(detail, default=str)
        return self.redact(_one_line(detail or "(empty body)"))

    def _cause(self, error: BaseException) -> str:
        cause = error.__cause__ or error.__context__ or error
        return self.redact(_one_line(f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__))

    # ------------------------------------------------------------------------------------------------- retries
    def _retry_delay(self, retries_done: int, headers: Any = None) -> float:
        """Seconds before the next attempt (called by the client's retry loop; counts the retry)."""
        self.stats["retries"] += 1
        self.stats["attempts"] += 1
        counter = _ATTEMPTS.get()
        if counter is not None:
            counter[0] += 1
        return self._delay(retries_done, _retry_after_seconds(headers))

    def _delay(self, attempt: int, retry_after: float | None = None) -> float:
        if retry_after is not None:
            return retry_after
        return self._jitter.uniform(0.0, min(self.backoff_max, self.backoff_base * 2**attempt))

    # ------------------------------------------------------------------------------------------- health check
    async def _check_server(self) -> None:
        """``GET /models``: fails fast when the server is down, the key is wrong or the model is not served."""
        import openai

        url = f"{self.redact(self.api_base)}/models"
        try:
            client = self._client.with_options(max_retries=0)
            raw = await client.models.with_raw_response.list(extra_headers=self._extra_headers)
            body = json.loads(raw.content)
        except openai.APIStatusError as e:
            if e.status_code in (401, 403):
                raise BackendUnavailable(self._auth_message(e.status_code)) from None
            if self.model is None:
                raise BackendUnavailable(
                    f"GET {url} answered HTTP {e.status_code} ({self._server_message(e.response)}); pass the served "
                    "model name with --model"
                ) from None
            return  # some servers do not list models; the first completion will tell
        except openai.APIConnectionError as e:
            raise BackendUnavailable(
                f"cannot reach the chat-completions server at {self.redact(self.api_base)}{self._proxy_note()} "
                f"({self._cause(e)}); start it (e.g. `vllm serve MODEL`) or fix generation.api_base / --api-base"
            ) from None
        except ValueError:
            body = None
        data = body.get("data") if isinstance(body, dict) else None
        served = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        if self.model is None:
            if len(served) != 1:
                raise BackendUnavailable(
                    f"the server lists {len(served)} models ({', '.join(map(str, served)) or 'none'}); choose one "
                    "with --model"
                )
            self.model = served[0]
        elif served and self.model not in served:
            raise BackendUnavailable(
                f"model {self.model!r} is not served at {self.redact(self.api_base)}; it serves: "
                f"{', '.join(map(str, served))}"
            )

    # ------------------------------------------------------------------------------------------------ requests
    async def complete(self, request: ChatRequest) -> ChatCompletion:
        if self._client is None or self._semaphore is None:
            raise RuntimeError("OpenAIBackend.start() must be awaited before complete()")
        self.stats["requests"] += 1
        async with self._semaphore:
            counter = [0]
            token = _ATTEMPTS.set(counter)
            try:
                return await self._complete(request, counter)
            except BackendError:
                self.stats["failed"] += 1
                raise
            finally:
                _ATTEMPTS.reset(token)

    async def _complete(self, request: ChatRequest, counter: list[int]) -> ChatCompletion:
        """Send ``request``; the client retries transport and server errors, this loop retries malformed bodies."""
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.stats["retries"] += 1
                counter[0] += 1
                await asyncio.sleep(self._delay(attempt - 1))
            raw = await self._send(request, counter)
            try:
                return _parse_completion(raw, self._secrets)
            except MalformedResponse as e:
                last = self.redact(_one_line(str(e)))
        raise BackendError(
            f"malformed response ({last}); {counter[0] + 1} attempts at {self.redact(self.api_base)}", reason="bad_body"
        )

    async def _send(self, request: ChatRequest, counter: list[int]) -> bytes:
        """One call of the client (with its retries): the body of a 200 answer, or the error for this request."""
        import openai

        where = f"{self.redact(self.api_base)}/chat/completions"
        while True:
            param = self.token_limit_param
            self.stats["attempts"] += 1
            try:
                raw = await self._client.chat.completions.with_raw_response.create(
                    model=self.model,
                    messages=request.messages,
                    temperature=request.temperature,
                    seed=request.seed,
                    n=1,
                    extra_body={param: request.max_tokens},
                    extra_headers=self._extra_headers,
                )
                return raw.content
            except openai.APIStatusError as e:
                status, message = e.status_code, self._server_message(e.response)
                if status == 400 and param == TOKEN_LIMIT_PARAMS[0] and _refuses_field(message, param):
                    # an older server that wants max_tokens: switch for the rest of the run and resend at once
                    self.token_limit_param = TOKEN_LIMIT_PARAMS[1]
                    counter[0] += 1
                    continue
                if status in (401, 403):
                    raise BackendUnavailable(self._auth_message(status)) from None
                if status == 404:
                    raise BackendUnavailable(
                        f"POST {where} answered 404 ({message}); check --api-base (it must end in /v1) and --model"
                    ) from None
                attempts = f"{counter[0] + 1} attempt" + ("s" if counter[0] else "")
                if status in RETRY_STATUSES or status >= 500:
                    raise BackendError(f"HTTP {status}: {message} ({attempts})", reason="server_error") from None
                raise RequestRejected(f"HTTP {status}: {message}") from None
            except openai.APITimeoutError:
                raise BackendError(
                    f"no answer from {where} within {self.timeout:g} s ({counter[0] + 1} attempts)", reason="timeout"
                ) from None
            except openai.APIConnectionError as e:
                cause = e.__cause__ or e.__context__
                if type(cause).__name__ in ("ConnectError", "ConnectionRefusedError", "ProxyError"):
                    raise BackendUnavailable(
                        f"lost the chat-completions server at {self.redact(self.api_base)}{self._proxy_note()}: "
                        f"{self._cause(e)} ({counter[0] + 1} attempts). Restart it and rerun the same command to "
                        "resume"
                    ) from None
                raise BackendError(
                    f"connection dropped by {where}: {self._cause(e)} ({counter[0] + 1} attempts)", reason="dropped"
                ) from None
            except openai.OpenAIError as e:  # anything else the client raises, reported like a server error
                raise BackendError(self.redact(_one_line(f"{type(e).__name__}: {e}")), reason="error") from None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "model": self.model, "api_base": self.redact(self.api_base)}


def _parse_completion(raw: bytes, secrets: Iterable[str] = ()) -> ChatCompletion:
    """The first choice of a chat-completion body (an echoed API key redacted); :class:`MalformedResponse` for a body
    that is not JSON, has no ``choices``, a ``choices[0]`` or ``message`` that is not an object or non-text content."""
    try:
        data = json.loads(raw)
    except ValueError:
        snippet = raw[:80].decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)[:80]
        raise MalformedResponse(f"the body is not JSON: {snippet!r}") from None
    if not isinstance(data, dict):
        raise MalformedResponse(f"the body is a JSON {type(data).__name__}, not an object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        said = data.get("error")
        if isinstance(said, dict):
            said = said.get("message", said)
        hint = f"; the server said: {_one_line(str(said), 200)}" if said else ""
        raise MalformedResponse(f"the body has no choices{hint}")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise MalformedResponse(f"choices[0] is a {type(choice).__name__}, not an object")
    message = choice.get("message")
    if not isinstance(message, dict):
        raise MalformedResponse(f"choices[0].message is a {type(message).__name__}, not an object with a content field")
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):  # content parts
        if not all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content):
            raise MalformedResponse("choices[0].message.content is a list that is not text parts")
        content = "".join(p.get("text", "") for p in content)
    elif not isinstance(content, str):
        raise MalformedResponse(f"choices[0].message.content is a {type(content).__name__}, not a string")
    for secret in secrets:
        if secret and len(secret) >= 8:  # a server that echoes the key into an answer never gets it saved
            content = content.replace(secret, REDACTED)
    finish = choice.get("finish_reason")
    return ChatCompletion(content, finish_reason=finish if isinstance(finish, str) and finish else "stop")
