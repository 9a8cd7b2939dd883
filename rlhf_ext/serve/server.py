"""``rlhf-ext serve rm``: a segment reward model's sequence evaluation e_phi over HTTP, in OpenRLHF's remote-reward
protocol (:mod:`rlhf_ext.serve.protocol`), as a plain ASGI app on uvicorn.

e_phi(x, y) = tau * logsumexp(r_seg / tau) over the segment rewards (paper 003 Eq. 4; ``"sum"`` / ``"mean"`` for the
ablations), computed by :func:`rlhf_ext.runtime.token_scores.segment_evaluation` as in the trainers, so OpenRLHF
(``--reward.remote_url http://HOST:PORT/get_reward``) and TRL (:mod:`rlhf_ext.trl.remote_reward`) train against it.

Routes: ``POST /get_reward`` (also ``POST /``) scores; ``GET /health`` answers at once with :meth:`RewardServer.health`
(503 when the scoring thread has stopped).

Every refusal is ``{"error": "<one line>"}`` with its status: 400 (not JSON, nested too deeply, invalid text, missing
key, wrong type, mismatched lengths, malformed HTTP or chunking), 401 (missing or wrong bearer token), 404 (unknown
route), 408 (a request head or body not received within ``read_timeout_s``), 413 (more pairs than
``max_request_pairs`` or a body over ``max_body_bytes``), 422 (a query that does not start with its prompt), 503 (more
than ``max_pending`` open connections, no score within ``request_timeout_s``, or the scoring thread stopped).

Work: the event loop only moves bytes; ``workers`` threads parse and tokenise bodies; one scoring thread
(:class:`~rlhf_ext.serve.batching.MicroBatcher`) scores the waiting pairs of all requests together, up to
``max_batch_size`` per batch. SIGINT and SIGTERM stop accepting, answer the requests in flight, then exit.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rlhf_ext.runtime.dense_sources import EncodedResponse
from rlhf_ext.runtime.segment_data import DatasetFormatError
from rlhf_ext.runtime.spans import Span
from rlhf_ext.runtime.token_scores import SegmentScorer
from rlhf_ext.serve.batching import MicroBatcher, ScorerStopped, SegmentEvaluator
from rlhf_ext.serve.protocol import HEALTH_PATH, REWARD_PATHS, RequestError, error_body, parse_reward_request
from rlhf_ext.serve.settings import API_KEY_ENV, ServeSettings, bind_listener

logger = logging.getLogger(__name__)

#: The most bytes of a too-large body read (and dropped) before answering 413, so that the client reads the answer
#: rather than a reset connection; beyond it the connection is closed.
DISCARD_LIMIT = 256 * 1024 * 1024
#: An ASGI app's reply: status, JSON payload, extra headers.
Reply = tuple[int, dict[str, Any], dict[str, str]]


def model_name(path: str | None) -> str | None:
    """A model's name without this machine's directory layout: a local directory's last component, a hub id as is."""
    if not path:
        return path
    return Path(path).name if Path(path).is_absolute() or Path(path).exists() else path


def _reply(status: int, payload: dict[str, Any], close: bool = False, headers: dict[str, str] | None = None) -> Reply:
    return status, payload, {**(headers or {}), **({"Connection": "close"} if close else {})}


async def _send_json(send, reply: Reply) -> None:
    """Send ``reply`` as an ASGI response: its headers, then ``content-length`` and ``content-type``."""
    status, payload, headers = reply
    body = json.dumps(payload).encode()
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    raw += [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    """The first value of the request header ``name`` (lower case), or None."""
    return next((v.decode("latin-1") for k, v in scope["headers"] if k == name), None)


class _GuardedProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol on httptools' C parser with a deadline on each request head (uvicorn has none) and
    JSON refusals for malformed requests (refused by the parser before the app sees any body byte)."""

    read_timeout_s = 60.0  # set on a subclass per server

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logger = logging.getLogger(f"{__name__}.http")
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_deadline is None and self._between_requests():
            self._arm()  # the first byte of a request head
        super().data_received(data)
        if not self._between_requests():
            self._disarm()  # the head is in: the app reads the body under its own deadline

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._head_deadline = self.loop.call_later(self.read_timeout_s, self._head_expired)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_expired(self) -> None:
        self._head_deadline = None
        if self._between_requests() and not self.transport.is_closing():
            self._refuse(408, f"request head not received within {self.read_timeout_s:g} s; send it at once")

    def send_400_response(self, msg: str) -> None:
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()  # answered already (e.g. 413 while a bad chunk followed)
        else:
            self._refuse(400, "malformed HTTP request (request line, header, Content-Length or chunked body); send "
                         "HTTP/1.1 with a valid Content-Length or chunked encoding")  # fmt: skip

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with ``{"error": message}`` and close the connection."""
        body = error_body(message)
        head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")  # fmt: skip
        self.transport.write(head.encode() + body)
        self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn's server, which on SIGINT or SIGTERM stops accepting and answers the requests in flight, without
    raising the signal again afterwards (that would end the process before the scoring thread is closed)."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class RewardServer:
    """The HTTP server of a segment reward model: a context manager (serving on a background thread), or call
    :meth:`serve_forever`::

        with RewardServer(SegmentScorer(rm_dir), ServeSettings(port=0)) as server:
            print(server.url)  # http://127.0.0.1:PORT

    ``listener``: a socket from :func:`~rlhf_ext.serve.settings.bind_listener` (default: bound here).
    """

    def __init__(self, scorer: SegmentScorer, settings: ServeSettings | None = None, model_dir: str | None = None,
                 listener=None):  # fmt: skip
        self.settings = settings or ServeSettings()
        self.listener = listener or bind_listener(self.settings.host, self.settings.port)  # first: may refuse
        self.scorer = scorer
        self.model_dir = model_dir or str(getattr(scorer.reward_model.config, "_name_or_path", ""))
        self.evaluator = SegmentEvaluator(scorer, self.settings.max_length)
        self.batcher = MicroBatcher(self.evaluator.evaluate, self.settings.max_batch_size, self.settings.max_wait_ms)
        self.in_flight = 0  # scoring requests between their head and their answer (changed on the event loop only)
        self._prepare_pool = ThreadPoolExecutor(self.settings.workers, thread_name_prefix="rm-prepare")
        protocol = type("Protocol", (_GuardedProtocol,), {"read_timeout_s": self.settings.read_timeout_s})
        config = uvicorn.Config(self._app, http=protocol, interface="asgi3", lifespan="off", log_config=None,
                                access_log=False, proxy_headers=False, backlog=2048)  # fmt: skip
        self._server = _Server(config)
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------------------ routes
    async def _app(self, scope: dict[str, Any], receive, send) -> None:
        """The routes: ``GET`` (or ``HEAD``) :data:`HEALTH_PATH`, ``POST`` :data:`REWARD_PATHS`, 404 otherwise."""
        if scope["type"] != "http":  # lifespan is off: nothing else reaches the app
            return
        method, path = scope["method"], scope["path"]
        if path == HEALTH_PATH and method in ("GET", "HEAD"):
            reply = self._health()
        elif path in REWARD_PATHS and method == "POST":
            reply = await self._score(scope, receive)
        elif method == "POST":
            reply = _reply(404, {"error": f"no route POST {path}; POST /get_reward or GET {HEALTH_PATH}"})
        else:
            reply = _reply(404, {"error": f"no route {method} {path}; GET {HEALTH_PATH} or POST /get_reward"})
        await _send_json(send, reply)

    def _health(self) -> Reply:
        if busy := self._busy():
            return _reply(503, {"error": busy})
        health = self.health()
        return _reply(200 if health["status"] == "ok" else 503, health)

    async def _score(self, scope: dict[str, Any], receive) -> Reply:
        try:
            if busy := self._busy():
                raise RequestError(503, busy)
            self._authorise(_header(scope, b"authorization"))
            self.in_flight += 1
            try:
                body = await self._read_body(scope, receive)
                pairs = await asyncio.get_running_loop().run_in_executor(self._prepare_pool, self.prepare, body)
                values, segments, spans = await self._scores(pairs)
            finally:
                self.in_flight -= 1
        except RequestError as e:
            headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
            return _reply(e.status, {"error": e.message}, close=e.status in (408, 413), headers=headers)
        except Exception as e:  # a scoring failure: the request fails, the server goes on
            logger.exception("a request failed")
            return _reply(500, {"error": " ".join(f"scoring failed: {type(e).__name__}: {e}".split())})
        return _reply(200, {"rewards": values, "scores": values, "extra_logs": {"segments": segments}, "spans": spans})

    # ----------------------------------------------------------------------------------------------------- checks
    def _busy(self) -> str | None:
        """The refusal while more than ``max_pending`` connections are open (not counting the asking one)."""
        if len(self._server.server_state.connections) - 1 >= self.settings.max_pending:
            return f"server busy: {self.settings.max_pending} requests running or queued; retry later"

    def _authorise(self, header: str | None) -> None:
        """Accept ``Authorization: Bearer KEY`` or HTTP basic auth with KEY as the password (constant-time compare)."""
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, credentials = (header or "").partition(" ")
        given = credentials.strip() if scheme.lower() == "bearer" else ""
        if scheme.lower() == "basic":
            with contextlib.suppress(binascii.Error, UnicodeDecodeError):
                given = base64.b64decode(credentials.strip(), validate=True).decode().partition(":")[2]
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise RequestError(401, f"missing or wrong API key: send 'Authorization: Bearer <key>' with the key the "
                               f"server was started with (--api-key or {API_KEY_ENV})")  # fmt: skip

    async def _read_body(self, scope: dict[str, Any], receive) -> bytes:
        """The request body, read within ``read_timeout_s``; a body over ``max_body_bytes`` is read to its end and
        dropped (up to :data:`DISCARD_LIMIT` bytes), then 413."""
        limit = self.settings.max_body_bytes
        declared = int(_header(scope, b"content-length") or "0")  # the parser refused a malformed one
        if declared > DISCARD_LIMIT:
            raise RequestError(413, self._too_large(declared))
        parts: list[bytes] = []
        size = 0

        async def read() -> None:
            nonlocal size
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise RequestError(400, "the client closed the connection before its body ended")
                chunk, more = message.get("body", b""), message.get("more_body", False)
                size += len(chunk)
                if size <= limit:
                    parts.append(chunk)
                elif size > DISCARD_LIMIT:
                    return  # the connection is closed after the 413
                else:
                    parts.clear()

        try:
            await asyncio.wait_for(read(), self.settings.read_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(408, f"request body not received within {self.settings.read_timeout_s:g} s; send it "
                               "at once") from None  # fmt: skip
        if size > limit:
            raise RequestError(413, self._too_large(size))
        return b"".join(parts)

    def _too_large(self, size: int) -> str:
        limit = self.settings.max_body_bytes
        return f"request body of {size} bytes exceeds this server's limit of {limit} bytes; split the batch"

    # ---------------------------------------------------------------------------------------------------- scoring
    def prepare(self, raw: bytes) -> list[EncodedResponse]:
        """The tokenised pairs of one request body (runs on a ``workers`` thread; raises :class:`RequestError`)."""
        prompts, texts, texts_are_queries = parse_reward_request(raw, self.settings.max_request_pairs)
        if texts_are_queries:
            texts = [self.evaluator.response_of_query(q, p, i) for i, (p, q) in enumerate(zip(prompts, texts))]
        encoded = []
        for i, (prompt, response) in enumerate(zip(prompts, texts)):
            try:
                encoded.append(self.evaluator.encode(prompt, response))
            except DatasetFormatError as e:
                raise RequestError(400, f"pair {i}: {e}") from None
        return encoded

    async def _scores(self, pairs: list[EncodedResponse]) -> tuple[list[float], list[int], list[list[Span]]]:
        """Queue ``pairs`` on the batcher and wait (holding no thread) for their values, segment counts and spans."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def wake() -> None:  # on the scoring thread
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        try:
            job = self.batcher.submit(pairs, on_done=wake)
        except ScorerStopped as e:
            raise RequestError(503, str(e)) from None
        try:
            await asyncio.wait_for(done, self.settings.request_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(503, f"no score within {self.settings.request_timeout_s:g} s; the server is "
                               "overloaded") from None  # fmt: skip
        if isinstance(job.error, ScorerStopped):
            raise RequestError(503, str(job.error))
        if job.error is not None:
            raise job.error
        return job.values, job.segments, job.spans

    # ---------------------------------------------------------------------------------------------------- running
    def health(self) -> dict[str, Any]:
        """The ``/health`` payload: status, scoring thread, model names (not paths), e_phi settings, limits, auth."""
        alive = self.batcher.alive
        scorer, settings = self.scorer, self.settings
        return {
            "status": "ok" if alive else "unavailable",
            "scorer": "running" if alive else self.batcher.failure,
            "model": model_name(self.model_dir),
            "sft_model": model_name(getattr(scorer.sft_model.config, "_name_or_path", None)),
            "aggregation": scorer.aggregation,
            "tau": scorer.tau,
            "entropy_cutoff": scorer.entropy_cutoff,
            "max_batch_size": settings.max_batch_size,
            "max_request_pairs": settings.max_request_pairs,
            "in_flight": self.in_flight,
            "auth": "bearer" if settings.api_key else "none",
        }

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the server listens on."""
        return self.listener.getsockname()[:2]

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    @property
    def pending(self) -> int:
        """Open connections (reading a request, waiting for scores, or idle between two requests)."""
        return len(self._server.server_state.connections)

    def start(self) -> RewardServer:
        """Serve on a background thread (returns once the server accepts connections)."""
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.listener]},
                                        name="rm-serve", daemon=True)  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            self.close()
            raise RuntimeError("the reward server did not start")
        return self

    def serve_forever(self) -> None:
        """Serve on this thread until SIGINT or SIGTERM (in the main thread), answering the requests in flight."""
        try:
            self._server.run(sockets=[self.listener])
        finally:
            self._release()

    def close(self) -> None:
        """Stop accepting, answer the requests in flight, then stop."""
        if self._thread is not None:
            self._server.should_exit = True
            self._thread.join()
            self._thread = None
        self._release()

    def _release(self) -> None:
        self.batcher.close()
        self._prepare_pool.shutdown(wait=True)
        self.listener.close()

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def serve_reward_model(
    model_dir: str, settings: ServeSettings, sft_model: str | None = None, echo: Callable[[str], None] = print
) -> None:
    """Listen (first: a bad address or a port in use fails before the model loads), load the segment reward model in
    ``model_dir`` (and its recorded SFT model), and serve it until SIGINT or SIGTERM."""
    listener = bind_listener(settings.host, settings.port)
    try:
        scorer = SegmentScorer(model_dir, sft_model=sft_model)
        server = RewardServer(scorer, settings, model_dir=model_dir, listener=listener)
    except BaseException:
        listener.close()
        raise
    auth = ", bearer token required" if settings.api_key else ""
    echo(f"serving {model_dir} (e_phi: {scorer.aggregation}, tau={scorer.tau:g}, cutoff={scorer.entropy_cutoff:g}) at "
         f"{server.url}: POST /get_reward, GET {HEALTH_PATH}{auth}")  # fmt: skip
    server.serve_forever()
    echo("stopped")
