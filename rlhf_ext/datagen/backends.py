"""Inference backends behind one asynchronous interface: ``offline``, ``hf`` and ``openai``.

Every backend answers :class:`ChatRequest` objects (chat messages + seed + token limit) with a
:class:`ChatCompletion`. The generator never knows which backend it talks to; the mappers' parsers read every answer,
including the offline backend's, so the same code path is exercised everywhere.

* :class:`OfflineBackend`: deterministic and model-free. It ignores the rendered messages and composes its answer
  from the request's structured ``context`` (seed words, style, stance, style axes) with the phrase bank
  (:mod:`rlhf_ext.datagen.phrasebank`), seeded by ``request.seed``. Temperature is ignored.
* :class:`HFBackend`: a local transformers causal LM (a path, hub id or ``builtin:`` model), one request at a time in
  a worker thread, seeded per request (``torch.manual_seed(request.seed)``), the tokenizer's chat template when it
  has one. ``max_tokens`` is clamped to the model's context.
* :class:`OpenAIBackend`: any OpenAI-compatible ``/v1/chat/completions`` endpoint (``vllm serve``, OpenAI, TGI ...).
  Up to ``max_concurrency`` requests in flight (a semaphore and the connection pool), a timeout per attempt,
  retries with exponential backoff and full jitter on HTTP 408/409/429/5xx, timeouts, dropped connections and
  malformed bodies (``Retry-After`` honoured). The API key is read from the environment variable named by
  ``api_key_env`` when the session starts, sent only in the ``Authorization`` header, and never logged, saved or
  shown in an error message or ``repr``.

Errors: :class:`BackendError` (a request failed after its retries: the sample is skipped for this run and retried
when the command is rerun), :class:`RequestRejected` (the backend refused this request, e.g. HTTP 400 or a prompt
longer than the context: the sample is skipped for good), :class:`BackendUnavailable` (the server cannot be reached,
rejects the credentials or does not serve the model: the run stops; finished samples stay cached).
"""

from __future__ import annotations

import abc
import asyncio
import json
import os
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlhf_ext.datagen.mappers import format_pair
from rlhf_ext.datagen.phrasebank import PhraseBank, compose_prompt, compose_response, rubric_for

REQUEST_KINDS = ("prompt", "pair", "response", "judge")


@dataclass(frozen=True)
class ChatRequest:
    """One chat-completion request.

    Attributes:
        kind: ``prompt`` (meta-prompt -> task prompt), ``pair`` (one-call chosen/rejected), ``response`` (one
            response), ``judge`` (A or B).
        messages: OpenAI-style ``[{"role": ..., "content": ...}]``.
        seed: sampling seed (sent to the server; vLLM honours it).
        max_tokens / temperature: sampling limits.
        context: the structured inputs the messages were rendered from (used by model-free backends only).
    """

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
    """The backend refused this particular request (retrying the same request cannot help)."""

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

    async def __aenter__(self) -> Backend:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


# ------------------------------------------------------------------------------------------------------ offline
class OfflineBackend(Backend):
    """Deterministic, model-free answers from the phrase bank (see :mod:`rlhf_ext.datagen.phrasebank`).

    * ``prompt``: :func:`compose_prompt` for ``context["objective_kind"]`` and ``context["seed_words"]``.
    * ``pair``: a chosen response that follows ``context["style"]`` and a rejected one that violates it, in the
      ``CHOSEN:``/``REJECTED:`` format.
    * ``response``: one response with ``context["stance"]`` (follow / violate / unstated).
    * ``judge``: ``A`` or ``B`` by gold score of ``context["a"]`` vs ``context["b"]``; ``TIE`` (unparseable) on ties.
    """

    name = "offline"

    def __init__(self, bank: PhraseBank, markers_per_response: int = 2):
        self.bank = bank
        self.markers = markers_per_response

    async def complete(self, request: ChatRequest) -> ChatCompletion:
        return ChatCompletion(self.answer(request))

    def answer(self, request: ChatRequest) -> str:
        ctx = request.context
        rng = random.Random(request.seed)
        if request.kind == "prompt":
            return compose_prompt(self.bank, ctx["objective_kind"], list(ctx["seed_words"]), rng)
        if request.kind == "judge":
            rubric = rubric_for(ctx["style"], self.bank)
            a, b = rubric.score(ctx["a"]), rubric.score(ctx["b"])
            return "A" if a > b else "B" if b > a else "TIE"
        common = dict(
            style=ctx["style"],
            objective_kind=ctx["objective_kind"],
            seed_words=list(ctx["seed_words"]),
            axes=[tuple(a) for a in ctx.get("axes", ())],
            markers=self.markers,
        )
        if request.kind == "pair":
            chosen = compose_response(self.bank, stance="follow", rng=rng, **common)
            rejected = compose_response(self.bank, stance="violate", rng=rng, **common)
            return format_pair(chosen, rejected)
        if request.kind == "response":
            return compose_response(self.bank, stance=ctx["stance"], rng=rng, **common)
        raise ValueError(f"unknown request kind {request.kind!r}; expected one of {', '.join(REQUEST_KINDS)}")

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "markers_per_response": self.markers}


# ----------------------------------------------------------------------------------------------------------- hf
class HFBackend(Backend):
    """A local transformers causal LM, one request at a time in a worker thread (deterministic per request seed)."""

    name = "hf"

    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32"):
        self.model_spec = model
        self.device = device
        self.dtype = dtype
        self._model = None
        self._tokenizer = None
        self._executor = None

    async def start(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlhf-ext-hf")
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlhf_ext.zoo.builtins import resolve_model

        try:
            path = resolve_model(self.model_spec)
            self._tokenizer = AutoTokenizer.from_pretrained(path)
            self._model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, self.dtype))
        except (OSError, ValueError, RuntimeError) as e:
            raise BackendUnavailable(
                f"cannot load the hf model {self.model_spec!r} ({type(e).__name__}: {e}); pass a local checkpoint "
                "directory, builtin:smollm2 or builtin:tiny-sft (no model hub on this machine)"
            ) from e
        self._model.to(self.device).eval()

    async def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._model = None

    async def complete(self, request: ChatRequest) -> ChatCompletion:
        if self._executor is None:
            raise RuntimeError("HFBackend.start() must be awaited before complete()")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._generate, request)

    def _render(self, messages: list[dict[str, str]]) -> str:
        tok = self._tokenizer
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "\n\n".join(m["content"] for m in messages) + "\n\n"

    def _generate(self, request: ChatRequest) -> ChatCompletion:
        import torch

        tok, model = self._tokenizer, self._model
        enc = tok(self._render(request.messages), return_tensors="pt", add_special_tokens=False)
        ids = enc["input_ids"].to(self.device)
        context = getattr(model.config, "max_position_embeddings", None) or 2048
        room = context - ids.shape[1]
        if room < 1:
            raise RequestRejected(f"prompt has {ids.shape[1]} tokens; the model's context is {context}")
        max_new = min(request.max_tokens, room)
        torch.manual_seed(request.seed)
        sampling = request.temperature > 0
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=enc["attention_mask"].to(self.device),
                max_new_tokens=max_new,
                do_sample=sampling,
                temperature=request.temperature if sampling else None,
                top_p=1.0 if sampling else None,
                top_k=0 if sampling else None,
                pad_token_id=pad,
            )
        new = out[0, ids.shape[1] :].tolist()
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        finished = bool(new) and new[-1] in eos_ids
        finish = "stop" if finished or len(new) < max_new else "length"
        return ChatCompletion(tok.decode(new, skip_special_tokens=True), finish_reason=finish)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "model": self.model_spec}


# ------------------------------------------------------------------------------------------------------- openai
RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class OpenAIBackend(Backend):
    """Asynchronous client for an OpenAI-compatible chat-completions server (see the module docstring).

    Args:
        api_base: URL up to ``/v1`` (e.g. ``http://localhost:8000/v1``).
        model: served model name; ``None`` picks the only model ``GET /models`` lists.
        api_key_env: environment variable holding the key (unset or empty: no ``Authorization`` header).
        max_concurrency: requests in flight at once.
        timeout: seconds per attempt.
        max_retries: retries after the first attempt.
        backoff_base / backoff_max: the k-th retry waits ``uniform(0, min(backoff_max, backoff_base * 2**k))``
            seconds (full jitter), or the server's ``Retry-After`` when it sends one.
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
        self.api_base = api_base.rstrip("/")
        self.model = model
        self.api_key_env = api_key_env
        self.max_concurrency = max_concurrency
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self._session = None
        self._semaphore: asyncio.Semaphore | None = None
        self._jitter = random.Random()
        self.stats = {"requests": 0, "attempts": 0, "retries": 0, "failed": 0}

    def __repr__(self) -> str:
        return f"OpenAIBackend(api_base={self.api_base!r}, model={self.model!r}, api_key_env={self.api_key_env!r})"

    async def start(self) -> None:
        import aiohttp

        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env, "")
        if key:
            headers["Authorization"] = f"Bearer {key}"
        del key
        connector = aiohttp.TCPConnector(limit=self.max_concurrency, limit_per_host=self.max_concurrency)
        self._session = aiohttp.ClientSession(headers=headers, connector=connector)
        self._semaphore = asyncio.Semaphore(self.max_concurrency)
        try:
            await self._check_server()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _check_server(self) -> None:
        """``GET /models``: fails fast when the server is down, the key is wrong or the model is not served."""
        import aiohttp

        url = f"{self.api_base}/models"
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                if resp.status in (401, 403):
                    raise BackendUnavailable(self._auth_message(resp.status))
                if resp.status != 200:
                    if self.model is None:
                        raise BackendUnavailable(
                            f"GET {url} answered HTTP {resp.status}; pass the served model name with --model"
                        )
                    return  # some servers do not list models; the first completion will tell
                body = await resp.json(content_type=None)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise BackendUnavailable(
                f"cannot reach the chat-completions server at {self.api_base} ({type(e).__name__}: {e}); start it "
                "(e.g. `vllm serve MODEL`) or fix generation.api_base / --api-base"
            ) from e
        served = [m.get("id") for m in (body or {}).get("data", []) if isinstance(m, dict)]
        if self.model is None:
            if len(served) != 1:
                raise BackendUnavailable(
                    f"the server lists {len(served)} models ({', '.join(map(str, served)) or 'none'}); choose one "
                    "with --model"
                )
            self.model = served[0]
        elif served and self.model not in served:
            raise BackendUnavailable(
                f"model {self.model!r} is not served at {self.api_base}; it serves: {', '.join(map(str, served))}"
            )

    def _auth_message(self, status: int) -> str:
        where = f"${self.api_key_env}" if os.environ.get(self.api_key_env) else f"${self.api_key_env} (it is unset)"
        return f"the server at {self.api_base} rejected the credentials (HTTP {status}); check {where}"

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        if retry_after:
            try:
                return min(self.backoff_max, max(0.0, float(retry_after)))
            except ValueError:
                pass
        return self._jitter.uniform(0.0, min(self.backoff_max, self.backoff_base * 2**attempt))

    async def complete(self, request: ChatRequest) -> ChatCompletion:
        if self._session is None or self._semaphore is None:
            raise RuntimeError("OpenAIBackend.start() must be awaited before complete()")
        body = {
            "model": self.model,
            "messages": request.messages,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "seed": request.seed,
            "n": 1,
        }
        self.stats["requests"] += 1
        async with self._semaphore:
            return await self._post_with_retries(body)

    async def _post_with_retries(self, body: dict[str, Any]) -> ChatCompletion:
        import aiohttp

        url = f"{self.api_base}/chat/completions"
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        last, reason, retry_after = "", "error", None
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(self._delay(attempt - 1, retry_after))
            self.stats["attempts"] += 1
            retry_after = None
            try:
                async with self._session.post(url, json=body, timeout=timeout) as resp:
                    if resp.status == 200:
                        raw = await resp.read()
                        try:
                            return _parse_completion(raw)
                        except (ValueError, KeyError, IndexError, TypeError) as e:
                            last, reason = f"malformed response body ({e})", "bad_body"
                            continue
                    detail = (await resp.text())[:300]
                    if resp.status in (401, 403):
                        raise BackendUnavailable(self._auth_message(resp.status))
                    if resp.status == 404:
                        raise BackendUnavailable(
                            f"POST {url} answered 404 ({detail}); check --api-base (it must end in /v1) and --model"
                        )
                    if resp.status not in RETRY_STATUSES:
                        raise RequestRejected(f"HTTP {resp.status}: {detail}")
                    last, reason = f"HTTP {resp.status}: {detail}", "server_error"
                    retry_after = resp.headers.get("Retry-After")
            except asyncio.TimeoutError:
                last, reason = f"no answer within {self.timeout:g} s", "timeout"
            except aiohttp.ClientConnectorError as e:
                last, reason = f"cannot connect ({e})", "connection"
            except aiohttp.ClientError as e:  # connection dropped mid-request, broken payload ...
                last, reason = f"{type(e).__name__}: {e}", "dropped"
        self.stats["failed"] += 1
        message = f"request failed after {self.max_retries + 1} attempts: {last}"
        if reason == "connection":
            raise BackendUnavailable(
                f"lost the chat-completions server at {self.api_base}: {message}. Restart it and rerun the same "
                "command to resume"
            )
        raise BackendError(message, reason=reason)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "model": self.model, "api_base": self.api_base}


def _parse_completion(raw: bytes) -> ChatCompletion:
    data = json.loads(raw)
    choice = data["choices"][0]
    content = choice["message"].get("content")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise TypeError("message.content is not a string")
    return ChatCompletion(content, finish_reason=choice.get("finish_reason") or "stop")


def make_backend(spec, bank: PhraseBank | None = None) -> Backend:
    """Build the backend a :class:`~rlhf_ext.datagen.schema.GenerationSpec` asks for."""
    if spec.backend == "offline":
        from rlhf_ext.datagen.phrasebank import load_phrase_bank

        bank = bank if bank is not None else load_phrase_bank(spec.phrase_bank)
        return OfflineBackend(bank, spec.markers_per_response)
    if spec.backend == "hf":
        return HFBackend(spec.model)
    if spec.backend == "openai":
        return OpenAIBackend(
            api_base=spec.api_base,
            model=spec.model,
            api_key_env=spec.api_key_env,
            max_concurrency=spec.max_concurrency,
            timeout=spec.request_timeout,
            max_retries=spec.max_retries,
        )
    raise ValueError(f"unknown backend {spec.backend!r}; choose offline, hf or openai")
