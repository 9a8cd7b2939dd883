"""Generation: config -> drift schedule -> one job per sample -> backend calls -> cache -> ``ContinualDataset``.

Per sample (paper Algorithm 2 and Figure 3), with every random choice drawn from the sample's own seed:

1. **Prompt mapper**: sample seed words from the source task's domain, render the meta-prompt (Appendix E.1), ask
   the backend for the task prompt ``x``, wrap it in the task's prefix/suffix.
2. **Response mapper**: ``pair`` mode asks for a chosen/rejected pair in one call (Appendix E.2); ``judged`` mode
   asks for two responses (preference stated with probability ``preference_inclusion_prob``, shared auxiliary
   style axes) and lets the judge order them.
3. The record goes to the append-only cache the moment it is finished.

Unusable answers (unparseable, a judge tie, truncated or empty) are cached as skipped, for good. Failed requests are
counted under ``retry_later:<reason>`` (``run_stats["errors"]``: one redacted server message per reason), never
cached, and tried again by the next run; an unreachable server stops the run with :class:`BackendUnavailable`.

``workers=N`` shards the pending samples over ``N`` processes (``max_concurrency / N`` requests in flight, one cache
file each), which then write whole stages. Stages are assembled from the cache in index order
(``rlhf_ext.datagen.assemble``) and streamed to disk (``arrow_stage``; memory: the cache's index, ~40 bytes per sample,
and one batch of rows), so they are the same for any ``N`` or ``max_concurrency``; the ``offline`` backend gives
byte-identical files however often the run was interrupted.
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
from rlhf_ext.datagen.runner import SampleRunner, ShardedRun, pending_jobs, run_jobs
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
                        runner, limit = SampleRunner(plan, backend, bank), config.generation.max_concurrency
                        await run_jobs(runner, pending, cache, bar, counts, limit, errors)
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
        overrides: ``key.sub=value`` strings applied to the config; num_samples: replaces every task's count.
        backend: an unstarted :class:`Backend` instead of the config's (only with ``workers=1``).
        progress: a progress bar (default: when stderr is a terminal).
        workers: processes to shard the samples over (the dataset is byte-identical for any number).

    Returns:
        The saved :class:`ContinualDataset`; ``dataset.run_stats`` holds this run's counts and timing (with
        ``retry_later:<reason>`` counts and ``errors``, one redacted server message per reason).

    Raises:
        RecipeError: invalid config (names the key), or ``backend`` with ``workers > 1``. KnobError: ``workers``
        out of range. BackendUnavailable: the backend cannot serve requests (finished samples stay cached; rerun to
        resume). CacheLockedError: another run is writing ``output_dir``.
    """
    kwargs = dict(overrides=overrides, num_samples=num_samples, backend=backend, progress=progress, workers=workers)
    return asyncio.run(agenerate_dataset(config, output_dir, **kwargs))
