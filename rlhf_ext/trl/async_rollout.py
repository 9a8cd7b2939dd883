"""One-step asynchronous rollouts for TRL's GRPO-based trainers (paper 001, section 3 and Appendix D).

:class:`OneStepAsyncRollout` is a GRPO ``rollout_func``: a :class:`~rlhf_ext.online.OneStepAsyncRunner` thread
generates rollout batch ``t + 1`` with its own copy of the policy at ``theta_t`` (published after every optimizer
step) while the trainer trains on batch ``t``; every batch after the first is exactly one version old (asserted;
``sync=True``: zero, the on-policy baseline). It walks its own copy of the trainer's data loader (checked), returns
the behaviour policy's log-probs as ``logprobs`` (PPO's "old" log-probs) and samples batch ``t`` with a generator
seeded with :func:`~rlhf_ext.runtime.sampling.sampling_seed` ``(args.seed, "rollout", t)``, never the global RNG.

Requirements (checked): ``steps_per_generation == gradient_accumulation_steps``, ``num_iterations == 1``, HF
``generate`` (not vLLM), a single process.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import TrainerCallback

from rlhf_ext.runtime.async_runner import OneStepAsyncRunner, torch_threads
from rlhf_ext.runtime.sampling import SeededTokenSampler, sampling_seed


class _PublishAfterStep(TrainerCallback):
    """Hands the learner's new weights (a cloned snapshot, taken only if the generator will use it) to the runner."""

    def __init__(self, rollout: OneStepAsyncRollout):
        self.rollout = rollout

    def on_step_end(self, args, state, control, **kwargs):
        runner = self.rollout.runner
        if runner is not None:
            model = self.rollout.trainer.accelerator.unwrap_model(self.rollout.trainer.model)
            runner.publish(lambda: {k: v.detach().clone() for k, v in model.state_dict().items()})

    def on_train_end(self, args, state, control, **kwargs):
        self.rollout.close()


class OneStepAsyncRollout:
    """GRPO ``rollout_func`` that generates one step ahead of training (see the module docstring).

    Args:
        sync: generate each batch with the newest weights (staleness 0) instead of one step ahead.
        generator_threads: torch threads of the generator (the learner keeps the rest).
    """

    def __init__(self, sync: bool = False, generator_threads: int | None = None):
        self.sync = sync
        self.generator_threads = generator_threads
        self.trainer = None
        self.runner: OneStepAsyncRunner | None = None
        self.stats = None  # the runner's RunnerStats (versions, staleness histogram, timings) after training
        self._prompt_batches = None
        self._model = None
        self._first_step = 0

    # ------------------------------------------------------------------------------------------------ set-up
    def attach(self, trainer) -> None:
        args = trainer.args
        if args.num_iterations != 1 or args.steps_per_generation != args.gradient_accumulation_steps:
            raise ValueError(
                "one-step async rollouts need one generation per optimizer step: num_iterations=1 and "
                "steps_per_generation=gradient_accumulation_steps"
            )
        if args.use_vllm:
            raise ValueError("one-step async rollouts generate with HF generate; set use_vllm=False (or use OpenRLHF's "
                             "--train.async_enable with vLLM)")  # fmt: skip
        if trainer.accelerator.num_processes > 1:
            raise ValueError("one-step async rollouts run in a single process; use OpenRLHF's async mode to scale out")
        args.ignore_data_skip = True  # a resumed run restarts both prompt streams from the beginning, in step
        self.trainer = trainer
        trainer.add_callback(_PublishAfterStep(self))

    def _start(self) -> None:
        trainer = self.trainer
        self._model = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model)).eval()
        self._prompt_batches = iter(trainer.get_train_dataloader())
        self._first_step = trainer.state.global_step
        remaining = max(trainer.state.max_steps - trainer.state.global_step, 1)
        self.runner = OneStepAsyncRunner(
            self._generate,
            num_batches=remaining,
            load_weights_fn=lambda weights, version: self._model.load_state_dict(weights),
            sync=self.sync,
            generator_threads=self.generator_threads,
            name="rlhf-ext-ppo-generator",
        ).start()

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.stats = self.runner.stats
            self.runner = None

    # ---------------------------------------------------------------------------------------- generator side
    @torch.no_grad()
    def _generate(self, index: int, version: int) -> dict[str, Any]:
        """Rollout batch ``index`` with the policy of ``version``: prompt ids, completion ids (up to and including
        EOS) and the behaviour log-prob of every sampled token."""
        trainer = self.trainer
        rows = next(self._prompt_batches)
        prompts = [row["prompt"] for row in rows]
        prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
        tok = trainer._tokenizer
        pad = tok.pad_token_id
        width = max(len(p) for p in prompt_ids)
        device = next(self._model.parameters()).device
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompt_ids], device=device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
        args = trainer.args
        generator = torch.Generator(device).manual_seed(sampling_seed(args.seed, "rollout", self._first_step + index))
        sampler = SeededTokenSampler(generator, args.temperature, args.top_k or 0, args.top_p)
        with torch_threads(self.generator_threads):
            out = self._model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                **sampler.generate_kwargs(),
                max_new_tokens=args.max_completion_length,
                pad_token_id=pad,
            )
        gen = out[:, width:]  # [B, C]
        logps = torch.stack(sampler.token_logprobs, dim=1).float()  # the behaviour policy's, of the sampled tokens
        eos = set(trainer.eos_token_ids)
        completion_ids, logprobs = [], []
        for row_ids, row_lp in zip(gen.tolist(), logps.tolist()):
            end = next((i + 1 for i, t in enumerate(row_ids) if t in eos), len(row_ids))
            completion_ids.append(row_ids[:end])
            logprobs.append(row_lp[:end])
        return {"prompts": prompts, "prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    # ------------------------------------------------------------------------------------------ learner side
    def __call__(self, prompts: list, trainer) -> dict[str, Any]:
        if trainer is not self.trainer:
            raise RuntimeError("this OneStepAsyncRollout is attached to another trainer")
        if self.runner is None:
            self._start()
        batch = self.runner.next_batch()
        if batch.data["prompts"] != prompts:
            raise RuntimeError(
                "the async generator sampled other prompts than the trainer asked for (data loader order changed?); "
                "run without async_generation"
            )
        return {k: batch.data[k] for k in ("prompt_ids", "completion_ids", "logprobs")}
