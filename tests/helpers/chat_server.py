"""A local OpenAI-compatible chat-completions server for tests and benchmarks, with fault injection.

:class:`FakeChatServer` speaks the subset of the protocol that ``vllm serve`` offers and clients use:
``GET /v1/models`` and ``POST /v1/chat/completions`` (``model``, ``messages``, ``max_tokens``, ``temperature``,
``seed`` in; ``choices[0].message.content`` and ``finish_reason`` plus ``usage`` out). It runs an aiohttp server on
127.0.0.1 in a background thread (``with FakeChatServer(...) as server: server.url``) or as a process::

    python -m tests.helpers.chat_server --latency 0.05      # prints "URL http://127.0.0.1:PORT/v1"

Completions come from a ``responder(body) -> str`` (default :func:`datagen_responder`, deterministic canned answers
to the ``rlhf_ext.datagen`` templates). Faults come from ``fault(body, attempt) -> action | None`` where ``attempt``
counts earlier requests with the same messages and seed (0 for the first), so "fail the first attempt" and "always
fail" are both expressible. Actions: ``"error"`` (HTTP 500), ``"rate_limit"`` (HTTP 429 with ``Retry-After: 0``),
``"hang"`` (answer after ``hang_seconds``, i.e. a client timeout), ``"bad_body"`` (HTTP 200 with a non-JSON body),
``"reject"`` (HTTP 400). ``latency`` delays every answer. The server records request counts, the maximum number of
requests in flight and the ``Authorization`` headers it saw (``api_key`` makes it require one).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

Responder = Callable[[dict[str, Any]], str]
Fault = Callable[[dict[str, Any], int], "str | None"]


def request_digest(body: dict[str, Any]) -> str:
    """Identity of a request for attempt counting: its messages and seed."""
    return hashlib.sha256(json.dumps([body.get("messages"), body.get("seed")], sort_keys=True).encode()).hexdigest()


def last_user_message(body: dict[str, Any]) -> str:
    msgs = body.get("messages") or [{}]
    return str(msgs[-1].get("content", ""))


def _pick(options: list[str], text: str) -> str:
    return options[int(hashlib.sha256(text.encode()).hexdigest(), 16) % len(options)]


def datagen_responder(body: dict[str, Any]) -> str:
    """Deterministic answers to the ``rlhf_ext.datagen`` mapper and judge templates (same request -> same answer).

    Prompt requests get a question built from the seed words; pair requests a ``CHOSEN:``/``REJECTED:`` answer;
    response requests a careful answer when told to follow the preference and a careless one otherwise; judge
    requests pick the response containing "careful" (``A`` when neither or both do).
    """
    from rlhf_ext.datagen import mappers

    text = last_user_message(body)
    if text.startswith(mappers.META_PROMPT_TEMPLATE.split("\n", 1)[0]):
        m = re.search(r"following seed words: (.*)\.\n", text)
        words = m.group(1) if m else "this topic"
        return _pick([f"How do {words} relate to each other?", f"Why does {words} matter in practice?"], text)
    if text.startswith(mappers.PAIR_PROMPT_TEMPLATE.split(":", 1)[0]):
        return mappers.format_pair(
            "A careful answer that follows the stated preference closely.",
            "A careless answer that mostly ignores the preference.",
        )
    if text.startswith(mappers.RESPONSE_PROMPT_TEMPLATE.split(":", 1)[0]):
        if "must follow this preference" in text:
            return "A careful answer that follows the stated preference closely."
        if "must not respect this preference" in text:
            return "A careless answer that mostly ignores the preference."
        return _pick(["A careful answer with a neutral tone.", "A careless answer with a neutral tone."], text)
    if "RESPONSE A:" in text and "RESPONSE B:" in text:
        a = text.split("RESPONSE A:", 1)[1].split("RESPONSE B:", 1)[0]
        b = text.split("RESPONSE B:", 1)[1]
        return "B" if ("careful" in b and "careful" not in a) else "A"
    return "OK"


class FakeChatServer:
    """See the module docstring. Use as a context manager; ``url`` is the ``/v1`` base URL."""

    def __init__(
        self,
        responder: Responder | None = None,
        *,
        latency: float = 0.0,
        fault: Fault | None = None,
        hang_seconds: float = 30.0,
        model: str = "fake-model",
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.responder = responder or datagen_responder
        self.latency = latency
        self.fault = fault
        self.hang_seconds = hang_seconds
        self.model = model
        self.api_key = api_key
        self.host = host
        self.port = port
        self.requests = 0
        self.completed = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.actions: Counter = Counter()
        self.auth_headers: set[str] = set()
        self._attempts: Counter = Counter()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    # -------------------------------------------------------------------------------------------------- handlers
    def _app(self):
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    def _authorized(self, request) -> bool:
        header = request.headers.get("Authorization", "")
        if header:
            self.auth_headers.add(header)
        return self.api_key is None or header == f"Bearer {self.api_key}"

    async def _models(self, request):
        from aiohttp import web

        if not self._authorized(request):
            return web.json_response({"error": {"message": "invalid api key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _chat(self, request):
        from aiohttp import web

        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if not self._authorized(request):
                return web.json_response({"error": {"message": "invalid api key"}}, status=401)
            body = await request.json()
            digest = request_digest(body)
            with self._lock:
                attempt = self._attempts[digest]
                self._attempts[digest] += 1
            action = self.fault(body, attempt) if self.fault is not None else None
            self.actions[action or "ok"] += 1
            if self.latency:
                await asyncio.sleep(self.latency)
            if action == "hang":
                await asyncio.sleep(self.hang_seconds)
            elif action == "error":
                return web.json_response({"error": {"message": "injected server error"}}, status=500)
            elif action == "rate_limit":
                return web.json_response({"error": {"message": "slow down"}}, status=429, headers={"Retry-After": "0"})
            elif action == "reject":
                return web.json_response({"error": {"message": "injected bad request"}}, status=400)
            elif action == "bad_body":
                return web.Response(text="<html>not json</html>", status=200, content_type="text/html")
            if body.get("model") != self.model:
                return web.json_response({"error": {"message": f"model {body.get('model')} not found"}}, status=404)
            content = self.responder(body)
            self.completed += 1
            return web.json_response(
                {
                    "id": f"chatcmpl-{self.completed}",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": self.model,
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
                    ],
                    "usage": {"prompt_tokens": 0, "completion_tokens": len(content.split()), "total_tokens": 0},
                }
            )
        finally:
            self.in_flight -= 1

    # -------------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> FakeChatServer:
        self._thread = threading.Thread(target=self._serve, name="fake-chat-server", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=30)
        if self._error is not None:
            raise RuntimeError(f"fake chat server failed to start: {self._error}") from self._error
        return self

    def _serve(self) -> None:
        from aiohttp import web

        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)

        async def startup():
            self._runner = web.AppRunner(self._app(), access_log=None, shutdown_timeout=0.5)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port, shutdown_timeout=0.5)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]

        try:
            loop.run_until_complete(startup())
        except BaseException as e:  # report to start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:  # e.g. handlers still sleeping in an injected "hang"
            t.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(self._runner.cleanup())
        loop.close()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._thread = None

    def __enter__(self) -> FakeChatServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """Run the server in the foreground (``--latency`` seconds per answer) until interrupted."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", default="fake-model")
    args = parser.parse_args(argv)
    server = FakeChatServer(latency=args.latency, port=args.port, model=args.model).start()
    print(f"URL {server.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
