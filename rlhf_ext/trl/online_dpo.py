"""Iterative best/worst-of-n online DPO (paper 004, Algorithm 2) and one-step asynchronous online DPO (paper 001).

``IterativeDPOTrainer`` drives TRL's stable ``DPOTrainer``; it does not replace it. Two schedules:

**iterative** (paper 004, section 3.3) — for iteration ``k = 0 .. num_iterations-1``, with ``pi_0`` the SFT model:

1. *collect*: take this iteration's prompts, sample ``n`` responses per prompt from ``pi_k`` split across the
   temperatures (default 8 at [0.7, 1.0]), score them with the reward, pick one pair per prompt with
   :func:`~rlhf_ext.online.select_pairs` (best vs worst of the length-penalised reward, Eq. 9) and write the pairs
   to the on-disk store as iteration ``k``'s dataset (atomically);
2. *train*: run ``DPOTrainer`` from ``pi_k`` on the pairs of iterations ``0..k`` (``pair_data="accumulate"``, the
   paper's "historical + new") or of iteration ``k`` only (``"latest"``), against the reference ``pi_0``
   (``reference="sft"``, the authors' choice) or ``pi_k`` (``reference="previous"``, what some public iterative-DPO
   scripts do); save ``pi_{k+1}`` (atomically);
3. *evaluate* ``pi_{k+1}``: the reward's mean score of its samples on the evaluation prompts (and ``gold_fn`` if
   given).

Every step writes its result before the next starts and is skipped when its result exists, so a killed run resumes
at the last completed step: an iteration's pairs are collected exactly once (none lost, none duplicated), a
half-finished DPO run continues from its last ``DPOTrainer`` checkpoint (``save_steps``). With the same seed a
resumed run produces the same pairs in the same order as an uninterrupted one. An iteration where every prompt's
responses tie yields no pairs: a warning, and ``pi_{k+1} = pi_k`` without training.

**online** (paper 001, sections 3.5 and 4.2) — one DPO update per generated batch. A generator thread samples
``num_samples`` responses (2, or K for best/worst-of-K) for ``per_device_train_batch_size *
gradient_accumulation_steps`` prompts, scores and selects pairs (topping up with further prompts when some tie),
while the learner — ``DPOTrainer``'s own training loop, fed through :class:`~rlhf_ext.online.OneStepAsyncRunner` —
trains on the previous batch; new weights go to the generator after each optimizer step. ``async_generation=False``
is the synchronous on-policy baseline through the same code. As in section 4.2, reward scoring belongs to the
generation side. Each trained batch's pairs are written to the store; a killed run resumes from the last
``DPOTrainer`` checkpoint and regenerates the batches after it.

Example::

    from rlhf_ext.trl import IterativeDPOConfig, IterativeDPOTrainer

    trainer = IterativeDPOTrainer(
        model="my-sft-checkpoint",
        args=IterativeDPOConfig(output_dir="runs/idpo", num_iterations=3, num_samples=8, beta=0.1,
                                learning_rate=5e-7, num_train_epochs=2),
        prompts=prompt_dataset,                    # a "prompt" column (text or chat messages)
        reward_model="my-reward-model",            # or reward_fn=lambda prompts, responses: scores
    )
    summary = trainer.train()
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from trl import DPOConfig, DPOTrainer

from rlhf_ext.algos.pair_selection import SELECTION_RULES, check_num_samples
from rlhf_ext.runtime.async_runner import Batch, OneStepAsyncRunner, RunnerStats, torch_threads
from rlhf_ext.runtime.io import atomic_directory, atomic_write_json, stable_hash
from rlhf_ext.runtime.pair_collection import OnlinePairGenerator, SelectionSettings, score_and_select
from rlhf_ext.runtime.pair_store import PairStore
from rlhf_ext.runtime.rewards import RewardFn, SequenceClassifierReward, load_reward, score
from rlhf_ext.runtime.sampling import is_conversation, make_sampler, split_temperatures

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
STATE_FILE = "state.json"


@dataclass
class IterativeDPOConfig(DPOConfig):
    """``DPOConfig`` (the inner DPO runs: ``beta``, ``learning_rate``, ``num_train_epochs`` ...) plus the online
    settings. Defaults follow paper 004 (n = 8, temperatures 0.7 / 1.0, best vs worst, SFT reference,
    accumulated pairs) and paper 001 (queue size 1, one-step off-policy).

    Args:
        num_iterations: iterations of Algorithm 2 (paper: 3).
        prompts_per_iteration: prompts per iteration (paper: 20k); default ``len(prompts) // num_iterations``.
            Prompts are shuffled once with ``seed`` and taken in order, wrapping around if they run out.
        num_samples: ``n`` responses per prompt (>= 2; paper 004: 8 or 16; paper 001: 2, or K = 4).
        temperatures: ``n`` is split evenly across these (paper: [0.7, 1.0]).
        max_new_tokens, max_prompt_length, top_p, top_k: sampling limits (paper: no top-p / top-k).
        selection_rule: ``max_min`` (best vs worst), ``max_random`` or ``random``.
        length_penalty: ``lambda`` of Eq. 9 (paper's concise variant: 0.001 per character).
        length_unit: ``chars`` (paper) or ``tokens`` for ``|a|`` in Eq. 9.
        tie_tolerance: pairs whose scores differ by at most this are dropped.
        pair_data: ``accumulate`` (train on all pairs so far; paper) or ``latest``.
        reference: ``sft`` (the SFT model, as the paper's authors did) or ``previous`` (the iterate being trained).
        generation_backend: ``auto`` (vLLM on a CUDA machine when installed, else HF), ``hf`` or ``vllm``.
        generation_batch_size: sequences per HF ``generate`` call.
        reward_batch_size: sequences per reward-model forward.
        eval_num_prompts / eval_samples_per_prompt / eval_temperature: the evaluation after each iteration.
        online_mode: ``iterative`` (Algorithm 2) or ``online`` (one update per generated batch, paper 001).
        async_generation: online mode: one-step asynchronous (default) or synchronous on-policy.
        generator_process: online mode: run the generator (sampling + scoring) in a spawned process instead of a
            thread, so the two roles do not contend for Python's interpreter lock (HF generation only; the reward
            function must be picklable).
        max_fill_rounds: online mode: extra sampling rounds to replace tied prompts before giving up.
        generation_threads / training_threads: torch intra-op threads of each role (CPU); ``None``: unchanged.
        vllm_gpu_memory_utilization / vllm_kwargs: passed to ``vllm.LLM``.
        resume: continue a run found in ``output_dir`` (``False``: refuse to touch an existing run).
    """

    num_iterations: int = field(default=3, metadata={"help": "Iterations of Algorithm 2."})
    prompts_per_iteration: int | None = field(default=None, metadata={"help": "Prompts per iteration."})
    num_samples: int = field(default=8, metadata={"help": "Responses sampled per prompt (n)."})
    temperatures: list[float] = field(default_factory=lambda: [0.7, 1.0], metadata={"help": "Sampling temps."})
    max_new_tokens: int = field(default=256, metadata={"help": "Maximum response length in tokens."})
    max_prompt_length: int | None = field(default=None, metadata={"help": "Prompts are cut from the left."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling (1.0 = off)."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling (0 = off)."})
    selection_rule: str = field(default="max_min", metadata={"help": "max_min | max_random | random"})
    length_penalty: float = field(default=0.0, metadata={"help": "lambda of Eq. 9."})
    length_unit: str = field(default="chars", metadata={"help": "chars | tokens"})
    tie_tolerance: float = field(default=0.0, metadata={"help": "Score gap at or below which a pair is a tie."})
    pair_data: str = field(default="accumulate", metadata={"help": "accumulate | latest"})
    reference: str = field(default="sft", metadata={"help": "sft | previous"})
    generation_backend: str = field(default="auto", metadata={"help": "auto | hf | vllm"})
    generation_batch_size: int = field(default=64, metadata={"help": "Sequences per generate call."})
    reward_batch_size: int = field(default=32, metadata={"help": "Sequences per reward-model forward."})
    eval_num_prompts: int | None = field(default=64, metadata={"help": "Evaluation prompts (None: all)."})
    eval_samples_per_prompt: int = field(default=2, metadata={"help": "Samples per evaluation prompt."})
    eval_temperature: float = field(default=1.0, metadata={"help": "Evaluation sampling temperature."})
    online_mode: str = field(default="iterative", metadata={"help": "iterative | online"})
    async_generation: bool = field(default=True, metadata={"help": "Online mode: one-step async generation."})
    generator_process: bool = field(default=False, metadata={"help": "Online mode: generate in a separate process."})
    max_fill_rounds: int = field(default=4, metadata={"help": "Online mode: rounds to replace tied prompts."})
    generation_threads: int | None = field(default=None, metadata={"help": "CPU threads for generation."})
    training_threads: int | None = field(default=None, metadata={"help": "CPU threads for training."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "vLLM's share of GPU memory."})
    vllm_kwargs: dict[str, Any] | None = field(default=None, metadata={"help": "Extra vllm.LLM arguments."})
    resume: bool = field(default=True, metadata={"help": "Continue a run found in output_dir."})

    def __post_init__(self):
        super().__post_init__()
        check_num_samples(self.num_samples)
        split_temperatures(self.num_samples, self.temperatures)
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations}")
        if self.prompts_per_iteration is not None and self.prompts_per_iteration < 1:
            raise ValueError(f"prompts_per_iteration must be >= 1, got {self.prompts_per_iteration}")
        choices = {
            "selection_rule": SELECTION_RULES,
            "length_unit": ("chars", "tokens"),
            "pair_data": ("accumulate", "latest"),
            "reference": ("sft", "previous"),
            "generation_backend": ("auto", "hf", "vllm"),
            "online_mode": ("iterative", "online"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if not math.isfinite(self.length_penalty) or self.length_penalty < 0:
            raise ValueError(f"length_penalty (lambda of Eq. 9) must be >= 0, got {self.length_penalty}")
        if self.eval_samples_per_prompt < 1 or self.eval_temperature <= 0:
            raise ValueError("eval_samples_per_prompt must be >= 1 and eval_temperature > 0")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def settings(self) -> dict[str, Any]:
        """What makes two runs' pairs comparable (checked when a run is resumed)."""
        keys = [
            "num_iterations",
            "prompts_per_iteration",
            "num_samples",
            "temperatures",
            "max_new_tokens",
            "max_prompt_length",
            "top_p",
            "top_k",
            "selection_rule",
            "length_penalty",
            "length_unit",
            "tie_tolerance",
            "pair_data",
            "reference",
            "online_mode",
            "seed",
        ]
        return {k: getattr(self, k) for k in keys}


def _prompt_list(prompts, prompt_key: str) -> list[Any]:
    if prompts is None:
        raise ValueError("`prompts` is required: a dataset with a prompt column, or a list of prompts")
    if hasattr(prompts, "column_names"):
        if prompt_key not in prompts.column_names:
            raise ValueError(
                f"the prompt dataset has no {prompt_key!r} column (columns: {', '.join(prompts.column_names)}); "
                "pass prompt_key="
            )
        prompts = prompts[prompt_key]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("the prompt set is empty")
    for i, p in enumerate(prompts):
        if not (isinstance(p, str) or is_conversation(p)):
            raise ValueError(f"prompt {i} is neither text nor a list of chat messages: {p!r}")
    return prompts


@contextlib.contextmanager
def _quiet_datasets():
    """Silence ``datasets`` progress bars for the small per-batch maps of the online mode."""
    from datasets.utils import logging as ds_logging

    enabled = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            ds_logging.enable_progress_bar()


class _StreamLoader:
    """What the online-mode ``DPOTrainer`` iterates as its train dataloader: ``gradient_accumulation_steps``
    collated micro-batches per runner batch, so one optimizer step consumes exactly one generated batch."""

    def __init__(self, owner: IterativeDPOTrainer, runner: OneStepAsyncRunner, first: Batch, total: int, offset: int):
        self.owner, self.runner, self.first = owner, runner, first
        self.total, self.offset = total, offset
        self.trainer: DPOTrainer | None = None

    def __len__(self) -> int:
        return self.total * self.owner.args.gradient_accumulation_steps

    def __iter__(self):
        batch = self.first
        while True:
            yield from self._micro_batches(batch)
            if self.runner.delivered >= self.runner.num_batches:
                return
            batch = self.runner.next_batch()  # only asked for after the update on `batch` was published

    def _micro_batches(self, batch: Batch):
        trainer = self.trainer
        self.owner._record_online_batch(batch, self.offset)
        with _quiet_datasets():
            data = self.owner._dpo_dataset(batch.data)
            examples = list(trainer._prepare_dataset(data, trainer.processing_class, trainer.args, "online"))
        ga = trainer.args.gradient_accumulation_steps
        if len(examples) < ga:
            raise ValueError(
                f"online batch {batch.index} kept {len(examples)} pairs after tokenisation, fewer than "
                f"gradient_accumulation_steps={ga}: prompts longer than max_length are dropped; raise max_length"
            )
        bounds = [round(i * len(examples) / ga) for i in range(ga + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            yield trainer.data_collator(examples[lo:hi])


class _StreamingDPOTrainer(DPOTrainer):
    """``DPOTrainer`` whose train dataloader is a :class:`_StreamLoader` (online mode)."""

    def __init__(self, *args, stream: _StreamLoader, **kwargs):
        super().__init__(*args, **kwargs)
        self._stream = stream
        stream.trainer = self

    def get_train_dataloader(self):
        return self._stream


class _PublishWeights(TrainerCallback):
    """After every optimizer step, report the update to the runner; the weights snapshot (cloned tensors) is only
    taken when the generator will use that version."""

    def __init__(self, runner: OneStepAsyncRunner, model_fn: Callable[[], torch.nn.Module], to_cpu: bool = False):
        self.runner, self.model_fn, self.to_cpu = runner, model_fn, to_cpu

    def snapshot(self) -> dict[str, torch.Tensor]:
        sd = self.model_fn().state_dict()
        return {k: (v.detach().cpu() if self.to_cpu else v.detach()).clone() for k, v in sd.items()}

    def on_step_end(self, args, state, control, **kwargs):
        self.runner.publish(self.snapshot)


class IterativeDPOTrainer:
    """Iterative best/worst-of-n online DPO on TRL's ``DPOTrainer`` (see the module docstring).

    Args:
        model: the SFT checkpoint path (``pi_0``), or a causal LM (saved to ``output_dir/policies/policy_000``).
        args: :class:`IterativeDPOConfig`.
        prompts: a ``datasets.Dataset`` with a ``prompt_key`` column, or a list of prompts (text or chat messages).
        eval_prompts: held-out prompts for the evaluation after each iteration (default: the first
            ``eval_num_prompts`` training prompts).
        reward_fn: ``(prompts, responses) -> tensor[N]`` — any scorer (e.g. the simulator's annotators).
        reward_model: instead of ``reward_fn``: a reward-model checkpoint (sequence classification or rlhf-ext
            segment RM, see :func:`~rlhf_ext.runtime.rewards.load_reward`) or an instantiated
            sequence-classification model.
        processing_class: the tokenizer (default: loaded from ``model``).
        ref_model: path of the SFT reference (default: ``model``).
        gold_fn: an extra scorer reported at evaluation only (e.g. a gold reward).
        callbacks: ``transformers`` callbacks added to every inner ``DPOTrainer``.
        prompt_key: the prompt column of dataset inputs.
    """

    def __init__(
        self,
        model,
        args: IterativeDPOConfig | None = None,
        prompts=None,
        eval_prompts=None,
        reward_fn: RewardFn | None = None,
        reward_model=None,
        processing_class=None,
        ref_model: str | None = None,
        gold_fn: RewardFn | None = None,
        callbacks: list | None = None,
        prompt_key: str = "prompt",
    ):
        from accelerate import PartialState
        from transformers import AutoTokenizer

        self.args = args if args is not None else IterativeDPOConfig(output_dir="iterative-dpo")
        if not isinstance(self.args, IterativeDPOConfig):
            raise TypeError(f"args must be an IterativeDPOConfig, got {type(self.args).__name__}")
        self.state = PartialState()
        self.root = Path(self.args.output_dir)
        self.prompts = _prompt_list(prompts, prompt_key)
        self.eval_prompts = _prompt_list(eval_prompts, prompt_key) if eval_prompts is not None else self.prompts
        if self.args.eval_num_prompts is not None:
            self.eval_prompts = self.eval_prompts[: self.args.eval_num_prompts]
        if (reward_fn is None) == (reward_model is None):
            raise ValueError("pass exactly one of reward_fn= (a callable) or reward_model= (a checkpoint or model)")
        if processing_class is None:
            if not isinstance(model, str | Path):
                raise ValueError("pass processing_class= (the tokenizer) when the model is already instantiated")
            processing_class = AutoTokenizer.from_pretrained(str(model))
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        self.tokenizer = processing_class
        if isinstance(model, str | Path):
            self.sft_path = str(model)
        else:  # an instantiated pi_0: every iteration reloads policies from disk, so it is saved once, atomically
            self.sft_path = str(self.root / "policies" / "policy_000")
            if not (Path(self.sft_path) / "config.json").exists() and self.state.is_main_process:
                with atomic_directory(self.sft_path) as tmp:
                    model.save_pretrained(tmp)
                    processing_class.save_pretrained(tmp)
            self.state.wait_for_everyone()
        self.ref_path = str(ref_model) if ref_model is not None else self.sft_path
        if reward_fn is not None:
            if not callable(reward_fn):
                raise TypeError("reward_fn must be callable: (prompts, responses) -> one score per response")
            self.reward_fn = reward_fn
        elif isinstance(reward_model, str | Path):
            self.reward_fn = load_reward(str(reward_model), batch_size=self.args.reward_batch_size)
        else:
            self.reward_fn = SequenceClassifierReward(
                reward_model, tokenizer=processing_class, batch_size=self.args.reward_batch_size
            )
        self.gold_fn = gold_fn
        self.callbacks = list(callbacks or [])
        self.store = PairStore(self.root / "pairs")
        self._sampler = None
        self.runner_stats = None

    # ------------------------------------------------------------------------------------------------- run state
    def _read_state(self) -> dict[str, Any]:
        path = self.root / STATE_FILE
        return json.loads(path.read_text()) if path.exists() else {"policies": {"0": self.sft_path}, "skipped": []}

    def _write_state(self, state: dict[str, Any]) -> None:
        if self.state.is_main_process:
            atomic_write_json(self.root / STATE_FILE, state)
        self.state.wait_for_everyone()

    def policy_path(self, k: int) -> str | None:
        """Checkpoint of ``pi_k`` (``pi_0`` = SFT), or None if it does not exist yet."""
        return self._read_state()["policies"].get(str(k))

    def _check_run_dir(self) -> None:
        run = {"settings": self.args.settings(), "sft": self.sft_path, "prompts": stable_hash(self.prompts)}
        path = self.root / RUN_FILE
        if path.exists():
            if not self.args.resume:
                raise FileExistsError(
                    f"{self.root} already holds a run; delete it, choose another output_dir, or set resume=True"
                )
            old = json.loads(path.read_text())
            if old != json.loads(json.dumps(run)):
                changed = sorted(
                    k for k in run["settings"] if old.get("settings", {}).get(k) != run["settings"][k]
                ) or [k for k in ("sft", "prompts") if old.get(k) != run[k]]
                raise ValueError(
                    f"{self.root} holds a run with different settings ({', '.join(changed)}); resuming would mix "
                    "its pairs with new ones. Use another output_dir or restore the settings."
                )
        elif self.state.is_main_process:
            atomic_write_json(path, run)
        self.state.wait_for_everyone()

    # ------------------------------------------------------------------------------------------------- helpers
    def _seed(self, *parts: Any) -> int:
        return int(stable_hash(self.args.seed, *parts), 16) % (2**31 - 1)

    def iteration_prompts(self, k: int) -> tuple[list[Any], list[int]]:
        """(prompts, their indices in the prompt set) of iteration ``k``: a fixed shuffled order, consecutive
        slices of ``prompts_per_iteration``, wrapping around."""
        total = len(self.prompts)
        m = self.args.prompts_per_iteration or max(1, total // self.args.num_iterations)
        order = torch.randperm(total, generator=torch.Generator().manual_seed(self._seed("order")))
        positions = (k * m + torch.arange(m)) % total
        ids = order[positions].tolist()
        return [self.prompts[i] for i in ids], ids

    def sampler_spec(self) -> dict[str, Any]:
        """Keyword arguments of :func:`~rlhf_ext.runtime.sampling.make_sampler` for this run."""
        a = self.args
        return dict(
            backend=a.generation_backend,
            policy=self.sft_path,
            tokenizer=self.tokenizer,
            max_new_tokens=a.max_new_tokens,
            temperatures=a.temperatures,
            batch_size=a.generation_batch_size,
            max_prompt_length=a.max_prompt_length,
            top_p=a.top_p,
            top_k=a.top_k,
            vllm_kwargs={"gpu_memory_utilization": a.vllm_gpu_memory_utilization, **(a.vllm_kwargs or {})},
        )

    def sampler(self):
        if self._sampler is None:
            self._sampler = make_sampler(**self.sampler_spec())
        return self._sampler

    def _dpo_dataset(self, rows: Sequence[dict[str, Any]]):
        """The prompt / chosen / rejected columns TRL's DPOTrainer expects (chat prompts get assistant turns)."""
        from datasets import Dataset

        def side(prompt, text):
            return [{"role": "assistant", "content": text}] if is_conversation(prompt) else text

        return Dataset.from_list(
            [
                {
                    "prompt": r["prompt"],
                    "chosen": side(r["prompt"], r["chosen"]),
                    "rejected": side(r["prompt"], r["rejected"]),
                }
                for r in rows
            ]
        )

    def _dpo_args(self, output_dir: Path, **overrides: Any) -> IterativeDPOConfig:
        return dataclasses.replace(self.args, output_dir=str(output_dir), **overrides)

    def _load_causal_lm(self, path: str):
        from trl.trainer.utils import create_model_from_path

        return create_model_from_path(path, **dict(self.args.model_init_kwargs or {}))

    def _save_policy(self, trainer: DPOTrainer, dest: Path) -> None:
        """Save ``trainer``'s model to ``dest`` atomically (all ranks take part; the main process renames)."""
        partial = dest.with_name(f".{dest.name}.partial")
        if self.state.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        self.state.wait_for_everyone()
        trainer.save_model(str(partial))
        if self.state.is_main_process:
            self.tokenizer.save_pretrained(str(partial))
            os.replace(partial, dest)
        self.state.wait_for_everyone()

    # ------------------------------------------------------------------------------------------------ iterative
    def collect(self, k: int) -> dict[str, Any]:
        """Step 1 of iteration ``k``: sample from ``pi_k``, score, select, store (skipped if already stored)."""
        if not self.store.has(k) and self.state.is_main_process:
            policy = self.policy_path(k)
            prompts, ids = self.iteration_prompts(k)
            sampler = self.sampler()
            sampler.load_policy(policy)
            with torch_threads(self.args.generation_threads):
                samples = sampler.sample(prompts, self.args.num_samples, seed=self._seed("collect", k))
            sampler.release()
            rows, stats = score_and_select(
                prompts,
                ids,
                samples,
                self.reward_fn,
                SelectionSettings.from_args(self.args),
                torch.Generator().manual_seed(self._seed("select", k)),
            )
            for r in rows:
                r.update(iteration=k, policy=k)
            if not rows:
                warnings.warn(
                    f"iteration {k}: every prompt's {self.args.num_samples} responses tied under the reward "
                    "(equal scores or identical text), so no preference pairs were collected",
                    stacklevel=2,
                )
            self.store.write(k, rows, {**stats, "policy": policy})
            logger.info("iteration %d: %d pairs (%d prompts dropped)", k, len(rows), stats["dropped"])
        self.state.wait_for_everyone()
        return self.store.summary(k)

    def train_iteration(self, k: int) -> str:
        """Step 2 of iteration ``k``: DPO from ``pi_k`` on the stored pairs -> ``pi_{k+1}`` (skipped if it exists)."""
        state = self._read_state()
        if str(k + 1) in state["policies"]:
            return state["policies"][str(k + 1)]
        start = state["policies"][str(k)]
        rows = self.store.training_pairs(k, self.args.pair_data)
        if not rows:
            warnings.warn(
                f"iteration {k}: no preference pairs to train on; skipping DPO (policy {k + 1} = policy {k})",
                stacklevel=2,
            )
            state["policies"][str(k + 1)] = start
            state["skipped"].append(k)
            self._write_state(state)
            return start
        from rlhf_ext.trl.args import last_checkpoint

        work = self.root / "iterations" / f"iter_{k:03d}"
        ref = self._load_causal_lm(self.ref_path if self.args.reference == "sft" else start)
        trainer = DPOTrainer(
            model=start,
            ref_model=ref,
            args=self._dpo_args(work, seed=self.args.seed + k),
            train_dataset=self._dpo_dataset(rows),
            processing_class=self.tokenizer,
            callbacks=self.callbacks,
        )
        last = last_checkpoint(work)
        with torch_threads(self.args.training_threads):
            trainer.train(resume_from_checkpoint=last)
        dest = self.root / "policies" / f"policy_{k + 1:03d}"
        self._save_policy(trainer, dest)
        if self.state.is_main_process:
            for ckpt in work.glob("checkpoint-*"):
                shutil.rmtree(ckpt, ignore_errors=True)
        state["policies"][str(k + 1)] = str(dest)
        self._write_state(state)
        del trainer, ref
        return str(dest)

    def evaluate(self, k: int) -> dict[str, Any]:
        """Mean reward (and ``gold_fn``) of ``pi_k``'s samples on the evaluation prompts (cached on disk)."""
        return self._evaluate_policy(self.policy_path(k), f"policy_{k:03d}", {"policy": k})

    def _evaluate_policy(self, path: str, name: str, extra: dict[str, Any]) -> dict[str, Any]:
        """Sample ``eval_samples_per_prompt`` responses per evaluation prompt from the checkpoint at ``path`` and
        score them; written to ``output_dir/eval/{name}.json``. Every policy is evaluated on the same prompts with
        the same sampling seed (common random numbers), so differences between policies are not prompt noise."""
        out = self.root / "eval" / f"{name}.json"
        if not out.exists() and self.state.is_main_process:
            a = self.args
            sampler = self.sampler()
            sampler.load_policy(path)
            with torch_threads(a.generation_threads):
                samples = sampler.sample(
                    self.eval_prompts,
                    a.eval_samples_per_prompt,
                    temperatures=[a.eval_temperature],
                    seed=self._seed("eval"),
                )
            sampler.release()
            flat_prompts = [p for p in self.eval_prompts for _ in range(a.eval_samples_per_prompt)]
            rewards = score(self.reward_fn, flat_prompts, samples.flat())
            metrics = {
                **extra,
                "path": str(path),
                "num_samples": int(rewards.numel()),
                "mean_reward": float(rewards.mean()),
                "std_reward": float(rewards.std()) if rewards.numel() > 1 else 0.0,
                "mean_length_chars": float(samples.num_chars().mean()),
                "mean_length_tokens": float(samples.num_tokens.float().mean()),
                "truncated_fraction": float(samples.truncated.float().mean()),
            }
            if self.gold_fn is not None:
                metrics["mean_gold"] = float(score(self.gold_fn, flat_prompts, samples.flat()).mean())
            atomic_write_json(out, metrics)
        self.state.wait_for_everyone()
        return json.loads(out.read_text())

    def train(self) -> dict[str, Any]:
        """Run (or resume) the schedule; returns a summary that is also written to ``output_dir/summary.json``."""
        self._check_run_dir()
        if self.args.online_mode == "online":
            return self._train_online()
        evals = [self.evaluate(0)]
        iterations = []
        for k in range(self.args.num_iterations):
            pairs = self.collect(k)
            self.train_iteration(k)
            evals.append(self.evaluate(k + 1))
            iterations.append({"iteration": k, "pairs": pairs, "eval": evals[-1]})
        state = self._read_state()
        summary = {
            "mode": "iterative",
            "output_dir": str(self.root),
            "final_policy": state["policies"][str(self.args.num_iterations)],
            "skipped_iterations": state["skipped"],
            "eval": evals,
            "iterations": iterations,
        }
        if self.state.is_main_process:
            atomic_write_json(self.root / "summary.json", summary)
        return summary

    # --------------------------------------------------------------------------------------------------- online
    def _record_online_batch(self, batch: Batch, offset: int) -> None:
        """Write a batch's pairs to the store as the learner takes it (index = the update it feeds)."""
        index = offset + batch.index
        rows = [{**r, "update": index, "policy_version": offset + batch.version} for r in batch.data]
        if self.state.is_main_process:
            self.store.write(
                index, rows, {"policy_version": offset + batch.version, "generate_seconds": batch.generate_seconds}
            )

    def _train_online(self) -> dict[str, Any]:
        from rlhf_ext.trl.args import last_checkpoint

        a = self.args
        if self.state.num_processes > 1 and a.generation_backend == "vllm":
            raise ValueError("online mode with vLLM runs on one process; launch a single process")
        pairs_per_update = a.per_device_train_batch_size * a.gradient_accumulation_steps
        total = (
            a.max_steps
            if a.max_steps > 0
            else max(1, len(self.prompts) // (pairs_per_update * self.state.num_processes))
        )
        work = self.root / "online"
        dest = self.root / "policies" / "online_final"
        if dest.exists() and (self.root / "summary.json").exists():
            return json.loads((self.root / "summary.json").read_text())  # the run already finished
        last = last_checkpoint(work)
        offset = int(Path(last).name.split("-")[-1]) if last else 0
        # batches generated after the last checkpoint belong to updates that were lost: they are generated again
        if self.state.is_main_process:
            for it in self.store.completed():
                if it >= offset:
                    shutil.rmtree(self.store.path(it))
        self.state.wait_for_everyone()
        evals = [self.evaluate(0)]
        if self.state.is_main_process:
            shutil.rmtree(dest, ignore_errors=True)  # left by a run killed between saving it and the summary
        self.state.wait_for_everyone()
        if offset < total:
            stats = self._run_online(total, offset, last, work, dest)
        else:  # killed after the last update's checkpoint, before the final policy was saved
            stats = RunnerStats()
            if self.state.is_main_process:
                with atomic_directory(dest) as tmp:
                    self._load_causal_lm(last).save_pretrained(tmp)
                    self.tokenizer.save_pretrained(tmp)
            self.state.wait_for_everyone()
        self.runner_stats = stats
        state = self._read_state()
        state["policies"]["final"] = str(dest)
        self._write_state(state)
        final_eval = self._evaluate_policy(str(dest), "online_final", {"policy": "final"})
        summary = {
            "mode": "online",
            "async_generation": a.async_generation,
            "output_dir": str(self.root),
            "final_policy": str(dest),
            "updates": total,
            "resumed_from_update": offset,
            "runner": stats.as_dict(),
            "eval": [*evals, final_eval],
        }
        if self.state.is_main_process:
            atomic_write_json(self.root / "summary.json", summary)
        return summary

    def _run_online(self, total: int, offset: int, last: str | None, work: Path, dest: Path) -> RunnerStats:
        """Updates ``offset .. total-1``: ``DPOTrainer``'s loop as the learner, fed by a :class:`OneStepAsyncRunner`
        whose generator holds its own copy of the policy; saves the final policy to ``dest``."""
        a = self.args
        generator = OnlinePairGenerator(
            prompts=self.prompts[self.state.process_index :: self.state.num_processes],
            pairs_per_update=a.per_device_train_batch_size * a.gradient_accumulation_steps,
            num_samples=a.num_samples,
            max_fill_rounds=a.max_fill_rounds,
            selection=SelectionSettings.from_args(a),
            reward_fn=self.reward_fn,
            sampler_spec={**self.sampler_spec(), "policy": last or self.sft_path},
            seed=self._seed("order", offset),
            sampler=None if a.generator_process else self.sampler(),
        )
        runner = OneStepAsyncRunner(
            generator.generate,
            num_batches=total - offset,
            load_weights_fn=generator.load_weights,
            sync=not a.async_generation,
            generator_threads=a.generation_threads,
            process=a.generator_process,
            name=f"rlhf-ext-generator-{self.state.process_index}",
        )
        with runner, torch_threads(a.training_threads):
            first = runner.next_batch()
            trainer = _StreamingDPOTrainer(
                model=self.sft_path,
                ref_model=self._load_causal_lm(self.ref_path),
                args=self._dpo_args(work, max_steps=total, ignore_data_skip=True),
                train_dataset=self._dpo_dataset(first.data),
                processing_class=self.tokenizer,
                callbacks=self.callbacks,
                stream=_StreamLoader(self, runner, first, total, offset),
            )
            plugin = trainer.accelerator.state.deepspeed_plugin
            if plugin is not None and plugin.zero_stage == 3:
                raise ValueError(
                    "online mode publishes the policy's full weights to the generator after every step, which ZeRO-3 "
                    "shards; use ZeRO-2 / DDP for online mode (iterative mode supports ZeRO-3)"
                )
            model_fn = lambda: trainer.accelerator.unwrap_model(trainer.model)  # noqa: E731
            trainer.add_callback(_PublishWeights(runner, model_fn, to_cpu=a.generator_process))
            trainer.train(resume_from_checkpoint=last)
        self._save_policy(trainer, dest)
        return runner.stats
