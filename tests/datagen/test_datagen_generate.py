"""Offline generation end to end: determinism, drift in the data, gold labels, resume, cache, dataset API."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from rlhf_ext.datagen import (
    BackendUnavailable,
    CacheLockedError,
    ContinualDataset,
    OfflineBackend,
    SampleCache,
    generate_dataset,
    gold_score,
    load_continual_dataset,
    load_phrase_bank,
    merge,
    preference_swap,
    resplit,
    subsample,
)
from rlhf_ext.datagen.cache import CACHE_DIR, SAMPLES_FILE

EDU = {"physics": {"seed_words": ["gravity", "friction", "orbit", "lens"]}, "math": {"seed_words": ["prime", "limit"]}}
POL = {"politics": {"seed_words": ["ballot", "senate", "tax reform"], "weight": 2.0}}


def small_config(**drift):
    return {
        "name": "small",
        "seed": 11,
        "drift": drift or {"type": "piecewise", "cycles": 2},
        "tasks": [
            {
                "name": "eli5",
                "objective": "Ask a physics question.",
                "preference": "Explain it like I'm five.",
                "domain": EDU,
                "num_samples": 12,
                "test_ratio": 0.25,
            },
            {
                "name": "expert",
                "objective": "Ask a physics question.",
                "preference": "Explain at an expert level.",
                "domain": EDU,
                "num_samples": 8,
                "test_ratio": 0.0,
            },
            {
                "name": "rapper",
                "objective": "Write a political blog post.",
                "preference": "Continue the story in the style of a rapper.",
                "domain": POL,
                "num_samples": 6,
                "metadata": {"prompt_prefix": "Post: ", "seed_words_per_prompt": 1},
            },
        ],
    }


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every dataset file (the cache is not part of the dataset)."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file() and CACHE_DIR not in p.relative_to(path).parts
    }


def test_same_config_and_seed_give_byte_identical_datasets(tmp_path):
    a = generate_dataset(small_config(), tmp_path / "a", progress=False)
    generate_dataset(small_config(), tmp_path / "b", progress=False)
    digest = tree_digest(tmp_path / "a")
    assert digest == tree_digest(tmp_path / "b")
    assert len([k for k in digest if k.endswith(".arrow")]) == 2 * len(a) == 12
    # one request at a time instead of 256: the same stage data; the metadata records the setting
    generate_dataset(small_config(), tmp_path / "c", overrides=["generation.max_concurrency=1"], progress=False)
    serial = tree_digest(tmp_path / "c")
    assert {k: v for k, v in serial.items() if k.startswith("stages")} == {
        k: v for k, v in digest.items() if k.startswith("stages")
    }
    meta_a = json.loads((tmp_path / "a" / "continual_dataset.json").read_text())
    meta_c = json.loads((tmp_path / "c" / "continual_dataset.json").read_text())
    meta_c["config"]["generation"]["max_concurrency"] = 256
    assert meta_a == meta_c
    other = generate_dataset(small_config(), tmp_path / "c", overrides=["seed=12"], progress=False)
    assert list(other[0]["train"]["chosen"]) != list(a[0]["train"]["chosen"])


def test_piecewise_stages_contain_exactly_their_task(tmp_path):
    ds = generate_dataset(small_config(), tmp_path / "out", progress=False)
    assert ds.names == ["eli5", "expert", "rapper", "eli5#c2", "expert#c2", "rapper#c2"]
    expected = [("eli5", 9, 3), ("expert", 8, 0), ("rapper", 5, 1)] * 2
    for dd, (task, n_train, n_test) in zip(ds, expected):
        assert (len(dd["train"]), len(dd["test"])) == (n_train, n_test)
        rows = dd["train"].to_list() + dd["test"].to_list()
        assert {r["source_task"] for r in rows} == {task}
        assert len({r["sample_id"] for r in rows}) == len(rows)
        for r in rows:
            assert gold_score(r["chosen"], r["style"]) == 2 and gold_score(r["rejected"], r["style"]) == -2
            vocab = POL if task == "rapper" else EDU
            words = {w for comp in vocab.values() for w in comp["seed_words"]}
            assert set(r["seed_words"]) <= words and all(w in r["prompt"] for w in r["seed_words"])
    assert all(r["prompt"].startswith("Post: ") for r in ds[2]["train"])
    assert list(ds[0]["train"]["prompt"]) != list(ds[3]["train"]["prompt"])  # cycle 2 draws new samples
    meta = json.loads((tmp_path / "out" / "continual_dataset.json").read_text())
    assert meta["drift"]["mode"] == "combined" and meta["stats"] == {
        "generated": 52,
        "missing": 0,
        "planned": 52,
        "skipped": 0,
    }
    assert [s["dir"] for s in meta["stages"]][3] == "stages/003-eli5_c2"


def test_lipschitz_stages_blend_source_tasks(tmp_path):
    ds = generate_dataset(small_config(type="lipschitz", lipschitz_constant=0.5), tmp_path / "out", progress=False)
    infos = ds.metadata["stages"]
    assert [i["name"] for i in infos] == ["eli5", "eli5>expert[0.5]", "expert", "expert>rapper[0.5]", "rapper"]
    assert infos[1]["source_counts"] == {"eli5": 5, "expert": 5} and infos[1]["num_samples"] == 10
    for info, dd in zip(infos, ds):
        rows = dd["train"].to_list() + dd["test"].to_list()
        counts = {t: sum(r["source_task"] == t for r in rows) for t in info["weights"]}
        assert counts == info["source_counts"]
        for r in rows:  # each row carries its own source task's preference
            assert gold_score(r["chosen"], r["style"]) > gold_score(r["rejected"], r["style"])


def test_preference_swap_noise_is_recorded_and_reverses_gold(tmp_path):
    ds = generate_dataset(
        small_config(), tmp_path / "out", overrides=["generation.preference_swap=0.3"], progress=False
    )
    rows = [r for dd in ds for split in ("train", "test") for r in dd[split]]
    swapped = [r for r in rows if r["swapped"]]
    assert 0.15 < len(swapped) / len(rows) < 0.45
    for r in rows:
        sign = -1 if r["swapped"] else 1
        assert sign * (gold_score(r["chosen"], r["style"]) - gold_score(r["rejected"], r["style"])) == 4
    # the noise is applied on assembly: the clean run's samples are the same (same cache keys)
    clean = generate_dataset(small_config(), tmp_path / "clean", progress=False)
    assert sorted(r["sample_id"] for dd in clean for r in dd["train"]) == sorted(
        r["sample_id"] for dd in ds for r in dd["train"]
    )


def test_judged_mode_with_the_rule_judge_counts_ties(tmp_path):
    ds = generate_dataset(
        small_config(),
        tmp_path / "out",
        overrides=["generation.response_mode=judged", "generation.judge=rule"],
        progress=False,
    )
    stats = ds.metadata["stats"]
    assert stats["generated"] + stats["skipped"] == stats["planned"] == 52 and stats["missing"] == 0
    assert stats["skipped"] > 0 and ds.run_stats["skipped:judge_tie"] == stats["skipped"]
    for dd in ds:
        for r in dd["train"]:
            assert gold_score(r["chosen"], r["style"]) > gold_score(r["rejected"], r["style"])
    # ties are permanent: a rerun does not retry them
    again = generate_dataset(
        small_config(), tmp_path / "out", overrides=["generation.response_mode=judged"], progress=False
    )
    assert again.run_stats["attempted"] == 0 and again.metadata["stats"] == stats


class FailingBackend(OfflineBackend):
    """Offline backend that loses its server after ``limit`` requests."""

    def __init__(self, limit: int):
        super().__init__(load_phrase_bank())
        self.limit = limit
        self.calls = 0

    async def complete(self, request):
        self.calls += 1
        if self.calls > self.limit:
            raise BackendUnavailable("server went away")
        return await super().complete(request)


def test_resume_after_an_interrupted_run_gives_the_uninterrupted_dataset(tmp_path):
    reference = tmp_path / "reference"
    generate_dataset(small_config(), reference, progress=False)
    out = tmp_path / "out"
    with pytest.raises(BackendUnavailable, match="rerun the same command to resume") as err:
        generate_dataset(small_config(), out, backend=FailingBackend(limit=41), progress=False)
    assert "/52 samples are finished and cached" in str(err.value)
    lines = (out / CACHE_DIR / SAMPLES_FILE).read_text().splitlines()
    assert len(lines) == 20  # two requests per sample: 20 samples finished, the 21st was in flight
    assert not (out / "continual_dataset.json").exists()
    with pytest.raises(FileNotFoundError, match="rerun `rlhf-ext data generate` to resume"):
        load_continual_dataset(out)
    # simulate a kill -9 in the middle of a write: a torn last line
    with open(out / CACHE_DIR / SAMPLES_FILE, "ab") as f:
        f.write(b'{"key": "torn", "status": "o')
    resumed = generate_dataset(small_config(), out, progress=False)
    assert resumed.run_stats["reused"] == 20 and resumed.run_stats["attempted"] == 32
    assert tree_digest(out) == tree_digest(reference)
    keys = [json.loads(line)["key"] for line in (out / CACHE_DIR / SAMPLES_FILE).read_text().splitlines()]
    assert len(keys) == len(set(keys)) == 52  # no duplicates, the torn line is gone


def test_more_samples_extend_the_cache(tmp_path):
    out = tmp_path / "out"
    small = generate_dataset(small_config(), out, num_samples=4, progress=False)
    assert small.metadata["stats"]["planned"] == 24
    bigger = generate_dataset(small_config(), out, num_samples=6, progress=False)
    assert bigger.run_stats["reused"] == 24 and bigger.run_stats["attempted"] == 12
    ids = {r["sample_id"] for dd in small for s in ("train", "test") for r in dd[s]}
    assert ids < {r["sample_id"] for dd in bigger for s in ("train", "test") for r in dd[s]}


def test_cache_lock_and_repair(tmp_path):
    with SampleCache(tmp_path) as cache:
        cache.append({"key": "a", "status": "ok"})
        cache.append({"key": "a", "status": "other"})  # duplicate keys are ignored
        with pytest.raises(CacheLockedError, match="another generation run"):
            SampleCache(tmp_path).open()
    (tmp_path / SAMPLES_FILE).open("a").write('{"key": "b", "status": "ok"}\n{"key": "c", "sta')
    with SampleCache(tmp_path) as cache:
        assert set(cache.keys()) == {"a", "b"} and cache.repaired_bytes == len('{"key": "c", "sta')
        assert cache.get("a")["status"] == "ok"
        cache.append({"key": "c", "status": "ok"})
    assert (tmp_path / SAMPLES_FILE).read_text().endswith('{"key": "c", "status": "ok"}\n')


def test_conversational_format_and_roundtrip(tmp_path):
    ds = generate_dataset(small_config(), tmp_path / "out", overrides=["output.format=conversational"], progress=False)
    row = ds[0]["train"][0]
    assert row["prompt"][0]["role"] == "user" and row["chosen"][0]["role"] == "assistant"
    loaded = load_continual_dataset(tmp_path / "out")
    assert isinstance(loaded, ContinualDataset) and loaded.format == "conversational"
    assert [dict(d["train"][0]) for d in loaded] == [dict(d["train"][0]) for d in ds]
    assert list(loaded["expert#c2"]["train"]["sample_id"]) == list(ds[4]["train"]["sample_id"])
    assert len(loaded["expert"]["test"]) == 0 and loaded["expert"]["test"].features == ds[0]["train"].features


def test_transforms_export_and_merge(tmp_path, monkeypatch):
    from datasets import load_dataset

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    ds = generate_dataset(small_config(), tmp_path / "out", progress=False)
    flipped = preference_swap(ds, p=1.0, seed=0)
    for a, b in zip(ds, flipped):
        assert list(a["train"]["chosen"]) == list(b["train"]["rejected"]) and all(b["train"]["swapped"])
    assert flipped.metadata["transforms"] == [{"type": "preference_swap", "p": 1.0, "seed": 0}]
    half = preference_swap(ds, p=0.5, seed=1)
    n_swapped = sum(sum(d["train"]["swapped"]) for d in half)
    assert 0 < n_swapped < sum(len(d["train"]) for d in half)

    split = resplit(ds, test_ratio=0.5, seed=0)
    assert [(len(d["train"]), len(d["test"])) for d in split] == [(6, 6), (4, 4), (3, 3)] * 2
    assert sorted([*split[0]["train"]["sample_id"], *split[0]["test"]["sample_id"]]) == sorted(
        [*ds[0]["train"]["sample_id"], *ds[0]["test"]["sample_id"]]
    )
    sampled = subsample(ds, keep_train=2, keep_ratio_test=0.0, seed=0)
    assert [(len(d["train"]), len(d["test"])) for d in sampled] == [(2, 0)] * 6
    with pytest.raises(ValueError, match="not both"):
        subsample(ds, keep_ratio_train=0.5, keep_train=2)

    merged = merge([ds, sampled])
    assert len(merged) == 12 and merged.names[6:] == ds.names
    merged.save(tmp_path / "merged")
    back = load_continual_dataset(tmp_path / "merged")
    assert [len(d["train"]) for d in back] == [9, 8, 5, 9, 8, 5] + [2] * 6

    ds.to_jsonl(tmp_path / "jsonl")
    ds.to_parquet(tmp_path / "parquet")
    for fmt, ext in (("jsonl", "json"), ("parquet", "parquet")):
        part = load_dataset(ext, data_files=str(tmp_path / fmt / "003-eli5_c2" / f"train.{fmt}"), split="train")
        assert list(part["chosen"]) == list(ds[3]["train"]["chosen"])
    assert json.loads((tmp_path / "jsonl" / "continual_dataset.json").read_text())["name"] == "small"

    with pytest.raises(RuntimeError, match="needs a Hugging Face token"):
        ds.push_to_hub("someone/some-dataset", token="")


def test_builtin_continual_dataset(cache_dir):
    from rlhf_ext.datagen.builtin import resolve_continual_dataset

    path = resolve_continual_dataset("builtin:continual-piecewise-qa")
    assert Path(path).is_relative_to(cache_dir)
    ds = load_continual_dataset("builtin:continual-piecewise-qa")
    assert ds.names == [
        "education_qna_hinted",
        "education_qna_direct",
        "education_qna_hinted#c2",
        "education_qna_direct#c2",
    ]
    assert [len(d["train"]) + len(d["test"]) for d in ds] == [200] * 4
    with pytest.raises(ValueError, match="unknown builtin continual dataset"):
        load_continual_dataset("builtin:continual-nope")
