"""The ``openai`` backend on the official ``openai.AsyncOpenAI`` client, against the local chat server.

Proxies from the environment, the ``max_completion_tokens`` -> ``max_tokens`` fallback, ``Retry-After``, timeouts,
and the issue-15 defects: secrets echoed by a server, runs where every request fails, HTTP 400 cached as a final
answer, and a ``choices[0].message`` that is a string.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rlhf_ext.datagen import BackendError, BackendUnavailable, ChatRequest, OpenAIBackend, generate_dataset
from rlhf_ext.datagen.cache import CACHE_DIR, SAMPLES_FILE
from rlhf_ext.datagen.chat import RequestRejected, redact_secrets
from rlhf_ext.datagen.mappers import PAIR_PROMPT_TEMPLATE
from tests.helpers.chat_server import FakeChatServer, ForwardProxy, last_user_message

EDU = {"physics": {"seed_words": ["gravity", "friction", "orbit", "lens", "pressure", "torque"]}}
SECRET = "sk-live-0123456789abcdefSECRET"


def config(n=2, mode="pair", **generation):
    return {
        "name": "remote",
        "seed": 11,
        "drift": {"type": "piecewise", "cycles": 1},
        "generation": {"backend": "openai", "response_mode": mode, "judge": "llm", "max_concurrency": 4, **generation},
        "tasks": [
            {
                "name": name,
                "objective": "Ask a physics question.",
                "preference": preference,
                "domain": EDU,
                "num_samples": n,
                "test_ratio": 0.0,
            }
            for name, preference in (("hinted", "Guide the student with a hint."), ("direct", "Directly answer."))
        ],
    }


def backend(server, **kw):
    kw = {"max_concurrency": 4, "timeout": 0.5, "max_retries": 2, "backoff_base": 0.01, **kw}
    return OpenAIBackend(server.url, **kw)


def is_pair(body) -> bool:
    return last_user_message(body).startswith(PAIR_PROMPT_TEMPLATE.split(":", 1)[0])


def complete_one(b: OpenAIBackend, max_tokens: int = 32):
    """Start ``b``, answer one request, close; returns the completion."""

    async def run():
        async with b:
            return await b.complete(ChatRequest("prompt", [{"role": "user", "content": "hi"}], 1, max_tokens, 0.0))

    return asyncio.run(run())


def files_under(path: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}


def cache_lines(out: Path) -> list[dict]:
    path = out / CACHE_DIR / SAMPLES_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_generate(tmp_path, server, out, *overrides, env=None):
    from rlhf_ext.cli import main

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(config()))
    args = ["data", "generate", str(cfg), "-o", str(out), "--api-base", server.url, "--no-progress", *overrides]
    return CliRunner().invoke(main, args, env=env)


# ---------------------------------------------------------------------------------------------- the client
def test_the_backend_is_the_official_client_and_sends_no_key_when_there_is_none(tmp_path, monkeypatch):
    import openai

    monkeypatch.setenv("OPENAI_API_KEY", SECRET)  # the client's own default variable must not leak in
    monkeypatch.delenv("RLHF_EXT_UNSET_KEY", raising=False)
    with FakeChatServer() as server:
        b = backend(server, api_key_env="RLHF_EXT_UNSET_KEY")

        async def run():
            async with b:
                assert isinstance(b._client, openai.AsyncOpenAI)
                return await b.complete(ChatRequest("prompt", [{"role": "user", "content": "hi"}], 1, 8, 0.0))

        assert asyncio.run(run()).text == "OK"
        assert server.auth_headers == set()  # no Authorization header at all
    monkeypatch.setenv("RLHF_EXT_SET_KEY", "abc-key-123456")
    with FakeChatServer(api_key="abc-key-123456") as server:
        complete_one(backend(server, api_key_env="RLHF_EXT_SET_KEY"))
        assert server.auth_headers == {"Bearer abc-key-123456"}


# ------------------------------------------------------------------------------------------------- proxies
# (tests/datagen/conftest.py clears the machine's proxy variables before each test)
def test_requests_go_through_the_proxy_from_the_environment(tmp_path, monkeypatch):
    with FakeChatServer() as server, ForwardProxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.proxy_url)
        ds = generate_dataset(config(n=1), tmp_path / "out", backend=backend(server), progress=False)
    assert ds.metadata["stats"]["generated"] == 2
    assert proxy.forwarded.count(f"{server.url}/models") == 1
    assert proxy.forwarded.count(f"{server.url}/chat/completions") == server.requests == 4


def test_a_dead_proxy_fails_the_run_and_no_proxy_bypasses_it(tmp_path, monkeypatch):
    dead = f"http://127.0.0.1:{closed_port()}"
    with FakeChatServer() as server:
        monkeypatch.setenv("HTTP_PROXY", dead)
        with pytest.raises(BackendUnavailable) as err:
            generate_dataset(config(n=1), tmp_path / "a", backend=backend(server), progress=False)
        assert f"cannot reach the chat-completions server at {server.url} through the proxy {dead}" in str(err.value)
        assert "NO_PROXY=127.0.0.1 bypasses it" in str(err.value)
        assert server.requests == 0 and server.auth_headers == set()  # nothing went around the proxy
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        ds = generate_dataset(config(n=1), tmp_path / "b", backend=backend(server), progress=False)
    assert ds.metadata["stats"]["generated"] == 2 and server.requests == 4


# ----------------------------------------------------------------------------------------- the token limit
def test_max_completion_tokens_is_sent_by_default(tmp_path):
    with FakeChatServer(reject_params=["max_tokens"]) as server:  # a server that wants the new name only
        ds = generate_dataset(config(n=3), tmp_path / "out", backend=backend(server), progress=False)
    assert ds.metadata["stats"]["generated"] == 6
    assert server.token_params == {"max_completion_tokens": 12} and server.actions["reject_param"] == 0


def test_an_older_server_that_rejects_max_completion_tokens_gets_max_tokens_for_the_rest_of_the_run(tmp_path):
    with FakeChatServer(reject_params=["max_completion_tokens"]) as server:
        b = backend(server, max_concurrency=1)
        ds = generate_dataset(config(n=3), tmp_path / "out", backend=b, progress=False)
    assert ds.metadata["stats"]["generated"] == 6 and "errors" not in ds.run_stats
    assert b.token_limit_param == "max_tokens"
    # one rejected request, then every request (its resend included) with max_tokens
    assert server.actions["reject_param"] == 1
    assert server.token_params == {"max_completion_tokens": 1, "max_tokens": 12}
    # many requests in flight when the server first refuses: each is resent once, none fails
    with FakeChatServer(reject_params=["max_completion_tokens"], latency=0.02) as server:
        ds = generate_dataset(
            config(n=6), tmp_path / "out2", backend=backend(server, max_concurrency=8), progress=False
        )
    assert ds.metadata["stats"]["generated"] == 12
    assert 1 <= server.actions["reject_param"] <= 8 and server.token_params["max_tokens"] == 24


def test_a_400_that_does_not_refuse_the_token_field_does_not_switch_it():
    with FakeChatServer(fault=lambda body, attempt: "reject") as server:
        b = backend(server)
        with pytest.raises(RequestRejected, match="HTTP 400: injected bad request"):
            complete_one(b)
    assert b.token_limit_param == "max_completion_tokens" and server.requests == 1  # a 400 is not retried
    too_large = {"error": {"message": "max_completion_tokens is too large: 100000. This model supports at most 16384"}}
    with FakeChatServer(fault=lambda body, attempt: (400, too_large)) as server:
        b = backend(server)
        with pytest.raises(RequestRejected, match="HTTP 400: max_completion_tokens is too large: 100000"):
            complete_one(b, max_tokens=100000)
    assert b.token_limit_param == "max_completion_tokens" and server.token_params == {"max_completion_tokens": 1}


# ---------------------------------------------------------------------------------------- retries, timeouts
def test_retry_after_is_honoured_and_counted():
    with FakeChatServer(fault=lambda body, attempt: "rate_limit" if attempt == 0 else None, retry_after="1") as server:
        b = backend(server, backoff_base=0.001, backoff_max=0.001)
        assert complete_one(b).text == "OK"
    (_, first), (_, second) = server.arrivals
    assert second - first >= 0.95  # the server's Retry-After: 1, not the 1 ms backoff
    assert b.stats == {"requests": 1, "attempts": 2, "retries": 1, "failed": 0}


def test_5xx_dropped_connections_and_bad_bodies_are_retried_with_backoff():
    for action in ("error", "drop", "bad_body", "string_message"):
        with FakeChatServer(fault=lambda body, attempt, a=action: a if attempt < 2 else None) as server:
            b = backend(server, max_retries=2)
            assert complete_one(b).text == "OK", action
        assert server.requests == 3 and b.stats["retries"] == 2 and b.stats["attempts"] == 3, action


def test_timeouts_and_exhausted_retries_raise_with_the_cause():
    timeout = r"no answer from .*/chat/completions within 0.3 s \(2 attempts\)"
    with (
        FakeChatServer(fault=lambda body, attempt: "hang", hang_seconds=3.0) as server,
        pytest.raises(BackendError, match=timeout) as e,
    ):
        complete_one(backend(server, timeout=0.3, max_retries=1))
    assert e.value.reason == "timeout" and server.requests == 2
    with (
        FakeChatServer(fault=lambda body, attempt: "error") as server,
        pytest.raises(BackendError, match=r"^HTTP 500: injected server error \(3 attempts\)$") as e,
    ):
        complete_one(backend(server))
    assert e.value.reason == "server_error" and server.requests == 3


# ------------------------------------------------------------------------------------ issue 15: secrets
def test_redact_secrets_covers_what_servers_echo():
    cases = {
        f"headers: {{'Authorization': 'Bearer {SECRET}'}}": SECRET,
        "authorization: Basic dXNlcjpwYXNzd29yZA==": "dXNlcjpwYXNzd29yZA==",
        '{"api_key": "plain-value-42"}': "plain-value-42",
        "GET /v1/models?api-key=abc123def&x=1": "abc123def",
        "token Bearer eyJhbGciOi.payload.sig here": "eyJhbGciOi.payload.sig",
        "a key sk-proj-AbCdEf0123456789 in text": "AbCdEf0123456789",
        "http://user:hunter2@proxy.local:3128": "hunter2",
    }
    for text, secret in cases.items():
        out = redact_secrets(text)
        assert secret not in out and "[REDACTED]" in out, (text, out)
    assert redact_secrets("no secret in my-bare-key-value", ["my-bare-key-value"]) == "no secret in [REDACTED]"
    assert redact_secrets("HTTP 500: injected server error") == "HTTP 500: injected server error"


def test_a_server_that_echoes_the_authorization_header_never_gets_the_key_saved_or_printed(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_EXT_TEST_KEY", SECRET)

    def fault(body, attempt):
        return "echo_auth" if is_pair(body) else None

    out = tmp_path / "out"
    with FakeChatServer(fault=fault, api_key=SECRET) as server:
        result = cli_generate(tmp_path, server, out, "generation.api_key_env=RLHF_EXT_TEST_KEY")
        assert server.actions["echo_auth"] == 4
    assert result.exit_code == 2, result.output
    assert SECRET not in result.output and "Bearer [REDACTED]" in result.output
    assert "failed:   rejected x4: HTTP 400: bad request; request headers: {'Authorization': 'Bearer [REDACTED]'}" in (
        result.output
    )
    files = files_under(out)
    assert out / CACHE_DIR / "runs.jsonl" in files
    for path, data in files.items():
        assert SECRET.encode() not in data, path
    assert cache_lines(out) == []  # an HTTP 400 is not an answer


def test_an_answer_that_echoes_the_key_is_saved_without_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_EXT_TEST_KEY", SECRET)
    with FakeChatServer(lambda body: f"Your key is {SECRET}.", api_key=SECRET) as server:
        b = backend(server, api_key_env="RLHF_EXT_TEST_KEY")
        assert complete_one(b).text == "Your key is [REDACTED]."


# --------------------------------------------------------------------------- issue 15: every request fails
@pytest.mark.parametrize(
    ("action", "reason", "message"),
    [
        ("error", "server_error", "HTTP 500: injected server error (2 attempts)"),
        ("bad_body", "bad_body", "malformed response (the body is not JSON: '<html>not json</html>'); 2 attempts"),
        ("drop", "dropped", "connection dropped by http://127.0.0.1:"),
        ("hang", "timeout", "/chat/completions within 0.3 s (2 attempts)"),
        ("string_message", "bad_body", "choices[0].message is a str, not an object with a content field"),
    ],
)
def test_a_run_where_every_request_fails_reports_the_server_message_and_exits_2(tmp_path, action, reason, message):
    out = tmp_path / "out"
    overrides = ["generation.max_retries=1", "generation.request_timeout=0.3"]
    with FakeChatServer(fault=lambda body, attempt: action, hang_seconds=2.0) as server:
        result = cli_generate(tmp_path, server, out, *overrides)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("  failed:")]
    assert len(lines) == 1 and lines[0].startswith(f"  failed:   {reason} x4: ") and message in lines[0], lines
    assert "error: no usable samples in" in result.output and "every request failed" in result.output
    assert cache_lines(out) == []
    run = json.loads((out / CACHE_DIR / "runs.jsonl").read_text().splitlines()[-1])
    assert run[f"retry_later:{reason}"] == 4 and message in run["errors"][reason]


def test_a_partial_failure_exits_0_and_still_shows_the_message(tmp_path):
    def fault(body, attempt):  # the "direct" task's pairs fail
        return "error" if is_pair(body) and "Directly answer." in last_user_message(body) else None

    with FakeChatServer(fault=fault) as server:
        result = cli_generate(tmp_path, server, tmp_path / "out", "generation.max_retries=0")
    assert result.exit_code == 0, result.output
    assert server.actions["error"] == 2 and "samples: 2/4" in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("  failed:")]
    assert lines == ["  failed:   server_error x2: HTTP 500: injected server error (1 attempt)"]
    assert "missing:  2 (failed this run; rerun the command to retry them)" in result.output


# ------------------------------------------------------------------------- issue 15: HTTP 400 is not final
def test_a_run_of_http_400s_is_not_cached_and_a_rerun_against_a_healthy_server_generates(tmp_path):
    out = tmp_path / "out"
    with FakeChatServer(fault=lambda body, attempt: "reject") as server:
        ds = generate_dataset(config(n=3), out, backend=backend(server), progress=False)
    assert ds.metadata["stats"] == {"generated": 0, "missing": 6, "planned": 6, "skipped": 0}
    assert ds.run_stats["retry_later:rejected"] == 6 and cache_lines(out) == []
    with FakeChatServer() as server:
        ds = generate_dataset(config(n=3), out, backend=backend(server), progress=False)
    assert ds.metadata["stats"]["generated"] == 6 and ds.run_stats["attempted"] == 6


def test_http_400_skips_cached_by_older_versions_are_dropped_and_regenerated(tmp_path):
    out = tmp_path / "out"
    with FakeChatServer() as server:
        generate_dataset(config(n=3), out, backend=backend(server), progress=False)
    path = out / CACHE_DIR / SAMPLES_FILE
    records = cache_lines(out)
    old = [
        {**{k: r[k] for k in ("key", "stage", "index", "seed", "task")}, "status": "skipped"}
        | {"reason": "request_rejected", "detail": f"HTTP 400: {{'Authorization': 'Bearer {SECRET}'}}"}
        for r in records[:4]
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in old + records[4:]))  # what the buggy version left
    with FakeChatServer() as server:
        ds = generate_dataset(config(n=3), out, backend=backend(server), progress=False)
    assert ds.run_stats["attempted"] == 4 and ds.metadata["stats"]["generated"] == 6
    assert SECRET not in path.read_text() and all(r["status"] == "ok" for r in cache_lines(out))
    assert len(cache_lines(out)) == 6


# --------------------------------------------------------------------- issue 15: message is a string
def test_a_string_message_is_a_malformed_answer_not_a_crash(tmp_path):
    def fault(body, attempt):
        return "string_message" if is_pair(body) else None

    out = tmp_path / "out"
    with FakeChatServer(fault=fault) as server:
        ds = generate_dataset(config(n=2), out, backend=backend(server, max_retries=1), progress=False)
    assert server.actions["string_message"] == 8  # 4 pair requests, each retried once
    assert ds.run_stats["retry_later:bad_body"] == 4 and ds.metadata["stats"]["generated"] == 0
    assert "choices[0].message is a str, not an object" in ds.run_stats["errors"]["bad_body"]
    assert cache_lines(out) == []


def test_unreachable_server_message_names_no_proxy_when_none_is_set(tmp_path):
    port = closed_port()
    with pytest.raises(BackendUnavailable) as err:
        generate_dataset(config(n=1), tmp_path / "a", backend=OpenAIBackend(f"http://127.0.0.1:{port}/v1"))
    assert "proxy" not in str(err.value) and "ConnectError" in str(err.value)
