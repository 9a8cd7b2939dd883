"""``rlhf-ext serve rm`` under hostile or unlucky clients (issue 23, items 3-8): malformed chunking, slow clients,
bad flags, a stopped scoring thread, shutdown signals, unparseable text, bind failures, authentication."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlhf_ext.runtime.dense_sources import EncodedResponse
from rlhf_ext.serve.batching import MicroBatcher, ScorerStopped
from rlhf_ext.serve.server import RewardServer
from rlhf_ext.serve.settings import ServeError, ServeSettings, SettingError, bind_listener
from tests.helpers.reward_client import (
    TOLERANCE,
    Trickler,
    distinct_pairs,
    in_process,
    post,
    read_answer,
    request_head,
    reward_body,
)

PAIR = ("Question: Owls?\nAnswer:", " Owls hunt at night.")


@pytest.fixture()
def running(scorer, request):
    """A server on a free port; ``ServeSettings`` overrides from ``@pytest.mark.parametrize('running', [{...}],
    indirect=True)``."""
    settings = ServeSettings(port=0, **getattr(request, "param", {}))
    with RewardServer(scorer, settings) as server:
        yield server


def score_once(server: RewardServer, scorer, timeout: float = 30, headers: dict | None = None) -> None:
    status, answer = post(f"{server.url}/get_reward", reward_body([PAIR]), headers=headers, timeout=timeout)
    assert status == 200, answer
    assert answer["rewards"] == pytest.approx(in_process(scorer, [PAIR]), abs=TOLERANCE)


def wait_until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


# ----------------------------------------------------------------------------------------- 3: malformed chunking
@pytest.mark.parametrize("size_line", [b"-1", b"+10", b"0x10", b"zz", b"-ffffffff"])
def test_malformed_chunk_size_is_refused_before_any_body_is_read(running, size_line):
    """The old server read a ``-1`` chunk to the end of the stream (300 MB sent: +300 MB of memory): now the request
    is refused at the chunk-size line, while the client still holds its connection open."""
    with socket.create_connection(running.address) as sock:
        sock.sendall(request_head(running.address, chunked=True) + size_line + b"\r\n")
        assert read_answer(sock, timeout=20) == (400, {"error": (
            "malformed HTTP request (request line, header, Content-Length or chunked body); send HTTP/1.1 with a "
            "valid Content-Length or chunked encoding")})  # fmt: skip
    score_once(running, running.scorer)


@pytest.mark.parametrize("running", [{"max_body_bytes": 2000}], indirect=True)
def test_chunked_body_over_the_limit_is_not_kept(running):
    """Many chunks, each within the limit: the 413 counts all of them, and the server keeps none beyond the limit."""
    chunks = b"".join(b"3e8\r\n" + b"x" * 1000 + b"\r\n" for _ in range(50)) + b"0\r\n\r\n"  # 50 x 1000 bytes
    refusal = "request body of 50000 bytes exceeds this server's limit of 2000 bytes; split the batch"
    with socket.create_connection(running.address) as sock:
        sock.sendall(request_head(running.address, chunked=True) + chunks)
        assert read_answer(sock, timeout=20) == (413, {"error": refusal})


# --------------------------------------------------------------------------------------------------- 4: slowloris
@pytest.mark.parametrize("phase", ["head", "body"])
def test_slow_clients_block_neither_health_nor_scoring(running, scorer, phase):
    """16 clients sending one byte every 0.5 s (the old server's 16 request threads, all held): /health and a scoring
    request are answered while they trickle."""
    body = reward_body([PAIR])
    data = request_head(running.address, len(body)) + body
    start = 0 if phase == "head" else len(data) - len(body)
    slow = [Trickler(running.address, data, interval=0.5, start=start) for _ in range(16)]
    try:
        for client in slow:
            client.start()
        wait_until(lambda: all(c.sent > start for c in slow))
        status, health = post(f"{running.url}/health", b"", method="GET", timeout=10)
        assert status == 200 and health["status"] == "ok"
        score_once(running, scorer, timeout=10)
        assert all(c.closed_after is None for c in slow)  # still trickling: the answers did not wait for them
    finally:
        for client in slow:
            client.stop()


@pytest.mark.parametrize("running", [{"read_timeout_s": 1.0}], indirect=True)
@pytest.mark.parametrize("phase", ["head", "body"])
def test_a_request_trickling_in_is_cut_at_the_read_deadline(running, phase):
    """One byte every 0.1 s never trips a per-read timeout; the deadline is per request head and per body."""
    body = reward_body([PAIR]) + b" " * 400  # 400 spaces: valid JSON, 40 s at this pace
    data = request_head(running.address, len(body)) + body
    start = 0 if phase == "head" else len(data) - len(body)
    client = Trickler(running.address, data, interval=0.1, start=start)
    client.start()
    client.join(30)
    try:
        assert client.closed_after is not None and client.sent < len(data)
        assert 0.9 <= client.closed_after < 10  # at the deadline (timers may fire a clock tick early), not at the end
        head, _, payload = client.answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), client.answer
        assert json.loads(payload) == {"error": f"request {phase} not received within 1 s; send it at once"}
    finally:
        client.stop()
    wait_until(lambda: running.pending == 0)


def test_health_is_answered_under_500_open_connections(running, scorer):
    """500 clients that opened a request and stalled: /health and scoring are still answered (the old server took
    19 s for /health under 500 connections)."""
    stalled = [socket.create_connection(running.address) for _ in range(500)]
    try:
        for sock in stalled:
            sock.sendall(b"POST /get_reward HTTP/1.1\r\n")
        wait_until(lambda: running.pending >= 500)
        status, health = post(f"{running.url}/health", b"", method="GET", timeout=10)
        assert status == 200 and health["status"] == "ok"
        score_once(running, scorer, timeout=10)
    finally:
        for sock in stalled:
            sock.close()


# ------------------------------------------------------------------------------- 5: bad flags, a stopped batcher
BAD_FLAGS = [
    (["--max-wait-ms", "inf"], "--max-wait-ms must be a finite number >= 0, got inf"),
    (["--max-wait-ms", "nan"], "--max-wait-ms must be a finite number >= 0, got nan"),
    (["--max-wait-ms", "-1"], "--max-wait-ms must be a finite number >= 0, got -1.0"),
    (["--max-batch-size", "0"], "--max-batch-size must be an integer >= 1, got 0"),
    (["--max-request-pairs", "-1"], "--max-request-pairs must be an integer >= 1, got -1"),
    (["--workers", "0"], "--workers must be an integer from 1 to 256, got 0"),
    (["--max-length", "1"], "--max-length must be an integer >= 2, got 1"),
    (["--port", "70000"], "--port must be an integer from 0 (any free port) to 65535, got 70000"),
    (["--api-key", " "], "--api-key must be non-empty printable text, got (hidden)"),
    (["--host", "0.0.0.0"], "--host is '0.0.0.0', reachable from other machines: give an api_key (--api-key or "
     "RLHF_EXT_API_KEY) so that only clients holding it are served, or pass --insecure to serve anyone"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), BAD_FLAGS)
def test_cli_refuses_bad_flags_in_one_line(rm_dir, flags, message, monkeypatch):
    from rlhf_ext.cli import main

    monkeypatch.delenv("RLHF_EXT_API_KEY", raising=False)
    result = CliRunner().invoke(main, ["serve", "rm", "--model", rm_dir, "--port", "0", *flags])
    assert (result.exit_code, result.stderr) == (2, f"error: {message}\n")


def test_settings_refuse_what_the_cli_refuses():
    with pytest.raises(SettingError) as refused:
        ServeSettings(max_wait_ms=float("inf"))
    assert (refused.value.field, refused.value.rule) == ("max_wait_ms", "must be a finite number >= 0, got inf")
    assert ServeSettings(host="0.0.0.0", insecure=True).host == "0.0.0.0"
    assert ServeSettings(host="0.0.0.0", api_key="k").api_key == "k"
    assert ServeSettings(host="localhost").host == "localhost"


class _Fatal(BaseException):
    """Ends the scoring thread (as an ``OverflowError`` from ``queue.get(timeout=inf)`` ended the old one)."""


def test_a_stopped_scoring_thread_shows_in_health_and_fails_requests_at_once(running, monkeypatch):
    def fatal(pairs):
        raise _Fatal("injected")

    monkeypatch.setattr(running.batcher, "score_batch", fatal)
    stopped = "the scoring thread stopped: _Fatal: injected; restart the server"
    assert post(f"{running.url}/get_reward", reward_body([PAIR]), timeout=10) == (503, {"error": stopped})
    status, health = post(f"{running.url}/health", b"", method="GET", timeout=10)
    assert (status, health["status"], health["scorer"]) == (503, "unavailable", stopped)
    started = time.monotonic()
    assert post(f"{running.url}/get_reward", reward_body([PAIR]), timeout=10) == (503, {"error": stopped})
    assert time.monotonic() - started < 5  # at once, not after request_timeout_s


def test_batcher_fails_queued_and_later_jobs_when_its_thread_ends():
    release = threading.Event()

    def score(pairs):
        release.wait(10)
        raise _Fatal("gone")

    batcher = MicroBatcher(score, max_batch_size=1)
    running_job = batcher.submit([EncodedResponse([1], 0)])
    queued = batcher.submit([EncodedResponse([2], 0), EncodedResponse([3], 0)])
    release.set()
    assert running_job.done.wait(10) and queued.done.wait(10)
    message = "the scoring thread stopped: _Fatal: gone; restart the server"
    assert [str(job.error) for job in (running_job, queued)] == [message, message]
    assert isinstance(queued.error, ScorerStopped) and not batcher.alive
    with pytest.raises(ScorerStopped, match="_Fatal: gone"):
        batcher.submit([EncodedResponse([4], 0)])
    batcher.close()


def test_a_lone_request_does_not_wait_for_company():
    """Default ``max_wait_ms=0``: the batch closes when nothing else is queued, so a lone pair is scored at once even
    when a fixed wait would be an hour."""

    def ones(pairs):
        return [1.0] * len(pairs), [1] * len(pairs)

    batcher = MicroBatcher(ones, max_batch_size=8)
    try:
        job = batcher.submit([EncodedResponse([1], 0)])
        assert job.done.wait(10) and job.values == [1.0]
    finally:
        batcher.close()
    waiting = MicroBatcher(ones, max_batch_size=8, max_wait_ms=3_600_000)
    job = waiting.submit([EncodedResponse([1], 0)])
    assert not job.done.wait(0.5)  # the explicit wait is honoured
    waiting.close()  # closing ends the wait: the batch is scored
    assert job.done.is_set() and job.values == [1.0]


# ------------------------------------------------------------------------------------------ 6: drain on signals
def start_cli(rm_dir: str, *flags: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """``rlhf-ext serve rm`` in a process; returns it and its URL once it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_ext.cli", "serve", "rm", "--model", rm_dir, "--port", "0",
                             *flags], stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    for line in proc.stderr:
        if line.startswith("serving "):
            return proc, re.search(r" at (http://[0-9.]+:[0-9]+): ", line).group(1)
    proc.kill()
    raise AssertionError(f"the server did not start: {proc.stderr.read()}")


def refuses_connections(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_drain_requests_in_flight_then_exit(rm_dir, scorer, sig):
    """A request whose body is half sent when the signal arrives is still read, scored and answered; then the
    process says "stopped" and exits 0."""
    proc, url = start_cli(rm_dir)
    try:
        address = url.removeprefix("http://").split(":")
        address = (address[0], int(address[1]))
        body = reward_body([PAIR])
        with socket.create_connection(address) as sock:
            sock.sendall(request_head(address, len(body)) + body[:10])
            wait_until(lambda: post(f"{url}/health", b"", method="GET")[1]["in_flight"] == 1)
            proc.send_signal(sig)
            wait_until(lambda: refuses_connections(address))  # shutting down: no new connection is accepted
            sock.sendall(body[10:])
            status, answer = read_answer(sock, timeout=30)
        assert status == 200 and answer["rewards"] == pytest.approx(in_process(scorer, [PAIR]), abs=TOLERANCE)
        assert proc.wait(30) == 0
        assert proc.stderr.read().strip().splitlines()[-1] == "stopped"
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------- 7: unparseable text, bind failures
UNPARSEABLE = [
    (b'{"query": ["Q: \\ud800"], "prompts": ["Q:"]}',
     "'query[0]' is not valid text: lone surrogate '\\ud800' at character 3; send UTF-8 text"),
    (b'{"prompts": ["Q:"], "responses": ["\\udfff A."]}',
     "'responses[0]' is not valid text: lone surrogate '\\udfff' at character 0; send UTF-8 text"),
    (b'{"prompts": [[{"role": "user", "content": "\\ud83d"}]], "responses": [" A."]}',
     "'prompts[0][0].content' is not valid text: lone surrogate '\\ud83d' at character 0; send UTF-8 text"),
    (b'{"prompts": [[{"role": "user", "content": 5}]], "responses": [" A."]}',
     "'prompts[0][0].content' must be text, got int"),
    (b"[" * 100_000 + b"]" * 100_000, "request body is nested too deeply to parse; send a flat JSON object"),
    (b'{"query": ' + b"[" * 100_000 + b"]" * 100_000 + b', "prompts": []}',
     "request body is nested too deeply to parse; send a flat JSON object"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "message"), UNPARSEABLE)
def test_unparseable_text_is_400_not_500(running, scorer, body, message):
    assert post(f"{running.url}/get_reward", body) == (400, {"error": message})
    score_once(running, scorer)


def test_port_in_use_is_one_line_from_the_cli_and_the_library(rm_dir, scorer):
    from rlhf_ext.cli import main

    threads = threading.active_count()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = CliRunner().invoke(main, ["serve", "rm", "--model", rm_dir, "--port", str(port)])
        with pytest.raises(ServeError) as refused:
            RewardServer(scorer, ServeSettings(port=port))
    message = f"127.0.0.1:{port} is in use: pick another --port (0: any free one) or stop the server holding it"
    assert (result.exit_code, result.stderr, str(refused.value)) == (2, f"error: {message}\n", message)
    assert threading.active_count() == threads  # nothing started before the refusal


def test_cli_without_the_serve_extra_names_it(rm_dir):
    result = subprocess.run([sys.executable, "-m", "tests.helpers.without_packages", "uvicorn", "--", "serve", "rm",
                             "--model", rm_dir, "--port", "0"], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert (result.returncode, result.stderr.splitlines()[-1]) == (
        2, "error: needs the optional package uvicorn: pip install 'rlhf-ext[serve]'"
    )  # fmt: skip


@pytest.mark.parametrize(("host", "port", "message"), [
    ("203.0.113.7", 0, "cannot listen on 203.0.113.7:0: 203.0.113.7 is not an address of this machine; give one of "
     "its addresses (127.0.0.1: this machine only, 0.0.0.0: all)"),
    ("no-such-host.invalid", 0, "cannot listen on host 'no-such-host.invalid': it resolves to no address; give an "
     "address or name of this machine"),
])  # fmt: skip
def test_every_bind_failure_is_one_line(host, port, message):
    with pytest.raises(ServeError) as refused:
        bind_listener(host, port)
    assert str(refused.value) == message


def test_cli_bind_failure_comes_before_the_model_loads(tmp_path):
    """A directory that is not a model and an unusable address: the address is refused first (nothing loads)."""
    from rlhf_ext.cli import main

    result = CliRunner().invoke(main, ["serve", "rm", "--model", str(tmp_path), "--host", "203.0.113.7",
                                       "--insecure"])  # fmt: skip
    assert result.exit_code == 2
    assert result.stderr.startswith("error: cannot listen on 203.0.113.7:5000: 203.0.113.7 is not an address")


# --------------------------------------------------------------------------------------------------- 8: API key
KEY = "s3cret-token"
REFUSED = (401, {"error": "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the server was "
                 "started with (--api-key or RLHF_EXT_API_KEY)"})  # fmt: skip


@pytest.mark.parametrize("running", [{"api_key": KEY}], indirect=True)
def test_api_key_is_required_for_scoring(running, scorer):
    url = f"{running.url}/get_reward"
    assert post(url, reward_body([PAIR])) == REFUSED
    assert post(url, reward_body([PAIR]), headers={"Authorization": "Bearer wrong"}) == REFUSED
    assert post(url, reward_body([PAIR]), headers={"Authorization": f"Basic {KEY}"}) == REFUSED  # not base64
    score_once(running, scorer, headers={"Authorization": f"Bearer {KEY}"})
    basic = base64.b64encode(f"rm:{KEY}".encode()).decode()
    score_once(running, scorer, headers={"Authorization": f"Basic {basic}"})
    status, health = post(f"{running.url}/health", b"", method="GET")  # health needs no key and shows no secret
    assert status == 200 and health["auth"] == "bearer" and KEY not in json.dumps(health)


@pytest.mark.parametrize("running", [{"api_key": KEY}], indirect=True)
def test_openrlhf_client_sends_the_key_from_the_url(running, scorer):
    """OpenRLHF's client cannot set headers; aiohttp sends the URL's ``user:password`` as basic auth."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    pairs = distinct_pairs(3, seed=4)
    executor = SingleTurnAgentExecutor(running.url.replace("http://", f"http://rm:{KEY}@") + "/get_reward")
    answers = asyncio.run(
        executor._fetch_rewards_via_http([p + r for p, r in pairs], [p for p, _ in pairs], [None] * len(pairs))
    )
    assert answers[0]["rewards"] == pytest.approx(in_process(scorer, pairs), abs=TOLERANCE)


@pytest.mark.parametrize("running", [{"api_key": KEY}], indirect=True)
def test_trl_reward_function_sends_the_key(running, scorer, monkeypatch):
    from rlhf_ext.trl.remote_reward import RemoteRewardError, RemoteSegmentReward

    pairs = distinct_pairs(2, seed=5)
    prompts, completions = [p for p, _ in pairs], [r for _, r in pairs]
    assert RemoteSegmentReward(running.url, api_key=KEY)(prompts, completions) == pytest.approx(
        in_process(scorer, pairs), abs=TOLERANCE
    )
    monkeypatch.setenv("RLHF_EXT_API_KEY", KEY)  # the server's variable is the client's default
    assert RemoteSegmentReward(running.url)(prompts, completions) == pytest.approx(
        in_process(scorer, pairs), abs=TOLERANCE
    )
    monkeypatch.delenv("RLHF_EXT_API_KEY")
    with pytest.raises(RemoteRewardError, match=r"refused the request \(401\)"):
        RemoteSegmentReward(running.url)(prompts, completions)


def test_cli_takes_the_key_from_the_environment_and_serves_all_interfaces(rm_dir, scorer):
    env = {**os.environ, "RLHF_EXT_API_KEY": KEY}
    proc, url = start_cli(rm_dir, "--host", "0.0.0.0", env=env)
    try:
        port = url.rsplit(":", 1)[1]
        assert post(f"http://127.0.0.1:{port}/get_reward", reward_body([PAIR])) == REFUSED
        status, answer = post(f"http://127.0.0.1:{port}/get_reward", reward_body([PAIR]),
                              headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
        assert status == 200 and answer["rewards"] == pytest.approx(in_process(scorer, [PAIR]), abs=TOLERANCE)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
