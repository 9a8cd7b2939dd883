"""The task-sequence runner: continual RLHF over tasks ``0 .. K-1`` (paper 000, Algorithm 1 and section 4).

With reward models enabled, first one per task (Appendix C), from the SFT model on that task's pairs, scored on every
task's test split; they do not depend on the policy. Then, for each task ``t`` in order:

1. train the policy on task ``t`` from the snapshot of task ``t - 1`` (the SFT model for ``t = 0``), with the KL to
   that frozen snapshot weighted by ``c_t`` (:meth:`ContinualSection.coef_for_task`; ``c_0 = 0``);
2. write the snapshot ``task_{t}/policy`` atomically;
3. evaluate it on *every* task's test split: column ``t`` of the performance matrix ``R[k, t]``;
4. write ``task_{t}/result.json`` (the task is finished once this exists), then ``performance.json`` (matrix so far,
   metrics of :mod:`rlhf_ext.algos.forgetting`) and the plots.

Every task loads its inputs from the snapshots on disk, so a killed sequence rerun with ``resume: true`` skips the
finished tasks and produces exactly what an uninterrupted run produces. A stage is any object with
``run_task(task: TaskContext, test_sets)`` returning ``{"scores": [one float per test set], "metrics": {...}}``;
:func:`build_stages` picks TRL's DPO or PPO stages (:mod:`rlhf_ext.pipelines.continual_stages`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rlhf_ext.algos.forgetting import summarize
from rlhf_ext.pipelines.continual_recipe import ContinualRecipe
from rlhf_ext.runtime.io import atomic_write_json, stable_hash
from rlhf_ext.runtime.rundir import RunDir, RunSettingsChanged, describe_changes

REQUIRED_COLUMNS = ("prompt", "chosen", "rejected")
RUN_FILE = "run.json"
PERFORMANCE_FILE = "performance.json"
#: The run-directory stages of task ``t``'s policy and reward model: their markers (which hold the records) are
#: ``task_{t}/result.json`` and ``task_{t}/reward_model.json``.
RESULT_STAGE = "result"
RM_STAGE = "reward_model"
#: Recipe keys that may change between a run and its resumption without invalidating finished tasks.
RESUMABLE_KEYS = frozenset({"output_dir", "resume", "plots"})


class TaskSequenceError(ValueError):
    """The task sequence (or the run directory it is resumed from) is unusable; the message names the fix."""


@dataclass
class TaskContext:
    """Everything a stage needs to train task ``index`` (paths are strings loadable with ``from_pretrained``)."""

    index: int
    name: str
    train: Any  # datasets.Dataset with prompt / chosen / rejected
    test: Any
    init_policy: str  # the policy starts here: the previous snapshot, or the SFT model for task 0
    previous_policy: str | None  # frozen pi_{t-1} for the KL term; None for task 0
    reference_policy: str  # the SFT model: DPO reference (paper 000 Eq. 6) and reward-model initialisation
    tokenizer_path: str
    continual_kl_coef: float
    seed: int
    task_dir: Path
    reward_model_dirs: list[Path] | None = None  # every task's reward model, when reward models are enabled

    @property
    def policy_dir(self) -> Path:
        return self.task_dir / "policy"

    @property
    def reward_model_dir(self) -> Path:
        return self.task_dir / "reward_model"

    @property
    def work_dir(self) -> Path:
        return self.task_dir / "work"


class TaskStage(Protocol):
    """One per-task training stage (policy or reward model) of an engine."""

    def run_task(self, task: TaskContext, test_sets: Sequence[Any]) -> dict[str, Any]: ...


def _is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _barrier() -> None:
    """Wait for every process (a no-op without torch.distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# ------------------------------------------------------------------------------------------------ task sequences
def check_task_sequence(tasks: Sequence[Any]) -> None:
    """Each task must be a ``DatasetDict`` with non-empty ``train`` and ``test`` splits of prompt/chosen/rejected."""
    if len(tasks) == 0:
        raise TaskSequenceError("the task sequence is empty; it needs at least one task")
    for t, task in enumerate(tasks):
        if not hasattr(task, "keys") or any(split not in task for split in ("train", "test")):
            have = ", ".join(task.keys()) if hasattr(task, "keys") else type(task).__name__
            raise TaskSequenceError(
                f"task {t} must be a DatasetDict with 'train' and 'test' splits (has: {have}); split it first, "
                "e.g. dataset.train_test_split(test_size=0.1)"
            )
        for split in ("train", "test"):
            columns = task[split].column_names
            missing = [c for c in REQUIRED_COLUMNS if c not in columns]
            if missing:
                raise TaskSequenceError(
                    f"task {t} split '{split}' has no column {', '.join(map(repr, missing))} "
                    f"(columns: {', '.join(columns)}); every task needs prompt / chosen / rejected"
                )
            if len(task[split]) == 0:
                raise TaskSequenceError(f"task {t} split '{split}' is empty")


def load_task_sequence(recipe: ContinualRecipe, tasks: Sequence[Any] | str | os.PathLike | None = None) -> list[Any]:
    """The recipe's task sequence (or ``tasks``: a list of ``DatasetDict`` or a generator output directory), cut
    to ``data.num_tasks`` tasks and ``data.max_*_samples`` rows, validated."""
    data = recipe.data
    source = data.tasks if tasks is None else tasks
    if isinstance(source, str | os.PathLike):
        from rlhf_ext.zoo.continual_toy import builtin_sequence, is_builtin_sequence

        if is_builtin_sequence(str(source)):
            sizes = {"n_train": data.max_train_samples or 256, "n_test": data.max_test_samples or 64}
            try:
                loaded = builtin_sequence(str(source), num_tasks=data.num_tasks or 3, seed=data.seed, **sizes)
            except ValueError as e:
                raise TaskSequenceError(f"{e} (data.tasks: {source}, data.num_tasks: {data.num_tasks})") from None
        else:
            if not str(source).startswith("builtin:") and not Path(source).exists():
                raise TaskSequenceError(
                    f"data.tasks: {str(source)!r} is neither a builtin sequence (builtin:toy-continual-preference-"
                    "shift, builtin:toy-continual-domains, or a dataset generator's builtin:continual-*) nor an "
                    "existing dataset-generator output directory"
                )
            from rlhf_ext.datagen import load_continual_dataset  # only needed for generated sequences

            loaded = list(load_continual_dataset(str(source)))
    else:
        loaded = list(source)
    if data.num_tasks is not None:
        if data.num_tasks > len(loaded):
            raise TaskSequenceError(f"data.num_tasks is {data.num_tasks} but the sequence has {len(loaded)} tasks")
        loaded = loaded[: data.num_tasks]
    check_task_sequence(loaded)

    def cut(ds, limit):
        return ds.select(range(min(limit, len(ds)))) if limit is not None else ds

    limits = (data.max_train_samples, data.max_test_samples)
    return [{**task, "train": cut(task["train"], limits[0]), "test": cut(task["test"], limits[1])} for task in loaded]


def sequence_fingerprint(tasks: Sequence[Any]) -> str:
    """A short, process-stable hash of the task sequence (sizes and the first and last rows of every split)."""
    return stable_hash([[len(ds), ds[0], ds[len(ds) - 1]] for task in tasks for ds in (task["train"], task["test"])])


# --------------------------------------------------------------------------------------------------------- stages
def build_stages(recipe: ContinualRecipe) -> tuple[TaskStage, TaskStage | None]:
    """The (policy stage, reward-model stage or None) of the recipe's engine and algorithm."""
    if recipe.engine == "trl" and recipe.algorithm in ("dpo", "ppo"):
        from rlhf_ext.pipelines.continual_stages import DPOPolicyStage, PPOPolicyStage, RewardModelStage

        if recipe.algorithm == "dpo":
            return DPOPolicyStage(recipe), RewardModelStage(recipe) if recipe.reward_model.enabled else None
        if not recipe.reward_model.enabled:
            raise TaskSequenceError("algorithm: ppo trains against per-task reward models: set reward_model.enabled")
        return PPOPolicyStage(recipe), RewardModelStage(recipe)
    raise TaskSequenceError(f"no policy stage for engine={recipe.engine!r}, algorithm={recipe.algorithm!r}")


# --------------------------------------------------------------------------------------------------------- runner
class ContinualRunner:
    """Runs a recipe's task sequence (see the module docstring); ``run()`` returns the summary it also writes to
    ``performance.json``. ``tasks`` overrides ``recipe.data.tasks`` (a list of ``DatasetDict`` or a generator
    directory); the stages default to :func:`build_stages`."""

    def __init__(
        self,
        recipe: ContinualRecipe,
        tasks: Sequence[Any] | str | os.PathLike | None = None,
        policy_stage: TaskStage | None = None,
        reward_stage: TaskStage | None = None,
    ):
        self.recipe = recipe
        self.tasks = load_task_sequence(recipe, tasks)
        self.num_tasks = len(self.tasks)
        for t in range(self.num_tasks):  # validate the per-transition weights before any training
            recipe.continual.coef_for_task(t, self.num_tasks)
        if policy_stage is None:
            policy_stage, default_rm = build_stages(recipe)
            reward_stage = reward_stage if reward_stage is not None else default_rm
        self.policy_stage = policy_stage
        self.reward_stage = reward_stage
        self.out = Path(recipe.output_dir)
        self.names = [f"task_{t:02d}" for t in range(self.num_tasks)]
        self.reward_models: list[dict[str, Any]] = []
        self.run_dir: RunDir | None = None  # opened by run()

    # -- resume bookkeeping --------------------------------------------------------------------------------------
    def _open_run(self) -> RunDir:
        """Open the run directory (every rank; the run file is written atomically), refusing to resume a run of
        another task sequence or recipe."""
        if (self.out / RUN_FILE).exists() and not self.recipe.resume:
            raise TaskSequenceError(
                f"{self.out} already holds a continual run and resume is false; delete the directory or choose "
                "another output_dir (or set resume: true to continue it)"
            )
        _barrier()  # every rank has looked before any writes the run file
        fingerprint = sequence_fingerprint(self.tasks)
        recipe = {k: v for k, v in dataclasses.asdict(self.recipe).items() if k not in RESUMABLE_KEYS}
        settings = {"task_sequence": fingerprint, "tasks": self.names, "recipe": recipe}
        try:
            run_dir = RunDir(self.out, settings, kind="continual", run_file=RUN_FILE, stages_dir=".")
        except RunSettingsChanged as e:
            recipe_keys = [k.removeprefix("recipe.") for k in e.keys if k.startswith("recipe.")]
            if len(recipe_keys) < len(e.keys):
                raise TaskSequenceError(
                    f"{self.out} holds a run of a different task sequence; use a new output_dir or delete it"
                ) from e
            raise TaskSequenceError(
                f"{self.out} was started with a different recipe (changed: {', '.join(recipe_keys)}); finished tasks "
                f"would not match the rest ({describe_changes(recipe_keys, e.old['recipe'], e.new['recipe'])}). "
                "Restore those values, or use a new output_dir"
            ) from e
        _barrier()
        return run_dir

    def _finished(self, t: int) -> dict[str, Any] | None:
        stage = f"{self.names[t]}/{RESULT_STAGE}"
        result = self.run_dir.result(stage)
        if result is not None and not (self.out / self.names[t] / "policy" / "config.json").exists():
            raise TaskSequenceError(
                f"{self.run_dir.marker(stage)} says task {t} finished but its policy snapshot is missing; delete "
                f"{self.out / self.names[t]} to retrain that task"
            )
        return result

    # -- the loop ------------------------------------------------------------------------------------------------
    def context(self, t: int) -> TaskContext:
        from rlhf_ext.pipelines.builtins import resolve_model

        sft = resolve_model(self.recipe.model.sft_model)
        previous = str(self.out / self.names[t - 1] / "policy") if t > 0 else None
        return TaskContext(
            index=t,
            name=self.names[t],
            train=self.tasks[t]["train"],
            test=self.tasks[t]["test"],
            init_policy=previous or sft,
            previous_policy=previous,
            reference_policy=sft,
            tokenizer_path=resolve_model(self.recipe.model.tokenizer) if self.recipe.model.tokenizer else sft,
            continual_kl_coef=self.recipe.continual.coef_for_task(t, self.num_tasks),
            seed=self.recipe.seed + t,
            task_dir=self.out / self.names[t],
            reward_model_dirs=[self.out / n / "reward_model" for n in self.names] if self.reward_stage else None,
        )

    def run(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train the remaining tasks (all of them, or up to task index ``stop_after - 1``) and return the summary."""
        from rlhf_ext.zoo.builtins import check_model_source

        for spec in (self.recipe.model.sft_model, self.recipe.model.tokenizer):  # fail before the run file is written
            if spec is not None:
                check_model_source(spec)
        self.run_dir = self._open_run()
        test_sets = [task["test"] for task in self.tasks]
        if self.reward_stage is not None:
            self.reward_models = [self._reward_model(t, test_sets) for t in range(self.num_tasks)]
        results: list[dict[str, Any] | None] = [self._finished(t) for t in range(self.num_tasks)]
        last = self.num_tasks if stop_after is None else min(stop_after, self.num_tasks)
        summary = None
        for t in range(last):
            if results[t] is not None:
                continue
            if t > 0 and results[t - 1] is None:
                raise TaskSequenceError(f"task {t - 1} is not finished, so task {t} cannot start")
            task = self.context(t)
            record = dict(
                task=t, continual_kl_coef=task.continual_kl_coef, seed=task.seed, policy_dir=str(task.policy_dir)
            )
            marker = f"{task.name}/{RESULT_STAGE}"
            results[t] = self._run_stage(self.policy_stage, "policy", task, test_sets, record, marker)
            summary = self._write_summary(results)  # after every task: nothing finished is lost
        return summary if summary is not None else self._write_summary(results)

    def _reward_model(self, t: int, test_sets: Sequence[Any]) -> dict[str, Any]:
        """Train (or, when finished before, load the record of) task ``t``'s reward model."""
        task = self.context(t)
        stage = f"{task.name}/{RM_STAGE}"
        done = self.run_dir.result(stage)
        if done is not None and (task.reward_model_dir / "config.json").exists():
            return done
        record = {"task": t, "path": str(task.reward_model_dir)}
        return self._run_stage(self.reward_stage, "reward", task, test_sets, record, stage)

    def _run_stage(self, stage, what: str, task: TaskContext, test_sets, record: dict, marker: str) -> dict:
        """Run one stage on one task, check it scored every test set, then mark ``marker`` done with its record
        (last, atomically)."""
        start = time.time()
        out = stage.run_task(task, test_sets)
        if len(out["scores"]) != self.num_tasks:
            raise RuntimeError(f"the {what} stage returned {len(out['scores'])} scores for {self.num_tasks} tasks")
        record.update(scores=list(out["scores"]), metrics=out.get("metrics"), seconds=time.time() - start)
        if _is_main_process():
            self.run_dir.mark_done(marker, record)
            shutil.rmtree(task.work_dir, ignore_errors=True)
        _barrier()
        return record

    def _write_summary(self, results: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
        k = self.num_tasks
        matrix = [[None if r is None else r["scores"][task_k] for r in results] for task_k in range(k)]  # R[task, ckpt]
        done = sum(r is not None for r in results)
        summary: dict[str, Any] = {
            "tasks": self.names,
            "finished_tasks": done,
            "continual_kl_coefs": [self.recipe.continual.coef_for_task(t, k) for t in range(k)],
            "performance_matrix": matrix,
            "matrix_layout": "performance_matrix[k][t] = score on task k's test split of the snapshot after task t",
            "metric": "dpo implicit-reward accuracy"
            if self.recipe.algorithm == "dpo"
            else "mean score of the task's reward model on the policy's samples",
            "output_dir": str(self.out),
        }
        if self.reward_models:
            rm_scores = [rm["scores"] for rm in self.reward_models]
            summary["reward_model_accuracy"] = [[rm_scores[m][task_k] for m in range(k)] for task_k in range(k)]
            summary["reward_model_layout"] = "reward_model_accuracy[k][m] = reward model m's accuracy on task k"
        if done == k:
            summary["metrics"] = summarize(matrix).to_dict()
            summary["steps_per_task"] = [(r.get("metrics") or {}).get("steps") for r in results]
        if _is_main_process():
            atomic_write_json(self.out / PERFORMANCE_FILE, summary)
            if self.recipe.plots and done == k:
                summary["plots"] = plot_run(summary, results, self.out)
                atomic_write_json(self.out / PERFORMANCE_FILE, summary)
        return summary


# ----------------------------------------------------------------------------------------------------------- plots
def plot_run(summary: dict[str, Any], results: Sequence[dict[str, Any]], out: Path) -> dict[str, str] | None:
    """Write ``performance.png``: (a) training loss over steps, (b) each task's test performance at every snapshot,
    (c) backward transfer over time (Fig. 10), normalised ``(R[k,T] - R[k,k]) / R[k,k]`` unless the summary's is n/a
    (some ``R[k,k] <= 0``: then raw ``R[k,T] - R[k,k]``); dashed lines mark task switches. Without matplotlib: one
    warning and ``None``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn(
            "plots: true but matplotlib is not installed, so no performance.png; pip install matplotlib "
            "(or rlhf-ext[trl]), or set plots: false",
            stacklevel=2,
        )
        return None
    from rlhf_ext.algos.forgetting import backward_transfer_curve

    steps = [max(int((r.get("metrics") or {}).get("steps") or 0), 1) for r in results]
    ends = [sum(steps[: t + 1]) for t in range(len(steps))]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    ax = axes[0]
    for t, (res, offset) in enumerate(zip(results, [0, *ends])):  # each task's steps after the tasks before it
        history = (res.get("metrics") or {}).get("log_history") or []
        xs = [offset + h["step"] for h in history if "loss" in h and "step" in h]
        ys = [h["loss"] for h in history if "loss" in h and "step" in h]
        ax.plot(xs, ys, color=f"C{t}", label=summary["tasks"][t])
    ax.set(title="training loss", xlabel="step (all tasks)", ylabel="loss")
    ax = axes[1]
    matrix = summary["performance_matrix"]
    for k, row in enumerate(matrix):
        ax.plot(ends, row, marker="o", color=f"C{k}", alpha=0.35, linestyle=":")
        ax.plot(ends[k:], row[k:], marker="o", color=f"C{k}", label=summary["tasks"][k])
    ax.set(title=f"test {summary['metric']}", xlabel="step (snapshot at each task end)", ylabel="score")
    for axis in axes[:2]:
        for x in ends[:-1]:
            axis.axvline(x, color="grey", linestyle="--", linewidth=0.8)
        axis.legend(fontsize=8)
    ax = axes[2]
    # the summary's rule: normalised backward transfer is given (not n/a) only when every R[k,k] > 0
    normalised = (summary.get("metrics") or {}).get("backward_transfer") is not None
    if len(matrix) < 2:
        ax.text(0.5, 0.5, "n/a: one task, no later snapshot to compare with", ha="center", transform=ax.transAxes)
        ax.set(title="backward transfer: n/a", xlabel="snapshot (task index)")
    else:
        curve = backward_transfer_curve(matrix, normalized=normalised)
        ax.plot(curve["checkpoint"], curve["mean"], marker="o", color="C0", label="mean")
        ax.fill_between(curve["checkpoint"], curve["min"], curve["max"], color="C0", alpha=0.2, label="min / max")
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.legend(fontsize=8)
        ax.set_xticks(curve["checkpoint"])
        if normalised:
            ax.set(title="normalised backward transfer", ylabel="(R[k,T] - R[k,k]) / R[k,k]")
        else:
            ax.set(title="backward transfer, unnormalised\n(normalised is n/a: some R[k,k] <= 0)",
                   ylabel="R[k,T] - R[k,k]")  # fmt: skip
        ax.set(xlabel="snapshot (task index)")
    fig.tight_layout()
    path = out / "performance.png"
    tmp = out / ".performance.png.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return {"performance": str(path)}


def format_summary(summary: dict[str, Any]) -> str:
    """A plain-text report of a run: the performance matrix and the forgetting figures."""
    names = summary["tasks"]
    width = max(8, *(len(n) for n in names))
    lines = [
        f"continual run: {summary['output_dir']}  ({summary['finished_tasks']}/{len(names)} tasks finished)",
        f"R[task, snapshot] = {summary['metric']} on the task's test split",
        " " * width + "".join(f"{'after ' + n[-2:]:>10}" for n in names),
    ]
    for k, row in enumerate(summary["performance_matrix"]):
        cells = "".join(f"{'-' if v is None else format(v, '.3f'):>10}" for v in row)
        lines.append(f"{names[k]:<{width}}{cells}")
    lines.append("KL weight per task: " + ", ".join(f"{c:g}" for c in summary["continual_kl_coefs"]))
    metrics = summary.get("metrics")
    if metrics:
        fmt = lambda value: "n/a" if value is None else f"{value:+.4f}"
        lines += [
            f"average final performance: {metrics['average_performance']:.4f}",
            f"newest task performance:   {metrics['newest_task_performance']:.4f}",
            f"backward transfer (norm.): {fmt(metrics['backward_transfer'])}",
            f"forgetting:                {fmt(metrics['forgetting'])}",
        ]
    if summary.get("plots"):
        lines.append(f"plots: {', '.join(summary['plots'].values())}")
    return "\n".join(lines)


def run_continual(
    recipe: ContinualRecipe, tasks: Sequence[Any] | str | os.PathLike | None = None, stop_after: int | None = None
) -> dict[str, Any]:
    """Run (or resume) a continual recipe (:class:`ContinualRunner`) in its locked output directory
    (:func:`~rlhf_ext.runtime.rundir.claim_output_dir`)."""
    from rlhf_ext.runtime.rundir import claim_output_dir

    m = recipe.model
    inputs = {"model.sft_model": m.sft_model, "model.tokenizer": m.tokenizer, "data.tasks": recipe.data.tasks,
              **({"tasks": tasks} if isinstance(tasks, str | os.PathLike) else {})}  # fmt: skip
    with claim_output_dir(recipe.output_dir, inputs, "output_dir"):
        return ContinualRunner(recipe, tasks).run(stop_after=stop_after)
