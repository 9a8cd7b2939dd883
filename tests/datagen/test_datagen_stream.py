"""Streaming, sharded generation (issue 28): the stage files the streaming writer makes are those ``datasets`` makes,
memory does not grow with the sample count, and the dataset is byte-identical for any number of worker processes,
on a rerun and after a resumed run."""

from __future__ import annotations

import json
import os
import random
import tracemalloc
from pathlib import Path

import pytest

from rlhf_ext.algos.knobs import KnobError
from rlhf_ext.datagen import BackendUnavailable, OfflineBackend, SampleCache, generate_dataset, load_phrase_bank
from rlhf_ext.datagen.cache import CACHE_DIR, SAMPLES_FILE
from tests.datagen.test_datagen_generate import small_config, tree_digest


def random_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    text = "abc é漢 \n\"'"

    def s(k: int) -> str:
        return "".join(rng.choice(text) for _ in range(rng.randint(0, k)))

    return [
        {
            "prompt": s(80),
            "chosen": s(300),
            "rejected": s(300),
            "source_task": s(5),
            "style": s(3),
            "seed_words": [s(6) for _ in range(rng.randint(0, 3))],
            "sample_id": f"{i:020x}",
            "swapped": rng.random() < 0.3,
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("fmt", ["plain", "conversational"])
def test_split_writer_writes_the_files_save_to_disk_writes(fmt, tmp_path):
    from datasets import Dataset, DatasetDict, load_from_disk

    from rlhf_ext.datagen.arrow_stage import BATCH_ROWS, SplitWriter, write_dataset_dict
    from rlhf_ext.datagen.dataset import features

    feats = features(fmt)

    def conv(row: dict) -> dict:
        if fmt == "plain":
            return row
        roles = {"prompt": "user", "chosen": "assistant", "rejected": "assistant"}
        return {**row, **{k: [{"role": r, "content": row[k]}] for k, r in roles.items()}}

    for n in (0, 1, 7, BATCH_ROWS, 2 * BATCH_ROWS + 3):
        rows = random_rows(n, seed=n)
        ours = tmp_path / f"ours-{n}"
        for split, part in (("train", rows), ("test", rows[:2])):
            writer = SplitWriter(ours / split, fmt)
            for row in part:
                writer.add(row)
            assert writer.close() == len(part)
        write_dataset_dict(ours, ("train", "test"))
        ref = tmp_path / f"ref-{n}"
        columns = {split: {k: [conv(r)[k] for r in part] for k in feats} for split, part in (("train", rows),
                   ("test", rows[:2]))}  # fmt: skip
        dd = DatasetDict({k: Dataset.from_dict(v, features=feats) for k, v in columns.items()})
        dd.save_to_disk(str(ref), num_shards={"train": 1, "test": 1})
        loaded = load_from_disk(str(ours))
        for split in ("train", "test"):
            assert loaded[split].features == feats
            assert loaded[split].to_list() == dd[split].to_list()
        files = sorted(p.relative_to(ref) for p in ref.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(ours) for p in ours.rglob("*") if p.is_file())
        for rel in files:
            same = (ref / rel).read_bytes() == (ours / rel).read_bytes()
            if rel.name == "state.json":  # only the fingerprint differs
                a, b = json.loads((ref / rel).read_text()), json.loads((ours / rel).read_text())
                assert a.pop("_fingerprint") != b.pop("_fingerprint") and a == b
            elif rel.suffix == ".arrow" and n > BATCH_ROWS and rel.parts[0] == "train":
                assert not same  # buffer padding of save_to_disk's table slices (the rows are equal, above)
            else:
                assert same, (n, rel)


def test_stage_keys_are_the_stable_hash_of_each_sample():
    from rlhf_ext.datagen.drift import allocate_sources
    from rlhf_ext.datagen.plan import plan_generation
    from rlhf_ext.runtime.io import stable_hash

    plan = plan_generation("continual-lipschitz", num_samples=30)
    assert sum(len(set(allocate_sources(stage))) > 1 for stage in plan.stages) == 6  # blends of two tasks
    for stage in plan.stages:
        sources = allocate_sources(stage)
        expected = [
            stable_hash(plan.generation_fingerprint, plan.tasks[name].fingerprint, stage.seed, j, length=20)
            for j, name in enumerate(sources)
        ]
        assert plan.stage_keys(stage) == expected
        assert [job.key for job in plan.stage_jobs(stage, [3, 1])] == [expected[3], expected[1]]


def test_workers_give_the_same_bytes_fresh_rerun_and_resumed(tmp_path):
    one = generate_dataset(small_config(), tmp_path / "one", progress=False)
    digest = tree_digest(tmp_path / "one")
    two = generate_dataset(small_config(), tmp_path / "two", progress=False, workers=2)
    assert tree_digest(tmp_path / "two") == digest
    assert two.run_stats["generated"] == one.run_stats["generated"] == 52
    shard = tmp_path / "two" / CACHE_DIR / "samples-1.jsonl"
    own = (tmp_path / "two" / CACHE_DIR / SAMPLES_FILE).read_text().splitlines()
    assert len(own) + len(shard.read_text().splitlines()) == 52 and 20 <= len(own) <= 32  # every 2nd of each stage
    again = generate_dataset(small_config(), tmp_path / "two", progress=False, workers=2)  # a rerun: all cached
    assert again.run_stats["reused"] == 52 and tree_digest(tmp_path / "two") == digest
    # resumed with another worker count after a smaller run: the same dataset as one uninterrupted process
    generate_dataset(small_config(), tmp_path / "three", num_samples=5, progress=False, workers=3)
    resumed = generate_dataset(small_config(), tmp_path / "three", progress=False, workers=2)
    assert resumed.run_stats["reused"] == 30 and resumed.run_stats["attempted"] == 22
    assert tree_digest(tmp_path / "three") == digest
    with SampleCache(tmp_path / "three" / CACHE_DIR) as cache:
        assert len(cache) == 52  # samples.jsonl, samples-1.jsonl, samples-2.jsonl


def test_worker_count_is_checked(tmp_path):
    with pytest.raises(KnobError, match="workers must be an integer in"):
        generate_dataset(small_config(), tmp_path / "a", progress=False, workers=0)
    backend = OfflineBackend(load_phrase_bank())
    with pytest.raises(ValueError, match="pass backend= only with workers=1"):
        generate_dataset(small_config(), tmp_path / "b", progress=False, workers=2, backend=backend)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cache_index_spans_shard_files_and_keeps_the_first_record(tmp_path):
    from rlhf_ext.datagen.cache import SampleAppender

    with SampleCache(tmp_path) as cache:
        cache.append({"key": "k1", "status": "ok", "n": 1})
        other = SampleAppender(cache.shard_path(1))
        other.append({"key": "k2", "status": "skipped", "reason": "judge_tie"})
        other.append({"key": "k1", "status": "ok", "n": 2})  # a duplicate in a later file: the first record wins
        other.close()
        assert "k1" not in cache  # appended since the cache was opened
        cache.refresh()
        assert len(cache) == 2 and cache.get("k1")["n"] == 1
        where, ok = cache.locate(["k2", "nope", "k1"])
        assert [w >= 0 for w in where] == [True, False, True] and ok.tolist() == [False, False, True]
    with SampleCache(tmp_path) as cache:
        assert sorted(cache.keys()) == ["k1", "k2"] and cache.get("k2")["reason"] == "judge_tie"


def generation_peak(tmp_path, num_samples: int) -> int:
    """Peak Python-heap bytes (tracemalloc) of an offline run of ``continual-lipschitz`` (9 stages)."""
    generate_dataset("continual-lipschitz", tmp_path / "warm", num_samples=2, progress=False)  # imports, caches
    tracemalloc.start()
    try:
        generate_dataset("continual-lipschitz", tmp_path / f"n{num_samples}", num_samples=num_samples, progress=False)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_memory_does_not_grow_with_the_sample_count(tmp_path):
    """1,800 vs 7,200 samples: a run that holds its samples needs ~3 KB more per extra sample (main before issue 28:
    +15.5 MB measured); streaming needs the index (~40 B per sample), a batch per split and the cache scan's lists (~100
    B per record, turned into arrays every 65536 records): +0.84 MB measured."""
    small, large = generation_peak(tmp_path, 200), generation_peak(tmp_path, 800)
    assert large - small < 5400 * 200, (small, large)


def test_a_worker_that_cannot_reach_its_server_stops_the_run_with_the_resume_message(tmp_path):
    from tests.datagen.test_openai_backend import closed_port

    url = f"generation.api_base=http://127.0.0.1:{closed_port()}/v1"
    with pytest.raises(BackendUnavailable, match="rerun the same command to resume") as err:
        generate_dataset(small_config(), tmp_path / "a", overrides=["generation.backend=openai", url], workers=2,
                         progress=False)  # fmt: skip
    assert "ConnectError" in str(err.value) and "0/52 samples are finished" in str(err.value)
    assert not (tmp_path / "a" / "continual_dataset.json").exists()


@pytest.mark.parametrize("workers", [3, 5])
def test_workers_write_the_stages_the_parent_only_the_metadata(tmp_path, monkeypatch, workers):
    """``workers=N``: the stages are written in the worker processes (the parent's ``write_stage`` fails here, the
    spawned workers import their own), on uneven shares (52 samples in stages of 12, 8 and 6 samples over 3 or 5
    workers), and the bytes are those of one process."""
    from rlhf_ext.datagen import assemble

    generate_dataset(small_config(), tmp_path / "one", progress=False)

    def parent_writes(*args):
        raise AssertionError("the parent wrote a stage")

    monkeypatch.setattr(assemble, "write_stage", parent_writes)
    ds = generate_dataset(small_config(), tmp_path / "n", progress=False, workers=workers)
    assert tree_digest(tmp_path / "n") == tree_digest(tmp_path / "one")
    assert ds.run_stats["generated"] == 52 and [len(s["train"]) + len(s["test"]) for s in ds] == [12, 8, 6] * 2
    with pytest.raises(AssertionError, match="the parent wrote a stage"):  # all cached: no workers, the parent writes
        generate_dataset(small_config(), tmp_path / "n", progress=False, workers=workers)


def test_a_sharded_run_imports_datasets_only_to_load_the_result(tmp_path):
    """The parent of ``workers=2`` writes only the metadata: ``datasets`` is first imported by the final load."""
    import subprocess
    import sys

    code = (
        "import sys, json\n"
        "from rlhf_ext.datagen import dataset, generate_dataset\n"
        "from tests.datagen.test_datagen_generate import small_config\n"
        "load, seen = dataset.ContinualDataset.load, []\n"
        "def spy(path):\n"
        "    seen.append('datasets' in sys.modules)\n"
        "    return load(path)\n"
        "dataset.ContinualDataset.load = spy\n"
        "if __name__ == '__main__':\n"
        "    ds = generate_dataset(small_config(), sys.argv[1], progress=False, workers=2)\n"
        "    print(json.dumps([seen, len(ds[1]['train'])]))\n"
    )
    script = tmp_path / "run.py"
    script.write_text(code)
    root = str(Path(__file__).resolve().parents[2])  # the script imports this repository's tests package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "d")], capture_output=True, text=True, check=True,
                         env=env)  # fmt: skip
    seen, train = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == [False] and train == 8  # stage 1: task expert, 8 samples, test_ratio 0


class _Process:
    """A worker process handle as ``ShardedRun`` reads it: ``exitcode`` is ``None`` while it runs."""

    def __init__(self, exitcode: int | None):
        self.exitcode = exitcode


def _fake_run(procs: list[_Process]):
    import queue
    from types import SimpleNamespace

    from rlhf_ext.datagen.runner import ShardedRun

    run = ShardedRun.__new__(ShardedRun)  # the parent side only: no processes are spawned
    run.workers, run.procs, run.messages = len(procs), procs, queue.Queue()
    run.commands = [queue.Queue() for _ in procs]
    run.plan = SimpleNamespace(stages=[SimpleNamespace(num_samples=4)])
    run.cache = SimpleNamespace(index_state=dict)
    return run


def test_a_worker_that_reported_and_exited_is_not_taken_for_a_crash():
    """Worker 1 had no stage to write: it reports and exits (code 0) while worker 0 still writes its stage. The parent
    waits for worker 0 instead of failing with 'a generation worker stopped without reporting' (a race that failed
    the byte-identity test above on a loaded machine)."""
    import threading

    run = _fake_run([_Process(None), _Process(0)])
    run.messages.put(("assembled", 1, []))
    later = threading.Timer(1.5, run.messages.put, args=(("assembled", 0, [{"rows": 4}]),))  # > the 0.5 s poll
    later.start()
    assert run.write_stages([(0, Path("stage-0"))]) == [{"rows": 4}]
    later.join()
    assert run.commands[0].get_nowait() == ("assemble", {}, [(0, "stage-0")])
    assert run.commands[1].get_nowait() == ("assemble", {}, [])


def test_a_worker_that_exited_before_its_report_is_a_crash():
    run = _fake_run([_Process(None), _Process(-9)])
    run.messages.put(("assembled", 0, [{"rows": 4}]))
    with pytest.raises(
        RuntimeError, match=r"a generation worker stopped without reporting \(exit codes \[None, -9\]\)"
    ):
        run.write_stages([(0, Path("stage-0"))])
