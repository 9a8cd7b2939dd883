"""The wire protocol of ``rlhf-ext serve rm``: OpenRLHF 0.11.2's remote-reward request, the direct (TRL) request, and
the one-line errors a malformed request gets. Pure Python: no server, no model.

``POST /get_reward`` (also ``POST /``) takes one of two JSON bodies:

* OpenRLHF (``SingleTurnAgentExecutor._fetch_rewards_via_http``): ``{"query": [str], "prompts": [str], "labels":
  [any]}``, ``query[i]`` = the decoded prompt + response; the response is what follows ``prompts[i]``. ``labels`` is
  optional and ignored.
* direct: ``{"prompts": [str | messages], "responses": [str | messages]}``; chat messages (``[{"role", "content"}]``,
  as TRL passes conversational prompts and completions) are rendered with the reward model's chat template.

and answers ``{"rewards": [e_phi], "scores": [e_phi], "extra_logs": {"segments": [number of segments]}, "spans":
[[[char_start, char_end, segment reward], ...]]}``, one entry per pair, in request order: the shape of OpenRLHF's own
``openrlhf.cli.serve_rm`` (whose client reads ``rewards``, ``scores`` and ``extra_logs``) plus each response's
segments as spans over its text (the response after the prompt; a chat response's content), the dense-reward
contract of :mod:`rlhf_ext.runtime.spans` that rlhf-ext's clients map onto any policy tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

#: The POST paths that score: OpenRLHF's reference server serves ``/get_reward``.
REWARD_PATHS = ("/get_reward", "/")
HEALTH_PATH = "/health"

#: A chat message ``{"role": ..., "content": ...}``; a prompt or response is text or a list of them.
Message = dict[str, Any]


class RequestError(Exception):
    """A request the server refuses: the HTTP status and a one-line message for ``{"error": ...}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = " ".join(message.split())


def error_body(message: str) -> bytes:
    """The JSON body of a refusal: ``{"error": "<one line>"}``."""
    return json.dumps({"error": " ".join(message.split())}).encode()


def _expect_list(body: dict[str, Any], key: str) -> list:
    if key not in body:
        raise RequestError(400, f"missing key '{key}'")
    value = body[key]
    if not isinstance(value, list):
        raise RequestError(400, f"'{key}' must be a list, got {type(value).__name__}")
    return value


def _check_text(text: str, where: str) -> None:
    """``text`` can be encoded as UTF-8 (JSON's ``\\ud800`` escapes decode to lone surrogates, which cannot)."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise RequestError(
            400, f"{where} is not valid text: lone surrogate {text[e.start]!r} at character {e.start}; send UTF-8 text"
        ) from None


def _is_messages(item) -> bool:
    messages = isinstance(item, list) and bool(item)
    return messages and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in item)


def _check_items(values: list, key: str, allow_messages: bool) -> None:
    """Each item of ``body[key]`` is text (or, when ``allow_messages``, a non-empty list of chat messages with text
    content)."""
    for i, item in enumerate(values):
        if isinstance(item, str):
            _check_text(item, f"'{key}[{i}]'")
        elif allow_messages and _is_messages(item):
            for j, message in enumerate(item):
                content = message["content"]
                if not isinstance(content, str):
                    raise RequestError(400, f"'{key}[{i}][{j}].content' must be text, got {type(content).__name__}")
                _check_text(content, f"'{key}[{i}][{j}].content'")
        else:
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
        RequestError: 400 (empty, not JSON, nested too deeply, not an object, missing key, wrong type, invalid text,
            mismatched lengths) or 413 (more than ``max_request_pairs`` pairs).
    """
    if not raw.strip():
        raise RequestError(400, 'empty request body: send {"query": [...], "prompts": [...]} as JSON')
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(400, f"request body is not JSON: {e}") from None
    except RecursionError:
        raise RequestError(400, "request body is nested too deeply to parse; send a flat JSON object") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(body).__name__}")
    texts_are_queries = "query" in body
    if texts_are_queries:  # OpenRLHF
        texts, prompts = _expect_list(body, "query"), _expect_list(body, "prompts")
        if body.get("labels") is not None:
            _expect_list(body, "labels")
        n = _check_lengths(body, ("query", "prompts", "labels"))
        _check_items(texts, "query", allow_messages=False)
        _check_items(prompts, "prompts", allow_messages=False)
    elif "responses" in body:  # direct (TRL)
        prompts, texts = _expect_list(body, "prompts"), _expect_list(body, "responses")
        n = _check_lengths(body, ("responses", "prompts"))
        _check_items(prompts, "prompts", allow_messages=True)
        _check_items(texts, "responses", allow_messages=True)
    else:
        raise RequestError(
            400, 'missing key \'query\': send OpenRLHF\'s {"query", "prompts"} or {"prompts", "responses"}'
        )
    if n > max_request_pairs:
        raise RequestError(413, f"{n} pairs exceed this server's limit of {max_request_pairs} per request; split them")
    return prompts, texts, texts_are_queries


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
