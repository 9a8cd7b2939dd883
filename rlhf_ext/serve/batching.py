"""Scoring for ``rlhf-ext serve rm``: tokenised pairs, e_phi and segment spans of a padded batch, and the batcher that
groups the pairs of concurrent requests for one scoring thread."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rlhf_ext.runtime.dense_sources import EncodedResponse, SegmentRewardSpans
from rlhf_ext.runtime.spans import Span
from rlhf_ext.runtime.token_scores import SegmentScorer
from rlhf_ext.serve.protocol import Message, response_after_prompt

logger = logging.getLogger(__name__)


class SegmentEvaluator:
    """e_phi and segment spans of tokenised pairs in padded batches, with a loaded :class:`SegmentScorer`, through
    :class:`~rlhf_ext.runtime.dense_sources.SegmentRewardSpans` (the dense source the trainers use)."""

    def __init__(self, scorer: SegmentScorer, max_length: int | None = None):
        self.scorer = scorer
        self.max_length = max_length or getattr(scorer.reward_model.config, "max_position_embeddings", None)
        self.spans = SegmentRewardSpans(scorer, max_length=self.max_length)

    def encode(self, prompt: str | list[Message], response: str | list[Message]) -> EncodedResponse:
        """Tokenise a pair as the reward model's training data was (prompt and response separately, EOS appended, cut
        to ``max_length``), with the response tokens' character offsets."""
        return self.spans.encode(prompt or None, response)

    def response_of_query(self, query: str, prompt: str, index: int) -> str:
        """:func:`response_after_prompt` with this model's tokenizer."""
        with self.scorer.tokenizer_lock:  # a fast tokenizer refuses calls from two threads at once
            return response_after_prompt(query, prompt, self.scorer.tokenizer, index)

    def evaluate(self, pairs: Sequence[EncodedResponse]) -> tuple[list[float], list[int], list[list[Span]]]:
        """e_phi (paper 003 Eq. 4), the number of segments and the segment spans over the response text of each pair,
        from one forward of each model on the right-padded batch."""
        values, spans = self.spans.score(pairs)
        return values, [len(s) for s in spans], spans


class ScorerStopped(RuntimeError):
    """The batcher's scoring thread has ended: no pair will be scored until the server is restarted."""


@dataclass
class _Job:
    """The pairs of one request, filled in by the batcher; ``done`` is set (and ``on_done`` called, from the scoring
    thread) when all are scored or one failed."""

    size: int
    on_done: Callable[[], None] | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.values: list[float] = [0.0] * self.size
        self.segments: list[int] = [0] * self.size
        self.spans: list[list[Span] | None] = [None] * self.size
        self.remaining = self.size

    def finish(self, error: BaseException | None = None) -> None:
        if self.done.is_set():
            return
        self.error = error
        self.done.set()
        if self.on_done is not None:
            self.on_done()


class MicroBatcher:
    """Groups the pairs of concurrent requests into batches for one scoring thread.

    A batch takes the pairs waiting (from any request, in arrival order), up to ``max_batch_size``, and closes as soon
    as no other pair is waiting: a lone request is scored at once, and requests that arrive while a batch is scored
    form the next one. With ``max_wait_ms > 0`` the first pair of a batch also waits up to that long for company. The
    batch is scored by ``score_batch`` (pairs -> (values, segment counts[, spans])) and each value is written to its own
    request's slot. A failing batch fails every request with a pair in it; if the thread itself ends, every waiting
    and later request fails with :class:`ScorerStopped` and :attr:`failure` says why.
    """

    def __init__(
        self, score_batch: Callable[[Sequence[EncodedResponse]], tuple], max_batch_size: int, max_wait_ms: float = 0.0
    ):
        self.score_batch = score_batch
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self._queue: queue.SimpleQueue[tuple[_Job, int, EncodedResponse] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # submit vs the thread's end: no job is queued after the last drain
        self.failure: str | None = None
        self.batches = 0
        self.pairs = 0
        self._thread = threading.Thread(target=self._run, name="rm-batcher", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the scoring thread runs (and takes new pairs)."""
        return self.failure is None

    def submit(self, pairs: Sequence[EncodedResponse], on_done: Callable[[], None] | None = None) -> _Job:
        """Queue the pairs of one request; ``on_done`` is called from the scoring thread when the job is done."""
        job = _Job(len(pairs), on_done)
        with self._lock:
            if self.failure is not None:
                raise ScorerStopped(self.failure)
            for index, pair in enumerate(pairs):
                self._queue.put((job, index, pair))
        if not pairs:
            job.finish()
        return job

    def close(self) -> None:
        """Score what is queued, then end the thread."""
        with self._lock:
            if self.failure is None:
                self._queue.put(None)
        self._thread.join()

    def _collect(self) -> list[tuple[_Job, int, EncodedResponse]] | None:
        first = self._queue.get()
        if first is None:
            return None
        batch = [first]
        deadline = time.monotonic() + self.max_wait_s
        while len(batch) < self.max_batch_size:
            wait = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)  # finish this batch, then stop
                break
            batch.append(item)
        return batch

    def _score(self, batch: list[tuple[_Job, int, EncodedResponse]]) -> None:
        try:
            values, segments, *spans = self.score_batch([pair for _, _, pair in batch])
        except Exception as error:  # the requests answer 500 with it; the server goes on
            logger.exception("scoring a batch of %d pairs failed", len(batch))
            for job, _, _ in batch:
                job.finish(error)
            return
        self.batches += 1
        self.pairs += len(batch)
        spans = spans[0] if spans else [None] * len(batch)
        for (job, index, _), value, count, span in zip(batch, values, segments, spans):  # only this thread writes jobs
            job.values[index], job.segments[index], job.spans[index] = value, count, span
            job.remaining -= 1
            if job.remaining == 0:
                job.finish()

    def _run(self) -> None:
        batch: list[tuple[_Job, int, EncodedResponse]] = []
        reason = "closed"
        try:
            while (batch := self._collect()) is not None:
                self._score(batch)
            batch = []
        except BaseException as error:  # the thread ends here; health and every request say so
            reason = f"the scoring thread stopped: {type(error).__name__}: {error}; restart the server"
            logger.exception("the scoring thread stopped")
        finally:
            with self._lock:
                self.failure = reason
                left = list(batch)
                while not self._queue.empty():  # no one else puts or gets while the lock is held
                    left.append(self._queue.get_nowait())
            stopped = ScorerStopped(reason)
            for item in left:
                if item is not None:
                    item[0].finish(stopped)
