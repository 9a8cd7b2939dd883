"""Running sample jobs: one sample's backend calls (:class:`SampleRunner`), a pool of ``max_concurrency`` asyncio
workers over a job stream (:func:`run_jobs`), and the sharded run that spreads the pending samples over worker
processes, which then write the dataset's stages (:class:`ShardedRun`). ``rlhf_ext.datagen.generate`` plans the
jobs; ``rlhf_ext.datagen.assemble`` writes the dataset.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import pickle
import random
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_ext.datagen.backends import make_backend
from rlhf_ext.datagen.cache import SampleAppender, SampleCache, scan_records
from rlhf_ext.datagen.chat import Backend, BackendError, BackendUnavailable, ChatCompletion, ChatRequest
from rlhf_ext.datagen.drift import derive_seed
from rlhf_ext.datagen.judge import make_judge
from rlhf_ext.datagen.mappers import UnparseableOutput, parse_pair, sample_axes, sample_seed_words
from rlhf_ext.datagen.phrasebank import PhraseBank, load_phrase_bank
from rlhf_ext.datagen.plan import PROMPT_MAPPER, RESPONSE_MAPPER, plan_generation

if TYPE_CHECKING:
    from rlhf_ext.datagen.plan import GenerationPlan, SampleJob
    from rlhf_ext.datagen.schema import DatagenConfig


class _Skip(Exception):
    """A sample cannot be used (permanent): ``reason`` is counted and cached."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason


def _text(completion: ChatCompletion, request: ChatRequest) -> str:
    if completion.finish_reason == "length":
        raise _Skip("truncated", f"the {request.kind} answer hit max_tokens={request.max_tokens}")
    text = completion.text.strip()
    if not text:
        raise _Skip("empty_output", f"the {request.kind} answer is empty")
    return text


async def _gather(*aws):
    """``asyncio.gather`` that cancels the other awaitables when one fails."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _record(job: SampleJob, **fields: Any) -> dict[str, Any]:
    """A cache record: the job's identity plus ``status`` and its payload."""
    ident = {"key": job.key, "stage": job.stage.index, "index": job.index, "seed": job.seed}
    return {**ident, "task": job.task.spec.name, **fields}


class SampleRunner:
    def __init__(self, plan: GenerationPlan, backend: Backend, bank: PhraseBank):
        self.plan = plan
        self.gen = plan.config.generation
        self.backend = backend
        self.judge = make_judge(self.gen.resolved_judge(), backend, bank, self.gen.max_tokens_judge)

    def _request(self, kind: str, content: str, seed: int, max_tokens: int, ctx: dict[str, Any]) -> ChatRequest:
        return ChatRequest(kind, [{"role": "user", "content": content}], seed, max_tokens, self.gen.temperature, ctx)

    async def sample(self, job: SampleJob) -> dict[str, Any]:
        """Generate one sample; returns its cache record (``status`` ok or skipped). A failed request raises
        :class:`BackendError` (never a record: only answers are cached)."""
        try:
            sample, info = await self._generate(job)
            info["model"] = self.backend.describe().get("model")
        except _Skip as s:
            return _record(job, status="skipped", reason=s.reason, detail=self.backend.redact(str(s))[:200])
        return _record(job, status="ok", sample=sample, info=info)

    async def _generate(self, job: SampleJob) -> tuple[dict[str, Any], dict[str, Any]]:
        task, gen = job.task.spec, self.gen
        rng = random.Random(job.seed)
        words = sample_seed_words(task, rng)
        axes = sample_axes(task, rng)
        ctx = {"objective_kind": job.task.objective_kind, "seed_words": words, "style": job.task.style, "axes": axes}
        meta = PROMPT_MAPPER.meta_prompt(task, words)
        seeds = [derive_seed(job.seed, k) for k in range(4)]
        request = self._request("prompt", meta, seeds[0], gen.max_tokens_prompt, ctx)
        prompt = PROMPT_MAPPER.finalize(task, _text(await self.backend.complete(request), request))
        info: dict[str, Any] = {"axes": [list(a) for a in axes]}
        if gen.response_mode == "pair":
            pair_prompt = RESPONSE_MAPPER.pair_prompt(task, prompt, axes)
            request = self._request("pair", pair_prompt, seeds[1], gen.max_tokens_response, ctx)
            answer = _text(await self.backend.complete(request), request)
            try:
                chosen, rejected = parse_pair(answer)
            except UnparseableOutput as e:
                raise _Skip("pair_unparseable", f"{e}: {answer[:120]!r}") from None
        else:
            stances = RESPONSE_MAPPER.sample_stances(task, rng)
            texts = [RESPONSE_MAPPER.response_prompt(task, prompt, stance, axes) for stance in stances]
            requests = [
                self._request("response", text, seeds[1 + k], gen.max_tokens_response, {**ctx, "stance": stance})
                for k, (text, stance) in enumerate(zip(texts, stances))
            ]
            answers = await _gather(*(self.backend.complete(r) for r in requests))
            first, second = [_text(c, r) for c, r in zip(answers, requests)]
            verdict = await self.judge.judge(task, job.task.style, prompt, first, second, seeds[3])
            if verdict.winner is None:
                raise _Skip(verdict.reason or "judge_undecided", verdict.raw or "")
            chosen, rejected = (first, second) if verdict.winner == 0 else (second, first)
            info.update(stances=list(stances), winner=verdict.winner, judge=verdict.raw)
        sample = {"prompt": prompt, "chosen": chosen, "rejected": rejected, "source_task": task.name}
        return {**sample, "style": job.task.style or "", "seed_words": words}, info


async def run_jobs(
    runner: SampleRunner,
    pending: Pending,
    sink: SampleCache | SampleAppender,
    bar,
    counts: Counter,
    max_concurrency: int,
    errors: dict[str, str],
) -> None:
    """Run the ``pending`` jobs with ``max_concurrency`` workers between the backend's start and close, appending each
    record to ``sink``; ``counts`` gets the outcomes, ``errors`` each failure's first message."""
    plan = runner.plan
    jobs = (job for s, positions in pending for job in plan.stage_jobs(plan.stages[s], positions))

    async def worker() -> None:
        for job in jobs:  # one shared iterator: every job is taken exactly once
            try:
                record = await runner.sample(job)
            except BackendUnavailable:
                raise
            except BackendError as e:  # not cached: the next run attempts the sample again
                counts[f"retry_later:{e.reason}"] += 1
                errors.setdefault(e.reason, " ".join(runner.backend.redact(str(e)).split())[:300])
                bar.update(1)
                continue
            sink.append(record)
            counts["generated" if record["status"] == "ok" else f"skipped:{record['reason']}"] += 1
            bar.update(1)
            skipped = {k.split(":", 1)[1]: v for k, v in counts.items() if ":" in k}
            if skipped:
                bar.set_postfix(skipped, refresh=False)

    await runner.backend.start()
    num_jobs = sum(len(p) for _, p in pending)
    workers = [asyncio.create_task(worker()) for _ in range(max(1, min(max_concurrency, num_jobs)))]
    try:
        done, _ = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if isinstance(t.exception(), BackendUnavailable):
                raise BackendUnavailable(runner.backend.redact(str(t.exception()))) from t.exception()
            if t.exception() is not None:
                raise t.exception()
    finally:
        for t in workers:
            t.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await runner.backend.close()


Pending = list[tuple[int, Any]]  # (position of the stage in plan.stages, numpy array of sample indices)


def pending_jobs(plan: GenerationPlan, cache: SampleCache) -> Pending:
    """The samples of each stage that are not cached (failures never were: they are tried again)."""
    return [(s, (cache.locate(plan.stage_keys(stage))[0] < 0).nonzero()[0]) for s, stage in enumerate(plan.stages)]


class _QueueBar:
    """The progress-bar interface of a worker process: forwards counts to the parent every ``every`` samples."""

    def __init__(self, queue, every: int = 200):
        self.queue, self.every, self.n = queue, every, 0

    def update(self, n: int) -> None:
        self.n += n
        if self.n >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.n:
            self.queue.put(("progress", self.n))
            self.n = 0

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass


def _shard_worker(
    config: DatagenConfig, cache_dir: str, worker: int, num_workers: int, pending: Pending, queue, commands
):
    """One process of a sharded run: generates every ``num_workers``-th pending sample into its own cache file,
    reports ``("progress", n)`` and ``("done", worker, counts, errors, (path, start, end, scan_records entries))`` on
    ``queue``, then takes ``("assemble", index_state, [(stage position, directory), ...])`` (reporting ``("assembled",
    worker, results)``) or ``("stop",)`` from ``commands``. An exception is reported as ``("error", exception)``."""
    from rlhf_ext.datagen.assemble import write_stage

    bar = _QueueBar(queue)
    try:
        plan = plan_generation(config)
        gen = config.generation
        bank = load_phrase_bank(gen.phrase_bank)
        concurrency = max(1, math.ceil(gen.max_concurrency / num_workers))
        runner = SampleRunner(plan, make_backend(dataclasses.replace(gen, max_concurrency=concurrency), bank), bank)
        share = [(s, positions[worker::num_workers]) for s, positions in pending]
        counts: Counter = Counter()
        errors: dict[str, str] = {}
        path = SampleCache(cache_dir).shard_path(worker)
        start = path.stat().st_size if path.exists() else 0  # the parent's index covers the file up to here
        appender = SampleAppender(path)
        try:
            asyncio.run(run_jobs(runner, share, appender, bar, counts, concurrency, errors))
        finally:
            appender.close()
            bar.flush()
        entries = scan_records(path, start)  # this run's records: never a NOT_FINAL reason, never torn
        queue.put(("done", worker, dict(counts), errors, (str(path), start, path.stat().st_size, entries)))
        command = commands.get()
        if command[0] == "assemble":
            cache = SampleCache.from_index_state(cache_dir, command[1])
            try:
                results = [write_stage(plan, cache, i, Path(d)) for i, d in command[2]]
            finally:
                cache.close()
            queue.put(("assembled", worker, results))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        bar.flush()
        try:
            pickle.dumps(e)
        except Exception:  # noqa: BLE001 - what cannot travel is sent as its text
            e = RuntimeError(f"{type(e).__name__}: {e}")
        queue.put(("error", e))


class ShardedRun:
    """``workers`` spawned processes that generate ``pending`` (:meth:`generate`) and then write the dataset's stages
    (:meth:`write_stages`, the ``write_stages`` of ``assemble.write_dataset``): this process only merges their index
    entries and writes the metadata. Use as a context manager: on exit every worker is stopped."""

    def __init__(self, plan: GenerationPlan, cache: SampleCache, pending: Pending, workers: int):
        import multiprocessing as mp

        self.plan, self.cache, self.workers = plan, cache, workers
        ctx = mp.get_context("spawn")
        self.messages = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(workers)]
        args = (plan.config, str(cache.directory))
        self.procs = [
            ctx.Process(target=_shard_worker, args=(*args, w, workers, pending, self.messages, cmds), daemon=True)
            for w, cmds in enumerate(self.commands)
        ]

    def __enter__(self) -> ShardedRun:
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        for p, commands in zip(self.procs, self.commands):
            if p.is_alive():
                if exc_type is None:
                    commands.put(("stop",))
                else:  # a failed run: the workers may still be generating
                    p.terminate()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join()

    def _receive(self, owing: set[int]) -> tuple:
        """The next message of any worker. An error message is raised; so is a worker in ``owing`` (those whose
        report is still to come) that exited without sending it. A worker that reported and exited is no crash."""
        import queue as queue_mod

        while True:
            # checked before the wait: a process's messages are all in the queue once it has exited
            exited = any(self.procs[w].exitcode is not None for w in owing)
            try:
                message = self.messages.get(True, 0.5)
            except queue_mod.Empty:
                if exited:
                    codes = [p.exitcode for p in self.procs]
                    raise RuntimeError(f"a generation worker stopped without reporting (exit codes {codes})") from None
                continue
            if message[0] == "error":
                raise message[1]
            return message

    async def generate(self, bar, counts: Counter, errors: dict[str, str]) -> None:
        """Run the pending samples; the first error stops them all and is raised here. The workers' records are
        added to the cache's index from their own scans."""
        owing = set(range(self.workers))
        while owing:
            message = await asyncio.to_thread(self._receive, owing)
            if message[0] == "progress":
                bar.update(message[1])
            else:  # done
                _, worker, worker_counts, worker_errors, (path, start, end, entries) = message
                owing.discard(worker)
                counts.update(worker_counts)
                for reason, line in worker_errors.items():
                    errors.setdefault(reason, line)
                self.cache.add_records(Path(path), start, end, entries)

    def write_stages(self, jobs: list[tuple[int, Path]]) -> list[dict[str, Any]]:
        """Write the stages ``[(stage position, directory), ...]`` in the workers, whole stages each, balanced by
        sample count (largest first, to the least loaded worker); returns their results in ``jobs`` order."""
        shares: list[list[tuple[int, str]]] = [[] for _ in range(self.workers)]
        loads = [0] * self.workers
        for i, directory in sorted(jobs, key=lambda job: (-self.plan.stages[job[0]].num_samples, job[0])):
            w = loads.index(min(loads))
            shares[w].append((i, str(directory)))
            loads[w] += self.plan.stages[i].num_samples
        state = self.cache.index_state()
        for commands, share in zip(self.commands, shares):
            commands.put(("assemble", state, sorted(share)))
        results: dict[int, dict[str, Any]] = {}
        owing = set(range(self.workers))
        while owing:
            _, worker, done = self._receive(owing)
            owing.discard(worker)
            results.update((i, r) for (i, _), r in zip(sorted(shares[worker]), done))
        return [results[i] for i, _ in jobs]
