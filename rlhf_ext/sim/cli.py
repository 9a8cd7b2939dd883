"""``rlhf-ext sim``: the AlpacaFarm-style simulator (paper 002).

    rlhf-ext sim compare --config recipes/sim_compare.yaml [--methods sft,dpo] [--seeds 0,1] [--out DIR]
                         [--report-only] [key.sub=value ...]
    rlhf-ext sim tune --config recipes/sim_compare.yaml [--out DIR] [key.sub=value ...]

Heavy libraries are imported inside the commands.
"""

from __future__ import annotations

import click

from rlhf_ext.config import KnobType


@click.group("sim", context_settings={"help_option_names": ["-h", "--help"]})
def sim() -> None:
    """Simulated feedback, evaluation and method comparison (AlpacaFarm-style, paper 002)."""


@sim.command("compare", context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_path", required=True, help="Recipe YAML file or packaged recipe name.")
@click.option("--methods", default=None, help="Comma-separated subset of the recipe's methods (e.g. sft,dpo).")
@click.option("--seeds", type=KnobType("rlhf_ext.sim.recipe:SimCompareRecipe", "seeds"), default=None,
              help="Comma-separated seeds replacing the recipe's (e.g. 0,1,2).")  # fmt: skip
@click.option("--out", "out", default=None, help="Output directory (overrides output_dir).")
@click.option("--report-only", is_flag=True, help="Only rewrite the table/JSON/plots from finished results.")
@click.option("--budget", default=None, help="A named budget of the recipe's budgets: section (e.g. full).")
@click.option(
    "--tuning", "tuning_dir", default=None, help="Run each tuned method at the point `sim tune` picked in DIR/tuning/."
)
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def compare(config_path, methods, seeds, out, report_only, budget, tuning_dir, overrides) -> None:
    """Train and evaluate the recipe's methods for every seed; write a table (mean ± s.e.), plots and JSON.

    Each finished (method, seed) is written to OUT/results/ at once and skipped when the command is rerun.
    """
    from rlhf_ext.recipes import recipe_path
    from rlhf_ext.sim.compare import run_compare
    from rlhf_ext.sim.recipe import load_compare_recipe
    from rlhf_ext.sim.report import markdown_table, summarise, write_reports

    extra = list(overrides) + ([f"output_dir={out}"] if out is not None else [])
    if methods is not None:
        extra.append(f"methods=[{','.join(v.strip() for v in methods.split(',') if v.strip())}]")
    if seeds is not None:
        extra.append(f"seeds=[{','.join(map(str, seeds))}]")
    # a user's error (RecipeError, a model that cannot load ...) is reported in one line by `rlhf-ext`'s command
    # group (rlhf_ext.cli.UserErrorGroup), which runs this command
    recipe = load_compare_recipe(recipe_path(config_path), extra, budget)
    if tuning_dir is not None:
        from rlhf_ext.sim.tune import apply_tuning

        recipe = apply_tuning(recipe, tuning_dir)
    if report_only:
        from pathlib import Path

        summary = summarise(recipe)
        summary["reports"] = write_reports(summary, Path(recipe.output_dir))
    else:
        if recipe.model.base is not None:  # a model that cannot load fails before the output directory records it
            from rlhf_ext.zoo.builtins import check_model_source

            check_model_source(recipe.model.base)
        summary = run_compare(recipe, progress=lambda m: click.echo(m, err=True))
    click.echo(markdown_table(summary))
    click.echo("")
    for name, path in summary["reports"].items():
        click.echo(f"{name}: {path}")


@sim.command("tune", context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_path", required=True, help="Recipe YAML file or packaged recipe name.")
@click.option("--out", "out", default=None, help="Output directory (overrides output_dir).")
@click.option("--budget", default=None, help="A named budget of the recipe's budgets: section (e.g. smoke).")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def tune(config_path, out, budget, overrides) -> None:
    """Give every method of the recipe's tuning: section the same grid, trained on the tuning seeds and picked by
    the length-controlled win rate on validation prompts; print the table and the picked method_overrides.

    Results go to OUT/tuning/ (tuning.json, tuning.md); finished points are skipped when the command is rerun.
    """
    from rlhf_ext.recipes import recipe_path
    from rlhf_ext.sim.recipe import load_compare_recipe
    from rlhf_ext.sim.tune import run_tuning, tuning_markdown

    extra = list(overrides) + ([f"output_dir={out}"] if out is not None else [])
    recipe = load_compare_recipe(recipe_path(config_path), extra, budget)
    summary = run_tuning(recipe, progress=lambda m: click.echo(m, err=True))
    click.echo(tuning_markdown(summary))
