"""``rlhf-ext serve rm``: a segment reward model's sequence evaluation e_phi over HTTP, in OpenRLHF's remote-reward
protocol.

A segment reward model scores a response by ``e_phi(x, y) = tau * logsumexp(r_seg / tau)`` over its segment rewards
(paper 003 Eq. 4; ``"sum"`` / ``"mean"`` for the ablations), the segments starting where the SFT model's entropy
exceeds the recorded cutoff -- not by the last-token output a plain reward-model server returns. This server computes
e_phi with :func:`rlhf_ext.runtime.token_scores.segment_evaluation` (the code the trainers use), so OpenRLHF PPO/GRPO
(``--reward.remote_url http://HOST:PORT/get_reward``) and TRL (``reward_funcs=[RemoteSegmentReward(url)]``, see
:mod:`rlhf_ext.trl.remote_reward`) can train against a segment reward model as a scalar reward.

Routes:

* ``POST /get_reward`` (also ``POST /``), one of two bodies:

  - OpenRLHF 0.11.2 (``SingleTurnAgentExecutor._fetch_rewards_via_http``): ``{"query": [str], "prompts": [str],
    "labels": [any]}``, ``query[i]`` = the decoded prompt + response; the response is what follows ``prompts[i]``.
    ``labels`` is optional and ignored.
  - direct: ``{"prompts": [str | messages], "responses": [str | messages]}``; chat messages (``[{"role", "content"}]``,
    as TRL passes conversational prompts and completions) are rendered with the reward model's chat template.

  Answer (the shape of OpenRLHF's own ``openrlhf.cli.serve_rm``): ``{"rewards": [e_phi], "scores": [e_phi],
  "extra_logs": {"segments": [number of segments]}}``, one entry per pair, in request order.
* ``GET /health``: ``{"status": "ok", "model": RM_DIR, "sft_model": ..., "aggregation", "tau", "entropy_cutoff",
  "max_batch_size", "max_request_pairs"}``.

A malformed request gets a 4xx status and ``{"error": "<one line>"}`` (400: not JSON, missing key, wrong type,
mismatched lengths; 413: more pairs than ``max_request_pairs`` or a body over ``max_body_bytes``; 422: a query that
does not start with its prompt; 404: an unknown route); bodies come with a ``Content-Length`` or chunked. Scoring:
pairs of the requests that arrive within ``max_wait_ms`` of each other are scored together, up to ``max_batch_size``
pairs per batch: one right-padded forward of the SFT model (entropies) and one of the reward model (per-token scores)
per batch. ``workers`` request threads at most run at once; further connections wait for one (up to
``max_pending`` accepted connections, beyond which the server answers 503 at once; OpenRLHF's client retries).
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import torch

from rlhf_ext.runtime.segment_data import DatasetFormatError, pad_sequences
from rlhf_ext.runtime.token_scores import SegmentScorer

logger = logging.getLogger(__name__)

#: The POST paths that score: OpenRLHF's reference server serves ``/get_reward``.
REWARD_PATHS = ("/get_reward", "/")
HEALTH_PATH = "/health"
#: The most bytes of a too-large body read (and dropped) before answering 413; the rest of a larger one is not read.
DISCARD_LIMIT = 256 * 1024 * 1024
#: How long a connection refused with 503 is given to close before the server closes it.
REFUSE_LINGER_S = 2.0

#: A chat message ``{"role": ..., "content": ...}``; a prompt or response is text or a list of them.
Message = dict[str, Any]


@dataclass(frozen=True)
class ServeSettings:
    """How the server listens, batches and bounds its work.

    Args:
        host, port: where to listen (``port=0``: a free port, see :attr:`RewardServer.url`).
        max_batch_size: pairs scored in one forward pass of each model.
        max_wait_ms: how long the first pair of a batch waits for more pairs to arrive.
        max_request_pairs: pairs one request may carry (413 above it).
        max_body_bytes: size of one request body (413 above it).
        workers: request threads (parsing, tokenising, waiting for the batch); connections beyond them queue.
        max_pending: accepted connections, running or queued, beyond which a new one is answered 503 at once.
        max_length: tokens per prompt + response (prompts cut from the left, responses from the right, as in
            training); default: the reward model's ``max_position_embeddings``.
        request_timeout_s: how long a request waits for its scores before a 503.
    """

    host: str = "127.0.0.1"
    port: int = 5000
    max_batch_size: int = 32
    max_wait_ms: float = 5.0
    max_request_pairs: int = 256
    max_body_bytes: int = 16 * 1024 * 1024
    workers: int = 16
    max_pending: int = 1024
    max_length: int | None = None
    request_timeout_s: float = 600.0


class RequestError(Exception):
    """A request the server refuses: the HTTP status and a one-line message for ``{"error": ...}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


# ------------------------------------------------------------------------------------------------------- requests
def _expect_list(body: dict[str, Any], key: str) -> list:
    if key not in body:
        raise RequestError(400, f"missing key '{key}'")
    value = body[key]
    if not isinstance(value, list):
        raise RequestError(400, f"'{key}' must be a list, got {type(value).__name__}")
    return value


def _check_items(values: list, key: str, allow_messages: bool) -> None:
    """Each item of ``body[key]`` is text (or, when ``allow_messages``, a list of chat messages)."""
    for i, item in enumerate(values):
        if isinstance(item, str):
            continue
        if allow_messages and isinstance(item, list) and item:
            bad = [m for m in item if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m)]
            if not bad:
                continue
        expected = "text or a non-empty list of {'role', 'content'} messages" if allow_messages else "text"
        raise RequestError(400, f"'{key}[{i}]' must be {expected}, got {type(item).__name__}")


def _check_lengths(body: dict[str, Any], keys: Sequence[str]) -> int:
    lengths = {k: len(body[k]) for k in keys if isinstance(body.get(k), list)}
    (first, n), *rest = lengths.items()
    for key, other in rest:
        if other != n:
            raise RequestError(400, f"'{key}' has {other} items but '{first}' has {n}: one per pair")
    return n


def parse_reward_request(raw: bytes, max_request_pairs: int) -> tuple[list, list, bool]:
    """``(prompts, texts, texts_are_queries)`` of a request body: ``texts`` are the responses, or OpenRLHF's queries
    (prompt + response) when ``texts_are_queries``.

    Raises:
        RequestError: 400 (empty, not JSON, not an object, missing key, wrong type, mismatched lengths) or 413 (more
            than ``max_request_pairs`` pairs).
    """
    if not raw.strip():
        raise RequestError(400, 'empty request body: send {"query": [...], "prompts": [...]} as JSON')
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(400, f"request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(body).__name__}")
    if "query" in body:  # OpenRLHF
        queries, prompts = _expect_list(body, "query"), _expect_list(body, "prompts")
        labels = body.get("labels")
        if labels is not None and not isinstance(labels, list):
            raise RequestError(400, f"'labels' must be a list, got {type(labels).__name__}")
        n = _check_lengths(body, ("query", "prompts", "labels"))
        _check_items(queries, "query", allow_messages=False)
        _check_items(prompts, "prompts", allow_messages=False)
    elif "responses" in body:  # direct (TRL)
        prompts, responses = _expect_list(body, "prompts"), _expect_list(body, "responses")
        n = _check_lengths(body, ("responses", "prompts"))
        _check_items(prompts, "prompts", allow_messages=True)
        _check_items(responses, "responses", allow_messages=True)
        queries = None
    else:
        raise RequestError(
            400, 'missing key \'query\': send OpenRLHF\'s {"query", "prompts"} or {"prompts", "responses"}'
        )
    if n > max_request_pairs:
        raise RequestError(413, f"{n} pairs exceed this server's limit of {max_request_pairs} per request; split them")
    if queries is None:
        return prompts, responses, False
    return prompts, queries, True


def response_after_prompt(query: str, prompt: str, tokenizer, index: int) -> str:
    """The response part of an OpenRLHF query (``decode(prompt_ids + response_ids)``): the text after ``prompt``, or
    after the tokenizer's round trip of ``prompt`` when decoding does not reproduce it exactly."""
    if query.startswith(prompt):
        return query[len(prompt) :]
    rendered = tokenizer.decode(tokenizer(prompt, add_special_tokens=False)["input_ids"], skip_special_tokens=False)
    if query.startswith(rendered):
        return query[len(rendered) :]
    raise RequestError(
        422, f"query[{index}] does not start with prompts[{index}], so its response cannot be located (OpenRLHF sends "
        "the decoded prompt + response as the query)"
    )  # fmt: skip


# -------------------------------------------------------------------------------------------------------- scoring
@dataclass
class EncodedPair:
    """One tokenised pair: ``ids`` = prompt + response tokens, the response starting at ``prompt_len``."""

    ids: list[int]
    prompt_len: int


class SegmentEvaluator:
    """e_phi of tokenised pairs in padded batches, with a loaded :class:`SegmentScorer` (reward model, SFT model,
    recorded cutoff / aggregation / tau)."""

    def __init__(self, scorer: SegmentScorer, max_length: int | None = None):
        self.scorer = scorer
        self.tokenizer = scorer.tokenizer
        self.max_length = max_length or getattr(scorer.reward_model.config, "max_position_embeddings", None)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def encode(self, prompt: str | list[Message], response: str | list[Message]) -> EncodedPair:
        """Tokenise a pair as the reward model's training data was (:meth:`SegmentScorer.encode`: prompt and response
        separately, EOS appended, cut to ``max_length``)."""
        row = self.scorer.encode(prompt or None, response, self.max_length)
        return EncodedPair(row["chosen_ids"], row["prompt_len"])

    def response_of_query(self, query: str, prompt: str, index: int) -> str:
        """:func:`response_after_prompt` with this model's tokenizer."""
        with self.scorer.tokenizer_lock:
            return response_after_prompt(query, prompt, self.tokenizer, index)

    @torch.no_grad()
    def evaluate(self, pairs: Sequence[EncodedPair]) -> tuple[list[float], list[int]]:
        """e_phi (paper 003 Eq. 4) and the number of segments of each pair, from one forward of each model.

        The batch is right-padded to ``[B, T]``: ``input_ids``, ``attention_mask`` and the response mask (true from
        ``prompt_len`` to the end of each sequence).
        """
        device = next(self.scorer.reward_model.parameters()).device
        ids = pad_sequences([p.ids for p in pairs], self.pad_id, "right", torch.long).to(device)
        lengths = torch.tensor([len(p.ids) for p in pairs], device=device)
        starts = torch.tensor([p.prompt_len for p in pairs], device=device)
        positions = torch.arange(ids.shape[1], device=device)
        attention_mask = (positions < lengths[:, None]).long()
        response_mask = (positions >= starts[:, None]) & attention_mask.bool()
        evaluation = self.scorer.evaluate(ids, attention_mask, response_mask)
        return evaluation.values.float().tolist(), evaluation.segments.counts.tolist()


@dataclass
class _Job:
    """The pairs of one request, filled in by the batcher; ``done`` is set when all are scored (or one failed)."""

    size: int
    values: list[float] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    remaining: int = 0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.values = [0.0] * self.size
        self.segments = [0] * self.size
        self.remaining = self.size


class MicroBatcher:
    """Groups the pairs of concurrent requests into batches for one scoring thread.

    The first pair waits up to ``max_wait_ms`` for others (from any request) until ``max_batch_size`` pairs are
    collected; the batch is scored by ``score_batch`` (pairs -> (values, segment counts)) and each value is written to
    its own request's slot. A failing batch fails every request with a pair in it.
    """

    def __init__(
        self,
        score_batch: Callable[[Sequence[EncodedPair]], tuple[list[float], list[int]]],
        max_batch_size: int,
        max_wait_ms: float,
    ):
        self.score_batch = score_batch
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self._queue: queue.Queue[tuple[_Job, int, EncodedPair] | None] = queue.Queue()
        self.batches = 0
        self.pairs = 0
        self._thread = threading.Thread(target=self._run, name="rm-batcher", daemon=True)
        self._thread.start()

    def submit(self, pairs: Sequence[EncodedPair]) -> _Job:
        job = _Job(len(pairs))
        if not pairs:
            job.done.set()
        for index, pair in enumerate(pairs):
            self._queue.put((job, index, pair))
        return job

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _collect(self) -> list[tuple[_Job, int, EncodedPair]] | None:
        first = self._queue.get()
        if first is None:
            return None
        batch = [first]
        deadline = time.monotonic() + self.max_wait_s
        while len(batch) < self.max_batch_size:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)  # finish this batch, then stop
                break
            batch.append(item)
        return batch

    def _run(self) -> None:
        while (batch := self._collect()) is not None:
            try:
                values, segments = self.score_batch([pair for _, _, pair in batch])
            except Exception as error:  # the requests answer 500 with it; the server goes on
                logger.exception("scoring a batch of %d pairs failed", len(batch))
                for job, _, _ in batch:
                    job.error = error
                    job.done.set()
                continue
            self.batches += 1
            self.pairs += len(batch)
            for (job, index, _), value, count in zip(batch, values, segments):  # only this thread writes jobs
                job.values[index], job.segments[index] = value, count
                job.remaining -= 1
                if job.remaining == 0:
                    job.done.set()


# ----------------------------------------------------------------------------------------------------------- HTTP
class _PooledHTTPServer(HTTPServer):
    """An HTTP server whose requests run on a fixed pool of ``workers`` threads (bounded concurrency); accepted
    connections wait for a thread, and beyond ``max_pending`` of them a new one is answered 503 at once."""

    request_queue_size = 1024  # the listen backlog: a burst of connections waits instead of being refused

    def __init__(self, address: tuple[str, int], handler, workers: int, max_pending: int):
        super().__init__(address, handler)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rm-http")
        self._max_pending = max_pending
        self._pending = 0
        self._pending_lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Connections accepted and not finished (running or waiting for a thread)."""
        return self._pending

    def process_request(self, request, client_address) -> None:
        with self._pending_lock:
            busy = self._pending >= self._max_pending
            if not busy:
                self._pending += 1
        if busy:  # answered on a short-lived thread: the accept loop goes on at once
            threading.Thread(target=self._refuse, args=(request,), name="rm-refuse", daemon=True).start()
            return
        self._pool.submit(self._handle, request, client_address)

    def _handle(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            with self._pending_lock:
                self._pending -= 1

    def handle_error(self, request, client_address) -> None:
        """A client that went away before its answer was written is no error of the server's (debug log); anything
        else is logged with its traceback (socketserver would print it on stderr)."""
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError | TimeoutError):
            logger.debug("%s: connection lost: %s", client_address, error)
        else:
            logger.exception("request from %s failed", client_address)

    def _refuse(self, request: socket.socket) -> None:
        """Answer 503 without reading the request, then wait (briefly) for the client to close: closing a socket
        with its request unread would reset the connection and could lose the answer."""
        body = json.dumps({"error": f"server busy: {self._max_pending} requests running or queued; retry later"})
        head = f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
        with contextlib.suppress(OSError):  # the client may be gone already
            request.sendall(f"{head}\r\nConnection: close\r\n\r\n{body}".encode())
            request.shutdown(socket.SHUT_WR)
            request.settimeout(REFUSE_LINGER_S)
            while request.recv(1 << 16):
                pass
        request.close()

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=True)


class _RewardHandler(BaseHTTPRequestHandler):
    server_version = "rlhf-ext-rm"
    timeout = 60.0  # seconds a client may take to send its request (a stalled one does not hold a thread forever)
    server: _PooledHTTPServer
    app: RewardServer  # set on the subclass made by RewardServer

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        logger.debug("%s %s", self.address_string(), format % args)

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_error(self, error: RequestError) -> None:
        self.close_connection = True
        self._send_json(error.status, {"error": " ".join(error.message.split())})

    def do_GET(self) -> None:
        if self.path.split("?")[0] == HEALTH_PATH:
            self._send_json(200, self.app.health())
        else:
            self._send_error(RequestError(404, f"no route GET {self.path}; GET {HEALTH_PATH} or POST /get_reward"))

    def do_POST(self) -> None:
        try:
            body = self._read_body()  # first, so that even a refused request's body is consumed
            if self.path.split("?")[0] not in REWARD_PATHS:
                raise RequestError(404, f"no route POST {self.path}; POST /get_reward or GET {HEALTH_PATH}")
            self._send_json(200, self.app.handle(body))
        except RequestError as e:
            self._send_error(e)
        except Exception as e:  # a scoring failure: the request fails, the server goes on
            self._send_error(RequestError(500, f"scoring failed: {type(e).__name__}: {e}"))

    def _read_body(self) -> bytes:
        """The request body (``Content-Length`` or chunked); a body over the limit is read to its end, dropped (up
        to :data:`DISCARD_LIMIT` bytes, so that the client reads the answer, not a reset connection) and refused."""
        limit = self.app.settings.max_body_bytes
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            body, size = self._read_chunks(limit)
        else:
            length_header = self.headers.get("Content-Length", "0")
            try:
                size = int(length_header)
            except ValueError:
                raise RequestError(400, f"Content-Length is not a number: {length_header!r}") from None
            body = self.rfile.read(size) if 0 < size <= limit else b""
            if size > limit:
                self._discard(size)
        if size > limit:
            raise RequestError(
                413, f"request body of {size} bytes exceeds this server's limit of {limit} bytes; split the batch"
            )
        return body

    def _read_chunks(self, limit: int) -> tuple[bytes, int]:
        """A chunked body (kept while within ``limit`` bytes) and its size."""
        parts, size = [], 0
        while True:
            line = self.rfile.readline(1024)
            try:
                chunk_size = int(line.split(b";")[0].strip(), 16)
            except ValueError:
                raise RequestError(400, f"malformed chunk size line in a chunked body: {line[:40]!r}") from None
            if chunk_size == 0:
                while self.rfile.readline(1024).strip():  # trailer fields up to the empty line
                    pass
                return b"".join(parts), size
            size += chunk_size
            if size <= limit:
                parts.append(self.rfile.read(chunk_size))
            else:
                parts.clear()
                if size > DISCARD_LIMIT:
                    self.close_connection = True
                    return b"", size
                self._discard(chunk_size)
            self.rfile.readline(1024)  # the CRLF after the chunk

    def _discard(self, length: int) -> None:
        """Read and drop up to ``length`` bytes (at most :data:`DISCARD_LIMIT`)."""
        left = min(length, DISCARD_LIMIT)
        while left > 0 and (chunk := self.rfile.read(min(left, 1 << 16))):
            left -= len(chunk)


class RewardServer:
    """The HTTP server of a segment reward model: see the module docstring.

    Use as a context manager (serves on a background thread) or call :meth:`serve_forever`::

        with RewardServer(SegmentScorer(rm_dir), ServeSettings(port=0)) as server:
            print(server.url)  # http://127.0.0.1:PORT
    """

    def __init__(self, scorer: SegmentScorer, settings: ServeSettings | None = None, model_dir: str | None = None):
        self.settings = settings or ServeSettings()
        self.scorer = scorer
        self.model_dir = model_dir or str(getattr(scorer.reward_model.config, "_name_or_path", ""))
        self.evaluator = SegmentEvaluator(scorer, self.settings.max_length)
        self.batcher = MicroBatcher(self.evaluator.evaluate, self.settings.max_batch_size, self.settings.max_wait_ms)
        handler = type("RewardHandler", (_RewardHandler,), {"app": self})
        self.httpd = _PooledHTTPServer((self.settings.host, self.settings.port), handler,
                                       self.settings.workers, self.settings.max_pending)  # fmt: skip
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def health(self) -> dict[str, Any]:
        sft = getattr(self.scorer.sft_model.config, "_name_or_path", None)
        return {
            "status": "ok",
            "model": self.model_dir,
            "sft_model": sft,
            "aggregation": self.scorer.aggregation,
            "tau": self.scorer.tau,
            "entropy_cutoff": self.scorer.cutoff,
            "max_batch_size": self.settings.max_batch_size,
            "max_request_pairs": self.settings.max_request_pairs,
        }

    def handle(self, raw: bytes) -> dict[str, Any]:
        """Score one request body; returns the response object (raises :class:`RequestError`)."""
        prompts, texts, texts_are_queries = parse_reward_request(raw, self.settings.max_request_pairs)
        if texts_are_queries:
            texts = [self.evaluator.response_of_query(q, p, i) for i, (p, q) in enumerate(zip(prompts, texts))]
        encoded = []
        for i, (prompt, response) in enumerate(zip(prompts, texts)):
            try:
                encoded.append(self.evaluator.encode(prompt, response))
            except DatasetFormatError as e:
                raise RequestError(400, f"pair {i}: {e}") from None
        job = self.batcher.submit(encoded)
        if not job.done.wait(self.settings.request_timeout_s):
            raise RequestError(503, f"no score within {self.settings.request_timeout_s:g} s; the server is overloaded")
        if job.error is not None:
            raise job.error
        return {"rewards": job.values, "scores": job.values, "extra_logs": {"segments": job.segments}}

    def start(self) -> RewardServer:
        """Serve on a background thread."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="rm-accept", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        try:
            self.httpd.serve_forever()
        finally:
            self.close()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()
        self.batcher.close()

    @property
    def pending(self) -> int:
        """Requests accepted and not yet answered (running, or waiting for one of the ``workers`` threads)."""
        return self.httpd.pending

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def serve_reward_model(
    model_dir: str, settings: ServeSettings, sft_model: str | None = None, echo: Callable[[str], None] = print
) -> None:
    """Load the segment reward model in ``model_dir`` (and its recorded SFT model) and serve it until interrupted."""
    scorer = SegmentScorer(model_dir, sft_model=sft_model)
    server = RewardServer(scorer, settings, model_dir=model_dir)
    echo(f"serving {model_dir} (e_phi: {scorer.aggregation}, tau={scorer.tau:g}, cutoff={scorer.cutoff:g}) at "
         f"{server.url}: POST /get_reward, GET {HEALTH_PATH}")  # fmt: skip
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        echo("stopped")
