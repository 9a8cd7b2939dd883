"""Task YAML schema: packaged configs, errors that name the key, style/objective resolution, CLI error reporting."""

from __future__ import annotations

import copy

import pytest
import yaml
from click.testing import CliRunner

from rlhf_ext.config import RecipeError
from rlhf_ext.datagen import config_names, load_task_config, plan_generation

BASE = {
    "name": "tiny",
    "seed": 3,
    "tasks": [
        {
            "name": "a",
            "objective": "Ask a physics question.",
            "preference": "Explain it like I'm five.",
            "domain": {"physics": {"seed_words": ["gravity", "light", "heat"]}},
            "num_samples": 6,
        },
        {
            "name": "b",
            "objective": "Ask a physics question.",
            "preference": "Explain it at an expert level.",
            "domain": {"physics": {"seed_words": ["gravity", "light", "heat"]}},
            "num_samples": 4,
        },
    ],
}


def write(tmp_path, data, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def mutate(**changes):
    data = copy.deepcopy(BASE)
    for path, value in changes.items():
        node = data
        keys = path.split("__")
        for k in keys[:-1]:
            node = node[int(k)] if k.isdigit() else node.setdefault(k, {})
        if value is KeyError:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return data


def test_packaged_configs_have_the_papers_structure():
    assert config_names() == [
        "continual-lipschitz",
        "continual-mixed",
        "continual-piecewise-preference",
        "continual-piecewise-qa",
    ]
    lip = plan_generation("continual-lipschitz", num_samples=3)
    assert [t.style for t in lip.tasks.values()] == ["eli5", "highschool", "expert"]
    assert lip.drift["type"] == "lipschitz" and lip.drift["mode"] == "preference"
    assert len(lip.stages) == 1 + 2 * 4  # C = 0.25: four steps per transition

    pp = plan_generation("continual-piecewise-preference", num_samples=3)
    assert [s.name for s in pp.stages][:4] == [
        "politics_generate_rapper",
        "politics_generate_shakespeare",
        "politics_generate_formal",
        "politics_generate_rapper#c2",
    ]
    assert len(pp.stages) == 9 and pp.drift["mode"] == "preference" and pp.drift["cycles"] == 3

    qa = plan_generation("continual-piecewise-qa", num_samples=3)
    assert [t.style for t in qa.tasks.values()] == ["hinted", "direct"] and len(qa.stages) == 4

    mixed = plan_generation("continual-mixed", num_samples=3)
    assert mixed.drift["mode"] == "combined"
    assert [t["mode"] for t in mixed.drift["transitions"]] == ["preference", "combined", "combined"]
    assert [t.objective_kind for t in mixed.tasks.values()] == ["qa", "qa", "summary", "qa"]
    for plan in (lip, pp, qa, mixed):  # every packaged config runs with the offline backend
        assert plan.config.generation.backend == "offline"


def test_defaults_are_the_papers(tmp_path):
    cfg = load_task_config(write(tmp_path, BASE))
    g, m = cfg.generation, cfg.tasks[0].metadata
    assert (g.temperature, g.max_tokens_prompt, g.max_tokens_response, g.max_concurrency) == (0.99, 1024, 2048, 256)
    assert (m.seed_words_per_prompt, m.styles_per_response, m.preference_inclusion_prob) == (2, 3, 0.4)
    assert cfg.tasks[0].test_ratio == 0.15
    assert cfg.with_num_samples(7).tasks[1].num_samples == 7 and cfg.tasks[1].num_samples == 4


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"tasks__0__metadata": {"seed_word_per_prompt": 3}}, "'tasks[0].metadata.seed_word_per_prompt'"),
        ({"tasks__0__metadata": {"seed_word_per_prompt": 3}}, "did you mean 'tasks[0].metadata.seed_words_per_prompt'"),
        ({"tasks__1__preferense": "x"}, "unknown key 'tasks[1].preferense'"),
        ({"tasks__1__preference": KeyError}, "missing required key(s) in 'tasks[1]': preference"),
        ({"tasks__0__num_samples": "ten"}, "'tasks[0].num_samples' must be an integer"),
        ({"tasks__0__test_ratio": 1.5}, "tasks[0].test_ratio must be a number in [0, 1); got 1.5"),
        ({"tasks__0__domain": {"physics": {"seed_words": []}}}, "seed_words must contain at least one"),
        (
            {"tasks__0__domain": {"physics": {"seed_words": ["a"], "weight": -1}}},
            "physics.weight must be a number > 0; got -1.0",
        ),
        ({"drift": {"type": "lipschitz"}}, "lipschitz drift needs lipschitz_constant"),
        (
            {"drift": {"type": "lipschitz", "lipschitz_constant": 1.5}},
            "drift.lipschitz_constant must be a number in (0, 1]",
        ),
        ({"drift": {"type": "sudden"}}, "'drift.type' must be one of 'piecewise', 'lipschitz'"),
        ({"generation": {"backend": "hf"}}, "backend hf needs model"),
        ({"generation": {"preference_swap": 2}}, "generation.preference_swap must be a number in [0, 1]; got 2.0"),
        ({"tasks__1__name": "a"}, "task names must be unique; repeated: a"),
    ],
)
def test_bad_config_errors_name_the_key(tmp_path, changes, expected):
    path = write(tmp_path, mutate(**changes))
    with pytest.raises(RecipeError) as err:
        load_task_config(path)
    assert expected in str(err.value)
    assert str(path) in str(err.value)


def test_offline_backend_needs_a_style_it_can_resolve():
    data = mutate(tasks__1__preference="Be nice about it.")
    with pytest.raises(RecipeError, match=r"tasks\[1\]\.style \(b\): cannot tell which phrase-bank style"):
        plan_generation(data)
    with pytest.raises(RecipeError, match=r"tasks\[0\]\.style \(a\): unknown style 'pirate'"):
        plan_generation(mutate(tasks__0__style="pirate"))
    # an LLM backend with an LLM judge does not need phrase-bank styles
    plan = plan_generation(data, ["generation.backend=openai", "generation.response_mode=judged"])
    assert plan.tasks["b"].style is None and plan.tasks["a"].style == "eli5"
    with pytest.raises(RecipeError, match="matches several styles"):
        plan_generation(mutate(tasks__0__preference="Give a hint, in the style of Shakespeare."))


def test_overrides_and_cache_key_inputs():
    plan = plan_generation(BASE, ["generation.max_concurrency=3", "seed=5"])
    assert plan.config.generation.max_concurrency == 3 and plan.config.seed == 5
    keys = {j.key for j in plan.jobs}
    assert len(keys) == len(plan.jobs) == 10
    # concurrency, server address, swap probability and format do not change what a sample is ...
    same = plan_generation(
        BASE,
        [
            "seed=5",
            "generation.api_base=http://127.0.0.1:1/v1",
            "generation.preference_swap=0.5",
            "output.format=conversational",
        ],
    )
    assert {j.key for j in same.jobs} == keys
    # ... the seed, the model settings and the task content do
    assert not {j.key for j in plan_generation(BASE, ["seed=6"]).jobs} & keys
    assert not {j.key for j in plan_generation(BASE, ["seed=5", "generation.temperature=0.5"]).jobs} & keys
    changed = plan_generation(mutate(tasks__1__preference="Explain it at an expert level!"), ["seed=5"])
    assert {j.key for j in changed.jobs if j.task.spec.name == "a"} <= keys
    assert not {j.key for j in changed.jobs if j.task.spec.name == "b"} & keys
    # more samples keep the existing keys (a resumed run extends the dataset)
    assert keys < {j.key for j in plan_generation(BASE, ["seed=5"], num_samples=9).jobs}


def test_cli_reports_bad_yaml_with_the_key(tmp_path):
    from rlhf_ext.cli import main

    path = write(tmp_path, mutate(tasks__0__metadata={"prompt_prefx": "Q: "}))
    result = CliRunner().invoke(main, ["data", "generate", str(path), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "unknown key 'tasks[0].metadata.prompt_prefx'" in result.output
    assert "did you mean 'tasks[0].metadata.prompt_prefix'" in result.output
    assert not (tmp_path / "out").exists()
    result = CliRunner().invoke(main, ["data", "generate", "no-such-config", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "packaged configs: continual-lipschitz" in result.output


def test_datagen_and_the_cli_stay_light():
    import subprocess
    import sys

    code = (
        "import sys, rlhf_ext, rlhf_ext.cli\n"
        "from rlhf_ext.datagen import plan_generation\n"
        "plan_generation('continual-mixed', num_samples=2)\n"
        "heavy = ('trl', 'openrlhf', 'deepspeed', 'ray', 'vllm', 'torch', 'transformers', 'datasets', 'aiohttp',\n"
        "         'openai', 'httpx', 'httpx2')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
