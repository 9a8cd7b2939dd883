"""The simulator figures the README prints are the ones the runs wrote (`benchmarks/results/`): every table row under
"Simulator" matches its method's row in the results table it was copied from, cell by cell on the columns both share,
and the SFT-against-itself figure matches `sim_sft_bias.json`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")


def tables(text: str) -> list[tuple[list[str], dict[str, list[str]]]]:
    """Every markdown table of ``text``: (header cells, {first cell: row cells})."""
    found, lines = [], text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("| ") and set(lines[i + 1].replace("|", "").strip()) <= {"-", ":"} and lines[i + 1]:
            header = [c.strip() for c in line.strip("|").split("|")]
            rows = {}
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                cells = [c.strip() for c in row.strip("|").split("|")]
                rows[cells[0]] = cells
            found.append((header, rows))
    return found


def numbers(cell: str) -> list[str]:
    """The numbers of a cell, as printed (``0.535 ± 0.008`` -> ['0.535', '0.008']; ``–`` -> [])."""
    return NUMBER.findall(cell)


#: README column -> results column, where the README shortens the name.
SAME_COLUMN = {"AlpacaFarm sim. (% vs Davinci003)": "AlpacaFarm sim. win rate vs Davinci003 (%)",
               "win rate": "win rate vs SFT", "gold": "gold reward", "KL to SFT": "KL to SFT (nats)"}  # fmt: skip


def readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


@pytest.mark.parametrize(
    "results_md", ["sim_compare.md", "sim_compare_seeds123.md", "sim_compare_full_grid_seeds12345.md"]
)
def test_readme_simulator_tables_match_the_results_they_quote(results_md):
    section = readme_section("Simulator")
    assert f"benchmarks/results/{results_md.removesuffix('.md')}" in section, f"the README does not quote {results_md}"
    (result_header, result_rows), *_ = tables((RESULTS / results_md).read_text())
    quoted = [(h, rows) for h, rows in tables(section) if set(rows) and set(rows) <= set(result_rows)]
    assert quoted, f"no README table has the methods of {results_md}"
    header, rows = max(quoted, key=lambda t: len(t[1]))
    compared = 0
    for method, cells in rows.items():
        for name, cell in zip(header[1:], cells[1:]):
            column = SAME_COLUMN.get(name, name)
            if column not in result_header:
                continue
            expected = numbers(result_rows[method][result_header.index(column)])
            shown = numbers(cell)
            assert shown == expected[: len(shown)] and (shown or not expected), (method, name, cell, expected)
            compared += 1
    assert compared >= 4 * len(rows)


def test_readme_states_the_default_comparisons_wall_clock_as_recorded():
    """The packaged recipe's comparison time that the README prints is the results' ``wall_seconds``."""
    results = json.loads((RESULTS / "sim_compare.json").read_text())
    wall = results["wall_seconds"]
    minutes, seconds = divmod(round(wall), 60)
    text = " ".join(readme_section("Simulator").split())
    assert f"{len(results['methods'])} methods x {len(results['methods'][0]['seeds'])} seeds" in text
    assert f"**{minutes} min {seconds} s**" in text and f"({round(wall)} s, the results' `wall_seconds`" in text


def without_times(row: dict, drop: tuple[str, ...] = ()) -> dict:
    """A results row without its times (keys naming seconds) and without the keys ``drop``."""
    return {k: v for k, v in row.items() if "seconds" not in k and k not in drop}


def test_the_default_comparisons_rerun_is_identical_but_for_its_times():
    """``sim_compare_rerun.json``: the same command again (a later commit, another day, the recipe's resolved form
    with the new keys of its training sections). Every figure but the wall and per-method times equals
    ``sim_compare.json``'s, and the README prints its time as recorded."""
    first, rerun = (json.loads((RESULTS / name).read_text()) for name in ("sim_compare.json", "sim_compare_rerun.json"))

    def figures(results: dict) -> dict:
        methods = [{**without_times(m), "per_seed": [*map(without_times, m["per_seed"])]} for m in results["methods"]]
        kept = {k: v for k, v in results.items() if k not in ("wall_seconds", "machine", "recipe")}
        return {**kept, "methods": methods}

    assert figures(rerun) == figures(first)
    minutes, seconds = divmod(round(rerun["wall_seconds"]), 60)
    text = " ".join(readme_section("Simulator").split())
    assert (
        f"**{minutes} min {seconds} s** ({round(rerun['wall_seconds'])} s, `benchmarks/results/sim_compare_rerun.json`)"
        in text
    )


def test_the_default_comparison_on_the_later_machine_as_the_readme_states_it():
    """``sim_compare_rerun_b624b00.json``: the packaged comparison on a later machine. The README prints its time as
    recorded and the ratio of its summed method times to the first run's; the SFT evaluation timed at two commits
    there (``sft_evaluation_by_commit.json``) is quoted as recorded; and the methods whose settings the tuning does not
    change, the feedback and the reward models' accuracies equal the whole-grid comparison's on that machine."""
    later, first, grid = (
        json.loads((RESULTS / name).read_text())
        for name in ("sim_compare_rerun_b624b00.json", "sim_compare.json", "sim_compare_full_grid_all_seeds123.json")
    )
    text = " ".join(readme_section("Simulator").split())
    minutes, seconds = divmod(round(later["wall_seconds"]), 60)
    path = "benchmarks/results/sim_compare_rerun_b624b00.json"
    assert f"**{minutes} min {seconds} s** ({round(later['wall_seconds'])} s, `{path}`" in text

    def method_seconds(results: dict) -> float:
        return sum(s["train_seconds"] + s["eval_seconds"] for m in results["methods"] for s in m["per_seed"])

    assert f"took {method_seconds(later) / method_seconds(first):.2f}x as long in sum" in text
    timing = json.loads((RESULTS / "sft_evaluation_by_commit.json").read_text())
    by_commit = {
        c: [f"{r['eval_seconds']:.1f} s" for r in timing["runs"] if r["commit"] == c] for c in ("2c4062d", "b624b00")
    }
    assert f"({' and '.join(by_commit['2c4062d'])} against {' and '.join(by_commit['b624b00'])}, alternated" in text
    assert {r["win_rate"] for r in timing["runs"]} == {later["methods"][0]["per_seed"][0]["win_rate"]}
    assert timing["first_machine_seed1_win_rate_at_2c4062d"] == first["methods"][0]["per_seed"][0]["win_rate"]
    assert (
        f"seed-1 win rate there is {later['methods'][0]['per_seed'][0]['win_rate']:.3f} (this table's run: "
        f"{first['methods'][0]['per_seed'][0]['win_rate']:.3f})" in text
    )

    def figures(method: dict) -> list[dict]:  # the run directory's paths differ between the two runs
        return [without_times(s, drop=("policy", "policy_path", "reference")) for s in method["per_seed"]]

    tuned = json.loads((RESULTS / "sim_tuning_full_grid.json").read_text())["methods"]
    whole = {m["method"]: m for m in grid["methods"]}
    same = [m for m in later["methods"] if m["method"] not in tuned]
    assert all(figures(m) == figures(whole[m["method"]]) for m in same)
    assert f"the {len(same)} methods whose settings the tuning below does not change" in text
    for key in ("feedback", "reward_model_heldout_accuracy"):
        assert later[key] == grid[key], key


def test_readme_chunk_against_paper_mode_and_bandit_at_the_whole_grids_picks_are_the_results_differences():
    """The README's "chunk leads by D ± S" (against bandit) and "chunk leads paper mode on LC (by D ± S)" at the whole
    grid's picks: differences of the methods' mean LC win rates and the standard errors of those differences, from the
    results file."""
    methods = {
        m["method"]: m for m in json.loads((RESULTS / "sim_compare_full_grid_seeds12345.json").read_text())["methods"]
    }
    text = " ".join(readme_section("Simulator").split())
    for other, phrase in (("segment_ppo", "chunk leads paper mode on LC (by {}"), ("bandit_ppo", "chunk leads by {}")):
        chunk, them = methods["chunk_ppo"], methods[other]
        diff = chunk["lc_win_rate"] - them["lc_win_rate"]
        stderr = (chunk["lc_win_rate_se"] ** 2 + them["lc_win_rate_se"] ** 2) ** 0.5
        assert phrase.format(f"{diff:.3f} ± {stderr:.3f}") in text, other


def test_readme_sft_against_itself_matches_the_30_draws():
    bias = json.loads((RESULTS / "sim_sft_bias.json").read_text())
    mean, stderr = bias["mean_win_rate"], bias["stderr_of_mean"]
    shown = f"over {bias['draws']} independent draws it reads {mean:.3f} ± {stderr:.3f}"
    assert shown in " ".join(readme_section("Simulator").split())


def test_readme_online_dpo_tables_are_the_run_they_quote():
    """Each table of the README's simulator paragraph on online DPO is, row for row, a table `online_dpo_sim.py`
    wrote into `online_dpo_sim.json`."""
    section = readme_section("Iterative online DPO and one-step async")
    paragraph = section[section.index("**In the simulator**") :]
    markdown = json.loads((RESULTS / "online_dpo_sim.json").read_text())["markdown"]
    written = [(header, rows) for header, rows in tables(markdown)]
    shown = tables(paragraph)
    assert len(shown) == 3
    for table in shown:
        assert table in written, table


def test_readme_continual_ppo_table_is_the_run_it_quotes():
    """The README's sequential vs CPPO-style PPO table is the table `benchmarks/continual.py forgetting` wrote."""
    section = readme_section("Continual RLHF")
    paragraph = section[section.index("Sequential PPO vs CPPO-style PPO") :]
    written = json.loads((RESULTS / "continual_forgetting_ppo.json").read_text())["markdown"]
    lines = paragraph.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| sequence |"))
    shown = "\n".join(lines[first : next(i for i in range(first, len(lines)) if not lines[i].startswith("|"))])
    assert shown == written


def test_readme_claims_table_is_the_one_make_fidelity_wrote():
    section = readme_section("Simulator")
    paragraph = section[section.index("**Every fidelity result from one command**") :]
    written = (RESULTS / "fidelity.md").read_text()
    assert tables(paragraph)[0] == tables(written)[0]


def test_readme_ranking_with_every_method_tuned_is_the_fidelity_run():
    """The README's *Every method at the protocol's picks*: DPO's LC win rate, the rank correlations and their
    bootstrap intervals from `sim_fidelity_full_grid.json`, the two nearly tied methods, and the Spearman rho with
    those two swapped, recomputed here with the benchmark's own function."""
    from rlhf_ext.sim.fidelity import spearman_rho

    text = " ".join(readme_section("Simulator").split())
    metrics = json.loads((RESULTS / "sim_fidelity_full_grid.json").read_text())["metrics"]
    shown = []
    for metric in ("lc_win_rate", "win_rate"):
        stats = metrics[metric]["alpacafarm"]["statistics"]
        rho, tau = stats["spearman"], stats["kendall_tau_b"]
        shown += [f"{rho['value']:+.3f}", f"({rho['bootstrap_2.5']:+.3f}..{rho['bootstrap_97.5']:+.3f})",
                  f"{tau['value']:+.3f}"]  # fmt: skip
    lc, raw = shown[:3], shown[3:]
    assert (
        f"Spearman rho is {lc[0]} on the LC win rate (bootstrap over seeds {lc[1][1:]} and {raw[0]} on the raw one "
        f"{raw[1]}; Kendall tau-b {lc[2]} and {raw[2]}" in text
    )
    rows = {r["method"]: r for r in metrics["lc_win_rate"]["alpacafarm"]["methods"]}
    sft, rc = rows["sft"]["win_rate_vs_sft"], rows["reward_conditioning"]["win_rate_vs_sft"]
    assert f"SFT ({sft:.4f}) reading above reward conditioning ({rc:.4f}) by {sft - rc:.5f}" in text
    swapped = {**{m: r["win_rate_vs_sft"] for m, r in rows.items()}, "sft": rc, "reward_conditioning": sft}
    alpacafarm = [rows[m]["alpacafarm_sim_winrate_vs_davinci003"] for m in rows]
    assert f"rho on LC would be {spearman_rho([swapped[m] for m in rows], alpacafarm):+.3f}" in text
    dpo = {m["method"]: m for m in json.loads((RESULTS / "sim_compare_full_grid_all_seeds123.json").read_text())[
        "methods"]}["dpo"]  # fmt: skip
    assert f"DPO reads {dpo['lc_win_rate']:.3f} ± {dpo['lc_win_rate_se']:.3f} LC" in text


def test_readme_second_stage_at_the_whole_grids_picks_is_the_run_it_quotes():
    """The README's second-stage figures at the whole grid's picks: each PPO variant's LC win rate ± s.e. and the
    three reward models' mean held-out accuracies, from `sim_compare_stage1_full_grid.json` (`make fidelity`'s
    step 3)."""
    results = json.loads((RESULTS / "sim_compare_stage1_full_grid.json").read_text())
    lc = {m["method"]: f"{m['lc_win_rate']:.3f} ± {m['lc_win_rate_se']:.3f}" for m in results["methods"]}
    accuracy = {
        kind: sum(seeds.values()) / len(seeds) for kind, seeds in results["reward_model_heldout_accuracy"].items()
    }
    text = " ".join(readme_section("Simulator").split())
    assert (
        f"bandit PPO {lc['bandit_ppo']} LC, token {lc['token_ppo']}, chunk {lc['chunk_ppo']}, paper mode "
        f"{lc['segment_ppo']}" in text
    )
    assert (
        f"(segment {accuracy['segment']:.3f}, bandit {accuracy['bandit']:.3f}, token {accuracy['token']:.3f})" in text
    )
