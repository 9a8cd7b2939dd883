"""``rlhf-ext serve rm``: the segment reward model's e_phi over HTTP, checked against the in-process e_phi of the same
pairs (:meth:`SegmentScorer.score`, batch of one, no padding) through OpenRLHF 0.11.2's own remote-reward client,
TRL's reward-function signature, a load of concurrent requests, and malformed requests."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from rlhf_ext.runtime.dense_sources import EncodedResponse
from rlhf_ext.serve.batching import MicroBatcher
from rlhf_ext.serve.protocol import RequestError, response_after_prompt
from rlhf_ext.serve.server import RewardServer
from rlhf_ext.serve.settings import ServeSettings
from tests.helpers.reward_client import TOLERANCE, distinct_pairs, in_process, post, post_json


@pytest.fixture(scope="module")
def server(scorer, rm_dir):
    with RewardServer(scorer, ServeSettings(port=0, max_request_pairs=64), model_dir=rm_dir) as running:
        yield running


# --------------------------------------------------------------------------------------------- OpenRLHF's client
def test_openrlhf_remote_client_gets_in_process_e_phi(server, scorer):
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    pairs = distinct_pairs(12, seed=1)
    executor = SingleTurnAgentExecutor(f"{server.url}/get_reward")
    answers = asyncio.run(
        executor._fetch_rewards_via_http([p + r for p, r in pairs], [p for p, _ in pairs], [None] * len(pairs))
    )
    expected = in_process(scorer, pairs)
    assert len(answers) == 1  # one endpoint: the whole batch in one request
    assert answers[0]["rewards"] == pytest.approx(expected, abs=TOLERANCE)
    assert answers[0]["scores"] == answers[0]["rewards"]
    assert answers[0]["extra_logs"]["segments"] == [len(scorer.score(p, r).segments) for p, r in pairs]


def test_openrlhf_single_turn_executor_rewards_its_generation(server, scorer):
    """The path of an OpenRLHF PPO rollout: generate, decode prompt + response into the query, ask the RM."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    from tests.helpers.fixed_rollout_engine import FixedRolloutEngine

    tokenizer = scorer.tokenizer
    prompt = "Question: What should I know about volcanoes?\nAnswer:"
    response = " Most readers wonder about this. The facts about volcanoes are well documented."
    engine = FixedRolloutEngine(tokenizer, tokenizer(response)["input_ids"] + [tokenizer.eos_token_id])
    executor = SingleTurnAgentExecutor(f"{server.url}/get_reward")
    params = SimpleNamespace(max_tokens=64, logprobs=None)
    output = asyncio.run(executor.execute(prompt, "label", params, 256, tokenizer, engine))
    expected = scorer.score(prompt, response + tokenizer.eos_token).evaluation
    assert output["reward"] == pytest.approx([expected], abs=TOLERANCE)
    assert output["scores"] == output["reward"]
    assert output["extra_logs"] == {"segments": [len(scorer.score(prompt, response + tokenizer.eos_token).segments)]}


class _NormalisingTokenizer:
    """Decodes its tokens (words) joined by one space: a prompt with two spaces does not survive the round trip."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[str]]:
        return {"input_ids": text.split()}

    def decode(self, ids: list[str], skip_special_tokens: bool = False) -> str:
        return " ".join(ids)


def test_openrlhf_query_is_split_after_the_prompt_or_its_decoded_form():
    tokenizer = _NormalisingTokenizer()
    assert response_after_prompt("Q:  why? A.", "Q:  why?", tokenizer, 0) == " A."  # the prompt as sent
    assert response_after_prompt("Q: why? A.", "Q:  why?", tokenizer, 0) == " A."  # as OpenRLHF decoded it
    with pytest.raises(RequestError) as refused:
        response_after_prompt("R: why? A.", "Q:  why?", tokenizer, 3)
    assert refused.value.status == 422 and refused.value.message.startswith("query[3] does not start with prompts[3]")


# ------------------------------------------------------------------------------------------------------------ TRL
def test_trl_reward_function_gives_in_process_e_phi(server, scorer):
    from trl.trainer.utils import get_callable_name, is_async_callable

    from rlhf_ext.trl.remote_reward import RemoteSegmentReward

    pairs = distinct_pairs(7, seed=2)
    reward = RemoteSegmentReward(server.url, batch_size=3)  # 3 requests: 3 + 3 + 1 pairs
    values = reward(prompts=[p for p, _ in pairs], completions=[r for _, r in pairs], trainer_state=None, topic=[0] * 7)
    assert values == pytest.approx(in_process(scorer, pairs), abs=TOLERANCE)
    assert get_callable_name(reward) == "segment_rm" and not is_async_callable(reward)


def test_spans_are_the_segments_over_the_response_text(server, scorer):
    """The dense answer: each response's segments (paper 003) as (char_start, char_end, reward) over its text, the
    same segments and rewards as the in-process scorer; in OpenRLHF's query form, over the response after the prompt
    (its decoded EOS included)."""
    from rlhf_ext.trl.remote_reward import RemoteSegmentReward

    pairs = distinct_pairs(5, seed=3)
    spans = RemoteSegmentReward(server.url, spans=True)(
        prompts=[p for p, _ in pairs], completions=[r for _, r in pairs]
    )
    eos = scorer.tokenizer.eos_token
    for (prompt, response), row in zip(pairs, spans):
        view = scorer.score(prompt, response)
        assert [response[a:b] for a, b, _ in row] == [text.removesuffix(eos) for text in view.segments]
        assert [r for _, _, r in row] == pytest.approx(view.rewards, abs=TOLERANCE)
    status, answer = post_json(f"{server.url}/get_reward", {"query": [p + r + eos for p, r in pairs],
                                                             "prompts": [p for p, _ in pairs]})  # fmt: skip
    assert status == 200
    for (prompt, response), row in zip(pairs, answer["spans"]):
        view = scorer.score(prompt, response + eos)
        assert [(response + eos)[a:b] for a, b, _ in row] == view.segments


def test_trl_reward_function_renders_conversations_with_the_rm_chat_template(server, scorer):
    from rlhf_ext.trl.remote_reward import RemoteSegmentReward

    prompts = [[{"role": "user", "content": "What should I know about owls?"}],
               [{"role": "user", "content": "What should I know about tides?"}]]  # fmt: skip
    completions = [[{"role": "assistant", "content": " Owls hunt at night. The facts about owls are settled."}],
                   [{"role": "assistant", "content": " Tides follow the moon."}]]  # fmt: skip
    values = RemoteSegmentReward(server.url)(prompts=prompts, completions=completions)
    expected = [scorer.score(p, c).evaluation for p, c in zip(prompts, completions)]
    assert values == pytest.approx(expected, abs=TOLERANCE)


def test_trl_reward_function_raises_the_servers_refusal(server):
    from rlhf_ext.trl.remote_reward import RemoteRewardError, RemoteSegmentReward

    reward = RemoteSegmentReward(server.url, batch_size=100)  # the test server takes 64 pairs per request
    with pytest.raises(RemoteRewardError) as refused:
        reward(prompts=["Q:"] * 65, completions=[" A."] * 65)
    assert str(refused.value) == (
        f"{server.url}/get_reward refused the request (413): "
        '{"error": "65 pairs exceed this server\'s limit of 64 per request; split them"}'
    )


# ---------------------------------------------------------------------------------------------------------- routes
def test_health_route(server, rm_dir, scorer):
    """Model names, not this machine's paths (the recorded SFT model is the builtin's directory)."""
    status, body = post(f"{server.url}/health", b"", method="GET")
    assert status == 200
    assert body == {
        "status": "ok",
        "scorer": "running",
        "model": Path(rm_dir).name,
        "sft_model": Path(scorer.sft_model.config._name_or_path).name,
        "aggregation": "softmax",
        "tau": 0.5,
        "entropy_cutoff": 2.0,
        "max_batch_size": 32,
        "max_request_pairs": 64,
        "in_flight": 0,
        "auth": "none",
    }
    assert "/" not in json.dumps({k: body[k] for k in ("model", "sft_model")})


MALFORMED = [
    (b"", 400, 'empty request body: send {"query": [...], "prompts": [...]} as JSON'),
    (b"{not json", 400, "request body is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 "
     "(char 1)"),
    (b"\x80{}", 400, "request body is not JSON: 'utf-8' codec can't decode byte 0x80 in position 0: invalid start "
     "byte"),
    (b"[1, 2]", 400, "request body must be a JSON object, got list"),
    (b'{"prompts": ["Q:"]}', 400,
     "missing key 'query': send OpenRLHF's {\"query\", \"prompts\"} or {\"prompts\", \"responses\"}"),
    (b'{"query": ["Q: A."]}', 400, "missing key 'prompts'"),
    (b'{"query": "Q: A.", "prompts": ["Q:"]}', 400, "'query' must be a list, got str"),
    (b'{"query": ["Q: A.", "Q: B."], "prompts": ["Q:"]}', 400, "'prompts' has 1 items but 'query' has 2: one per pair"),
    (b'{"query": ["Q: A."], "prompts": ["Q:"], "labels": [1, 2]}', 400,
     "'labels' has 2 items but 'query' has 1: one per pair"),
    (b'{"query": ["Q: A."], "prompts": ["Q:"], "labels": "x"}', 400, "'labels' must be a list, got str"),
    (b'{"query": [3], "prompts": ["Q:"]}', 400, "'query[0]' must be text, got int"),
    (b'{"prompts": ["Q:"], "responses": [{"role": "assistant"}]}', 400,
     "'responses[0]' must be text or a non-empty list of {'role', 'content'} messages, got dict"),
    (b'{"prompts": ["Q:", "R:"], "responses": [" A."]}', 400, "'prompts' has 2 items but 'responses' has 1: one per "
     "pair"),
    (b'{"query": ["Other: A."], "prompts": ["Q:"]}', 422, "query[0] does not start with prompts[0], so its response "
     "cannot be located (OpenRLHF sends the decoded prompt + response as the query)"),
    (json.dumps({"query": ["Q: A."] * 65, "prompts": ["Q:"] * 65}).encode(), 413,
     "65 pairs exceed this server's limit of 64 per request; split them"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "message"), MALFORMED)
def test_malformed_request_gets_status_and_one_line_message(server, body, status, message):
    assert post(f"{server.url}/get_reward", body) == (status, {"error": message})


def test_unknown_routes_are_404(server):
    assert post(f"{server.url}/reward", b"{}") == (
        404, {"error": "no route POST /reward; POST /get_reward or GET /health"}
    )  # fmt: skip
    assert post(f"{server.url}/status", b"", method="GET") == (
        404, {"error": "no route GET /status; GET /health or POST /get_reward"}
    )  # fmt: skip


@pytest.mark.parametrize("method", ["TRACE", "PROPFIND"])
def test_any_other_method_is_404_with_one_line(server, method):
    """Every refusal is ``{"error": ...}``, for a method no route takes too (FastAPI answered 405 ``{"detail"}``)."""
    assert post(f"{server.url}/x", b"", method=method) == (
        404, {"error": f"no route {method} /x; GET /health or POST /get_reward"}
    )  # fmt: skip


def test_server_still_scores_after_malformed_requests(server, scorer):
    pair = ("Question: Owls?\nAnswer:", " Owls hunt at night.")
    for body, _, _ in MALFORMED:
        post(f"{server.url}/get_reward", body)
    status, answer = post(
        f"{server.url}/get_reward", json.dumps({"prompts": [pair[0]], "responses": [pair[1]]}).encode()
    )
    assert status == 200 and answer["rewards"] == pytest.approx(in_process(scorer, [pair]), abs=TOLERANCE)


@pytest.fixture()
def small_server(scorer):
    """One request thread, one pending connection at most, 2000-byte bodies."""
    settings = ServeSettings(port=0, workers=1, max_pending=1, max_body_bytes=2000)
    with RewardServer(scorer, settings) as running:
        yield running


def wait_for_pending(server: RewardServer, count: int) -> None:
    """Wait until ``count`` connections are accepted and unfinished (a thread finishes just after its answer)."""
    deadline = time.monotonic() + 30
    while server.pending != count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.pending == count


def post_chunked(server: RewardServer, chunks: list[bytes]) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(*server.address, timeout=60)
    try:
        connection.request("POST", "/get_reward", body=iter(chunks), headers={"Content-Type": "application/json"},
                           encode_chunked=True)  # fmt: skip
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_body_over_the_limit_is_413_with_a_length_or_chunked(small_server):
    payload = {"prompts": ["Q:"] * 200, "responses": [" A."] * 200}
    body = json.dumps(payload).encode()
    refusal = {"error": f"request body of {len(body)} bytes exceeds this server's limit of 2000 bytes; split the batch"}
    assert post_json(f"{small_server.url}/get_reward", payload) == (413, refusal)
    wait_for_pending(small_server, 0)
    assert post_chunked(small_server, [body[:1000], body[1000:]]) == (413, refusal)


def test_chunked_body_is_scored(small_server, scorer):
    pair = ("Question: Owls?\nAnswer:", " Owls hunt at night.")
    body = json.dumps({"prompts": [pair[0]], "responses": [pair[1]]}).encode()
    status, answer = post_chunked(small_server, [body[:10], body[10:]])
    assert status == 200 and answer["rewards"] == pytest.approx(in_process(scorer, [pair]), abs=TOLERANCE)


def test_connections_beyond_max_pending_get_503_and_the_server_recovers(small_server):
    wait_for_pending(small_server, 0)
    stalled = socket.create_connection(small_server.address)
    try:
        stalled.sendall(b"POST /get_reward HTTP/1.1\r\n")  # the only request thread now waits for the rest
        wait_for_pending(small_server, 1)
        assert post(f"{small_server.url}/health", b"", method="GET") == (
            503, {"error": "server busy: 1 requests running or queued; retry later"}
        )  # fmt: skip
    finally:
        stalled.close()
    wait_for_pending(small_server, 0)
    assert post_json(f"{small_server.url}/get_reward", {"prompts": [], "responses": []}) == (
        200, {"rewards": [], "scores": [], "extra_logs": {"segments": []}, "spans": []}
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------------- batching
def test_batcher_groups_pairs_that_arrive_while_a_batch_is_scored():
    release, first_started = threading.Event(), threading.Event()
    batches: list[list[int]] = []

    def score(pairs):
        batches.append([p.ids[0] for p in pairs])
        first_started.set()
        release.wait(10)
        return [float(p.ids[0]) for p in pairs], [1] * len(pairs)

    batcher = MicroBatcher(score, max_batch_size=4, max_wait_ms=50)
    try:
        first = batcher.submit([EncodedResponse([0], 0)])
        assert first_started.wait(10)  # the first batch is being scored: the next requests queue up
        jobs = [batcher.submit([EncodedResponse([i], 0) for i in ids]) for ids in ([1, 2, 3], [4, 5], [6, 7, 8, 9])]
        release.set()
        for job in (first, *jobs):
            assert job.done.wait(10)
    finally:
        batcher.close()
    assert batches == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]  # max 4 pairs per forward, in arrival order
    assert [job.values for job in (first, *jobs)] == [[0.0], [1.0, 2.0, 3.0], [4.0, 5.0], [6.0, 7.0, 8.0, 9.0]]


def test_batcher_fails_every_request_of_a_failing_batch_and_goes_on():
    calls = []

    def score(pairs):
        calls.append(len(pairs))
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return [1.0] * len(pairs), [1] * len(pairs)

    batcher = MicroBatcher(score, max_batch_size=8, max_wait_ms=200)
    try:
        failed = [batcher.submit([EncodedResponse([1], 0)]), batcher.submit([EncodedResponse([2], 0)])]
        for job in failed:
            assert job.done.wait(10)
        later = batcher.submit([EncodedResponse([3], 0)])
        assert later.done.wait(10)
    finally:
        batcher.close()
    assert [str(job.error) for job in failed] == ["out of memory", "out of memory"]
    assert later.error is None and later.values == [1.0]


@pytest.mark.slow
def test_load_concurrent_requests_each_get_their_own_scores(server, scorer):
    """200 requests of 1..8 distinct pairs, all sent at once from 200 threads."""
    requests, concurrency = 200, 200
    sizes = [1 + i % 8 for i in range(requests)]
    pairs = distinct_pairs(sum(sizes), seed=3)
    expected = in_process(scorer, pairs)
    bounds = [sum(sizes[:i]) for i in range(requests + 1)]
    start_line = threading.Barrier(concurrency)

    def call(i: int) -> tuple[int, dict]:
        chunk = pairs[bounds[i] : bounds[i + 1]]
        body = json.dumps({"query": [p + r for p, r in chunk], "prompts": [p for p, _ in chunk],
                           "labels": [None] * len(chunk)}).encode()  # fmt: skip
        start_line.wait(60)
        return post(f"{server.url}/get_reward", body)

    batches_before, pairs_before = server.batcher.batches, server.batcher.pairs
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(call, range(requests)))
    wall = time.perf_counter() - started
    batches = server.batcher.batches - batches_before
    print(f"\nload: {requests} requests, {len(pairs)} pairs, concurrency {concurrency}, wall {wall:.2f} s, "
          f"{len(pairs) / wall:.1f} pairs/s, {batches} batches")  # fmt: skip
    assert [status for status, _ in answers] == [200] * requests
    for i, (_, answer) in enumerate(answers):
        assert answer["rewards"] == pytest.approx(expected[bounds[i] : bounds[i + 1]], abs=TOLERANCE), i
    assert server.batcher.pairs - pairs_before == len(pairs)
    assert wall < 60


# ------------------------------------------------------------------------------------------------------------- CLI
def test_cli_refuses_a_directory_without_segment_settings(tmp_path):
    from rlhf_ext.cli import main

    result = CliRunner().invoke(main, ["serve", "rm", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert f"error: '{tmp_path}' is not a segment reward model" in result.stderr


def test_cli_serves_the_model(rm_dir, scorer, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_ext.cli", "serve", "rm", "--model", rm_dir, "--port", "0"],
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        lines = []
        for line in proc.stderr:  # the announcement names the URL of the free port
            lines.append(line)
            if line.startswith("serving "):
                break
        assert lines and lines[-1].startswith(f"serving {rm_dir} (e_phi: softmax, tau=0.5, cutoff=2) at http://"), lines
        url = re.search(r" at (http://[0-9.]+:[0-9]+): ", lines[-1]).group(1)
        status, health = post(f"{url}/health", b"", method="GET")
        assert status == 200 and health["model"] == Path(rm_dir).name
        pair = ("Question: Owls?\nAnswer:", " Owls hunt at night.")
        status, answer = post(
            f"{url}/get_reward", json.dumps({"query": [pair[0] + pair[1]], "prompts": [pair[0]]}).encode()
        )
        assert status == 200 and answer["rewards"] == pytest.approx(in_process(scorer, [pair]), abs=TOLERANCE)
    finally:
        proc.terminate()
        proc.wait(30)
