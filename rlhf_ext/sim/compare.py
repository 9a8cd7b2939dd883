"""``rlhf-ext sim compare``: AlpacaFarm's method comparison in the simulator (paper 002, sections 3-5).

AlpacaFarm's Figure 1 on a cheap task: SFT; simulated feedback ``p_sim`` on the PREF split; surrogate reward models;
each method trained from the SFT model and evaluated by its win rate against it on held-out prompts (``p_eval``), with
gold reward, length and KL alongside; mean ± standard error over seeds.

Layout of ``output_dir`` (written atomically, reused on rerun; only :data:`FREE_KEYS` and the ``method_overrides`` of
methods that have not run here may change between runs)::

    recipe.json                  the settings (the recipe less --methods/--seeds and method_overrides), fingerprint
    data/                        task splits (sft, pref, unlabeled, eval, rm_eval)        shared by all seeds
    base/, sft/                  the initial model and the SFT model                      shared by all seeds
    seed-<s>/feedback/           simulated feedback (train) + gold-ordered held-out pairs (test), agreement.json
    seed-<s>/rm_bandit/, rm_segment/, rm_token/   surrogate reward models (cutoff inf / segment cutoff / 0)
    seed-<s>/<method>/           the method's checkpoint
    seed-<s>/reference_samples.json    the SFT model's evaluation samples (shared by all methods of the seed)
    results/<method>/seed-<s>.json     one finished (method, seed): win rate, s.e., KL, length, gold, times
    results/<method>/overrides.json    the method_overrides the method runs with here (written when it first trains)
    sim_compare.json / .md / _winrate.png / _tradeoff.png   the summary over all finished results
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlhf_ext.algos.names import knob_values
from rlhf_ext.algos.segment_reward import SegmentRewardKnobs
from rlhf_ext.config import RecipeError, from_dict, to_dict
from rlhf_ext.runtime.io import atomic_directory, atomic_write_json, atomic_write_text
from rlhf_ext.runtime.rundir import RunDir, RunSettingsChanged, fingerprint
from rlhf_ext.sim.recipe import METHODS, SimCompareRecipe
from rlhf_ext.sim.report import RESULTS_DIR, result_stage, summarise, unparseable_text, write_reports

logger = logging.getLogger(__name__)

#: Entropy cutoffs of the bandit and token reward models (the segment model uses the recipe's ``entropy_cutoff``).
RM_CUTOFFS = {"bandit": math.inf, "token": 0.0}
#: Keys of the recipe that may change between runs of one output directory.
FREE_KEYS = ("output_dir", "seeds", "methods", "threads", "workers", "budgets", "tuning", "method_overrides")

Progress = Callable[[str], None]


def recipe_settings(recipe: SimCompareRecipe) -> dict[str, Any]:
    """The recipe less :data:`FREE_KEYS`: what every result of one output directory must share (a method's own
    ``method_overrides`` are checked per method: :func:`record_method_overrides`)."""
    return {k: v for k, v in to_dict(recipe).items() if k not in FREE_KEYS}


def recipe_fingerprint(recipe: SimCompareRecipe) -> str:
    return fingerprint(recipe_settings(recipe))


def overrides_stage(method: str) -> str:
    """The run-directory stage that records the ``method_overrides`` ``method`` runs with in one directory."""
    return f"{method}/overrides"


def record_method_overrides(run_dir: RunDir, recipe: SimCompareRecipe, method: str) -> None:
    """Record, before ``method`` first trains in ``run_dir``, the ``method_overrides`` it runs with (checked by
    :meth:`SimRun.check_directory` on every later run of the method there)."""
    if not run_dir.done(overrides_stage(method)):
        run_dir.mark_done(overrides_stage(method), {"overrides": recipe.method_overrides.get(method, [])})


def _migrate_method_overrides(run_file: Path) -> None:
    """An old directory whose ``recipe.json`` fingerprinted ``method_overrides`` with the other settings: record them
    for every method that ran there and fingerprint the rest, so its results stay usable."""
    old = json.loads(run_file.read_text()) if run_file.is_file() else {}
    settings = old.get("settings")
    if not isinstance(settings, dict) or "method_overrides" not in settings:
        return
    overrides = settings.pop("method_overrides") or {}
    root = run_file.parent
    for method in METHODS:
        marker = root / RESULTS_DIR / method / "overrides.json"
        ran = (root / RESULTS_DIR / method).is_dir() or any(root.glob(f"seed-*/{method}"))
        if ran and not marker.exists():
            atomic_write_json(marker, {"overrides": overrides.get(method, [])})
    atomic_write_json(run_file, {**old, "settings": settings, "fingerprint": fingerprint(settings)})


def order_by_gold(gold, pairs):
    """``pairs`` (a ``Dataset`` with ``prompt``, ``chosen``, ``rejected``, ``style``) with ``chosen`` the response of
    higher gold reward and gold ties dropped, and the fraction of pairs that tied."""
    cols = pairs.to_dict()
    n = len(pairs)
    scores = gold.score(cols["prompt"] * 2, cols["chosen"] + cols["rejected"], cols["style"] * 2)
    swap, tied = (scores[:n] < scores[n:]).tolist(), (scores[:n] == scores[n:]).tolist()
    rows = [
        {**r, "chosen": r["rejected"], "rejected": r["chosen"]} if sw else r
        for r, sw, t in zip(pairs.to_list(), swap, tied)
        if not t
    ]
    columns = {k: [r[k] for r in rows] for k in pairs.column_names}  # (from_list cannot make an empty dataset)
    return type(pairs).from_dict(columns, features=pairs.features), sum(tied) / max(n, 1)


class SimRun:
    """The artefacts of one comparison directory, each built on first use and reused afterwards."""

    def __init__(self, recipe: SimCompareRecipe, progress: Progress | None = None):
        self.recipe = recipe
        self.root = Path(recipe.output_dir)
        self.data_dir = self.root / "data"
        self.progress = progress or logger.info
        self._splits = None
        self._gold = None
        self._reward_fns: dict[int, Any] = {}
        self._pools: dict[int, Any] = {}
        self.run_dir: RunDir | None = None

    # ---------------------------------------------------------------------------------------- shared artefacts
    def check_directory(self) -> RunDir:
        """Open the run directory, refusing one that holds a run with other settings, or a method of this run that
        ran there with other ``method_overrides`` (its results would be mixed with new ones)."""
        _migrate_method_overrides(self.root / "recipe.json")
        try:
            settings = recipe_settings(self.recipe)
            self.run_dir = RunDir(
                self.root, settings, kind="sim-compare", run_file="recipe.json", stages_dir=RESULTS_DIR
            )
        except RunSettingsChanged as e:
            raise RecipeError(
                f"{self.root} holds a comparison with different settings (changed: {e.changes}); use another "
                "output_dir or restore the settings (only --methods and --seeds may change)"
            ) from e
        for method in self.recipe.methods:
            ran = self.run_dir.result(overrides_stage(method))
            now = self.recipe.method_overrides.get(method, [])
            if ran is not None and ran["overrides"] != now:
                raise RecipeError(
                    f"{self.root}: {method} was run here with method_overrides {ran['overrides']}, now {now}; use "
                    f"another output_dir, or delete {self.root}/seed-*/{method} and {self.root}/{RESULTS_DIR}/{method} "
                    "to rerun it"
                )
        return self.run_dir

    def splits(self):
        """The task's ``DatasetDict`` (:func:`rlhf_ext.sim.task.build_task_splits`), built once."""
        if self._splits is None:
            from datasets import load_from_disk

            from rlhf_ext.sim.task import build_task_splits

            if not (self.data_dir / "dataset_dict.json").exists():
                self.progress(f"building the task splits ({self.recipe.task.source})")
                splits = build_task_splits(self.recipe.task, self.root, seed=self.recipe.model.seed)
                with atomic_directory(self.data_dir) as tmp:
                    splits.save_to_disk(str(tmp))
            self._splits = load_from_disk(str(self.data_dir))
        return self._splits

    @property
    def gold(self):
        """The gold scorer of the task (one style, or a prompt -> style mapping when stages mix styles)."""
        if self._gold is None:
            from rlhf_ext.sim.gold import GoldScorer

            style_of = {r["prompt"]: r["style"] for split in self.splits().values() for r in split}
            styles = set(style_of.values())
            self._gold = GoldScorer(
                styles.pop() if len(styles) == 1 else style_of, phrase_credit=self.recipe.task.phrase_credit
            )
        return self._gold

    def base_model(self) -> str:
        base = self.recipe.model.base
        if base is not None:
            from rlhf_ext.pipelines.builtins import resolve_model

            return resolve_model(base)
        dest = self.root / "base"
        if not (dest / "config.json").exists():
            from rlhf_ext.sim.task import build_base_model, task_texts

            self.progress("building the tiny base model and its task tokenizer")
            build_base_model(dest, task_texts(self.splits()), self.recipe.model.tokenizer_vocab, self.recipe.model.seed)
        return str(dest)

    def sft_model(self) -> str:
        """The SFT model (TRL ``SFTTrainer`` on the SFT split, chosen and rejected responses by default)."""
        from rlhf_ext.sim.methods import fine_tune

        dest = self.root / "sft"
        if not (dest / "config.json").exists():
            cfg = self.recipe.sft
            keys = ("chosen", "rejected") if cfg.responses == "both" else ("chosen",)
            rows = [{"prompt": r["prompt"], "completion": r[k]} for r in self.splits()["sft"] for k in keys]
            self.progress(f"supervised fine-tuning on {len(rows)} responses")
            fine_tune(self, self.base_model(), rows, cfg, dest, cfg.seed)
        return str(dest)

    # ------------------------------------------------------------------------------------- per-seed artefacts
    def seed_dir(self, seed: int) -> Path:
        return self.root / f"seed-{seed}"

    def feedback_dir(self, seed: int) -> Path:
        return self.seed_dir(seed) / "feedback"

    def pool(self, seed: int):
        if seed not in self._pools:
            self._pools[seed] = self.recipe.feedback.pool.build(self.gold, seed=seed, sft_model=self.sft_model())
        return self._pools[seed]

    def policy(self, path: str, prompt_prefix: str = "", temperature: float | None = None):
        from rlhf_ext.sim.evaluate import HFPolicy

        g = self.recipe.generation
        temperature = g.temperature if temperature is None else temperature
        return HFPolicy(
            path,
            prompt_prefix=prompt_prefix,
            max_new_tokens=g.max_new_tokens,
            temperature=temperature,
            batch_size=g.batch_size,
        )

    def sft_pairs(self, prompts: list[Any], styles: list[Any], seed: int):
        """Two SFT samples per prompt as ``(prompt, chosen, rejected, style)`` rows, unordered (AlpacaFarm's pairs)."""
        from datasets import Dataset

        samples = self.policy(self.sft_model()).sample(prompts, 2, seed=seed)
        rows = zip(prompts, samples.texts, styles)
        return Dataset.from_list([{"prompt": p, "chosen": s[0], "rejected": s[1], "style": st} for p, s, st in rows])

    def feedback(self, seed: int):
        """Simulated human feedback of ``seed``: ``train`` PREF pairs labelled by ``p_sim`` (training flips), ``test``
        held-out pairs of the same kind ordered by the gold reward (gold ties dropped); with the pool's agreement
        report and the tie rates next to it."""
        from datasets import DatasetDict, load_from_disk

        out = self.feedback_dir(seed)
        if not (out / "dataset_dict.json").exists():
            pref, held_out = self.splits()["pref"], self.splits()["rm_eval"]
            if self.recipe.feedback.pairs == "sft_samples":
                self.progress(f"seed {seed}: sampling {2 * (len(pref) + len(held_out))} SFT responses for feedback")
                pairs = self.sft_pairs(pref["prompt"], pref["style"], seed=10_000 + seed)
                held_out = self.sft_pairs(held_out["prompt"], held_out["style"], 40_000 + seed)
            else:
                pairs = pref
            test, test_tied = order_by_gold(self.gold, held_out)
            if len(test) == 0:
                credit = self.recipe.task.phrase_credit
                raise RecipeError(
                    f"all {len(held_out)} held-out feedback pairs tie under the gold reward (the SFT model's samples "
                    "carry no key-phrase credit), so no reward model can be evaluated; train the SFT model longer "
                    "(sft.max_steps)" + (" or use task.phrase_credit: partial" if credit == "exact" else "")
                )
            pool = self.pool(seed)
            before = pool.label_counts()
            labelled = pool.relabel(pairs, train=True)  # pool.unparseable: drop leaves some rows out
            cols = pairs.to_dict()
            report = pool.agreement(cols["prompt"], cols["chosen"], cols["rejected"], cols["style"])
            gold = self.gold.score(list(labelled["prompt"]) * 2, list(labelled["chosen"]) + list(labelled["rejected"]))
            n = len(labelled)
            decided = gold[:n] != gold[n:]
            quality = {
                "pairs": n,
                "gold_tied_fraction": float((~decided).float().mean()),
                "labels_agreeing_with_gold": float((gold[:n] > gold[n:])[decided].float().mean()),
                "heldout_pairs": len(test),
                "heldout_gold_tied_fraction": test_tied,
                "unparseable": pool.label_counts(since=before),
                "unparseable_policy": pool.unparseable,
            }
            with atomic_directory(out) as tmp:
                DatasetDict(train=labelled, test=test).save_to_disk(str(tmp))
                atomic_write_json(tmp / "agreement.json", {"report": report.as_dict(), "labels": quality})
                atomic_write_text(tmp / "agreement.md", report.as_markdown() + "\n")
        return load_from_disk(str(out))

    def reward_model(self, seed: int, kind: str) -> str:
        """A surrogate reward model of ``seed`` (``bandit``, ``segment`` or ``token``: :data:`RM_CUTOFFS`), trained
        with the segment reward-model recipe from the SFT model on the simulated feedback."""
        from rlhf_ext.pipelines import segment_rm as srm
        from rlhf_ext.sim.methods import train_args

        out = self.seed_dir(seed) / f"rm_{kind}"
        if not (out / "metrics.json").exists():
            cfg = self.recipe.reward_model
            self.feedback(seed)
            feedback = str(self.feedback_dir(seed))
            self.progress(f"seed {seed}: training the {kind} reward model")
            knobs = knob_values(cfg, SegmentRewardKnobs)  # paper 003's; bandit and token differ only in the cutoff
            if kind in RM_CUTOFFS:
                knobs["entropy_cutoff"] = RM_CUTOFFS[kind]
            with atomic_directory(out) as tmp:
                recipe = srm.SegmentRMRecipe(
                    engine="trl",
                    model=srm.ModelSection(sft_model=self.sft_model()),
                    data=srm.PreferenceDataSection(
                        train=feedback, eval=feedback, eval_split="test", max_length=self.recipe.task.max_length
                    ),
                    segment=srm.SegmentSection(**knobs),
                    train=srm.RMTrainSection(**train_args(cfg.train, tmp, seed)),
                )
                summary = srm.run_segment_rm(recipe)
                atomic_write_json(tmp / "metrics.json", {**summary, "model_dir": str(out)})
        return str(out)

    def reward_fn(self, seed: int):
        """The bandit surrogate reward model of ``seed`` as a reward function (``load_reward``, e_phi at cutoff inf)."""
        if seed not in self._reward_fns:
            from rlhf_ext.runtime.rewards import load_reward

            self._reward_fns[seed] = load_reward(self.reward_model(seed, "bandit"))
        return self._reward_fns[seed]

    def reference_samples(self, seed: int):
        """The SFT model's evaluation samples of ``seed`` (drawn once, shared by every method's comparison)."""
        from rlhf_ext.runtime.sampling import Samples

        ev = self.recipe.eval
        name = "reference_samples.json" if ev.split == "eval" else f"reference_samples_{ev.split}.json"
        path = self.seed_dir(seed) / name
        if not path.exists():
            s = self.policy(self.sft_model(), temperature=ev.temperature).sample(
                self.eval_prompts(), ev.samples_per_prompt, seed=30_000 + seed
            )
            atomic_write_json(path, {"texts": s.texts, "num_tokens": s.num_tokens, "truncated": s.truncated,
                                     "temperatures": s.temperatures})  # fmt: skip
        d = json.loads(path.read_text())
        return Samples(d["texts"], torch.tensor(d["num_tokens"]), torch.tensor(d["truncated"], dtype=torch.bool),
                       d["temperatures"])  # fmt: skip

    def eval_split(self):
        """The prompts (and styles) the win rate is measured on: the ``eval`` split, or with ``eval.split:
        validation`` the next ``task.max_eval_prompts`` rows of the test split (disjoint from ``eval``)."""
        splits = self.splits()
        if self.recipe.eval.split == "eval":
            return splits["eval"]
        n = self.recipe.task.max_eval_prompts
        test = splits["rm_eval"]
        if len(test) < 2 * n:
            raise RecipeError(
                f"eval.split=validation needs {2 * n} test prompts (task.max_eval_prompts={n} for eval, then {n} for "
                f"validation) but the task has {len(test)}; raise task.num_samples or lower task.max_eval_prompts"
            )
        return test.select(range(n, 2 * n))

    def eval_prompts(self) -> list[Any]:
        return list(self.eval_split()["prompt"])

    def for_method(self, method: str) -> SimRun:
        """This run as ``method`` sees it: the recipe with ``method_overrides[method]`` applied (shared caches)."""
        overrides = self.recipe.method_overrides.get(method)
        if not overrides:
            return self
        from rlhf_ext.config import apply_overrides

        view = copy.copy(self)
        view.recipe = from_dict(SimCompareRecipe, apply_overrides(to_dict(self.recipe), overrides))
        return view

    # ------------------------------------------------------------------------------------------------ evaluate
    def evaluate(self, seed: int, spec) -> dict[str, Any]:
        """Win rate of ``spec`` (a :class:`~rlhf_ext.sim.methods.PolicySpec`) against the SFT model."""
        from rlhf_ext.sim.evaluate import BestOfNPolicy, win_rate

        ev = self.recipe.eval
        policy = self.policy(spec.path, spec.prompt_prefix, temperature=ev.temperature)
        if spec.best_of_n:
            policy = BestOfNPolicy(policy, self.reward_fn(seed), spec.best_of_n)
        reference = self.policy(self.sft_model(), temperature=ev.temperature)
        prompts = self.eval_prompts()
        samples = policy.sample(prompts, ev.samples_per_prompt, seed=20_000 + seed)
        before = self.pool(seed).label_counts() if ev.judge == "pool" else None
        result = win_rate(
            policy,
            reference,
            prompts,
            styles=list(self.eval_split()["style"]),
            judge=self.pool(seed) if ev.judge == "pool" else self.gold,
            gold=self.gold,
            samples_per_prompt=ev.samples_per_prompt,
            seed=20_000 + seed,
            reference_samples=self.reference_samples(seed),
            samples=samples,
        )
        flat_prompts = [p for p in prompts for _ in range(ev.samples_per_prompt)]
        segmentation = reference.segmentation(
            flat_prompts, samples.flat(), samples.truncated.flatten(), self.recipe.reward_model.entropy_cutoff
        )  # the SFT model's segmentation of the policy's evaluation samples (the reward-hacking monitor's view)
        unparseable = self.pool(seed).label_counts(since=before) if before is not None else {}
        return {**result.as_dict(), **segmentation, "unparseable": unparseable}


# ---------------------------------------------------------------------------------------------------- running
def run_compare(recipe: SimCompareRecipe, progress: Progress | None = None) -> dict[str, Any]:
    """Train and evaluate every (method, seed) of ``recipe`` that has no result yet, then write and return the summary
    (:func:`~rlhf_ext.sim.report.summarise`); ``progress`` gets one line per step (default: this module's logger).
    With ``recipe.workers > 1`` the seeds run in that many processes once the SFT model is built (same results)."""
    from rlhf_ext.runtime.async_runner import torch_threads
    from rlhf_ext.runtime.rundir import claim_output_dir

    progress = progress or logger.info
    inputs = {"model.base": recipe.model.base, "task.source": recipe.task.source}
    with claim_output_dir(recipe.output_dir, inputs, "output_dir"):
        run = SimRun(recipe, progress)
        run_dir = run.check_directory()
        start = time.time()
        pending = [s for s in recipe.seeds if not all(run_dir.done(result_stage(m, s)) for m in recipe.methods)]
        if recipe.workers > 1 and len(pending) > 1:
            with torch_threads(recipe.threads):
                run.sft_model()  # built once, before the workers share it
            jobs = [(f"seed {s}", from_dict(SimCompareRecipe, {**to_dict(recipe), "seeds": [s]})) for s in pending]
        else:
            jobs = [("", recipe)]
        run_jobs(jobs, recipe.workers, recipe.threads, progress)
        summary = summarise(recipe, wall_seconds=time.time() - start)
        summary["reports"] = write_reports(summary, run.root)
        return summary


def run_jobs(jobs: list[tuple[str, SimCompareRecipe]], workers: int, threads: int | None, progress: Progress) -> None:
    """Run every (method, seed) of each ``(label, recipe)`` in ``jobs`` that has no result yet: here, or with
    ``workers > 1`` and several jobs in that many spawned processes (progress lines prefixed with the job's label)."""
    from rlhf_ext.runtime.async_runner import torch_threads

    if workers <= 1 or len(jobs) <= 1:
        with torch_threads(threads):
            for _, job in jobs:
                run = SimRun(job, progress)
                run_dir = run.check_directory()
                for seed in job.seeds:
                    run_seed(run, run_dir, seed, progress)
        return
    import multiprocessing
    import warnings
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    init = {"initializer": _init_worker, "initargs": (list(warnings.filters),)}
    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context, **init) as pool:
        futures = [(label, pool.submit(_run_job_in_worker, label, job)) for label, job in jobs]
        for label, _ in futures:
            progress(f"[{label}] started in a worker process")
        for label, future in futures:
            future.result()
            progress(f"[{label}] finished")


def _init_worker(warning_filters: list) -> None:
    """Worker initializer: the parent's warning filters (a spawned process starts with Python's defaults), and, on
    Linux, end this worker when the parent dies (a ``kill`` must not leave workers training in the background)."""
    import contextlib
    import ctypes
    import signal
    import sys
    import warnings

    warnings.filters[:] = warning_filters
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _run_job_in_worker(label: str, job: SimCompareRecipe) -> None:
    import sys

    def progress(message: str) -> None:
        print(f"[worker {label}] {message}", file=sys.stderr, flush=True)

    run_jobs([(label, job)], 1, job.threads, progress)


def run_seed(run: SimRun, run_dir: RunDir, seed: int, progress: Progress) -> None:
    """Train and evaluate every method of ``run.recipe`` for ``seed`` that has no result yet."""
    from rlhf_ext.sim.methods import METHOD_FUNCTIONS

    for method in run.recipe.methods:
        if run_dir.done(result_stage(method, seed)):
            progress(f"[{method} seed {seed}] done earlier, skipped")
            continue
        progress(f"[{method} seed {seed}] training")
        record_method_overrides(run_dir, run.recipe, method)
        t0 = time.time()
        spec = METHOD_FUNCTIONS[method](run.for_method(method), seed)
        t1 = time.time()
        progress(f"[{method} seed {seed}] evaluating ({t1 - t0:.0f} s of training)")
        metrics = run.evaluate(seed, spec)
        t2 = time.time()
        result = {
            "method": method,
            "seed": seed,
            **metrics,
            "policy_path": spec.path,
            **{k: getattr(spec, k) for k in ("prompt_prefix", "best_of_n", "info", "labels", "samples")},
            "train_seconds": t1 - t0,
            "eval_seconds": t2 - t1,
        }
        run_dir.mark_done(result_stage(method, seed), result)
        progress(
            f"[{method} seed {seed}] win rate {metrics['win_rate']:.3f} ± {metrics['stderr']:.3f}, "
            f"KL {metrics['kl']:.2f}, gold {metrics['gold_mean']:+.2f}, {metrics['avg_length_chars']:.0f} chars"
            + unparseable_text(metrics["unparseable"], "comparisons", "a coin")
        )
