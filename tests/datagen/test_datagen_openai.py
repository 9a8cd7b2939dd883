"""The ``openai`` backend against a real local chat-completions server (tests.helpers.chat_server) with faults."""

from __future__ import annotations

import json
import socket
import threading
from collections import Counter
from pathlib import Path

import pytest

from rlhf_ext.datagen import BackendUnavailable, OpenAIBackend, generate_dataset
from rlhf_ext.datagen.cache import CACHE_DIR, SAMPLES_FILE
from tests.helpers.chat_server import FakeChatServer, datagen_responder, last_user_message, request_digest

EDU = {"physics": {"seed_words": ["gravity", "friction", "orbit", "lens", "pressure", "torque"]}}


def config(n=10, mode="judged", cycles=1):
    return {
        "name": "remote",
        "seed": 5,
        "drift": {"type": "piecewise", "cycles": cycles},
        "generation": {"backend": "openai", "response_mode": mode, "judge": "llm", "max_concurrency": 8},
        "tasks": [
            {
                "name": "hinted",
                "objective": "Ask a physics question.",
                "preference": "Guide the student with a hint.",
                "domain": EDU,
                "num_samples": n,
                "test_ratio": 0.2,
            },
            {
                "name": "direct",
                "objective": "Ask a physics question.",
                "preference": "Directly answer the question.",
                "domain": EDU,
                "num_samples": n,
                "test_ratio": 0.2,
            },
        ],
    }


def backend(server, **kw):
    kw = {"max_concurrency": 8, "timeout": 0.3, "max_retries": 3, "backoff_base": 0.01, **kw}
    return OpenAIBackend(server.url, **kw)


def kind(body) -> str:
    text = last_user_message(body)
    if text.startswith("Generate a text that fulfills"):
        return "prompt"
    if text.startswith("Generate a response"):
        return "response"
    return "judge" if "RESPONSE A:" in text else "pair"


def bucket(body, n: int) -> int:
    return int(request_digest(body), 16) % n


def samples_by_id(path: Path) -> dict[str, dict]:
    out = {}
    for line in (path / CACHE_DIR / SAMPLES_FILE).read_text().splitlines():
        rec = json.loads(line)
        out[rec["key"]] = rec
    return out


def test_faults_are_retried_counted_and_nothing_finished_is_lost(tmp_path):
    malformed, always_failing = set(), set()

    def responder(body):
        if kind(body) == "judge" and bucket(body, 4) == 0:
            malformed.add(request_digest(body))
            return "I think the first one is better."
        return datagen_responder(body)

    def fault(body, attempt):
        if kind(body) == "prompt" and bucket(body, 5) == 0:
            always_failing.add(request_digest(body))
            return "error"  # every attempt fails: the sample is retried by the next run
        if attempt == 0:  # the first attempt fails, the retry succeeds
            return {1: "error", 2: "hang", 3: "bad_body", 4: "rate_limit"}.get(bucket(body, 6))
        return None

    out = tmp_path / "out"
    with FakeChatServer(responder, fault=fault, hang_seconds=2.0) as server:
        ds = generate_dataset(config(), out, backend=backend(server), progress=False)
    stats = ds.run_stats
    assert server.actions["hang"] > 0 and server.actions["error"] > 0 and server.actions["bad_body"] > 0
    assert stats["backend"]["retries"] >= server.actions["hang"] + server.actions["bad_body"]
    n_bad, n_failing = len(malformed), len(always_failing)
    assert n_bad > 0 and n_failing > 0
    assert stats["skipped:judge_unparseable"] == n_bad
    assert stats["retry_later:server_error"] == n_failing
    assert stats["generated"] + n_bad + n_failing == stats["planned"] == 20
    assert ds.metadata["stats"] == {
        "generated": 20 - n_bad - n_failing,
        "missing": n_failing,
        "planned": 20,
        "skipped": n_bad,
    }
    first = samples_by_id(out)
    assert len(first) == 20 - n_failing  # generated + permanently skipped; transient failures are not cached

    # the server recovers: a rerun retries only the transient failures and keeps every finished sample
    with FakeChatServer(responder) as server:
        again = generate_dataset(config(), out, backend=backend(server), progress=False)
    assert again.run_stats["reused"] == 20 - n_failing and again.run_stats["attempted"] == n_failing
    # (the retried samples may meet malformed judge answers too)
    assert again.metadata["stats"] == {
        "generated": 20 - len(malformed),
        "missing": 0,
        "planned": 20,
        "skipped": len(malformed),
    }
    second = samples_by_id(out)
    assert {k: v for k, v in second.items() if k in first} == first
    ordered = 0
    for dd in again:
        for row in dd["train"]:
            # the judge prefers "careful"; its answers are mapped back through the shuffled A/B order
            assert not (row["chosen"].startswith("A careless") and row["rejected"].startswith("A careful"))
            assert second[row["sample_id"]]["sample"]["chosen"] == row["chosen"]
            ordered += row["chosen"].startswith("A careful") and row["rejected"].startswith("A careless")
    assert ordered > 0


def test_concurrency_is_bounded_and_used(tmp_path):
    with FakeChatServer(latency=0.05) as server:
        ds = generate_dataset(
            config(n=12, mode="pair"),
            tmp_path / "out",
            overrides=["generation.max_concurrency=4"],
            backend=backend(server, max_concurrency=4),
            progress=False,
        )
    assert server.max_in_flight == 4
    assert server.requests == 2 * 24 and ds.metadata["stats"]["generated"] == 24
    row = ds[0]["train"][0]
    assert row["chosen"].startswith("A careful answer") and row["rejected"].startswith("A careless answer")
    assert ds.metadata["generator"]["models"] == ["fake-model"]  # resolved from GET /models


def test_api_key_comes_from_the_environment_and_is_never_written(tmp_path, monkeypatch, capsys):
    secret = "sk-test-0123456789-secret"
    monkeypatch.setenv("RLHF_EXT_TEST_KEY", secret)
    cfg = config(n=2, mode="pair")
    cfg["generation"]["api_key_env"] = "RLHF_EXT_TEST_KEY"
    out = tmp_path / "out"
    with FakeChatServer(api_key=secret) as server:
        b = backend(server, api_key_env="RLHF_EXT_TEST_KEY")
        generate_dataset(cfg, out, backend=b, progress=False)
    assert server.auth_headers == {f"Bearer {secret}"}
    assert secret not in repr(b)
    for p in out.rglob("*"):
        if p.is_file():
            assert secret.encode() not in p.read_bytes(), p
    with FakeChatServer(api_key="another-key") as server, pytest.raises(BackendUnavailable) as err:
        generate_dataset(cfg, tmp_path / "out2", backend=backend(server, api_key_env="RLHF_EXT_TEST_KEY"))
    assert "rejected the credentials (HTTP 401); check $RLHF_EXT_TEST_KEY" in str(err.value)
    assert secret not in str(err.value) and secret not in capsys.readouterr().err


def test_unreachable_server_and_unknown_model_fail_clearly(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(BackendUnavailable, match=r"cannot reach the chat-completions server .*vllm serve"):
        generate_dataset(config(n=1), tmp_path / "a", backend=OpenAIBackend(f"http://127.0.0.1:{port}/v1"))
    with (
        FakeChatServer() as server,
        pytest.raises(BackendUnavailable, match="model 'other' is not served .* it serves: fake-model"),
    ):
        generate_dataset(config(n=1), tmp_path / "b", backend=backend(server, model="other"))


def test_rejected_requests_are_not_retried_and_not_cached(tmp_path):
    # (issue 15: an HTTP 400 used to be cached as a permanent skip; only answers are final now)
    def fault(body, attempt):
        return "reject" if kind(body) == "pair" and bucket(body, 3) == 0 else None

    out = tmp_path / "out"
    with FakeChatServer(fault=fault) as server:
        ds = generate_dataset(config(n=9, mode="pair"), out, backend=backend(server), progress=False)
    rejected = ds.run_stats["retry_later:rejected"]
    assert rejected == server.actions["reject"] > 0  # HTTP 400 is not retried within the run ...
    assert ds.metadata["stats"]["skipped"] == 0 and ds.metadata["stats"]["missing"] == rejected  # ... nor cached
    assert ds.run_stats["errors"] == {"rejected": "HTTP 400: injected bad request"}
    assert len(samples_by_id(out)) == 18 - rejected
    with FakeChatServer() as server:  # the next run asks again
        again = generate_dataset(config(n=9, mode="pair"), out, backend=backend(server), progress=False)
    assert again.run_stats["attempted"] == rejected and again.metadata["stats"]["generated"] == 18


def test_losing_the_server_stops_the_run_and_a_rerun_resumes(tmp_path):
    completed = Counter()
    box = {}

    def responder(body):
        completed["n"] += 1
        if completed["n"] == 25:  # the server goes away in the middle of the run
            threading.Thread(target=box["server"].stop).start()
        return datagen_responder(body)

    out = tmp_path / "out"
    server = FakeChatServer(responder, latency=0.01).start()
    box["server"] = server
    try:
        with pytest.raises(BackendUnavailable, match="rerun the same command to resume") as err:
            generate_dataset(config(n=20, mode="pair"), out, backend=backend(server, max_concurrency=2))
    finally:
        server.stop()
    cached = samples_by_id(out)
    assert 8 <= len(cached) <= 12 and f"{len(cached)}/40 samples are finished" in str(err.value)
    with FakeChatServer() as other:  # restarted on another port: the cache is keyed by content, not address
        ds = generate_dataset(config(n=20, mode="pair"), out, backend=backend(other), progress=False)
    assert ds.run_stats["reused"] == len(cached) and ds.metadata["stats"]["generated"] == 40
