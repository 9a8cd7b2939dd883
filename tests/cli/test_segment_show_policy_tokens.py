"""``rlhf-ext segment show --policy-tokenizer``: a segment reward model on GPT-2's BPE, its segments shown on the toy
policy's tokens as PPO receives them (even split of each segment's reward over the policy tokens it covers)."""

from __future__ import annotations

import ast
import json

import pytest
from click.testing import CliRunner

from rlhf_ext.cli import main
from tests.helpers.cross_tokenizer import gpt2_segment_rm

PROMPT = "Question: What should I know about tides?\nAnswer:"
RESPONSE = " Many people wonder about this. The facts about tides are backed by peer-reviewed evidence."


@pytest.fixture(scope="module")
def gpt2_rm(tmp_path_factory):
    return gpt2_segment_rm(tmp_path_factory.mktemp("gpt2_rm"))


def _show(rm: str, *extra: str):
    return CliRunner().invoke(main, ["segment", "show", "--model", rm, "--prompt", PROMPT, "--response", RESPONSE,
                                     *extra])  # fmt: skip


def _segment_spans(segments: list[str], eos: str) -> list[tuple[int, int]]:
    """Characters of the response each of the RM's segments holds, from the segment texts alone (a segment of EOS
    alone is attached to the last character before it, as the spans are)."""
    spans, end = [], 0
    for text in segments:
        text = text.removesuffix(eos)
        spans.append((end, end + len(text)) if text else (end - 1, end))
        end += len(text)
    return spans


def test_policy_tokens_carry_the_segments_rewards_split_evenly(gpt2_rm, tiny_base_path):
    from rlhf_ext.runtime.token_scores import SegmentScorer

    result = _show(gpt2_rm, "--json", "--policy-tokenizer", tiny_base_path)
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    tokens = shown["policy_tokens"]
    assert "".join(t["text"] for t in tokens) == RESPONSE
    assert sum(t["reward"] for t in tokens) == pytest.approx(sum(shown["rewards"]), abs=1e-5)
    # the even split by hand: each segment's reward over the policy tokens that overlap its characters
    eos = SegmentScorer(gpt2_rm).tokenizer.eos_token
    assert "".join(s.removesuffix(eos) for s in shown["segments"]) == RESPONSE  # ASCII: segments tile the response
    spans = _segment_spans(shown["segments"], eos)
    expected = [0.0] * len(tokens)
    for (a, b), reward in zip(spans, shown["rewards"]):
        covered = [i for i, t in enumerate(tokens) if t["start"] < b and a < t["end"]]
        assert covered, (a, b)
        for i in covered:
            expected[i] += reward / len(covered)
    assert [t["reward"] for t in tokens] == pytest.approx(expected, abs=1e-5)
    for t in tokens:  # every rewarded token lies on a segment
        if t["reward"] != 0:
            assert any(t["start"] < b and a < t["end"] for a, b in spans)
    assert len(shown["segments"]) > 1 and len(tokens) > len(shown["segments"])  # a real split, not one bandit span


def test_policy_tokens_in_the_text_output(gpt2_rm, cache_dir):
    result = _show(gpt2_rm, "--policy-tokenizer", "builtin:tiny")
    assert result.exit_code == 0, result.output
    head, _, table = result.stdout.partition("on the policy's tokens (builtin:tiny):\n")
    assert head.startswith("e(x, y) = ") and table
    rows = table.strip("\n").split("\n")
    texts = [row.split(")  ", 1)[1] for row in rows]
    assert "".join(map(ast.literal_eval, texts)) == RESPONSE  # each row ends with the token's text, repr'd


@pytest.mark.parametrize("bad", ["missing_dir", "empty_dir", "builtin:nope"])
def test_a_bad_policy_tokenizer_is_one_line_naming_the_flag(gpt2_rm, tmp_path, bad):
    spec = {"missing_dir": str(tmp_path / "nope"), "empty_dir": str(tmp_path)}.get(bad, bad)
    result = _show(gpt2_rm, "--policy-tokenizer", spec)
    assert result.exit_code == 2
    assert result.stdout == "" and result.stderr.count("\n") == 1, result.output  # nothing scored, one line
    assert result.stderr.startswith("error: --policy-tokenizer ") and spec in result.stderr, result.stderr
