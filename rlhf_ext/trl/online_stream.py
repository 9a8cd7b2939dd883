"""The per-batch mode of :class:`~rlhf_ext.trl.IterativeDPOTrainer` (``online_mode="online"``, paper 001 sections
3.5 and 4.2): one DPO run whose train dataloader is a stream. A generator thread or process
(:class:`~rlhf_ext.online.OneStepAsyncRunner`) samples ``num_generations`` responses for
``per_device_train_batch_size * gradient_accumulation_steps`` prompts, scores them and selects pairs (topping up when
some tie) while training runs on the previous batch, and gets the new weights after each optimizer step
(``async_generation=False``: the synchronous on-policy baseline). A killed run resumes from its last checkpoint
(``save_steps``) and regenerates the later batches with the same seeds: synchronous runs end as uninterrupted ones,
asynchronous ones generate the first batch after a resume with the checkpoint's weights (``theta_k``, not
``theta_{k-1}``), still deterministically.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback
from trl import DPOTrainer

from rlhf_ext.algos.names import knob_values
from rlhf_ext.algos.pair_selection import OnlineDPOKnobs
from rlhf_ext.runtime.async_runner import Batch, OneStepAsyncRunner, RunnerStats, torch_threads
from rlhf_ext.runtime.io import atomic_directory, atomic_write_json, recover_directory
from rlhf_ext.runtime.iterations import POLICIES_DIR, eval_logs
from rlhf_ext.runtime.log import quiet_datasets
from rlhf_ext.runtime.pair_collection import OnlinePairGenerator, wants_generator_process
from rlhf_ext.runtime.sampling import is_conversation

if TYPE_CHECKING:
    from rlhf_ext.trl.online_dpo import IterativeDPOTrainer


def dpo_dataset(rows: Sequence[dict[str, Any]]):
    """The prompt / chosen / rejected columns TRL's DPOTrainer expects (chat prompts get assistant turns)."""
    from datasets import Dataset

    def side(prompt, text):
        return [{"role": "assistant", "content": text}] if is_conversation(prompt) else text

    sides = ("chosen", "rejected")
    return Dataset.from_list([{"prompt": r["prompt"], **{k: side(r["prompt"], r[k]) for k in sides}} for r in rows])


class _StreamLoader:
    """The train dataloader of the per-batch DPO run (``run``, a :class:`StreamDPOTrainer`):
    ``gradient_accumulation_steps`` micro-batches per runner batch (one optimizer step per generated batch); each
    batch's pairs are stored (with every process's prompt cursor) as the run takes it."""

    def __init__(self, trainer: IterativeDPOTrainer, runner: OneStepAsyncRunner, first: Batch, total: int, offset: int):
        self.trainer, self.runner, self.first = trainer, runner, first
        self.total, self.offset = total, offset
        self.run: DPOTrainer | None = None

    def __len__(self) -> int:
        return self.total * self.trainer.args.gradient_accumulation_steps

    def __iter__(self):
        batch = self.first
        while True:
            yield from self._micro_batches(batch)
            if self.runner.delivered >= self.runner.num_batches:
                return
            batch = self.runner.next_batch()  # only asked for after the update on `batch` was published

    def _micro_batches(self, batch: Batch):
        from accelerate.utils import gather_object

        run, offset = self.run, self.offset
        cursors = [int(c) for c in gather_object([batch.data.cursor])]
        self.trainer.iteration_steps.record_online_batch(
            offset + batch.index, offset + batch.version, batch.data.rows, batch.generate_seconds, cursors
        )
        with quiet_datasets():
            data = dpo_dataset(batch.data.rows)
            examples = list(run._prepare_dataset(data, run.processing_class, run.args, "online"))
        ga = run.args.gradient_accumulation_steps
        if len(examples) < ga:
            raise ValueError(
                f"online batch {offset + batch.index} kept {len(examples)} pairs after tokenisation, fewer than "
                f"gradient_accumulation_steps={ga}: prompts longer than max_length are dropped; raise max_length"
            )
        bounds = [round(i * len(examples) / ga) for i in range(ga + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            yield run.data_collator(examples[lo:hi])


class StreamDPOTrainer(DPOTrainer):
    """A plain ``DPOTrainer`` but for its train dataloader: the per-batch run's :class:`_StreamLoader` (``stream``)."""

    stream: _StreamLoader

    def get_train_dataloader(self):
        self.stream.run = self
        return self.stream


class _PublishWeights(TrainerCallback):
    """After every optimizer step, report the update to the runner (it snapshots the weights only if it uses them)."""

    def __init__(self, runner: OneStepAsyncRunner, model_fn: Callable[[], torch.nn.Module], to_cpu: bool = False):
        self.runner, self.model_fn, self.to_cpu = runner, model_fn, to_cpu

    def snapshot(self) -> dict[str, torch.Tensor]:
        sd = self.model_fn().state_dict()
        if self.to_cpu:  # for a generator process: the runner copies them into shared memory as it publishes
            return {k: v.detach().cpu() for k, v in sd.items()}
        return {k: v.detach().clone() for k, v in sd.items()}

    def on_step_end(self, args, state, control, **kwargs):
        self.runner.publish(self.snapshot)


def train_online(trainer: IterativeDPOTrainer) -> dict[str, Any]:
    """``trainer``'s per-batch run (see the module docstring), resumed from its last checkpoint in ``output_dir``;
    returns the run's summary (also ``output_dir/summary.json``)."""
    from rlhf_ext.trl.args import last_checkpoint

    a, steps, dist = trainer.args, trainer.iteration_steps, trainer._dist
    if dist.num_processes > 1 and a.generation_backend == "vllm":
        raise ValueError("online mode with vLLM runs on one process; launch a single process")
    pairs_per_update = a.per_device_train_batch_size * a.gradient_accumulation_steps
    total = a.max_steps if a.max_steps > 0 else max(1, len(trainer.prompts) // (pairs_per_update * dist.num_processes))
    work = trainer.root / "online"
    dest = trainer.root / POLICIES_DIR / "online_final"
    if dest.exists() and (trainer.root / "summary.json").exists():
        return json.loads((trainer.root / "summary.json").read_text())  # the run already finished
    last = last_checkpoint(work)
    offset = int(Path(last).name.split("-")[-1]) if last else 0
    # batches generated after the last checkpoint belong to updates that were lost: they are generated again
    if dist.is_main_process:
        for it in steps.store.completed():
            if it >= offset:
                shutil.rmtree(steps.store.path(it))
        recover_directory(dest)
        shutil.rmtree(dest, ignore_errors=True)  # left by a run killed between saving it and the summary
    dist.wait_for_everyone()
    evals = [steps.evaluate_policy(0)]
    if offset < total:
        stats = _run_online(trainer, total, offset, last, work, dest)
    else:  # killed after the last update's checkpoint, before the final policy was saved
        stats = RunnerStats()
        if dist.is_main_process:
            with atomic_directory(dest) as tmp:
                trainer._load_model(last).save_pretrained(tmp)
                trainer.processing_class.save_pretrained(tmp)
        dist.wait_for_everyone()
    trainer.runner_stats = stats
    state = steps.read_state()
    state["policies"]["final"] = str(dest)
    steps.write_state(state)
    final_eval = steps.evaluate_checkpoint(str(dest), "online_final", {"policy": "final"})
    trainer.log({"update": total, **eval_logs(final_eval)})
    summary = {
        "mode": "online",
        "async_generation": a.async_generation,
        "output_dir": str(trainer.root),
        "final_policy": str(dest),
        "updates": total,
        "resumed_from_update": offset,
        "runner": stats.as_dict(),
        "eval": [*evals, final_eval],
    }
    if dist.is_main_process:
        atomic_write_json(trainer.root / "summary.json", summary)
    return summary


def _run_online(trainer: IterativeDPOTrainer, total: int, offset: int, last: str | None, work: Path,
                dest: Path) -> RunnerStats:  # fmt: skip
    """Updates ``offset .. total-1``: one DPO run of ``trainer`` on a :class:`OneStepAsyncRunner`'s batches; saves the
    final policy to ``dest``."""
    a, steps = trainer.args, trainer.iteration_steps
    process = wants_generator_process(a.generator_process, a.async_generation, a.generation_backend, trainer.reward_fn)
    generator = OnlinePairGenerator(
        prompts=trainer.prompts[trainer._dist.process_index :: trainer._dist.num_processes],
        pairs_per_update=a.per_device_train_batch_size * a.gradient_accumulation_steps,
        max_fill_rounds=a.max_fill_rounds,
        selection=OnlineDPOKnobs(**knob_values(a, OnlineDPOKnobs)),  # a plain dataclass: pickles to a process
        reward_fn=trainer.reward_fn,
        sampler_spec={**steps.sampler_spec(), "policy": last or trainer.sft_path},
        seed=steps.seed("order", 0),  # one prompt order per run, whatever update it resumes at
        sampler=None if process else steps.sampler(),
        first_index=offset,
        cursor=steps.resume_cursor(offset),
    )
    runner = OneStepAsyncRunner(
        generator.generate,
        num_batches=total - offset,
        load_weights_fn=generator.load_weights,
        sync=not a.async_generation,
        generator_threads=a.generation_threads,
        process=process,
        name=f"rlhf-ext-generator-{trainer._dist.process_index}",
    )

    def setup(run: DPOTrainer) -> None:
        plugin = run.accelerator.state.deepspeed_plugin
        if plugin is not None and plugin.zero_stage == 3:
            raise ValueError(
                "online mode publishes the policy's full weights to the generator after every step, which "
                "ZeRO-3 shards; use ZeRO-2 / DDP for online mode (iterative mode supports ZeRO-3)"
            )
        model_fn = lambda: run.accelerator.unwrap_model(run.model)  # noqa: E731
        run.add_callback(_PublishWeights(runner, model_fn, to_cpu=process))

    with runner, torch_threads(a.training_threads):
        first = runner.next_batch()
        trainer._run_dpo(
            model=trainer.sft_path,
            ref_path=trainer.ref_path,
            args=dataclasses.replace(a, output_dir=str(work), max_steps=total, ignore_data_skip=True),
            train_dataset=dpo_dataset(first.data.rows),
            stream=_StreamLoader(trainer, runner, first, total, offset),
            setup=setup,
        )
    trainer._save_policy(dest)
    trainer._release_dpo_run(keep_model=True)
    return runner.stats
