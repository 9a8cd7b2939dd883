"""AIF-Gen's own formats: its 19 task configs generate as they are (offline, and a dry run with the openai backend),
and its dataset JSON imports, exports and imports again unchanged (fixtures: tests/fixtures/aif_gen, see its
README)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from rlhf_ext.cli import main
from rlhf_ext.config import RecipeError
from rlhf_ext.datagen import ContinualDataset, load_continual_dataset
from rlhf_ext.datagen.aif_gen import dataset_from_aif_gen, dataset_to_aif_gen
from rlhf_ext.datagen.aif_gen_config import VOCABULARIES, config_to_rlhf_ext, preference_style
from rlhf_ext.datagen.phrasebank import load_phrase_bank, preference_style_name, rubric_for
from rlhf_ext.datagen.schema import GenerationSpec, load_task_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "aif_gen"
CONFIGS = sorted((FIXTURES / "config").rglob("*.yaml"))
DEBUG_JSON = FIXTURES / "continual_data_debug.json"
CAP = 3  # --num-samples: samples per task in the offline runs

#: The phrase-bank style of every task of every AIF-Gen config (hand-read from the preference texts).
EXPECTED_STYLES = {
    "education_qna_hinted_2_direct": ["hinted", "direct"],
    "mock_config": [
        "pref:headline-polarizing",
        "pref:headline-short-unbiased",
        "pref:headline-conservative-news-outlet",
        "pref:headline-liberal-news-outlet",
    ],
    "education_qna_direct": ["direct"],
    "education_qna_eli5": ["eli5"],
    "education_qna_expert": ["expert"],
    "education_qna_hinted": ["hinted"],
    "education_summary_eli5": ["eli5"],
    "education_summary_expert": ["expert"],
    "politics_generate_formal": ["formal"],
    "politics_generate_rapper": ["rapper"],
    "politics_generate_shakespeare": ["shakespeare"],
    "politics_qna_expert": ["expert"],
    "politics_summary_eli5": ["eli5"],
    "politics_summary_expert": ["expert"],
    "tech_healthcare_qna_eli5": ["eli5"],
    "tech_healthcare_qna_expert": ["expert"],
    "tech_physics_summary_eli5": ["eli5"],
    "tech_physics_summary_expert": ["expert"],
    "tech_physics_summary_highschool": ["highschool"],
}
#: Stage names: ``task<i>-<domain components>`` (AIF-Gen's tasks have no names).
EXPECTED_COMPONENTS = {
    "mock_config": "healthcare-technology",
    "tech_healthcare_qna_eli5": "technology-healthcare",
    "tech_healthcare_qna_expert": "technology-healthcare",
    "tech_physics_summary_eli5": "technology-physics",
    "tech_physics_summary_expert": "technology-physics",
    "tech_physics_summary_highschool": "technology-physics",
}


def _cli(*args: Any):
    return CliRunner().invoke(main, ["data", *map(str, args)])


def _task_specs(path: Path) -> list[dict[str, Any]]:
    return yaml.safe_load(path.read_text())["task_specs"]


def _skeleton(value: Any) -> Any:
    """The key structure of a JSON value: mappings keep their keys (in order), lists their items' distinct shapes."""
    if isinstance(value, dict):
        return [(k, _skeleton(v) if k != "seed_words" else "words") for k, v in value.items()]
    if isinstance(value, list):
        shapes: list[Any] = []
        for item in value:
            shape = _skeleton(item)
            if shape not in shapes:
                shapes.append(shape)
        return shapes
    return type(value).__name__


# ------------------------------------------------------------------------------------------------ task configs
def test_the_fixture_set_is_aif_gens_nineteen_configs():
    assert len(CONFIGS) == 19
    assert sorted(p.stem for p in CONFIGS) == sorted(EXPECTED_STYLES)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_aif_gen_config_generates_offline_with_its_tasks_and_counts(config, tmp_path):
    specs = _task_specs(config)
    out = tmp_path / "ds"
    result = _cli("generate", config, "-o", out, "--backend", "offline", "--num-samples", CAP, "--no-progress")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == f"wrote {len(specs)} stages to {out}"

    ds = load_continual_dataset(out)
    components = EXPECTED_COMPONENTS.get(config.stem, config.stem.split("_")[0])
    names = [f"task{i}-{components}" for i in range(len(specs))]
    assert ds.names == names
    assert [info["weights"] for info in ds.metadata["stages"]] == [{n: 1.0} for n in names]
    # the config's own counts are what the uncapped config asks for (the cap replaces each of them)
    assert [t.num_samples for t in load_task_config(config).tasks] == [s["num_samples"] for s in specs]
    bank = load_phrase_bank()
    styles = EXPECTED_STYLES[config.stem]
    for dd, name, style in zip(ds, names, styles):
        rows = [*dd["train"], *dd["test"]]
        assert len(rows) == CAP
        assert {r["source_task"] for r in rows} == {name} and {r["style"] for r in rows} == {style}
        rubric = rubric_for(style, bank)
        markers = GenerationSpec().markers_per_response
        assert [(rubric.score(r["chosen"]), rubric.score(r["rejected"])) for r in rows] == [(markers, -markers)] * CAP


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_aif_gen_config_dry_run_with_the_openai_backend_plans_the_configs_counts(config, tmp_path):
    specs = _task_specs(config)
    result = _cli("generate", config, "-o", tmp_path / "ds", "--backend", "openai", "--model", "m", "--dry-run")
    assert result.exit_code == 0, result.output
    total = sum(s["num_samples"] for s in specs)
    assert result.output.splitlines()[0] == (
        f"dataset {config.stem!r}: {len(specs)} stages, {total} samples (0 already cached), 2 requests per sample"
    )
    planned = [int(n) for n in re.findall(r"^\s+\[\s*\d+\] \S+\s+n=(\d+)", result.output, re.M)]
    assert planned == [s["num_samples"] for s in specs]
    assert "backend: openai (m), mode pair" in result.output
    assert not (tmp_path / "ds").exists()


def test_domains_follow_aif_gens_rules():
    """No value / no seed_words: the built-in vocabulary of the component's name; weights as given or 1/n."""
    tech_physics = load_task_config(FIXTURES / "config/static/tech_physics_summary_eli5.yaml").tasks[0].domain
    assert tech_physics["technology"].seed_words == [
        "engineering",
        "AI",
        "internet",
        "computer",
        "innovation",
        "machine learning",
    ]
    assert len(tech_physics["physics"].seed_words) == 15 and tech_physics["physics"].weight == 0.5
    tech_health = load_task_config(FIXTURES / "config/static/tech_healthcare_qna_expert.yaml").tasks[0].domain
    assert tech_health["technology"].seed_words == list(VOCABULARIES["technology"])
    assert tech_health["healthcare"].seed_words == list(VOCABULARIES["healthcare"])
    assert (tech_health["technology"].weight, tech_health["healthcare"].weight) == (0.5, 0.5)
    education = load_task_config(FIXTURES / "config/static/education_qna_eli5.yaml").tasks[0].domain
    assert education["education"].seed_words == list(VOCABULARIES["education"])
    assert education["education"].weight == 1.0
    mock = load_task_config(FIXTURES / "config/mock_config.yaml").tasks[0].domain  # description: (no value)
    assert (mock["healthcare"].weight, mock["technology"].weight) == (0.5, 0.5)
    aliased = config_to_rlhf_ext(_one_task({"a": {"seed_words": "finance", "weight": 3}, "politics": {"weight": 1}}))
    # unnormalised weights are kept, as AIF-Gen keeps them
    assert aliased["tasks"][0]["domain"] == {
        "a": {"seed_words": list(VOCABULARIES["finance"]), "weight": 3},
        "politics": {"seed_words": list(VOCABULARIES["politics"]), "weight": 1},
    }


def _one_task(domain: dict[str, Any], preference: str = "Directly answer the question.") -> dict[str, Any]:
    task = {"objective": "Ask a question", "preference": preference, "domain": domain}
    return {"task_specs": [{"num_samples": 4, "alignment_task": task}]}


@pytest.mark.parametrize(
    ("domain", "message"),
    [
        (
            {"b": {"weight": 1}},
            "task_specs[0].alignment_task.domain.b: the component has no seed_words and 'b' is not a built-in "
            "vocabulary (education, finance, healthcare, politics, technology); list its words: "
            "seed_words: [word, ...]",
        ),
        (
            {"education": {"weight": 1}, "finance": None},
            "task_specs[0].alignment_task.domain: weight is given for education but not for finance; give every "
            "component a weight or none (uniform)",
        ),
        (
            {"education": {"seed_word": ["x"]}},
            "task_specs[0].alignment_task.domain.education: unknown key 'seed_word'; valid keys here: description, "
            "name, seed_words, weight",
        ),
    ],
)
def test_invalid_aif_gen_domains_name_the_key(domain, message):
    with pytest.raises(RecipeError) as e:
        config_to_rlhf_ext(_one_task(domain))
    assert str(e.value) == message


def test_format_option_chooses_the_config_format(tmp_path):
    aif = FIXTURES / "config/static/education_qna_eli5.yaml"
    forced = _cli("generate", aif, "-o", tmp_path / "a", "--format", "rlhf-ext", "--dry-run")
    assert forced.exit_code == 2
    assert f"{aif}: unknown key 'task_specs'" in forced.output
    native = _cli("generate", "continual-piecewise-qa", "-o", tmp_path / "b", "--format", "aif-gen", "--dry-run")
    assert native.exit_code == 2
    assert "not an AIF-Gen task config: it has no task_specs (it has: drift, generation, name, " in native.output
    both = _cli("generate", aif, "-o", tmp_path / "c", "--format", "plain", "--format", "conversational")
    assert both.exit_code == 2
    assert "--format takes at most one output format (plain|conversational)" in both.output
    conversational = tmp_path / "d"
    ok = _cli(
        "generate", aif, "-o", conversational, "--format", "aif-gen", "--format", "conversational", "--num-samples", 7
    )
    assert ok.exit_code == 0, ok.output
    ds = load_continual_dataset(conversational)
    assert ds.format == "conversational"
    exported = dataset_to_aif_gen(ds)["datasets"][0]["train"]
    assert [s["chosen"] for s in exported] == [r["chosen"][0]["content"] for r in ds[0]["train"]]


# ------------------------------------------------------------------------------------------ vocabularies, styles
def test_builtin_vocabularies_have_about_a_hundred_distinct_words():
    assert sorted(VOCABULARIES) == ["education", "finance", "healthcare", "politics", "technology"]
    for words in VOCABULARIES.values():
        assert 90 <= len(words) <= 100
        assert len({w.lower() for w in words}) == len(words)


def test_free_form_preferences_get_a_derived_style_that_the_rubric_scores():
    assert preference_style_name("Make the headline polarizing") == "pref:headline-polarizing"
    assert preference_style("Make the headline polarizing") == "pref:headline-polarizing"
    assert preference_style("Explain at an expert level.") == "expert"
    # several packaged styles match ("hint" and "direct answer"): the derived style keeps the wording
    assert preference_style("Give a hint, not a direct answer") == "pref:give-hint-not-direct-answer"
    bank = load_phrase_bank()
    rubric = rubric_for("pref:headline-polarizing", bank)
    assert rubric.positive[1] == "written with headline polarizing firmly in mind"
    assert rubric.negative[1] == "written with no regard for headline polarizing at all"
    assert bank.family("pref:headline-polarizing") == ["pref:headline-polarizing:contrary"]
    assert rubric.score("Also, written with headline polarizing firmly in mind.") == 1
    with pytest.raises(RecipeError) as e:
        config_to_rlhf_ext(_one_task({"education": None}, preference="!!!"))
    assert str(e.value) == (
        "task_specs[0].alignment_task.preference: preference '!!!' has no words to derive a phrase-bank style from; "
        "add style: NAME to the alignment_task"
    )


#: AIF-Gen's own test-suite task config (its tests' ``mock_config_dict``): free-form objective and preference texts.
AIF_GEN_TEST_CONFIG = {"task_specs": [
    {"num_samples": 5, "alignment_task": {
        "domain": {"Component A": {"seed_words": ["a_foo", "a_bar", "a_baz"]},
                   "Component B": {"seed_words": ["b_foo", "b_bar", "b_baz"]}},
        "objective": f"Mock Objective {i}", "preference": f"Mock Preference {i}"}}
    for i in (1, 2)
]}  # fmt: skip


def test_aif_gens_test_suite_config_generates_offline(tmp_path):
    """It failed offline on ``objective_kind`` (a key AIF-Gen does not define), naming ``tasks[0]`` where the file says
    ``task_specs[0]``: free-form objectives now get the generic kind, like free-form preferences a derived style."""
    config = tmp_path / "mock.yaml"
    config.write_text(yaml.safe_dump(AIF_GEN_TEST_CONFIG))
    result = _cli("generate", config, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    stages = load_continual_dataset(tmp_path / "out").stages
    assert [len(st["train"]) + len(st["test"]) for st in stages] == [5, 5]
    mapped = config_to_rlhf_ext(AIF_GEN_TEST_CONFIG)["tasks"]
    assert [t["objective_kind"] for t in mapped] == ["generation", "generation"]
    assert "objective_kind" not in config_to_rlhf_ext(_one_task({"education": None}))["tasks"][0]  # inferable: qa
    bad = _one_task({"education": None})
    bad["task_specs"][0]["alignment_task"]["objective_kind"] = "poem"
    with pytest.raises(RecipeError, match=r"^task_specs\[0\]\.alignment_task\.objective_kind: unknown kind 'poem'"):
        config_to_rlhf_ext(bad)


# ------------------------------------------------------------------------------------------------ dataset JSON
def test_import_reads_aif_gens_dataset_json(tmp_path):
    result = _cli("import", DEBUG_JSON, "-o", tmp_path / "imp")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"wrote 2 stages (190 train / 190 test rows) to {tmp_path / 'imp'}"
    ds = load_continual_dataset(tmp_path / "imp")
    peer = json.loads(DEBUG_JSON.read_text())["datasets"]
    assert ds.names == ["task0-education", "task1-education"]
    for dd, entry in zip(ds, peer):
        for split in ("train", "test"):
            assert [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in dd[split]] == entry[split]
        assert {r["style"] for r in dd["train"]} == {"hinted"}
    assert (
        ds.metadata["config"]["tasks"][0]["domain"]["education"]["seed_words"]
        == (peer[0]["task"]["domain"]["education"]["seed_words"])
    )


def test_import_export_import_round_trip_is_identical(tmp_path):
    assert _cli("import", DEBUG_JSON, "-o", tmp_path / "a").exit_code == 0
    exported = _cli("export", tmp_path / "a", "-o", tmp_path / "exp", "--format", "aif-gen")
    assert exported.exit_code == 0, exported.output
    assert exported.output.strip() == f"exported 2 stages as aif-gen to {tmp_path / 'exp' / 'data.json'}"
    assert sorted(p.name for p in (tmp_path / "exp").iterdir()) == ["data.json"]
    assert json.loads((tmp_path / "exp" / "data.json").read_text()) == json.loads(DEBUG_JSON.read_text())
    assert _cli("import", tmp_path / "exp" / "data.json", "-o", tmp_path / "b").exit_code == 0
    first, second = load_continual_dataset(tmp_path / "a"), load_continual_dataset(tmp_path / "b")
    for x, y in zip(first, second, strict=True):
        for split in ("train", "test"):
            assert x[split].to_list() == y[split].to_list()


def test_export_of_a_generated_dataset_has_the_peers_structure(tmp_path):
    out = tmp_path / "gen"
    config = FIXTURES / "config/continual/education_qna_hinted_2_direct.yaml"
    # 7 samples per task: round(7 * 0.15) = 1 test row, so both splits have samples
    assert _cli("generate", config, "-o", out, "--num-samples", 7, "--no-progress").exit_code == 0
    assert _cli("export", out, "-o", tmp_path / "exp", "--format", "aif-gen").exit_code == 0
    ours = json.loads((tmp_path / "exp" / "data.json").read_text())
    assert _skeleton(ours) == _skeleton(json.loads(DEBUG_JSON.read_text()))
    task = ours["datasets"][1]["task"]
    assert task["preference"] == "Directly answer the question."
    assert task["domain"]["education"] == {
        "name": "education",
        "seed_words": list(VOCABULARIES["education"]),
        "weight": 1.0,
    }
    # the same structure as the peer's file, read back by our importer into the same samples
    again = ContinualDataset.from_aif_gen(tmp_path / "exp" / "data.json")
    generated = load_continual_dataset(out)
    for x, y in zip(generated, again, strict=True):
        for split in ("train", "test"):
            assert x[split]["chosen"] == y[split]["chosen"] and x[split]["prompt"] == y[split]["prompt"]


def test_export_refuses_a_stage_that_mixes_tasks():
    ds = dataset_from_aif_gen(json.loads(DEBUG_JSON.read_text()), "debug")
    ds.metadata["stages"][1]["weights"] = {"task0-education": 0.5, "task1-education": 0.5}
    with pytest.raises(ValueError) as e:
        dataset_to_aif_gen(ds)
    assert str(e.value) == (
        "stage 1 (task1-education) mixes task0-education 0.50, task1-education 0.50; AIF-Gen's format has one task "
        "per dataset: export it as jsonl or parquet"
    )


def test_a_file_of_neither_format_is_one_line_and_exit_2(tmp_path):
    other = tmp_path / "other.json"
    other.write_text('{"rows": []}')
    result = _cli("import", other, "-o", tmp_path / "x")
    assert result.exit_code == 2
    assert result.output == (
        f'error: {other} is neither an AIF-Gen dataset JSON ({{"datasets": [...]}}) nor an rlhf-ext continual '
        "dataset (a directory with continual_dataset.json): it holds the keys rows\n"
    )
    text = tmp_path / "notes.txt"
    text.write_text("not json")
    result = _cli("import", text, "-o", tmp_path / "y")
    assert result.exit_code == 2
    assert result.output.endswith(f"{text} is not JSON (Expecting value at line 1 column 1)\n")
    assert len(result.output.splitlines()) == 1


def test_aif_gen_json_renamed_as_metadata_is_one_line_and_exit_2(tmp_path):
    """Before: ``KeyError: 'stages'`` (a traceback, exit 1)."""
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "continual_dataset.json").write_text(DEBUG_JSON.read_text())
    result = _cli("export", renamed, "-o", tmp_path / "out")
    assert result.exit_code == 2
    meta = renamed / "continual_dataset.json"
    assert result.output == (
        f"error: {meta} is AIF-Gen's dataset JSON, not rlhf-ext metadata: import it with "
        f"`rlhf-ext data import {meta} -o DIR`\n"
    )
    meta.write_text('{"name": "x"}')
    result = _cli("preview", renamed)
    assert result.exit_code == 2
    assert result.output == f"error: {meta} is not rlhf-ext continual-dataset metadata (it has no 'stages' list)\n"
