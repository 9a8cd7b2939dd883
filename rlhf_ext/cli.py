"""The ``rlhf-ext`` command line.

    rlhf-ext train segment-rm --config FILE [key.sub=value ...]
    rlhf-ext train online-dpo --config FILE [key.sub=value ...]
    rlhf-ext train continual --config FILE [key.sub=value ...]
    rlhf-ext plan --config FILE [--cluster auto|NODESxGPUS] [key.sub=value ...]
    rlhf-ext recipe list | rlhf-ext recipe copy NAME DEST
    rlhf-ext segment show --model RM_DIR --prompt TEXT --response TEXT [--html OUT]
    rlhf-ext serve rm --model RM_DIR [--port 5000]
    rlhf-ext demo

Heavy libraries are imported inside each command. A user's mistake (:func:`user_error_message`) is one ``error: ...``
line naming the fix, exit code 2; a programming error keeps its traceback.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import click

from rlhf_ext.config import OPTIONAL_PACKAGES, HubOfflineError, KnobType, MissingOptionalPackage, hub_offline
from rlhf_ext.datagen.cli import data
from rlhf_ext.recipes import recipe_dir, recipe_names, recipe_path
from rlhf_ext.sim.cli import sim as sim_group


def _fail(message: str) -> None:
    """Report a command's own check (not an exception) like a user error: one line, exit code 2."""
    click.secho(f"error: {message}", fg="red", err=True)
    sys.exit(2)


# --------------------------------------------------------------------------------------------------- user errors
def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling (``__cause__``, else an unsuppressed
    ``__context__``)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def _loaded_type(module: str, name: str) -> type | None:
    """Class ``module.name`` if ``module`` was imported (an exception of a never-imported module cannot occur, so
    matching never imports a heavy library)."""
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def _hub_offline_message(exc: BaseException) -> str | None:
    """A model or tokenizer named by hub id while the hub is switched off (HF_HUB_OFFLINE=1)."""
    names = ("LocalEntryNotFoundError", "OfflineModeIsEnabled")
    hub_errors = tuple(t for t in (_loaded_type("huggingface_hub.errors", n) for n in names) if t is not None)
    for e in _chain(exc):
        if isinstance(e, HubOfflineError):
            return str(e)
        if hub_errors and isinstance(e, hub_errors) and hub_offline():
            # the hub id is the ``repo_id`` argument of the failing huggingface_hub call
            ids = (frame.f_locals.get("repo_id") for frame, _ in traceback.walk_tb(e.__traceback__))
            return str(HubOfflineError(next((i for i in ids if isinstance(i, str)), None) or "the hub model"))
    return None


def _missing_package_message(exc: BaseException) -> str | None:
    """An optional package (:data:`rlhf_ext.config.OPTIONAL_PACKAGES`) is not installed; another missing module is
    a programming or installation error and keeps its traceback."""
    if isinstance(exc, MissingOptionalPackage):
        return str(exc)
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in OPTIONAL_PACKAGES:
        return str(MissingOptionalPackage(exc.name.split(".")[0]))
    return None


def _os_error_message(exc: BaseException) -> str | None:
    """A path the user gave does not exist, or the disk is full."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        where = f" writing {exc.filename}" if exc.filename else ""
        return (
            f"no space left on device{where}: free some space or point the output directory at another disk, then "
            "rerun the same command (finished stages and cached samples are kept)"
        )
    if isinstance(exc, FileNotFoundError):
        if exc.errno is None:  # raised by rlhf-ext with its own message
            return str(exc)
        return f"'{exc.filename}' does not exist: check the path (a relative path is relative to {os.getcwd()})"
    return None


#: The exceptions rlhf-ext raises for a user's mistake, by (module, class name); each message names the fix.
USER_ERROR_TYPES: tuple[tuple[str, str], ...] = (
    ("rlhf_ext.config", "RecipeError"),
    ("rlhf_ext.algos.knobs", "KnobError"),
    ("rlhf_ext.openrlhf.cli_runner", "ExtArgsError"),
    ("rlhf_ext.runtime.rundir", "RunSettingsChanged"),
    ("rlhf_ext.runtime.rundir", "OutputDirError"),
    ("rlhf_ext.trl.args", "CheckpointError"),
    ("rlhf_ext.zoo.builtins", "BuiltinNotBuiltError"),
    ("rlhf_ext.pipelines.continual", "TaskSequenceError"),
    ("rlhf_ext.runtime.segment_data", "DatasetFormatError"),
    ("rlhf_ext.algos.location_norm", "NormalizerError"),
    ("rlhf_ext.datagen.cache", "CacheLockedError"),
    ("rlhf_ext.datagen.chat", "BackendUnavailable"),
    ("rlhf_ext.runtime.resources", "PlanError"),
    ("rlhf_ext.openrlhf.train_ppo_ray", "ExtArgsError"),
)


def _typed_message(exc: BaseException) -> str | None:
    """The message of one of :data:`USER_ERROR_TYPES`."""
    for module, name in USER_ERROR_TYPES:
        cls = _loaded_type(module, name)
        if cls is not None and isinstance(exc, cls):
            return str(exc)
    return None


def user_error_message(exc: BaseException) -> str | None:
    """One line that names the user's error and its fix, or None when ``exc`` is not a user error (a hub id while
    offline, a missing optional package, one of :data:`USER_ERROR_TYPES`, a missing path, a full disk)."""
    for matcher in (_hub_offline_message, _missing_package_message, _typed_message, _os_error_message):
        if message := matcher(exc):
            return " ".join(message.split())
    return None


class UserErrorGroup(click.Group):
    """A command group that reports user errors (:func:`user_error_message`) as one ``error: ...`` line on stderr
    with exit code 2; any other exception keeps its traceback. Its sub-groups are UserErrorGroups too."""

    group_class = type

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise  # click's own outcomes (usage errors, exit codes), reported by click
        except Exception as e:
            message = user_error_message(e)
            if message is None:
                raise
            click.secho(f"error: {message}", fg="red", err=True)
            raise click.exceptions.Exit(2) from None


@click.group(cls=UserErrorGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rlhf-ext")
@click.option("--local_rank", "--local-rank", type=int, default=None, hidden=True, expose_value=False,
              help="Set by `deepspeed --module rlhf_ext.cli ...`; the rank is read from the environment.")  # fmt: skip
def main() -> None:
    """rlhf-ext: segment rewards, online DPO, async and continual RLHF for TRL and OpenRLHF."""
    from rlhf_ext.runtime.log import configure_cli_output

    configure_cli_output()  # log lines on stderr at INFO (RLHF_EXT_VERBOSITY), no progress bars when piped


@main.result_callback()
def release_process_group(*_: object, **__: object) -> None:
    """Destroy the process group a finished command ran in (torchrun, accelerate, deepspeed): left to interpreter
    exit, gloo's threads can abort the process (SIGABRT) after training has finished (pytorch/pytorch#179291)."""
    dist = sys.modules.get("torch.distributed")  # a command that never imported torch has no process group
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


main.add_command(data)
main.add_command(sim_group)


def _load(cls: type, config_path: str | Path, overrides: tuple[str, ...], engine: str | None = None):
    """Recipe ``cls`` from ``--config`` (a file or a packaged name) and the overrides; ``--engine`` when given."""
    from rlhf_ext.config import load_recipe

    recipe = load_recipe(cls, recipe_path(config_path), overrides)
    if engine is not None:
        recipe.engine = engine
    return recipe


# ---------------------------------------------------------------------------------------------------------- plan
@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_path", required=True, help="Recipe YAML file or packaged recipe name.")
@click.option(
    "--cluster",
    default="auto",
    show_default=True,
    help="auto (the Ray cluster a launch here would connect to, else this machine) or NODESxGPUS: 1x8, 2x8; "
    "1x0 = CPU only.",
)
@click.option("--gpu-memory", type=KnobType("rlhf_ext.runtime.resources:Cluster", "gpu_memory_gib"), default=80.0,
              show_default=True, help="GiB per GPU of a stated --cluster.")  # fmt: skip
@click.option("--engine", type=click.Choice(["trl", "openrlhf"]), default=None, help="Override the recipe's engine.")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def plan(config_path: str, cluster: str, gpu_memory: float, engine: str | None, overrides: tuple[str, ...]) -> None:
    """The pre-flight plan of a recipe: placement and memory per GPU, before any model loads (every launch runs the
    same check first). Exit code 2 if the plan cannot run."""
    from rlhf_ext.config import RecipeError, read_yaml
    from rlhf_ext.pipelines.plan import segment_rm_plan
    from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe, plan_segment_ppo
    from rlhf_ext.pipelines.segment_rm import SegmentRMRecipe
    from rlhf_ext.runtime.resources import parse_cluster

    if cluster == "auto":
        from rlhf_ext.openrlhf.plan import detect_cluster

        shape = detect_cluster()
    else:
        shape = parse_cluster(cluster, gpu_memory)
    path = recipe_path(config_path)
    sections = set(read_yaml(path))
    if "segment" not in sections or sections & {"online", "continual", "methods"}:
        raise RecipeError(
            f"{config_path}: `rlhf-ext plan` plans segment PPO and segment reward-model recipes (a segment: section); "
            f"this recipe has {', '.join(sorted(sections))}"
        )
    recipe = _load(SegmentPPORecipe if "ppo" in sections else SegmentRMRecipe, path, overrides, engine)
    result = plan_segment_ppo(recipe, shape) if "ppo" in sections else segment_rm_plan(recipe, shape)
    click.echo(result.table())
    if result.problems:
        _fail(result.problems[0])


# --------------------------------------------------------------------------------------------------------- train
@main.group()
def train() -> None:
    """Train with a recipe (YAML) plus key.sub=value overrides."""


@train.command("segment-rm", context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_path", required=True, help="Recipe YAML file or packaged recipe name.")
@click.option("--engine", type=click.Choice(["trl", "openrlhf"]), default=None, help="Override the recipe's engine.")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def train_segment_rm(config_path: str, engine: str | None, overrides: tuple[str, ...]) -> None:
    """Segment-level reward model (paper 003, section 2.2)."""
    from rlhf_ext.pipelines.segment_rm import SegmentRMRecipe, run_segment_rm

    print_rm_summary(run_segment_rm(_load(SegmentRMRecipe, config_path, overrides, engine)))


def print_rm_summary(summary: dict) -> None:
    """Print where a segment reward-model run left its checkpoint, accuracy and report (rank 0 only)."""
    if not summary or os.environ.get("RANK", "0") != "0":
        return
    ev = summary.get("eval", {})
    click.echo("")
    click.secho("segment reward model trained", fg="green", bold=True)
    click.echo(f"  checkpoint:      {summary['model_dir']}")
    if "eval_accuracy" in ev:
        segs = ev.get("eval_segments_per_response", 0.0)
        click.echo(f"  held-out acc.:   {ev['eval_accuracy']:.3f}  (segments/response {segs:.2f})")
    elif "eval_skipped" in summary:
        click.echo(f"  held-out acc.:   {summary['eval_skipped']}")
    if "report" in summary:
        click.echo(f"  segment report:  {summary['report']['html']}")
        click.echo(f"                   {summary['report']['text']}")


@train.command("continual", context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_path", required=True, help="Recipe YAML file or packaged recipe name.")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def train_continual(config_path: str, overrides: tuple[str, ...]) -> None:
    """Continual RLHF over a task sequence with the KL to the previous task's policy (paper 000)."""
    from rlhf_ext.pipelines.continual import format_summary, run_continual
    from rlhf_ext.pipelines.continual_recipe import ContinualRecipe

    summary = run_continual(_load(ContinualRecipe, config_path, overrides))
    click.echo("")
    click.echo(format_summary(summary))


@train.command("segment-ppo", context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_path", required=True, help="Recipe YAML file or packaged recipe name.")
@click.option("--engine", type=click.Choice(["trl", "openrlhf"]), default=None, help="Override the recipe's engine.")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def train_segment_ppo(config_path: str, engine: str | None, overrides: tuple[str, ...]) -> None:
    """Segment-level PPO (paper 003, section 2.3)."""
    from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe, run_segment_ppo

    print_ppo_summary(run_segment_ppo(_load(SegmentPPORecipe, config_path, overrides, engine)))


def print_ppo_summary(summary: dict) -> None:
    """Print the reward/KL curve of a PPO run and where its checkpoint is (rank 0 only)."""
    if not summary or os.environ.get("RANK", "0") != "0":
        return
    click.echo("")
    click.secho("segment PPO finished", fg="green", bold=True)
    click.echo(f"  checkpoint: {summary['model_dir']}")
    curve = summary.get("curve", [])
    if curve:
        click.echo(f"  {'step':>5} {'reward':>9} {'KL':>8} {'RM score':>9}")
        for row in curve:
            click.echo(
                f"  {row.get('step', 0):5d} {row.get('reward', float('nan')):9.3f} "
                f"{row.get('segment/kl', float('nan')):8.4f} {row.get('segment/raw_last_score', float('nan')):9.3f}"
            )


@train.command("online-dpo", context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_path", required=True, help="Recipe YAML file or packaged recipe name.")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def train_online_dpo(config_path: str, overrides: tuple[str, ...]) -> None:
    """Iterative best/worst-of-n online DPO (paper 004) or one-step asynchronous online DPO (paper 001)."""
    from rlhf_ext.pipelines.iterative_dpo import OnlineDPORecipe, run_online_dpo

    _print_online_summary(run_online_dpo(_load(OnlineDPORecipe, config_path, overrides)))


def _print_online_summary(summary: dict) -> None:
    if os.environ.get("RANK", "0") != "0":  # under accelerate / torchrun only rank 0 reports
        return
    click.echo("")
    click.secho(f"online DPO finished ({summary['mode']})", fg="green", bold=True)
    click.echo(f"  final policy:    {summary['final_policy']}")
    for ev in summary["eval"]:
        gold = f"  gold {ev['mean_gold']:.3f}" if "mean_gold" in ev else ""
        length = f"({ev['mean_length_chars']:.0f} chars)"
        click.echo(f"  policy {ev['policy']!s:>5}:    reward {ev['mean_reward']:+.3f}{gold}  {length}")
    for it in summary.get("iterations", []):
        p = it["pairs"]
        click.echo(f"  iteration {it['iteration']}:     {p['num_pairs']} pairs, {p['dropped']} prompts tied")
    if "runner" in summary:
        click.echo(f"  staleness:       {summary['runner']['staleness']}")


# -------------------------------------------------------------------------------------------------------- recipe
@main.group()
def recipe() -> None:
    """List and copy the packaged recipes."""


@recipe.command("list")
def recipe_list() -> None:
    """Show the packaged recipes with their first comment line."""
    for name in recipe_names():
        first = (recipe_dir() / f"{name}.yaml").read_text().splitlines()[0].lstrip("# ").strip()
        click.echo(f"{name:32s} {first}")


@recipe.command("copy")
@click.argument("name")
@click.argument("dest", type=click.Path(), default=".")
def recipe_copy(name: str, dest: str) -> None:
    """Copy packaged recipe NAME to DEST (a file or a directory; default: ./NAME.yaml)."""
    src = recipe_path(name)
    target = Path(dest) / src.name if Path(dest).is_dir() else Path(dest)
    if target.exists():
        _fail(f"{target} exists; choose another destination or delete it first")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, target)
    click.echo(str(target))


# ----------------------------------------------------------------------------------------------------------- zoo
@main.group()
def zoo() -> None:
    """The ``builtin:`` models (resolving a name never trains; ``build`` does, once, into the cache)."""


@zoo.command("list")
def zoo_list() -> None:
    """List the builtin models and whether each is built."""
    from rlhf_ext.zoo.builtins import BUILTIN_MODELS, builtin_model_dir

    for name in BUILTIN_MODELS:
        built = (builtin_model_dir(name) / "config.json").exists()
        click.echo(f"builtin:{name:<18} {'built' if built else 'not built'}  {builtin_model_dir(name)}")


@zoo.command("build")
@click.argument("names", nargs=-1, required=True)
def zoo_build(names: tuple[str, ...]) -> None:
    """Build builtin models (e.g. ``tiny-sft``: 300 SFT steps on the toy task, ~15 s on 2 CPU cores)."""
    from rlhf_ext.pipelines.builtins import build_model

    for name in names:
        try:
            click.echo(build_model(name.removeprefix("builtin:")))
        except ValueError as e:
            _fail(str(e))


# ------------------------------------------------------------------------------------------------------- segment
@main.group()
def segment() -> None:
    """Inspect segment reward models."""


def _finite_or_null(value):
    """``value`` with every non-finite float (NaN, +-inf) replaced by ``None``, in nested lists and dicts: strict
    JSON has no NaN or Infinity (``json.dumps`` would write them as bare words no JSON parser accepts)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_null(v) for v in value]
    return value


SEGMENT_KNOBS = "rlhf_ext.algos.segment_reward:SegmentRewardKnobs"


@segment.command("show")
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True), help="Segment reward model dir.")
@click.option("--prompt", default="", help="Prompt text.")
@click.option("--response", required=True, help="Response text to segment and score.")
@click.option("--sft-model", default=None, help="SFT model for segmentation (default: the one recorded in MODEL).")
@click.option("--entropy-cutoff", "--cutoff", "entropy_cutoff", type=KnobType(SEGMENT_KNOBS, "entropy_cutoff"),
              default=None, help="Entropy cutoff (default: the training value).")  # fmt: skip
@click.option("--html", "html_path", type=click.Path(), default=None, help="Also write a coloured HTML view here.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text (NaN and inf are written as null).")
@click.option("--policy-tokenizer", default=None,
              help="Also show the rewards on this policy tokenizer's tokens (directory or builtin:NAME).")  # fmt: skip
def segment_show(model_dir, prompt, response, sft_model, entropy_cutoff, html_path, as_json, policy_tokenizer) -> None:
    """Split RESPONSE into segments and print each segment's reward (paper Figure 3), and on policy tokens."""
    from rlhf_ext.pipelines.builtins import load_tokenizer, resolve_model
    from rlhf_ext.runtime.io import atomic_write_text
    from rlhf_ext.runtime.token_scores import SegmentScorer, render_html

    tokenizer = load_tokenizer(policy_tokenizer, "--policy-tokenizer") if policy_tokenizer else None
    try:
        scorer = SegmentScorer(
            model_dir, sft_model=resolve_model(sft_model) if sft_model else None, entropy_cutoff=entropy_cutoff
        )
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    view = scorer.score(prompt or None, response)
    shown, text = dict(view.__dict__), view.as_text()
    if tokenizer is not None:
        from rlhf_ext.runtime.dense_sources import SegmentRewardSpans, policy_token_rewards

        tokens = policy_token_rewards(SegmentRewardSpans(scorer), tokenizer, prompt or None, response)
        shown["policy_tokens"] = [t.__dict__ for t in tokens]
        text += f"\non the policy's tokens ({policy_tokenizer}):\n" + "\n".join(map(str, tokens))
    click.echo(json.dumps(_finite_or_null(shown), indent=2, allow_nan=False) if as_json else text)
    if html_path:
        atomic_write_text(html_path, render_html([view]))
        click.echo(f"html: {html_path}", err=as_json)


@segment.command("import-normalizer")
@click.argument("param_json", type=click.Path(exists=True, dir_okay=False))
@click.option("--model-type", required=True, help="param.json's model type key, e.g. rlhflow_llama_3_sft_8b_v2.")
@click.option("--dataset", required=True, help="Reward-fit dataset key, e.g. preference700k_60000.")
@click.option("--method", "segment_method", required=True, help="Segmentation method key, e.g. peak.")
@click.option("--aggregation", required=True, help="Aggregation key, e.g. avg.")
@click.option("--entropy-cutoff", "--cutoff", "entropy_cutoff", type=KnobType(SEGMENT_KNOBS, "entropy_cutoff"),
              required=True, help="Entropy cutoff (matched numerically: 2 finds '2.0').")  # fmt: skip
@click.option("-o", "--out", "out_path", required=True, type=click.Path(dir_okay=False), help="Normalizer JSON.")
@click.option("--reward-model", default=None, help="The reward model it belongs to (PPO refuses it for another).")
@click.option("--std-floor", type=KnobType("rlhf_ext.algos.location_norm:LocationNormalizer", "std_floor"),
              default=None, help="Clamp Std(p) below at this value where it is <= 0.")  # fmt: skip
@click.option("--max-segments", type=KnobType("rlhf_ext.algos.location_norm:ReferenceImport", "max_segments"),
              default=1024, show_default=True,
              help="Most segments a response has (p >= 1/N); the public PPO generates <= 1024 tokens.")  # fmt: skip
def segment_import_normalizer(
    param_json, model_type, dataset, segment_method, aggregation, entropy_cutoff, out_path, reward_model, std_floor,
    max_segments,
) -> None:  # fmt: skip
    """Import one of paper 003's released normalizers from its public code's PARAM_JSON (Mean(p) = a ln p + c,
    Std(p) = b ln p + d) as a LocationNormalizer file for `model.normalizer`."""
    from rlhf_ext.runtime.calibration import import_reference_normalizer, model_id, save_normalizer

    norm = import_reference_normalizer(
        param_json, model_type, dataset, segment_method, aggregation, entropy_cutoff,
        reward_model=model_id(reward_model) if reward_model else None, std_floor=std_floor, max_segments=max_segments,
    )  # fmt: skip
    save_normalizer(norm, out_path)
    clamp = f", clamped at >= {norm.std_floor:g}" if norm.std_floor is not None else ""
    click.echo(f"imported {norm.source}")
    click.echo(f"  Mean(p) = {norm.w_mu:g} * ln(p) + {norm.b_mu:g}")
    click.echo(f"  Std(p)  = {norm.w_sigma:g} * ln(p) + {norm.b_sigma:g}{clamp}")
    click.echo(f"  saved:  {out_path}")


# ---------------------------------------------------------------------------------------------------------- demo
@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_path", default="demo", show_default=True, help="Demo recipe (file or packaged name).")
@click.option("--out", default=None, help="Output directory (default: the recipe's, runs/demo).")
@click.option("--force", is_flag=True, help="Redo every stage instead of reusing finished ones.")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def demo(config_path: str, out: str | None, force: bool, overrides: tuple[str, ...]) -> None:
    """The main job on the embedded default (tiny models, generated data, CPU): data -> SFT -> simulated labels ->
    segment reward model -> normalizer -> segment PPO -> evaluation -> runs/demo/report.html."""
    from rlhf_ext.demo import DemoPipeline, DemoRecipe

    recipe = _load(DemoRecipe, config_path, (*((f"out={out}",) if out else ()), *overrides))
    results = DemoPipeline(recipe, force=force, echo=lambda m: click.secho(m, fg="cyan")).run()
    ev = results["eval"]["ppo_vs_sft"]
    click.echo("")
    click.secho(f"demo finished in {results['total_seconds']:.0f} s", fg="green", bold=True)
    click.echo(
        f"  win rate PPO vs SFT: {ev['win_rate']:.3f} +- {ev['stderr']:.3f} ({ev['num_comparisons']} comparisons)"
    )
    click.echo(f"  gold reward:         PPO {ev['gold_mean']:+.3f}   SFT {ev['ref_gold_mean']:+.3f}")
    click.echo(f"  KL(PPO || SFT):      {format_kl(ev)}")
    click.echo(f"  report:              {results['report']['html']}")
    click.echo(f"  metrics:             {results['report']['metrics']}")


#: How each KL estimate of :func:`rlhf_ext.sim.win_rate` is described next to its value.
KL_METHODS = {
    "exact_token_sum": "exact per-token KL summed per response",
    "sequence_log_ratio": "log-ratio estimate, can be negative",
    "analytic_best_of_n": "analytic",
}


def format_kl(ev: dict) -> str:
    """``0.123 ± 0.010 nats (exact per-token KL summed per response, 64 PPO samples)``: a KL estimate with its
    standard error, estimator and sample count."""
    method = ev.get("kl_method", "sequence_log_ratio")
    return (
        f"{ev['kl']:.3f} ± {ev.get('kl_stderr', float('nan')):.3f} nats ({KL_METHODS.get(method, method)}, "
        f"{ev['num_comparisons']} PPO samples)"
    )


# --------------------------------------------------------------------------------------------------------- serve
@main.group()
def serve() -> None:
    """Serve models over HTTP."""


@serve.command("rm")
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True), help="Segment reward model dir.")
@click.option("--sft-model", default=None, help="SFT model for segmentation (default: the one recorded in MODEL).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: all; needs --api-key or --insecure).")  # fmt: skip
@click.option("--port", type=int, default=5000, show_default=True, help="Port (0: a free one).")
@click.option("--api-key", default=None, envvar="RLHF_EXT_API_KEY", show_envvar=True,
              help="Bearer token every scoring request must carry (Authorization: Bearer KEY).")  # fmt: skip
@click.option("--insecure", is_flag=True, help="Serve anyone on a non-loopback --host without --api-key.")
@click.option("--max-batch-size", type=int, default=32, show_default=True, help="Pairs scored per forward pass.")
@click.option("--max-wait-ms", type=float, default=0.0, show_default=True,
              help="How long a batch waits for more pairs (0: it closes as soon as none is waiting).")  # fmt: skip
@click.option("--max-request-pairs", type=int, default=256, show_default=True, help="Pairs per request (413 above).")
@click.option("--workers", type=int, default=2, show_default=True, help="Threads parsing and tokenising requests.")
@click.option("--max-length", type=int, default=None,
              help="Tokens per prompt + response (default: the model's context).")  # fmt: skip
def serve_rm(model_dir: str, sft_model: str | None, **knobs) -> None:
    """Serve a segment reward model's e_phi (paper 003 Eq. 4) in OpenRLHF's remote-reward protocol: POST
    /get_reward {"query": [...], "prompts": [...]} -> {"rewards": [...]}; GET /health. For OpenRLHF:
    --reward.remote_url http://HOST:PORT/get_reward (with a key: http://rm:KEY@HOST:PORT/get_reward); for TRL:
    rlhf_ext.trl.remote_reward.RemoteSegmentReward(URL). SIGINT and SIGTERM answer the requests in flight, then stop."""
    from rlhf_ext.serve.settings import ServeError, ServeSettings, SettingError

    try:
        settings = ServeSettings(**knobs)
    except SettingError as e:
        _fail(f"--{e.field.replace('_', '-')} {e.rule}")
    except ServeError as e:
        _fail(str(e))
    from rlhf_ext.pipelines.builtins import resolve_model
    from rlhf_ext.serve.server import serve_reward_model

    try:
        serve_reward_model(model_dir, settings, sft_model=resolve_model(sft_model) if sft_model else None,
                           echo=lambda m: click.echo(m, err=True))  # fmt: skip
    except (FileNotFoundError, ValueError, ServeError) as e:
        _fail(str(e))


if __name__ == "__main__":
    main()
