"""One-step asynchronous off-policy RLHF: generation and learning overlap (paper 001, section 3.5 and Appendix D).

Appendix D (Cleanba-style asynchronous RLHF), with ``theta_t`` the policy after ``t`` updates::

    generate batch 0 with theta_0
    for t = 0, 1, ...:                      # both run at the same time
        learner:   train on batch t          theta_t -> theta_{t+1}
        generator: load theta_t, generate batch t+1 with theta_t

so every batch after the first is exactly one version old (batch 0 is on-policy); ``sync=True`` is the on-policy
baseline through the same code (staleness 0).

:class:`OneStepAsyncRunner` runs the generator in a background thread (or process) and the learner in the caller's,
joined by two queues of size 1 (batches, new weights), and checks each batch's order and version. A generator exception
is re-raised in the learner as :class:`AsyncRunnerError` (chained, with its traceback); a learner exception stops the
generator and propagates unchanged. On exit the generator is joined.

Two ways to drive it::

    # 1. hand the runner a train function
    stats = OneStepAsyncRunner(generate_fn, num_batches=100, load_weights_fn=load).run(train_fn)

    # 2. pull batches (e.g. from a training framework's data loader) and publish after each optimizer step
    with OneStepAsyncRunner(generate_fn, num_batches=100, load_weights_fn=load) as runner:
        for batch in runner:
            ...                                  # one update on batch.data
            runner.publish(lambda: snapshot(model))

Published weights must be a snapshot (e.g. cloned tensors): the learner keeps changing its own parameters while
the generator uses them.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import queue
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")

_POLL_SECONDS = 0.02


class AsyncRunnerError(RuntimeError):
    """The generator thread failed; the original exception is chained as ``__cause__``."""


class StalenessError(RuntimeError):
    """A batch reached the learner with a policy version other than the one-step (or on-policy) schedule allows."""


@dataclass(frozen=True)
class Batch(Generic[T]):
    """One generated batch: its position in the stream, the policy version that generated it, and its data."""

    index: int
    version: int
    data: T
    generate_seconds: float = 0.0


@dataclass
class RunnerStats:
    """What happened during a run (filled in as it goes): ``staleness`` ``{learner_version - batch_version: count}``,
    ``trained`` ``(batch index, batch version, learner version)`` per batch; per batch, seconds in ``generate_fn``,
    between receiving a batch and publishing its update (``train``), and waiting for it; ``publish_seconds``: when
    (since ``start()``) each update was published (steady-state throughput is its slope)."""

    staleness: Counter = field(default_factory=Counter)
    trained: list[tuple[int, int, int]] = field(default_factory=list)
    generate_seconds: list[float] = field(default_factory=list)
    train_seconds: list[float] = field(default_factory=list)
    wait_seconds: list[float] = field(default_factory=list)
    publish_seconds: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {
            "staleness": {int(k): int(v) for k, v in sorted(self.staleness.items())},
            "trained": [list(t) for t in self.trained],
        }


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads in *this* thread (OpenMP's setting is per thread), then restore."""
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _put(q, item: Any, stop) -> bool:
    """Put with polling, giving up when ``stop`` is set (works for thread and process queues)."""
    while not stop.is_set():
        with contextlib.suppress(queue.Full):
            q.put(item, timeout=_POLL_SECONDS)
            return True
    return False


def _get(q, stop) -> Any:
    """Get with polling; None once ``stop`` is set and nothing arrived."""
    while True:
        with contextlib.suppress(queue.Empty):
            return q.get(timeout=_POLL_SECONDS)
        if stop.is_set():
            return None


def _picklable(e: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any failure means "send the text only"
        return None


class SharedTensors:
    """A dict of CPU tensors packed into one shared-memory buffer per dtype, for a generator process: one segment per
    dtype instead of one per tensor (each costs a socket round trip, ~0.4 ms, on every update's critical path).
    :meth:`unpack` gives views with the original names, shapes and dtypes; each instance is a fresh buffer."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        sizes: dict[torch.dtype, int] = {}
        self.layout: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        for name, tensor in tensors.items():
            offset = sizes.get(tensor.dtype, 0)
            self.layout.append((name, tensor.dtype, tuple(tensor.shape), offset))
            sizes[tensor.dtype] = offset + tensor.numel()
        self.buffers = {dtype: torch.empty(n, dtype=dtype).share_memory_() for dtype, n in sizes.items()}
        with torch.no_grad():
            for tensor, view in zip(tensors.values(), self._views()):
                view.copy_(tensor)

    @staticmethod
    def packable(payload: Any) -> bool:
        """Whether ``payload`` is a non-empty dict of CPU tensors (what a policy's state dict snapshot is)."""
        return (
            isinstance(payload, Mapping)
            and len(payload) > 0
            and all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in payload.values())
        )

    def _views(self) -> list[torch.Tensor]:
        return [self.buffers[dtype][offset : offset + math.prod(shape)].view(shape)
                for _, dtype, shape, offset in self.layout]  # fmt: skip

    def unpack(self) -> dict[str, torch.Tensor]:
        """The tensors, as views into the shared buffers."""
        return {name: view for (name, *_), view in zip(self.layout, self._views())}


def _generator_loop(generate_fn, load_weights_fn, num_batches: int, lag: int, threads, batches, weights, stop, errors):
    """The generator side of Appendix D (in a thread or a spawned process): batch ``k`` is generated with
    ``theta_{max(k - lag, 0)}`` (published ``weights`` are loaded until it holds that version); a failure is reported
    through ``errors`` as ``(traceback text, exception or None)`` and sets ``stop``."""
    loaded = 0
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        for index in range(num_batches):
            need = max(index - lag, 0)
            while loaded < need:
                item = _get(weights, stop)
                if item is None:
                    return
                version, payload = item
                if isinstance(payload, SharedTensors):
                    payload = payload.unpack()
                if load_weights_fn is not None:
                    load_weights_fn(payload, version)
                loaded = version
            if loaded != need:  # the lock-step protocol makes this impossible; fail loudly if it breaks
                raise StalenessError(f"generator holds version {loaded} for batch {index}, expected {need}")
            t0 = time.perf_counter()
            data = generate_fn(index, loaded)
            if not _put(batches, Batch(index, loaded, data, time.perf_counter() - t0), stop):
                return
    except BaseException as e:  # noqa: BLE001 - re-raised in the learner
        errors.put(("".join(traceback.format_exception(type(e), e, e.__traceback__)), _picklable(e)))
        stop.set()


def _process_main(*args) -> None:
    """Entry point of the generator process: run the loop, then exit without waiting to flush a full queue."""
    _generator_loop(*args)
    batches, stop = args[5], args[7]
    if stop.is_set():
        batches.cancel_join_thread()


class OneStepAsyncRunner(Generic[T]):
    """Overlap generation of batch ``t+1`` (with ``theta_t``) and training on batch ``t`` (paper 001, Appendix D).

    Args:
        generate_fn: ``(index, version) -> data`` — produce batch ``index`` with policy ``version`` (generator side).
        num_batches: number of batches (= learner updates) in the run.
        load_weights_fn: ``(weights, version) -> None`` — install published weights in the generator. ``None``: the
            generator shares the learner's policy object (safe with ``sync`` or a ``generate_fn`` that ignores it).
        sync: on-policy baseline (generate batch ``t+1`` only after update ``t``); staleness 0.
        generator_threads / learner_threads: torch intra-op threads for each role; ``None`` leaves the setting alone.
        process: run the generator in a spawned process, free of the interpreter lock two busy Python roles
            contend for (paper 001, A.2, "GIL"); ``generate_fn`` and ``load_weights_fn`` are then pickled to the
            child (build heavy state lazily on the first call) and batches must be picklable.
    """

    def __init__(
        self,
        generate_fn: Callable[[int, int], T],
        num_batches: int,
        load_weights_fn: Callable[[Any, int], None] | None = None,
        sync: bool = False,
        generator_threads: int | None = None,
        learner_threads: int | None = None,
        process: bool = False,
        name: str = "rlhf-ext-generator",
    ):
        if not isinstance(num_batches, int) or num_batches < 1:
            raise ValueError(f"num_batches must be a positive integer, got {num_batches!r}")
        if load_weights_fn is None and not sync:
            raise ValueError(
                "asynchronous mode needs load_weights_fn: the generator must hold its own copy of the policy, "
                "because the learner updates its parameters while the generator samples (or use sync=True)"
            )
        if load_weights_fn is None and process:
            raise ValueError("a generator process cannot share the learner's policy object; pass load_weights_fn")
        self.generate_fn, self.load_weights_fn, self.num_batches = generate_fn, load_weights_fn, num_batches
        self.sync, self.lag = sync, 0 if sync else 1  # batch k is generated with theta_{max(k - lag, 0)}
        self.generator_threads, self.learner_threads = generator_threads, learner_threads
        self.process, self.name = process, name
        self.stats = RunnerStats()
        if process:
            import torch.multiprocessing as mp  # registers the shared-memory tensor reductions

            self._ctx = mp.get_context("spawn")
        Queue, Event = (self._ctx.Queue, self._ctx.Event) if process else (queue.Queue, threading.Event)
        self._batches, self._weights, self._errors = Queue(maxsize=1), Queue(maxsize=1), Queue()
        self._stop = Event()
        self._worker: threading.Thread | Any | None = None
        self._error: BaseException | None = None
        self._error_text: str | None = None
        self._version, self._next_index = 0, 0  # learner: updates done, next batch expected
        self._awaiting_publish, self._received_at, self._started_at = False, 0.0, 0.0

    # ------------------------------------------------------------------------------------------------ properties
    @property
    def version(self) -> int:
        """The learner's policy version (number of published updates)."""
        return self._version

    @property
    def delivered(self) -> int:
        """How many batches the learner has received."""
        return self._next_index

    def version_for(self, index: int) -> int:
        """The policy version batch ``index`` is generated with: ``max(index - 1, 0)`` async, ``index`` sync."""
        return max(index - self.lag, 0)

    # --------------------------------------------------------------------------------------------------- control
    def start(self) -> OneStepAsyncRunner[T]:
        if self._worker is not None:
            raise RuntimeError("the runner was already started; create a new OneStepAsyncRunner for another run")
        self._started_at = time.perf_counter()
        threads = self.generator_threads
        if threads is None and self.process:  # a fresh process would start with every core; inherit the budget
            threads = torch.get_num_threads()
        args = (self.generate_fn, self.load_weights_fn, self.num_batches, self.lag, threads)
        args += (self._batches, self._weights, self._stop, self._errors)
        worker, target = (self._ctx.Process, _process_main) if self.process else (threading.Thread, _generator_loop)
        self._worker = worker(target=target, args=args, name=self.name, daemon=True)
        self._worker.start()
        return self

    def close(self, timeout: float = 60.0) -> None:
        """Stop the generator and wait for it (a ``generate_fn`` call in progress finishes first). A generator
        process still alive after ``timeout`` seconds is terminated."""
        self._stop.set()
        if self._worker is None:
            return
        if self.process:
            self._weights.cancel_join_thread()  # do not block on weights the child will never read
            with contextlib.suppress(queue.Empty):  # unblock a child waiting to flush a batch
                while True:
                    self._batches.get_nowait()
            self._worker.join(timeout)
            if self._worker.is_alive():
                self._worker.terminate()
                self._worker.join()
        else:
            self._worker.join()

    def __enter__(self) -> OneStepAsyncRunner[T]:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
        if exc is None:
            self._raise_generator_error()

    def _raise_generator_error(self, wait: float = 0.0) -> None:
        """Raise the failure the generator reported, if any; ``wait`` seconds for a report still in flight."""
        if self._error_text is None:
            with contextlib.suppress(queue.Empty):
                item = self._errors.get(timeout=wait) if wait > 0 else self._errors.get_nowait()
                self._error_text, self._error = item
        if self._error_text is not None:
            raise AsyncRunnerError(
                f"the generator failed; the learner stopped.\n--- generator traceback ---\n{self._error_text}"
            ) from (self._error or RuntimeError(self._error_text))

    def _wait_for_batch(self) -> Batch[T]:
        while True:
            with contextlib.suppress(queue.Empty):
                return self._batches.get(timeout=_POLL_SECONDS)
            self._raise_generator_error()
            if self._stop.is_set():  # set by a failing generator (its report may still be in flight) or by close()
                self._raise_generator_error(wait=5.0)
                raise RuntimeError("the runner was closed while the learner was waiting for a batch")
            if self.process and not self._worker.is_alive():
                try:  # the last batch may still be in the pipe
                    return self._batches.get(timeout=1.0)
                except queue.Empty:
                    self._raise_generator_error(wait=1.0)
                    self._error_text = f"the generator process exited with code {self._worker.exitcode}"
                    self._raise_generator_error()

    # --------------------------------------------------------------------------------------------------- learner
    def __iter__(self) -> Iterator[Batch[T]]:
        while self._next_index < self.num_batches:
            yield self.next_batch()

    def next_batch(self) -> Batch[T]:
        """Block until the next batch is ready and return it (learner side)."""
        if self._worker is None:
            raise RuntimeError("start the runner first (use it as a context manager or call start())")
        if self._awaiting_publish:
            raise RuntimeError("call publish() after training on each batch, before asking for the next one")
        if self._next_index >= self.num_batches:
            raise RuntimeError(f"all {self.num_batches} batches were already delivered")
        t0 = time.perf_counter()
        batch = self._wait_for_batch()
        self.stats.wait_seconds.append(time.perf_counter() - t0)
        if batch.index != self._next_index:
            raise StalenessError(f"expected batch {self._next_index}, got batch {batch.index} (dropped or repeated)")
        staleness = self._version - batch.version
        expected = min(batch.index, self.lag)
        if staleness != expected:
            raise StalenessError(
                f"batch {batch.index} was generated by policy version {batch.version} but the learner is at "
                f"{self._version}: staleness {staleness}, the {'sync' if self.sync else 'one-step'} schedule "
                f"requires {expected}"
            )
        self.stats.staleness[staleness] += 1
        self.stats.trained.append((batch.index, batch.version, self._version))
        self.stats.generate_seconds.append(batch.generate_seconds)
        self._next_index += 1
        self._awaiting_publish = True
        self._received_at = time.perf_counter()
        return batch

    def publish(self, weights: Any = None) -> None:
        """Report one finished update: the learner's version becomes ``version + 1``. ``weights`` (or a zero-argument
        callable returning them) goes to the generator if it will generate with this version, else is not evaluated."""
        if not self._awaiting_publish:
            raise RuntimeError("publish() must follow next_batch(): one update per batch")
        self._awaiting_publish = False
        self.stats.train_seconds.append(time.perf_counter() - self._received_at)
        self._version += 1
        self.stats.wall_seconds = time.perf_counter() - self._started_at
        self.stats.publish_seconds.append(self.stats.wall_seconds)
        # the generator uses versions 1 .. version_for(num_batches - 1); later ones are never needed
        if self._version > self.version_for(self.num_batches - 1):
            return
        payload = weights() if callable(weights) else weights
        if self.process and SharedTensors.packable(payload):
            payload = SharedTensors(payload)
        if not _put(self._weights, (self._version, payload), self._stop):
            self._raise_generator_error(wait=5.0)
            raise RuntimeError("the runner was closed while publishing weights")

    def run(self, train_fn: Callable[[Batch[T]], Any]) -> RunnerStats:
        """Train on every batch: ``train_fn(batch)`` does one update and returns the new weights (or a callable
        returning them, or None when ``load_weights_fn`` ignores them). Returns the run's :class:`RunnerStats`."""
        with self, torch_threads(self.learner_threads):
            for batch in self:
                self.publish(train_fn(batch))
        return self.stats
