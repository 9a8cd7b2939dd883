"""A local OpenAI-compatible chat-completions server for tests and benchmarks, with fault injection.

:class:`FakeChatServer` speaks the subset of the protocol that ``vllm serve`` offers and clients use:
``GET /v1/models`` and ``POST /v1/chat/completions`` (``model``, ``messages``, ``max_tokens``, ``temperature``,
``seed`` in; ``choices[0].message.content`` and ``finish_reason`` plus ``usage`` out). It runs an aiohttp server on
127.0.0.1 in a background thread (``with FakeChatServer(...) as server: server.url``) or as a process::

    python -m tests.helpers.chat_server --latency 0.05      # prints "URL http://127.0.0.1:PORT/v1"

Completions come from a ``responder(body) -> str`` (default :func:`datagen_responder`, deterministic canned answers
to the ``rlhf_ext.datagen`` templates). Faults come from ``fault(body, attempt) -> action | None`` where ``attempt``
counts earlier requests with the same messages and seed (0 for the first), so "fail the first attempt" and "always
fail" are both expressible. Actions: ``"error"`` (HTTP 500), ``"rate_limit"`` (HTTP 429 with ``Retry-After:
retry_after``, default 0), ``"hang"`` (answer after ``hang_seconds``, i.e. a client timeout), ``"bad_body"`` (HTTP 200
with a non-JSON body), ``"reject"`` (HTTP 400), ``"echo_auth"`` (HTTP 400 whose error message echoes the request's
``Authorization`` header, as some proxies and debug servers do), ``"string_message"`` (HTTP 200 whose
``choices[0].message`` is a string, not an object), ``"drop"`` (the connection is closed without an answer), or a
``(status, json_body)`` tuple for any other answer.
``reject_params`` names request fields the server refuses with HTTP 400 naming the field, the way an older vLLM
refuses ``max_completion_tokens`` (``"extra_forbidden"``) or OpenAI refuses ``max_tokens`` for newer models.
``latency`` delays every answer. The server records request counts, the maximum number of requests in flight, the
arrival time of each chat request, which token-limit fields the requests carried and the ``Authorization`` headers it
saw (``api_key`` makes it require one).

:class:`ForwardProxy` is a minimal HTTP forward proxy (absolute-form requests, no CONNECT) that records the URLs it
forwards, for tests of proxies taken from the environment.
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
Fault = Callable[[dict[str, Any], int], "str | tuple[int, Any] | None"]


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


#: Marks of a test response's quality for :func:`alpaca_farm_responder` (one per response).
AF_GOOD, AF_BAD, AF_EVEN = "[[good]]", "[[bad]]", "[[even]]"


def alpaca_farm_responder(body: dict[str, Any]) -> str:
    """Answers AlpacaFarm's / AlpacaEval's annotator prompts in each template's own answer format.

    The real examples of the last user message are found by their responses' marks (:data:`AF_GOOD`, :data:`AF_BAD`,
    :data:`AF_EVEN`, one per response: output (a) then (b) of each example, in order), followed by the batch's padding
    examples (instruction ``1+1=``). Output (a) wins when it is marked good and (b) is not, (b) in the mirrored case;
    otherwise (and for padding) the answer is (a), except that the ``lmsys_gpt4`` format answers two equal scores (a
    draw) when both responses are marked even. Formats: JSON ``"Output (a) is better than Output (b)": true/false``,
    ``### Best output for example k:`` lists, ``### Best output:`` / ``Best output:`` single answers, two scores
    (lmsys), and ``Output (a)`` / ``Output (b)`` lines (the ChatML templates).
    """
    text = last_user_message(body)
    marks = re.findall(r"\[\[(good|bad|even)\]\]", text)
    pairs = list(zip(marks[0::2], marks[1::2]))
    winners = ["b" if (m1 != "good" and m2 == "good") else "a" for m1, m2 in pairs]
    winners += ["a"] * len(re.findall(r"1\+1=\n", text))  # padding: "2" beats "3"
    tail = text.rstrip()
    if "[The Start of Assistant 1's Answer]" in text:
        m1, m2 = pairs[0]
        return "5 5\nEqually good." if m1 == m2 == "even" else ("8 3\nFirst." if winners[0] == "a" else "3 8\nSecond.")
    if "JSON format" in text:
        return "\n\n".join(
            f'{{\n"Concise explanation": "checked.",\n"Output (a) is better than Output (b)": '
            f"{'true' if w == 'a' else 'false'}\n}}"
            for w in winners
        )
    if re.search(r"Best output for example \d+:$", tail):
        first = int(re.findall(r"Best output for example (\d+):$", tail)[0])
        return "\n\n".join(
            (f"### Best output for example {first + k}:" if k else "") + f"\n({w})" for k, w in enumerate(winners)
        )
    if tail.endswith("### Best output:"):
        return "".join(f"\n({w})" for w in winners)
    if tail.endswith("Best output:"):
        return "".join(f" ({w})" for w in winners)
    return "\n".join(f"Output ({w})" for w in winners)


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
        retry_after: str = "0",
        reject_params: tuple[str, ...] | list[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.responder = responder or datagen_responder
        self.retry_after = retry_after
        self.reject_params = tuple(reject_params)
        self.token_params: Counter = Counter()  # max_tokens / max_completion_tokens, as the requests sent them
        self.arrivals: list[tuple[str, float]] = []  # (request digest, time.monotonic()) of every chat request
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
                self.arrivals.append((digest, time.monotonic()))
            for name in ("max_tokens", "max_completion_tokens"):
                if name in body:
                    self.token_params[name] += 1
            refused = [name for name in self.reject_params if name in body]
            if refused:
                self.actions["reject_param"] += 1
                return web.json_response(_param_error(refused[0]), status=400)
            action = self.fault(body, attempt) if self.fault is not None else None
            if isinstance(action, tuple):  # (status, JSON body): any other error answer
                self.actions[f"custom:{action[0]}"] += 1
                return web.json_response(action[1], status=action[0])
            self.actions[action or "ok"] += 1
            if self.latency:
                await asyncio.sleep(self.latency)
            if action == "hang":
                await asyncio.sleep(self.hang_seconds)
            elif action == "error":
                return web.json_response({"error": {"message": "injected server error"}}, status=500)
            elif action == "rate_limit":
                return web.json_response(
                    {"error": {"message": "slow down"}}, status=429, headers={"Retry-After": self.retry_after}
                )
            elif action == "reject":
                return web.json_response({"error": {"message": "injected bad request"}}, status=400)
            elif action == "echo_auth":
                echoed = request.headers.get("Authorization", "")
                return web.json_response(
                    {"error": {"message": f"bad request; request headers: {{'Authorization': '{echoed}'}}"}},
                    status=400,
                )
            elif action == "bad_body":
                return web.Response(text="<html>not json</html>", status=200, content_type="text/html")
            elif action == "drop":
                request.transport.close()  # no status line: the client sees the connection dropped
                return web.Response(status=500)
            if action == "string_message":
                return web.json_response(
                    {
                        "id": "chatcmpl-str",
                        "object": "chat.completion",
                        "model": self.model,
                        "choices": [{"index": 0, "message": "a bare string", "finish_reason": "stop"}],
                    }
                )
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
            site = web.TCPSite(self._runner, self.host, self.port)
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


def _param_error(name: str) -> dict[str, Any]:
    """The HTTP 400 body a server sends for a request field it does not accept (vLLM / OpenAI wording)."""
    if name == "max_completion_tokens":  # an older vLLM (pydantic extra="forbid")
        detail = [{"type": "extra_forbidden", "loc": ["body", name], "msg": "Extra inputs are not permitted"}]
        return {"object": "error", "message": json.dumps(detail), "type": "BadRequestError", "param": None, "code": 400}
    return {  # OpenAI for models that only take max_completion_tokens
        "error": {
            "message": f"Unsupported parameter: '{name}' is not supported with this model. Use "
            "'max_completion_tokens' instead.",
            "type": "invalid_request_error",
            "param": name,
            "code": "unsupported_parameter",
        }
    }


class ForwardProxy(FakeChatServer):
    """A minimal HTTP forward proxy on 127.0.0.1 (``with ForwardProxy() as proxy: proxy.proxy_url``): forwards each
    absolute-form request to its target and records the target URL in ``forwarded``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        super().__init__(host=host, port=port)
        self.forwarded: list[str] = []

    @property
    def proxy_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _app(self):
        from aiohttp import web

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        return app

    async def _forward(self, request):
        import aiohttp
        from aiohttp import web

        url = str(request.url)
        self.forwarded.append(url)
        skip = {"host", "proxy-connection", "connection", "content-length", "transfer-encoding"}
        headers = {k: v for k, v in request.headers.items() if k.lower() not in skip}
        async with (
            aiohttp.ClientSession() as session,
            session.request(request.method, url, headers=headers, data=await request.read()) as resp,
        ):
            body = await resp.read()
            keep = {k: v for k, v in resp.headers.items() if k.lower() in ("content-type", "retry-after")}
            return web.Response(body=body, status=resp.status, headers=keep)


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
