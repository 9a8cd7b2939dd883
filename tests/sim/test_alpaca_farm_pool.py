"""AlpacaFarm's annotator pool ``annotator_pool_v0`` as shipped, run by the simulator against a local chat server.

The pool's data files are the copies in ``tests/fixtures/alpaca_farm`` (identical to the installed ``alpaca_farm``
package's, checked when it is installed); the server answers every template in its own format
(:func:`tests.helpers.chat_server.alpaca_farm_responder`).
"""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

import pytest
import torch

from rlhf_ext.sim import AnnotatorPool, PoolConfig
from rlhf_ext.sim.alpaca_farm_pool import (
    PADDING_WITHOUT_INPUT,
    AlpacaFarmAssignment,
    alpaca_farm_annotators,
    chatml_to_messages,
    load_pool,
    resolve_pool,
)
from tests.helpers.chat_server import AF_BAD, AF_GOOD, FakeChatServer, alpaca_farm_responder

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
POOL = FIXTURES / "alpaca_farm" / "annotator_pool_v0"
NAMES = [
    "gpt4_1", "gpt4_2", "gpt4_3", "gpt4_4", "gpt4_5", "chatgpt_1", "chatgpt_2", "chatgpt_3", "chatgpt_4",
    "davinci003_1", "davinci003_2", "davinci003_3", "davinci003_4",
]  # fmt: skip
BATCH_SIZES = [4, 5, 5, 1, 5, 1, 1, 1, 1, 4, 1, 5, 1]


def pairs(n: int, offset: int = 0) -> tuple[list[str], list[str], list[str]]:
    """``n`` pairs; ``a`` is the good response of the odd rows, ``b`` of the even rows."""
    prompts = [f"Question number {offset + i}?" for i in range(n)]
    a = [f"answer {offset + i} {AF_GOOD if i % 2 else AF_BAD}" for i in range(n)]
    b = [f"reply {offset + i} {AF_BAD if i % 2 else AF_GOOD}" for i in range(n)]
    return prompts, a, b


def annotators_at(server: FakeChatServer, seed: int = 0):
    from rlhf_ext.datagen import OpenAIBackend

    return alpaca_farm_annotators(
        POOL, lambda model: OpenAIBackend(server.url, model=model, max_retries=0), models=["fake-model"], seed=seed
    )


def test_fixture_is_the_installed_package_data():
    if importlib.util.find_spec("alpaca_farm") is None:
        pytest.skip("alpaca_farm is not installed (pip install --no-deps alpaca-farm==0.2.0)")
    shipped = resolve_pool("annotator_pool_v0").parent
    assert sorted(p.name for p in shipped.iterdir() if p.is_file()) == sorted(p.name for p in POOL.iterdir())
    for path in POOL.iterdir():
        assert path.read_bytes() == (shipped / path.name).read_bytes(), path.name


def test_all_13_annotators_load_as_configured():
    pool = load_pool(POOL)
    assert [c.name for c in pool] == NAMES
    assert [c.batch_size for c in pool] == BATCH_SIZES
    assert {c.parser.name for c in pool} == {"regex_parser"}
    by_name = {c.name: c for c in pool}
    assert (by_name["gpt4_1"].model_name, by_name["gpt4_1"].max_tokens, by_name["gpt4_1"].temperature) == (
        "gpt-4-0314",
        600,
        1.0,
    )
    assert by_name["davinci003_4"].parser.kwargs["outputs_to_match"] == {1: r" \(a\)", 2: r" \(b\)"}
    assert set(by_name["chatgpt_1"].templates) == {"with_inputs", "without_inputs"}
    with pytest.raises(FileNotFoundError, match="no such path"):
        resolve_pool("no/such/pool:")


def test_prompts_are_formatted_as_the_templates_say():
    pool = {c.name: c for c in load_pool(POOL)}
    prompts, a, b = pairs(2)
    from rlhf_ext.sim.alpaca_farm_pool import AlpacaFarmAnnotator

    # batch size 1, ChatML, without input: one prompt per pair, the pair's fields at the template's placeholders
    single = AlpacaFarmAnnotator(pool["chatgpt_1"], backend=None, seed=0)
    examples, a_first = single.examples(prompts, a, b)
    requests = single.requests(examples)
    assert [r.rows for r in requests] == [[0], [1]] or [r.rows for r in requests] == [[1], [0]]
    for request in requests:
        ex = examples[request.rows[0]]
        assert (
            f"### Instruction:\n{ex['instruction']}\n\n### Output (a):\n{ex['output_1']}\n\n### Output (b):\n"
            f"{ex['output_2']}\n\n### Which is best, Output (a) or Output (b)?:\n<|im_end|>"
        ) in request.prompt
        messages = chatml_to_messages(request.prompt)
        assert [m["role"] for m in messages] == ["system", "user"]
        assert messages[1]["content"].endswith(f"{ex['output_2']}\n\n### Which is best, Output (a) or Output (b)?:")
    for ex, first, x, y in zip(examples, a_first, a, b):  # each pair is shown once, in one of its two orders
        assert (ex["output_1"], ex["output_2"]) == ((x, y) if first else (y, x))

    # batch size 5: two pairs fill examples 5 and 6 in shuffled order, dummy examples pad 7-9
    batched = AlpacaFarmAnnotator(pool["gpt4_3"], backend=None, seed=0)
    examples, _ = batched.examples(prompts, a, b)
    (request,) = batched.requests(examples)
    assert sorted(request.rows) == [0, 1]
    for slot, row in zip((5, 6), request.rows):
        ex = examples[row]
        assert (
            f"### Instruction {slot}:\n{ex['instruction']}\n\n### Output (a) for example {slot}:\n{ex['output_1']}\n\n"
            f"### Output (b) for example {slot}:\n{ex['output_2']}\n"
        ) in request.prompt
    for slot in (7, 8, 9):
        assert f"### Instruction {slot}:\n1+1=\n\n### Output (a) for example {slot}:\n2\n\n" in request.prompt
    assert "{instruction}" not in request.prompt and "{output_1}" not in request.prompt

    # a prompt with an input uses the with_inputs template (text format)
    text = AlpacaFarmAnnotator(pool["davinci003_4"], backend=None, seed=0)
    examples, _ = text.examples([{"instruction": "Add them.", "input": "2 and 3"}], ["5 " + AF_GOOD], ["6 " + AF_BAD])
    (request,) = text.requests(examples)
    ex = examples[0]
    assert request.prompt.endswith(
        f"Instruction: Add them.\nInput: 2 and 3\nOutput (a): {ex['output_1']}\nOutput (b): {ex['output_2']}\n"
        "Best output:"
    )
    assert text.chat_request(request.prompt).messages == [{"role": "user", "content": request.prompt}]
    assert PADDING_WITHOUT_INPUT == {"instruction": "1+1=", "input": "", "output_1": "2", "output_2": "3"}


def test_completions_are_parsed_per_example():
    pool = {c.name: c for c in load_pool(POOL)}
    from rlhf_ext.sim.alpaca_farm_pool import AlpacaFarmAnnotator

    five = AlpacaFarmAnnotator(pool["gpt4_2"], backend=None)
    assert five.parse("Output (b)\nOutput (a)\n Output (a)\nOutput (b)\nOutput (a)", 5) == [2, 1, 1, 2, 1]
    assert five.parse("Output (b)\nOutput (a)\nOutput (a)\nOutput (b)\nOutput (a)", 2) == [2, 1]  # then padding
    assert all(math.isnan(c) for c in five.parse("Output (b)\nOutput (a)", 2))  # 2 answers for 5 examples
    json4 = AlpacaFarmAnnotator(pool["gpt4_1"], backend=None)
    completion = "\n".join(f'{{"Concise explanation": "x", "Output (a) is better than Output (b)": {v}}}' for v in (
        "true", "false", "false", "true"))  # fmt: skip
    assert json4.parse(completion, 4) == [1, 2, 2, 1]
    davinci = AlpacaFarmAnnotator(pool["davinci003_3"], backend=None)
    listed = "\n(b)\n\n### Best output for example 8:\n(a)\n\n### Best output for example 9:\n(b)\n\n### x:\n(a)\n(a)"
    assert davinci.parse(listed, 5) == [2, 1, 2, 1, 1]
    assert AlpacaFarmAnnotator(pool["davinci003_4"], backend=None).parse(" (b)", 1) == [2]
    assert all(math.isnan(c) for c in AlpacaFarmAnnotator(pool["chatgpt_1"], backend=None).parse("Neither", 1))


def test_every_annotator_runs_against_a_chat_server():
    prompts, a, b = pairs(7)
    expected = [0.0, 1.0] * 3 + [0.0]  # a wins on the odd rows
    with FakeChatServer(alpaca_farm_responder) as server:
        annotators = annotators_at(server)
        for annotator, size in zip(annotators, BATCH_SIZES):
            p, draws = annotator.probability_with_ties(prompts, a, b, [None] * 7)
            assert p.tolist() == expected, annotator.name
            assert not draws.any()
            assert annotator.stats == {"requests": math.ceil(7 / size), "examples": 7, "unparseable": 0, "draws": 0}
            # P(a > b) = 1 - P(b > a): the pair is presented in the same order either way
            assert annotator.probability(prompts, b, a, [None] * 7).tolist() == [1 - e for e in expected]
    assert [x.name for x in annotators] == NAMES
    assert server.requests == 2 * sum(math.ceil(7 / s) for s in BATCH_SIZES)


def test_annotator_choice_is_alpaca_evals_seeded_uniform_choice():
    assign = AlpacaFarmAssignment(NAMES, seed=3)
    prompts = [f"instruction {i}" for i in range(13 * 400)]
    index = assign(prompts, [""] * len(prompts), [""] * len(prompts))
    # AlpacaEval: random_seeded_choice(seed="annotator" + "".join(row[input_keys]) + str(seed), choices=names)
    for i in (0, 1, 2, 977, 5199):
        assert NAMES[index[i]] == random.Random(f"annotator{prompts[i]}3").choices(NAMES, k=1)[0]
    assert torch.equal(assign(prompts[:50], ["x"] * 50, ["y"] * 50), index[:50])  # depends on the example only
    with_input = assign([{"instruction": "Add.", "input": "2, 3"}], ["a"], ["b"])
    assert NAMES[with_input[0]] == random.Random("annotator2, 3Add.3").choices(NAMES, k=1)[0]
    counts = torch.bincount(index, minlength=13).double()
    n, q = len(prompts), 1 / 13
    se = math.sqrt(q * (1 - q) / n)
    assert ((counts / n - q).abs() < 4 * se).all(), (counts / n).tolist()
    assert not torch.equal(AlpacaFarmAssignment(NAMES, seed=4)(prompts, prompts, prompts), index)


def test_pool_labels_and_training_noise_rate():
    n = 600
    prompts, a, b = pairs(n)
    cfg = PoolConfig(backend="alpaca_farm", alpaca_farm_pool=str(POOL), models=["fake-model"], flip_prob=0.25)
    with FakeChatServer(alpaca_farm_responder) as server:
        cfg.api_base = server.url
        pool = cfg.build(seed=0)
        evals = pool.decide(prompts, a, b, train=False)
        train = pool.decide(prompts, a, b, train=True)
    assert pool.names == NAMES and isinstance(pool.assign, AlpacaFarmAssignment)
    good_a = torch.tensor([i % 2 == 1 for i in range(n)])
    assert torch.equal(evals.prefer_a, good_a) and not evals.flipped.any() and not evals.tie.any()
    assert torch.equal(evals.annotator, train.annotator)
    flips = (train.prefer_a != evals.prefer_a).double()
    assert torch.equal(flips.bool(), train.flipped)
    se = math.sqrt(0.25 * 0.75 / n)  # binomial standard error of the measured flip rate
    assert abs(flips.mean().item() - 0.25) < 3 * se, flips.mean().item()
    assert set(torch.unique(evals.annotator).tolist()) == set(range(13))  # 600 instructions reach all 13


def test_alpaca_eval_evaluator_directory_is_a_pool():
    pool = load_pool(FIXTURES / "alpaca_eval" / "lmsys_gpt4")
    assert [(c.name, c.parser.name, c.batch_size, c.randomize_output_order) for c in pool] == [
        ("lmsys_gpt4", "lmsys_parser", 1, False)
    ]
    assert set(pool[0].templates) == {"any"}
    built = AnnotatorPool.from_alpaca_farm(str(FIXTURES / "alpaca_eval" / "lmsys_gpt4"), models=["fake-model"])
    assert built.names == ["lmsys_gpt4"] and built.annotators[0].model == "fake-model"


@pytest.mark.slow  # builds the session's tiny SFT model when no earlier test did
def test_sim_compare_with_the_alpaca_farm_pool(tmp_path, tiny_sft_path, monkeypatch):
    import json

    import yaml
    from click.testing import CliRunner

    from rlhf_ext.cli import main
    from rlhf_ext.sim.report import result_path

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with FakeChatServer(alpaca_farm_responder) as server:
        pool = {
            "backend": "alpaca_farm",
            "alpaca_farm_pool": str(POOL),
            "api_base": server.url,
            "models": ["fake-model"],
        }
        recipe = {
            "output_dir": str(tmp_path / "run"),
            "seeds": [0],
            "methods": ["sft"],
            "task": {"source": "toy", "num_samples": 60, "max_eval_prompts": 8, "max_length": 128},
            "model": {"base": tiny_sft_path},
            "sft": {"max_steps": 0},
            "generation": {"max_new_tokens": 32},
            "eval": {"samples_per_prompt": 1, "judge": "pool"},
            "feedback": {"pool": pool},
        }
        (tmp_path / "sim.yaml").write_text(yaml.safe_dump(recipe))
        res = CliRunner().invoke(main, ["sim", "compare", "--config", str(tmp_path / "sim.yaml")])
    assert res.exit_code == 0, res.output
    result = json.loads(result_path(tmp_path / "run", "sft", 0).read_text())
    assert result["num_comparisons"] == 8 and result["wins"] + result["ties"] + result["losses"] == 8
    assert result["win_rate"] == pytest.approx((result["wins"] + result["ties"] / 2) / 8, abs=1e-12)
    assert result["tie_rate"] == result["ties"] / 8
    assert server.requests > 0  # the pool's annotators judged the evaluation pairs through the server
