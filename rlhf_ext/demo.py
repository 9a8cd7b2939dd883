"""The main job: the whole RLHF pipeline on an embedded default, on a CPU, in minutes (``make demo``).

Each stage writes its outputs atomically and a marker ``stages/<stage>.json``; a rerun reuses finished stages unless
``--force`` and refuses a directory started with other settings (a ``data.config`` file's content included):

1. ``data``       — a small continual preference dataset from the ``offline`` generator (paper 000); stage 0 is used.
2. ``sft``        — a BPE tokenizer and a tiny Llama fine-tuned (TRL ``SFTTrainer``) on chosen and rejected
                    responses alike, so the SFT policy is mixed-quality.
3. ``labels``     — the preference split relabelled by the simulated annotator pool (25% label flips; paper 002).
4. ``rm``         — a segment reward model (paper 003, section 2.2) trained on those labels.
5. ``normalizer`` — the location-aware normalizer fitted on the labelled pairs (paper 003 Eq. 6).
6. ``ppo``        — segment-level PPO (paper 003, section 2.3) from the SFT model.
7. ``eval``       — win rate of PPO against SFT on held-out prompts (noise-free annotator pool), gold reward,
                    response length, exact per-token KL to the SFT model; reward-model accuracy.
8. ``report``     — ``report.html`` (metrics, reward/KL curves, SFT and PPO responses coloured by segment reward,
                    provenance) and ``metrics.json`` (the same numbers).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlhf_ext.algos.knobs import knob, knob_like, seed_knob
from rlhf_ext.algos.names import knob_values
from rlhf_ext.algos.ppo import PPOKnobs
from rlhf_ext.algos.segment_dense import DenseRewardKnobs, resolve_granularity
from rlhf_ext.algos.segment_reward import SegmentRewardKnobs
from rlhf_ext.config import TrainSection, load_recipe
from rlhf_ext.datagen.schema import MAX_TASK_SAMPLES
from rlhf_ext.runtime.io import atomic_directory, recover_directory
from rlhf_ext.runtime.rundir import RunDir, claim_output_dir

logger = logging.getLogger(__name__)

STAGES = ("data", "sft", "labels", "rm", "normalizer", "ppo", "eval", "report")


@dataclass
class DemoData:
    config: str = "continual-piecewise-preference"
    num_samples: int = knob(600, ge=10, le=MAX_TASK_SAMPLES, help="Preference pairs generated per task (train + test).")
    stage: int = knob(0, ge=0, help="The generated stage the demo trains on.")
    sft_fraction: float = knob(0.4, gt=0, lt=1, help="Share of the stage's train split used for SFT.")
    annotator_flip_prob: float = knob(0.25, ge=0, le=1, help="AlpacaFarm's label noise of the training labels.")
    max_completion_length: int = knob(112, ge=1, help="Tokens per response, in PPO and in the evaluation.")
    eval_prompts: int = knob(64, ge=1)


@dataclass
class DemoModel:
    """``base_model: null`` builds a tiny Llama with a BPE tokenizer trained on the data; a checkpoint path or
    ``builtin:smollm2`` fine-tunes that model (and its tokenizer) instead."""

    base_model: str | None = None
    tokenizer_vocab: int = knob(1024, ge=64)
    hidden_size: int = knob(96, ge=8)
    num_layers: int = knob(2, ge=1)


@dataclass
class DemoSFTTrain(TrainSection):
    """Supervised fine-tuning on the demonstrations."""

    num_train_epochs: float = knob_like(TrainSection, "num_train_epochs", 10.0)
    learning_rate: float = knob_like(TrainSection, "learning_rate", 3e-3)
    warmup_ratio: float = knob_like(TrainSection, "warmup_ratio", 0.05)
    logging_steps: int = knob_like(TrainSection, "logging_steps", 20)


@dataclass
class DemoRMTrain(TrainSection):
    """The segment reward model's training (``train`` of :class:`~rlhf_ext.pipelines.segment_rm.SegmentRMRecipe`)."""

    num_train_epochs: float = knob_like(TrainSection, "num_train_epochs", 2.0)
    learning_rate: float = knob_like(TrainSection, "learning_rate", 1e-3)


@dataclass
class DemoPPOTrain(TrainSection):
    """Segment PPO's training (``train`` of :class:`~rlhf_ext.pipelines.segment_ppo.SegmentPPORecipe`):
    ``batch_size`` rollouts per step, 2 per prompt."""

    max_steps: int | None = knob_like(TrainSection, "max_steps", 20)
    learning_rate: float = knob_like(TrainSection, "learning_rate", 3e-4)
    logging_steps: int = knob_like(TrainSection, "logging_steps", 1)


@dataclass
class DemoTrain:
    """The optimisation of each training stage, in the keys of every recipe's ``train`` section
    (:class:`~rlhf_ext.config.TrainSection`)."""

    sft: DemoSFTTrain = field(default_factory=DemoSFTTrain)
    reward_model: DemoRMTrain = field(default_factory=DemoRMTrain)
    ppo: DemoPPOTrain = field(default_factory=DemoPPOTrain)


@dataclass
class DemoRecipe:
    """Settings of ``rlhf-ext demo`` (``recipes/demo.yaml``); defaults run in a few minutes on 2 CPU cores."""

    out: str = "runs/demo"
    seed: int = seed_knob(0)
    data: DemoData = field(default_factory=DemoData)
    model: DemoModel = field(default_factory=DemoModel)
    train: DemoTrain = field(default_factory=DemoTrain)
    #: the papers' knobs, the same dataclasses (names, defaults) as the TRL configs and the recipes
    segment: SegmentRewardKnobs = field(default_factory=SegmentRewardKnobs)
    dense: DenseRewardKnobs = field(default_factory=DenseRewardKnobs)
    ppo: PPOKnobs = field(default_factory=lambda: PPOKnobs(advantage_estimator="reinforce_baseline"))
    #: TRL's ``report_to`` for every training stage; not a setting of the results (never invalidates finished stages)
    report_to: str | list[str] = "none"

    def __post_init__(self) -> None:  # the demo learns from a segment reward model: unset granularity = chunk
        self.dense.granularity = resolve_granularity(self.dense.granularity, spans=False)


class DemoPipeline:
    """Runs the stages in order, skipping finished ones. ``echo`` receives one line per stage started, finished or
    reused (default: the ``rlhf_ext.demo`` logger at ``INFO``)."""

    def __init__(self, recipe: DemoRecipe, force: bool = False, echo: Callable[[str], Any] | None = None):
        self.recipe = recipe
        self.out = Path(recipe.out)
        self.echo = echo or logger.info
        self._settings = settings = {k: v for k, v in asdict(recipe).items() if k not in ("out", "report_to")}
        if Path(recipe.data.config).is_file():  # a data.config file's content can change under the same name
            settings["data_config_sha256"] = hashlib.sha256(Path(recipe.data.config).read_bytes()).hexdigest()[:16]
        if recipe.model.base_model is not None:  # a model that cannot load fails now, before `out` records it
            from rlhf_ext.zoo.builtins import check_model_source

            check_model_source(recipe.model.base_model)
        #: Raises :class:`rlhf_ext.runtime.rundir.RunSettingsChanged` when ``out`` was started with other settings.
        with self._claim():
            self.run_dir = RunDir(
                self.out,
                settings,
                kind="demo",
                force=force,
                redo="rerun with --force (Python: DemoPipeline(..., force=True))",
            )
        self.markers = self.run_dir.stages  # (benchmarks/segment_fidelity.py writes its markers here)
        self._derived_built: set[str] = set()  # the derived datasets this process wrote (see _derived_dataset)

    # ----------------------------------------------------------------------------------------------- plumbing
    def _done(self, stage: str) -> dict[str, Any] | None:
        """The result of a finished stage, else None (benchmarks/segment_fidelity.py reuses stages through it)."""
        return self.run_dir.result(stage)

    def _claim(self):
        """``out`` checked against the inputs and locked (:func:`~rlhf_ext.runtime.rundir.claim_output_dir`)."""
        return claim_output_dir(self.recipe.out, {"model.base_model": self.recipe.model.base_model}, "out")

    def run(self) -> dict[str, Any]:
        """Run the stages, holding ``out``'s lock; refused when another run holds it or restarted ``out`` with other
        settings since this pipeline was made."""
        with self._claim():
            self.run_dir = RunDir(self.out, self._settings, kind="demo")
            results: dict[str, Any] = {}
            start = time.perf_counter()
            for i, stage in enumerate(STAGES, 1):
                done = self.run_dir.result(stage)
                if done is not None:
                    self.echo(f"[{i}/{len(STAGES)}] {stage}: reusing {self.run_dir.marker(stage)}")
                    results[stage] = done
                    continue
                self.echo(f"[{i}/{len(STAGES)}] {stage} ...")
                recover_directory(self.out / stage)  # what a killed run of this stage left half-written
                t0 = time.perf_counter()
                results[stage] = getattr(self, f"stage_{stage}")(results)
                results[stage]["seconds"] = round(time.perf_counter() - t0, 1)
                self.run_dir.mark_done(stage, results[stage])
                self.echo(f"[{i}/{len(STAGES)}] {stage}: done in {results[stage]['seconds']} s")
            results["total_seconds"] = round(time.perf_counter() - start, 1)
            return results

    def _derived_dataset(self, name: str, build: Callable[[], Any]) -> Path:
        """``out/<name>``: a ``DatasetDict`` derived from finished stages (``build()``), written atomically the first
        time this process needs it (never taken from an earlier run, so it always matches the current stages)."""
        path = self.out / name
        if name not in self._derived_built:
            recover_directory(path)
            with atomic_directory(path) as tmp:
                build().save_to_disk(str(tmp))
            self._derived_built.add(name)
        return path

    def _stage_split(self):
        from rlhf_ext.datagen import load_continual_dataset

        data = load_continual_dataset(self.out / "data")[self.recipe.data.stage]
        train = data["train"]
        n_sft = int(len(train) * self.recipe.data.sft_fraction)
        return train.select(range(n_sft)), train.select(range(n_sft, len(train))), data["test"]

    # ------------------------------------------------------------------------------------------------- stages
    def stage_data(self, results) -> dict[str, Any]:
        from rlhf_ext.datagen import generate_dataset

        ds = generate_dataset(
            self.recipe.data.config, self.out / "data", num_samples=self.recipe.data.num_samples, progress=None
        )
        stage = ds[self.recipe.data.stage]
        return {"path": str(self.out / "data"), "stage": ds.names[self.recipe.data.stage],
                "train": len(stage["train"]), "test": len(stage["test"])}  # fmt: skip

    def stage_sft(self, results) -> dict[str, Any]:
        from rlhf_ext.pipelines.trl_runs import fine_tune
        from rlhf_ext.zoo.models import tiny_causal_lm
        from rlhf_ext.zoo.tokenizer import train_bpe_tokenizer

        m, seed = self.recipe.model, self.recipe.seed
        sft_rows, pref_rows, _ = self._stage_split()
        if m.base_model is None:
            texts = [r["prompt"] + r[k] for rows in (sft_rows, pref_rows) for r in rows for k in ("chosen", "rejected")]
            tokenizer = train_bpe_tokenizer(texts, m.tokenizer_vocab)
            model = tiny_causal_lm(tokenizer, seed=seed, hidden_size=m.hidden_size,
                                   intermediate_size=2 * m.hidden_size, num_hidden_layers=m.num_layers)  # fmt: skip
        else:  # fine_tune loads the checkpoint (float32) and its tokenizer
            from rlhf_ext.pipelines.builtins import resolve_model

            model, tokenizer = resolve_model(m.base_model), None
        demos = [{"prompt": r["prompt"], "completion": " " + r[k]} for r in sft_rows for k in ("chosen", "rejected")]
        dest = self.out / "sft"
        fine_tune(model, demos, dest, self.recipe.train.sft, seed=seed, tokenizer=tokenizer,
                  report_to=self.recipe.report_to)  # fmt: skip
        return {"path": str(dest), "demonstrations": len(demos)}

    def stage_labels(self, results) -> dict[str, Any]:
        from rlhf_ext.sim import AnnotatorPool

        _, pref_rows, _ = self._stage_split()
        pool = AnnotatorPool.default(flip_prob=self.recipe.data.annotator_flip_prob, seed=self.recipe.seed)
        labelled = pool.relabel(pref_rows, train=True)
        dest = self.out / "labels"
        with atomic_directory(dest) as tmp:
            labelled.save_to_disk(str(tmp))
        agree = sum(a == b for a, b in zip(labelled["chosen"], pref_rows["chosen"])) / len(labelled)
        return {"path": str(dest), "pairs": len(labelled), "agreement_with_generator_label": agree}

    def _train_overrides(self, stage: str) -> list[str]:
        """``train.*`` overrides that hand the ``train.<stage>`` section to that stage's recipe, its ``trl_args``
        with the demo's ``report_to``."""
        section = getattr(self.recipe.train, stage)
        trl_args = {**section.trl_args, "report_to": self.recipe.report_to}
        return _overrides("train", {**knob_values(section, TrainSection), "trl_args": trl_args})

    def rm_recipe(self, results, out_dir: Path, *extra: str):
        """The segment reward-model recipe of this pipeline (``extra``: more ``key=value`` overrides)."""
        from datasets import DatasetDict, load_from_disk

        from rlhf_ext.pipelines.segment_rm import SegmentRMRecipe

        def pairs() -> DatasetDict:  # the labelled pairs, and the held-out split with the generator's labels
            _, _, test = self._stage_split()
            labels = load_from_disk(results["labels"]["path"])
            return DatasetDict(train=labels, test=test.select_columns(["prompt", "chosen", "rejected"]))

        data_dir = self._derived_dataset("rm_data", pairs)
        return load_recipe(
            SegmentRMRecipe,
            None,
            [f"model.sft_model={results['sft']['path']}", f"data.train={data_dir}", "data.max_length=160",
             f"train.output_dir={out_dir}", f"train.seed={self.recipe.seed}", *self._train_overrides("reward_model"),
             *_overrides("segment", knob_values(self.recipe.segment, SegmentRewardKnobs)), *extra],
        )  # fmt: skip

    def ppo_recipe(self, results, out_dir: Path, reward_model: str, normalizer: str | None, *extra: str):
        """The segment-PPO recipe of this pipeline (``extra``: more ``key=value`` overrides)."""
        from datasets import DatasetDict

        from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe

        def prompts() -> DatasetDict:  # the prompts of the preference split
            return DatasetDict(train=self._stage_split()[1].select_columns(["prompt"]))

        prompts_dir = self._derived_dataset("ppo_prompts", prompts)
        return load_recipe(
            SegmentPPORecipe,
            None,
            [f"model.sft_model={results['sft']['path']}", f"model.reward_model={reward_model}",
             f"model.normalizer={normalizer if normalizer else 'null'}", f"data.prompts={prompts_dir}",
             f"data.calibration={results['labels']['path'] if normalizer is None else 'null'}",
             "data.calibration_split=train", f"data.max_completion_length={self.recipe.data.max_completion_length}",
             *_overrides("segment", knob_values(self.recipe.dense, DenseRewardKnobs)),
             *_overrides("ppo", knob_values(self.recipe.ppo, PPOKnobs)),
             f"train.output_dir={out_dir}", "train.critic_learning_rate=1e-4", f"train.seed={self.recipe.seed}",
             *self._train_overrides("ppo"), *extra],
        )  # fmt: skip

    def stage_rm(self, results) -> dict[str, Any]:
        from rlhf_ext.pipelines.segment_rm import run_segment_rm

        summary = run_segment_rm(self.rm_recipe(results, self.out / "rm"))
        return {"path": summary["model_dir"], "eval": summary.get("eval", {})}

    def stage_normalizer(self, results) -> dict[str, Any]:
        from datasets import load_from_disk
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        from rlhf_ext.runtime.calibration import fit_normalizer, model_id, save_normalizer
        from rlhf_ext.runtime.segment_data import load_segment_settings

        rm, sft = results["rm"]["path"], results["sft"]["path"]
        settings = load_segment_settings(rm)
        norm = fit_normalizer(
            AutoModelForSequenceClassification.from_pretrained(rm, num_labels=1),
            AutoModelForCausalLM.from_pretrained(sft),
            AutoTokenizer.from_pretrained(sft),
            load_from_disk(results["labels"]["path"]),
            kind=self.recipe.dense.normalizer_kind,
            basis=self.recipe.dense.normalizer_basis,
            granularity=self.recipe.dense.granularity,
            entropy_cutoff=settings["entropy_cutoff"],
            reward_model_id=model_id(rm),
        )
        path = self.out / "normalizer.json"
        save_normalizer(norm, path)
        return {"path": str(path), **{k: v for k, v in asdict(norm).items() if k != "reward_model"}}

    def stage_ppo(self, results) -> dict[str, Any]:
        from rlhf_ext.pipelines.segment_ppo import run_segment_ppo

        recipe = self.ppo_recipe(results, self.out / "ppo", results["rm"]["path"], results["normalizer"]["path"])
        summary = run_segment_ppo(recipe)
        return {"path": summary["model_dir"], "curve": summary["curve"]}

    def stage_eval(self, results) -> dict[str, Any]:
        from rlhf_ext.sim import AnnotatorPool, win_rate

        _, _, test = self._stage_split()
        test = test.select(range(min(self.recipe.data.eval_prompts, len(test))))
        pool = AnnotatorPool.default(seed=self.recipe.seed)
        result = win_rate(
            results["ppo"]["path"],
            results["sft"]["path"],
            list(test["prompt"]),
            styles=list(test["style"]),
            judge=pool,
            seed=self.recipe.seed,
            max_new_tokens=self.recipe.data.max_completion_length,
            kl_estimator="exact",  # KL(PPO || SFT) per response, never negative (a log-ratio mean can be)
        )
        return {"ppo_vs_sft": asdict(result), "rm": results["rm"]["eval"]}

    def stage_report(self, results) -> dict[str, Any]:
        """SFT and PPO samples on the same held-out prompts, the provenance (recipe, versions, model sizes, stage
        times), then ``report.html`` and ``metrics.json``."""
        from rlhf_ext.pipelines.reports import collect_provenance, parameter_count, sample_segment_views, write_report

        started = time.perf_counter()
        seed = self.recipe.seed
        _, _, test = self._stage_split()
        policies = {"SFT": results["sft"]["path"], "PPO": results["ppo"]["path"]}
        samples = sample_segment_views(
            results["rm"]["path"], policies, list(test["prompt"][:4]), self.recipe.data.max_completion_length, seed=seed
        )
        parameters = {
            "policy": parameter_count(results["ppo"]["path"]),
            "reward model": parameter_count(results["rm"]["path"], reward_model=True),
        }
        stage_seconds = {stage: results[stage].get("seconds") for stage in STAGES if stage in results}
        stage_seconds["report"] = round(time.perf_counter() - started, 1)  # until the page is written
        provenance = collect_provenance(asdict(self.recipe), seed, parameters, stage_seconds, self.out / "data")
        return write_report(self.out, results, samples, provenance)


def _overrides(section: str, values: dict[str, Any]) -> list[str]:
    """``section.name=value`` overrides (strings bare, other values as JSON, which YAML reads back)."""
    return [f"{section}.{name}={v if isinstance(v, str) else json.dumps(v)}" for name, v in values.items()]
