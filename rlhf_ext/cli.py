"""The ``rlhf-ext`` command line.

    rlhf-ext train segment-rm --config FILE [key.sub=value ...]
    rlhf-ext train online-dpo --config FILE [key.sub=value ...]
    rlhf-ext train continual --config FILE [key.sub=value ...]
    rlhf-ext recipe list | rlhf-ext recipe copy NAME DEST
    rlhf-ext segment show --model RM_DIR --prompt TEXT --response TEXT [--html OUT]
    rlhf-ext demo

Heavy libraries are imported inside each command, so ``rlhf-ext --help`` is instant.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import click

from rlhf_ext.config import RecipeError
from rlhf_ext.datagen.cli import data
from rlhf_ext.recipes import recipe_dir, recipe_names, recipe_path
from rlhf_ext.sim.cli import sim as sim_group


def _fail(message: str) -> None:
    click.secho(f"error: {message}", fg="red", err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rlhf-ext")
@click.option("--local_rank", "--local-rank", type=int, default=None, hidden=True, expose_value=False,
              help="Set by `deepspeed --module rlhf_ext.cli ...`; the rank is read from the environment.")  # fmt: skip
def main() -> None:
    """rlhf-ext: segment rewards, online DPO, async and continual RLHF for TRL and OpenRLHF."""


main.add_command(data)
main.add_command(sim_group)


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
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.segment_rm import SegmentRMRecipe, run_segment_rm

    try:
        recipe = load_recipe(SegmentRMRecipe, recipe_path(config_path), overrides)
    except RecipeError as e:
        _fail(str(e))
    if engine is not None:
        recipe.engine = engine
    summary = run_segment_rm(recipe)
    print_rm_summary(summary)


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
    if "report" in summary:
        click.echo(f"  segment report:  {summary['report']['html']}")
        click.echo(f"                   {summary['report']['text']}")


@train.command("continual", context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_path", required=True, help="Recipe YAML file or packaged recipe name.")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def train_continual(config_path: str, overrides: tuple[str, ...]) -> None:
    """Continual RLHF over a task sequence with the KL to the previous task's policy (paper 000)."""
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.continual import TaskSequenceError, format_summary, run_continual
    from rlhf_ext.pipelines.continual_recipe import ContinualRecipe

    try:
        recipe = load_recipe(ContinualRecipe, recipe_path(config_path), overrides)
        summary = run_continual(recipe)
    except (RecipeError, TaskSequenceError) as e:
        _fail(str(e))
    click.echo("")
    click.echo(format_summary(summary))


@train.command("segment-ppo", context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_path", required=True, help="Recipe YAML file or packaged recipe name.")
@click.option("--engine", type=click.Choice(["trl", "openrlhf"]), default=None, help="Override the recipe's engine.")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def train_segment_ppo(config_path: str, engine: str | None, overrides: tuple[str, ...]) -> None:
    """Segment-level PPO (paper 003, section 2.3)."""
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe, run_segment_ppo

    try:
        recipe = load_recipe(SegmentPPORecipe, recipe_path(config_path), overrides)
    except RecipeError as e:
        _fail(str(e))
    if engine is not None:
        recipe.engine = engine
    print_ppo_summary(run_segment_ppo(recipe))


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
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.iterative_dpo import OnlineDPORecipe, run_online_dpo

    try:
        recipe = load_recipe(OnlineDPORecipe, recipe_path(config_path), overrides)
    except RecipeError as e:
        _fail(str(e))
    _print_online_summary(run_online_dpo(recipe))


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
@click.argument("dest", type=click.Path())
def recipe_copy(name: str, dest: str) -> None:
    """Copy packaged recipe NAME to DEST (a file or a directory)."""
    try:
        src = recipe_path(name)
    except RecipeError as e:
        _fail(str(e))
    target = Path(dest)
    if target.is_dir():
        target = target / src.name
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


@segment.command("show")
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True), help="Segment reward model dir.")
@click.option("--prompt", default="", help="Prompt text.")
@click.option("--response", required=True, help="Response text to segment and score.")
@click.option("--sft-model", default=None, help="SFT model for segmentation (default: the one recorded in MODEL).")
@click.option("--cutoff", type=float, default=None, help="Entropy cutoff (default: the training value).")
@click.option("--html", "html_path", type=click.Path(), default=None, help="Also write a coloured HTML view here.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def segment_show(model_dir, prompt, response, sft_model, cutoff, html_path, as_json) -> None:
    """Split RESPONSE into segments and print each segment's reward (paper Figure 3)."""
    from rlhf_ext.pipelines.builtins import resolve_model
    from rlhf_ext.runtime.io import atomic_write_text
    from rlhf_ext.runtime.token_scores import SegmentScorer, render_html

    try:
        scorer = SegmentScorer(
            model_dir, sft_model=resolve_model(sft_model) if sft_model else None, entropy_cutoff=cutoff
        )
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    view = scorer.score(prompt or None, response)
    if as_json:
        click.echo(json.dumps(view.__dict__, indent=2))
    else:
        click.echo(view.as_text())
    if html_path:
        atomic_write_text(html_path, render_html([view]))
        click.echo(f"html: {html_path}", err=as_json)


# ---------------------------------------------------------------------------------------------------------- demo
@main.command()
@click.option("--config", "config_path", default="demo", show_default=True, help="Demo recipe (file or packaged name).")
@click.option("--out", default=None, help="Output directory (default: the recipe's, runs/demo).")
@click.option("--force", is_flag=True, help="Redo every stage instead of reusing finished ones.")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def demo(config_path: str, out: str | None, force: bool, overrides: tuple[str, ...]) -> None:
    """The main job on the embedded default (tiny models, generated data, CPU): data -> SFT -> simulated labels ->
    segment reward model -> normalizer -> segment PPO -> evaluation -> runs/demo/report.html."""
    from rlhf_ext.config import load_recipe
    from rlhf_ext.demo import DemoPipeline, DemoRecipe

    try:
        recipe = load_recipe(DemoRecipe, recipe_path(config_path), (*((f"out={out}",) if out else ()), *overrides))
    except RecipeError as e:
        _fail(str(e))
    from rlhf_ext.runtime.rundir import RunSettingsChanged

    try:
        results = DemoPipeline(recipe, force=force, echo=lambda m: click.secho(m, fg="cyan")).run()
    except RunSettingsChanged as e:
        _fail(str(e))
    ev = results["eval"]["ppo_vs_sft"]
    click.echo("")
    click.secho(f"demo finished in {results['total_seconds']:.0f} s", fg="green", bold=True)
    click.echo(
        f"  win rate PPO vs SFT: {ev['win_rate']:.3f} +- {ev['stderr']:.3f} ({ev['num_comparisons']} comparisons)"
    )
    click.echo(f"  gold reward:         PPO {ev['gold_mean']:+.3f}   SFT {ev['ref_gold_mean']:+.3f}")
    click.echo(f"  KL(PPO || SFT):      {ev['kl']:.3f} nats")
    click.echo(f"  report:              {results['report']['html']}")
    click.echo(f"  metrics:             {results['report']['metrics']}")


if __name__ == "__main__":
    main()
