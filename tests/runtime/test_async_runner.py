"""OneStepAsyncRunner (paper 001, Appendix D): staleness, overlap, ordering, failures on either side, shutdown."""

from __future__ import annotations

import threading
import time
import traceback

import pytest
import torch

from rlhf_ext.online import AsyncRunnerError, OneStepAsyncRunner

N = 7
TIMEOUT = 10.0


class Recorder:
    """A generator and a learner whose 'weights' are the version number, so every handover can be checked."""

    def __init__(self, n: int = N, fail_generate_at: int | None = None, fail_train_at: int | None = None):
        self.n = n
        self.fail_generate_at = fail_generate_at
        self.fail_train_at = fail_train_at
        self.gen_weights = 0  # what the generator currently holds
        self.generated: list[tuple[int, int]] = []  # (index, version used)
        self.loaded: list[int] = []
        self.snapshots = 0
        self.learner_version = 0
        self.started = [threading.Event() for _ in range(n)]
        self.threads_in_generate: list[int] = []

    def generate(self, index: int, version: int) -> dict:
        self.started[index].set()
        self.threads_in_generate.append(torch.get_num_threads())
        if index == self.fail_generate_at:
            raise ValueError(f"boom while generating batch {index}")
        time.sleep(0.01)
        self.generated.append((index, version))
        return {"index": index, "weights_used": self.gen_weights}

    def load(self, weights: int, version: int) -> None:
        assert weights == version
        self.loaded.append(version)
        self.gen_weights = weights

    def snapshot(self) -> int:
        self.snapshots += 1
        return self.learner_version

    def train(self, batch):
        if batch.index == self.fail_train_at:
            raise RuntimeError(f"learner boom at batch {batch.index}")
        # the data really was produced with the weights of the version the batch claims
        assert batch.data["weights_used"] == batch.version
        assert batch.data["index"] == batch.index
        time.sleep(0.01)
        self.learner_version += 1
        return self.snapshot


def _runner_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("rlhf-ext-generator")]


@pytest.mark.parametrize("sync", [False, True])
def test_every_batch_trained_once_with_the_scheduled_staleness(sync):
    rec = Recorder()
    runner = OneStepAsyncRunner(rec.generate, num_batches=N, load_weights_fn=rec.load, sync=sync)
    stats = runner.run(rec.train)
    lag = 0 if sync else 1
    # (index, generating version, learner version when trained)
    assert stats.trained == [(k, max(k - lag, 0), k) for k in range(N)]
    assert [i for i, _ in rec.generated] == list(range(N))  # each batch generated exactly once, in order
    if sync:
        assert dict(stats.staleness) == {0: N}
        assert rec.loaded == list(range(1, N))
        assert rec.snapshots == N - 1  # the final update's weights are never needed
    else:
        assert dict(stats.staleness) == {0: 1, 1: N - 1}  # batch 0 is on-policy, every later one is 1 version old
        assert rec.loaded == list(range(1, N - 1))
        assert rec.snapshots == N - 2
    assert runner.version == N
    assert not _runner_threads()


def test_async_overlaps_generation_of_next_batch_with_training():
    rec = Recorder()
    overlapped = []

    def train(batch):
        nxt = batch.index + 1
        if nxt < N:  # generation of batch t+1 must start while batch t is being trained
            overlapped.append(rec.started[nxt].wait(timeout=TIMEOUT))
        return rec.train(batch)

    OneStepAsyncRunner(rec.generate, num_batches=N, load_weights_fn=rec.load).run(train)
    assert overlapped == [True] * (N - 1)


def test_sync_never_generates_ahead_of_the_learner():
    rec = Recorder()
    ahead = []

    def train(batch):
        time.sleep(0.05)  # give a wrongly scheduled generator time to start
        if batch.index + 1 < N:
            ahead.append(rec.started[batch.index + 1].is_set())
        return rec.train(batch)

    OneStepAsyncRunner(rec.generate, num_batches=N, load_weights_fn=rec.load, sync=True).run(train)
    assert ahead == [False] * (N - 1)


def test_generator_failure_stops_the_learner_with_its_traceback():
    rec = Recorder(fail_generate_at=3)
    runner = OneStepAsyncRunner(rec.generate, num_batches=N, load_weights_fn=rec.load)
    with pytest.raises(AsyncRunnerError) as info:
        runner.run(rec.train)
    assert isinstance(info.value.__cause__, ValueError)
    assert "boom while generating batch 3" in str(info.value)
    assert "in generate" in str(info.value)  # the generator's frames, not the learner's
    assert [k for k, _, _ in runner.stats.trained] == [0, 1, 2]
    assert not _runner_threads()


def test_learner_failure_stops_the_generator_and_propagates_unchanged():
    rec = Recorder(fail_train_at=2)
    runner = OneStepAsyncRunner(rec.generate, num_batches=N, load_weights_fn=rec.load)
    with pytest.raises(RuntimeError, match="learner boom at batch 2") as info:
        runner.run(rec.train)
    assert not isinstance(info.value, AsyncRunnerError)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert frames[-1] == "train"
    # batch 3 (generated with theta_2 while batch 2 trained) may exist; batch 4 needs theta_3, which never existed
    assert max(i for i, _ in rec.generated) <= 3
    assert max(v for _, v in rec.generated) <= 2
    assert not _runner_threads()


def test_learner_failure_while_generator_blocks_on_a_full_queue():
    # a slow learner: the generator finishes batch t+1 and blocks in put(); the failure must still unblock it
    def train(batch):
        time.sleep(0.1)
        raise KeyboardInterrupt

    rec = Recorder()
    runner = OneStepAsyncRunner(rec.generate, num_batches=N, load_weights_fn=rec.load)
    with pytest.raises(KeyboardInterrupt):
        runner.run(train)
    assert not _runner_threads()


def test_pull_mode_and_misuse():
    rec = Recorder()
    with OneStepAsyncRunner(rec.generate, num_batches=N, load_weights_fn=rec.load) as runner:
        batch = runner.next_batch()
        with pytest.raises(RuntimeError, match="publish"):
            runner.next_batch()
        runner.publish(rec.train(batch))
        with pytest.raises(RuntimeError, match="publish"):
            runner.publish(0)
        seen = [b.index for b in _train_all(runner, rec)]
    assert seen == list(range(1, N))
    assert not _runner_threads()


def _train_all(runner, rec):
    for b in runner:
        runner.publish(rec.train(b))
        yield b


def test_learner_may_stop_early_and_nothing_is_left_running():
    rec = Recorder()
    with OneStepAsyncRunner(rec.generate, num_batches=N, load_weights_fn=rec.load) as runner:
        for b in runner:
            runner.publish(rec.train(b))
            if b.index == 1:
                break
    assert not _runner_threads()
    assert max(i for i, _ in rec.generated) <= 3


def test_thread_budgets_apply_per_role():
    rec = Recorder(n=3)
    before = torch.get_num_threads()
    learner_threads = []

    def train(batch):
        learner_threads.append(torch.get_num_threads())
        return rec.train(batch)

    OneStepAsyncRunner(
        rec.generate, num_batches=3, load_weights_fn=rec.load, generator_threads=1, learner_threads=1
    ).run(train)
    assert rec.threads_in_generate == [1, 1, 1] and learner_threads == [1, 1, 1]
    assert torch.get_num_threads() == before


def test_constructor_errors():
    with pytest.raises(ValueError, match="num_batches"):
        OneStepAsyncRunner(lambda i, v: None, num_batches=0, sync=True)
    with pytest.raises(ValueError, match="load_weights_fn"):
        OneStepAsyncRunner(lambda i, v: None, num_batches=3)
    runner = OneStepAsyncRunner(lambda i, v: None, num_batches=1, sync=True)
    with pytest.raises(RuntimeError, match="start"):
        runner.next_batch()


# ----------------------------------------------------------------------------------------------- process mode
def _probe_run(probe, sync=False, fail_train_at=None, n=5):
    import os

    from tests.helpers.async_probe import version_weights

    seen = []

    def train(batch):
        if batch.index == fail_train_at:
            raise RuntimeError(f"learner boom at batch {batch.index}")
        assert batch.data["weights_used"] == batch.version and batch.data["pid"] != os.getpid()
        seen.append(batch)
        return version_weights(batch.index + 1)

    runner = OneStepAsyncRunner(
        probe.generate, num_batches=n, load_weights_fn=probe.load_weights, sync=sync, process=True, generator_threads=1
    )
    return runner, seen, train


def test_process_generator_keeps_the_one_step_schedule():
    from tests.helpers.async_probe import VersionProbe

    runner, seen, train = _probe_run(VersionProbe())
    stats = runner.run(train)
    assert stats.trained == [(k, max(k - 1, 0), k) for k in range(5)]
    assert all(b.data["threads"] == 1 for b in seen)
    assert not runner._worker.is_alive() and runner._worker.exitcode == 0


def test_process_generator_failure_reaches_the_learner_with_its_traceback():
    from tests.helpers.async_probe import VersionProbe

    runner, seen, train = _probe_run(VersionProbe(fail_at=2))
    with pytest.raises(AsyncRunnerError, match="probe failed while generating batch 2") as info:
        runner.run(train)
    assert isinstance(info.value.__cause__, ValueError)
    assert "in generate" in str(info.value)
    assert [b.index for b in seen] == [0, 1]
    assert not runner._worker.is_alive()


def test_learner_failure_stops_the_generator_process():
    from tests.helpers.async_probe import VersionProbe

    runner, _, train = _probe_run(VersionProbe(sleep=0.2), fail_train_at=1)
    with pytest.raises(RuntimeError, match="learner boom at batch 1"):
        runner.run(train)
    assert not runner._worker.is_alive()


def test_shared_tensors_pack_a_state_dict_exactly():
    """A generator process receives a state dict as one shared buffer per dtype: the same names, dtypes, shapes and
    values as sent (a copy: the learner goes on changing its own tensors)."""
    from rlhf_ext.runtime.async_runner import SharedTensors

    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(3, 4, generator=g).t(),  # not contiguous
        "b": torch.randn(5, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7),
        "mask": torch.tensor([True, False]),
        "empty": torch.zeros(0, 2),
        "v": torch.randn(2, 2, generator=g),
    }
    packed = SharedTensors(tensors)
    assert set(packed.buffers) == {torch.float32, torch.bfloat16, torch.int64, torch.bool}
    assert all(b.is_shared() for b in packed.buffers.values())
    assert packed.buffers[torch.float32].numel() == 12 + 0 + 4
    out = packed.unpack()
    assert list(out) == list(tensors)
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name], tensor), name
    tensors["w"].add_(1.0)
    assert not torch.equal(out["w"], tensors["w"])
    assert SharedTensors.packable(tensors)
    assert not SharedTensors.packable({}) and not SharedTensors.packable({"a": 1}) and not SharedTensors.packable([1])


def _module_level_reward(prompts, responses):
    return [0.0] * len(responses)


def test_generator_process_by_default_only_where_it_can_run_and_pays(monkeypatch):
    from rlhf_ext.algos.pair_selection import OnlineSamplingKnobs
    from rlhf_ext.runtime.pair_collection import wants_generator_process

    assert OnlineSamplingKnobs().generator_process is None  # the default is decided per run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert wants_generator_process(None, True, "auto", _module_level_reward) is True
    assert wants_generator_process(None, True, "hf", _module_level_reward) is True
    assert wants_generator_process(None, False, "hf", _module_level_reward) is False  # sync: nothing to overlap
    assert wants_generator_process(None, True, "vllm", _module_level_reward) is False  # vLLM has its own process
    assert wants_generator_process(None, True, "hf", lambda p, r: [0.0] * len(r)) is False  # does not pickle
    assert wants_generator_process(False, True, "hf", _module_level_reward) is False  # asked: kept
    assert wants_generator_process(True, False, "hf", _module_level_reward) is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert wants_generator_process(None, True, "auto", _module_level_reward) is False  # GPU: vLLM or HF on the GPU
