"""Generation: config -> drift schedule -> one job per sample -> backend calls -> cache -> ``ContinualDataset``.

Per sample (paper Algorithm 2 and Figure 3), with every random choice drawn from the sample's own seed:

1. **Prompt mapper**: sample seed words from the source task's domain, render the meta-prompt (Appendix E.1), ask
   the backend for the task prompt ``x``, wrap it in the task's prefix/suffix.
2. **Response mapper**: ``pair`` mode asks for a chosen/rejected pair in one call (Appendix E.2); ``judged`` mode
   asks for two responses (preference stated with probability ``preference_inclusion_prob``, shared auxiliary
   style axes) and lets the judge order them.
3. The record goes to the append-only cache the moment it is finished.

Samples whose answers cannot be used (unparseable pair or judge answer, a judge tie, a truncated or empty answer) are
**skipped for good**: counted, cached as skipped and not retried. Only an answer is final: samples whose requests
failed (HTTP 4xx/5xx after the backend's retries, timeouts, dropped connections, malformed bodies) are skipped **for
this run**: counted under ``retry_later:<reason>``, never cached, and attempted again by the next run of the same
command; ``run_stats["errors"]`` keeps one redacted line of the server's message per reason. If the server becomes
unreachable the run stops with :class:`BackendUnavailable`; every finished sample is already in the cache.

``workers=N`` shards the jobs over ``N`` processes (each takes every ``N``-th pending sample of every stage, runs
its own backend with ``max_concurrency / N`` requests in flight and appends to its own cache file, then writes whole
stages of the dataset, balanced by sample count: this process merges the index entries the workers scanned from their
own files and writes only the metadata; ``datasets`` is imported only to load the result); the dataset is
byte-identical for any ``N``.
Worth it for the CPU-bound ``offline`` backend; an API backend waits on the server.

After all jobs ran, the stages are assembled from the cache in index order (``rlhf_ext.datagen.assemble``;
preference-swap noise, output format and the seeded train/test split applied there) and streamed to disk record by
record (``arrow_stage``): memory holds the cache's index (~40 bytes per sample) and one batch of rows, never the
samples. The dataset (``stages/`` and ``continual_dataset.json``) depends only on the config and seed, so with the
``offline`` backend the same config and seed give byte-identical files however often the run was interrupted; the
stage data is also identical for any ``max_concurrency`` (which the metadata records as part of the config).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rlhf_ext.algos.knobs import check_value, knob, knob_specs
from rlhf_ext.config import RecipeError
from rlhf_ext.datagen.assemble import write_dataset
from rlhf_ext.datagen.backends import make_backend
from rlhf_ext.datagen.cache import CACHE_DIR, SampleCache
from rlhf_ext.datagen.chat import Backend, BackendUnavailable
from rlhf_ext.datagen.dataset import ContinualDataset
from rlhf_ext.datagen.phrasebank import load_phrase_bank
from rlhf_ext.datagen.plan import plan_generation
from rlhf_ext.datagen.runner import (
    SampleRunner,
    ShardedRun,
    job_stream,
    pending_jobs,
    run_jobs,
)
from rlhf_ext.datagen.schema import DatagenConfig
from rlhf_ext.runtime.log import progress as log_progress


@dataclass(frozen=True)
class RunOptions:
    """Options of a generation run that never change the dataset (so neither the config nor the metadata has them)."""

    workers: int = knob(1, ge=1, le=256, help="Processes to shard the samples over (the dataset is the same).")


async def agenerate_dataset(
    config: DatagenConfig | str | Path,
    output_dir: str | Path,
    *,
    overrides: Iterable[str] = (),
    num_samples: int | None = None,
    backend: Backend | None = None,
    progress: bool | None = None,
    workers: int = 1,
) -> ContinualDataset:
    """Async :func:`generate_dataset` (for callers already inside an event loop)."""
    check_value(knob_specs(RunOptions)["workers"], workers, "workers")
    if backend is not None and workers > 1:
        raise RecipeError(
            "workers > 1 runs the backend the config names in each worker process; pass backend= only with workers=1"
        )
    plan = plan_generation(config, overrides, num_samples)
    config = plan.config
    bank = load_phrase_bank(config.generation.phrase_bank)
    out = Path(output_dir)
    counts: Counter = Counter()
    errors: dict[str, str] = {}
    started = time.monotonic()
    generating = 0.0
    backend_stats = None
    with SampleCache(out / CACHE_DIR) as cache, contextlib.ExitStack() as stack:
        pending = pending_jobs(plan, cache)
        attempted = sum(len(p) for _, p in pending)
        reused = plan.num_jobs - attempted
        shards = None
        if attempted:
            workers = min(workers, attempted)
            if workers > 1:
                shards = stack.enter_context(ShardedRun(plan, cache, pending, workers))
            with log_progress(plan.num_jobs, reused, config.name, "samples", progress) as bar:
                t0 = time.monotonic()
                try:
                    if shards is None:
                        backend = backend if backend is not None else make_backend(config.generation, bank)
                        runner = SampleRunner(plan, backend, bank)
                        jobs = job_stream(plan, pending)
                        limit = config.generation.max_concurrency
                        await run_jobs(runner, jobs, attempted, cache, bar, counts, limit, errors)
                        backend_stats = dict(backend.stats) if hasattr(backend, "stats") else None
                    else:
                        await shards.generate(bar, counts, errors)
                    generating = time.monotonic() - t0
                except BackendUnavailable as e:
                    cache.refresh()
                    raise BackendUnavailable(
                        f"{e}\n{plan.cached(cache)}/{plan.num_jobs} samples are finished and cached in "
                        f"{cache.directory}; rerun the same command to resume"
                    ) from e
        cache.sync()
        cache.refresh()
        write_dataset(plan, cache, out, shards.write_stages if shards is not None else None)
        elapsed = time.monotonic() - started
        run = {
            "time": time.time(),
            "elapsed_s": round(elapsed, 3),
            "generate_s": round(generating, 3),
            "samples_per_s": round(attempted / generating, 2) if generating > 0 else None,
            "planned": plan.num_jobs,
            "reused": reused,
            "attempted": attempted,
            **{k: v for k, v in sorted(counts.items())},
        }
        if errors:
            run["errors"] = dict(sorted(errors.items()))
        if backend_stats is not None:
            run["backend"] = backend_stats
        cache.log_run(run)
    dataset = ContinualDataset.load(out)
    dataset.run_stats = run
    return dataset


def generate_dataset(
    config: DatagenConfig | str | Path,
    output_dir: str | Path,
    *,
    overrides: Iterable[str] = (),
    num_samples: int | None = None,
    backend: Backend | None = None,
    progress: bool | None = None,
    workers: int = 1,
) -> ContinualDataset:
    """Generate (or resume generating) a continual preference dataset into ``output_dir``.

    Args:
        config: a :class:`DatagenConfig`, a YAML path or a packaged config name.
        output_dir: the dataset directory (created); its ``.cache`` makes reruns resume.
        overrides: ``key.sub=value`` strings applied to the config (``generation.backend=openai``).
        num_samples: replace every task's ``num_samples`` (run a packaged config small).
        backend: an unstarted :class:`Backend` to use instead of the one the config names (started and closed here;
            only with ``workers=1``).
        progress: show a progress bar with rate and ETA (default: when stderr is a terminal).
        workers: processes to shard the samples over (the dataset is byte-identical for any number); each runs the
            config's backend with ``max_concurrency / workers`` requests in flight.

    Returns:
        The saved :class:`ContinualDataset`; ``dataset.run_stats`` holds this run's counts and timing, including
        ``retry_later:<reason>`` counts of failed samples (not cached; the next run tries them again) and ``errors``:
        one redacted line of the server's message per reason.

    Raises:
        RecipeError: invalid config (names the key), or ``backend`` with ``workers > 1``. KnobError: ``workers``
        out of range. BackendUnavailable: the backend cannot serve
        requests (finished samples stay cached; rerun to resume). CacheLockedError: another run is writing
        ``output_dir``.
    """
    return asyncio.run(
        agenerate_dataset(
            config,
            output_dir,
            overrides=overrides,
            num_samples=num_samples,
            backend=backend,
            progress=progress,
            workers=workers,
        )
    )
