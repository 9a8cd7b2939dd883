"""The GAE critic of :class:`~rlhf_ext.trl.segment_ppo.DensePPOTrainer` (paper 003 section 2.3 and Appendix C: PPO's
value model, initialised from the reward model, trained with a clipped value loss, lr 9e-6).

The policy is the ``Trainer``'s model; the critic is a second model with its own optimizer, so it lives here: values
at rollout time, one clipped value-loss step per policy micro-batch (the optimizer steps at every accumulation
boundary), and its weights and optimizer state in each checkpoint's ``critic/``.
"""

from __future__ import annotations

import logging
import os

import torch

from rlhf_ext.algos.ppo import clipped_value_loss
from rlhf_ext.runtime.token_scores import (
    CRITIC_DIR,
    TokenScoreCapture,
    critic_optimizer,
    load_critic,
    load_value_model,
    position_scores,
    save_critic_state,
)


class Critic:
    """A value model and its fused AdamW, prepared by ``accelerator`` (single process or DDP).

    Attributes:
        model: the prepared value model (a sequence-classification model whose head is read at every position).
        optimizer: its AdamW (:func:`~rlhf_ext.runtime.token_scores.critic_optimizer`).
        micro_steps: value-loss backward passes so far (the optimizer steps every ``accumulation`` of them).
    """

    def __init__(self, model: torch.nn.Module, accelerator, learning_rate: float):
        self.accelerator = accelerator
        self.model, self.optimizer = accelerator.prepare(model, critic_optimizer(model, learning_rate))
        self._capture = TokenScoreCapture(self.model)
        self.micro_steps = 0

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int) -> torch.Tensor:
        """``[B, C]`` V(s_t) for each completion token t of ``input_ids`` ``[B, P + C]``: the head at the position
        that predicts t."""
        scores = position_scores(self._capture, self.model, input_ids, attention_mask)
        return scores[:, -completion_len - 1 : -1]

    def step(
        self, inputs: dict, accumulation: int, max_grad_norm: float, value_clip: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One clipped value-loss backward on a micro-batch (``prompt_ids``/``completion_ids`` and masks, the rollout's
        ``old_values`` and ``returns`` ``[B, C]``); clip and step every ``accumulation`` micro-batches. Returns the
        detached loss and clip fraction (scalars)."""
        self.model.train()
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        values = self.values(input_ids, attention_mask, inputs["completion_ids"].size(1))
        mask = inputs["completion_mask"].bool()
        loss, clip_frac = clipped_value_loss(values, inputs["old_values"], inputs["returns"], mask, value_clip)
        self.accelerator.backward(loss / accumulation)
        self.micro_steps += 1
        if self.micro_steps % accumulation == 0:
            self.accelerator.clip_grad_norm_(self.model.parameters(), max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), clip_frac.detach()

    def save_weights(self, output_dir: str) -> None:
        """The critic's weights into ``output_dir/critic/`` (``save_pretrained``)."""
        self.accelerator.unwrap_model(self.model).save_pretrained(os.path.join(output_dir, CRITIC_DIR))

    def save_state(self, checkpoint: str) -> None:
        """Its optimizer state and micro-step count next to the weights."""
        save_critic_state(self.optimizer, self.micro_steps, checkpoint)

    def load(self, checkpoint: str) -> None:
        """Weights and optimizer state from ``checkpoint/critic/`` (the micro-step count too, where it was saved)."""
        steps = load_critic(self.accelerator.unwrap_model(self.model), self.optimizer, checkpoint)
        self.micro_steps = self.micro_steps if steps is None else steps


def gae_critic(args, critic: torch.nn.Module | None, source: str, accelerator, on_reward_funcs: bool) -> Critic | None:
    """The critic of a ``DensePPOConfig`` run: ``critic``, else a value model loaded from ``source``; ``None`` for
    the critic-free estimators (``args.advantage_estimator`` other than ``gae``). Trained on reward functions'
    rewards (``on_reward_funcs``) it warns that ``reinforce_baseline`` needs none."""
    if args.advantage_estimator != "gae":
        return None
    if on_reward_funcs:
        logging.getLogger("rlhf_ext").warning(
            "DensePPOTrainer: advantage_estimator 'gae' (the default, paper 003's PPO) trains a critic on "
            "the reward functions' rewards; pass advantage_estimator='reinforce_baseline' for critic-free "
            "advantages with the prompt group's mean as baseline (as GRPO)"
        )
    critic = critic if critic is not None else load_value_model(source, "critic")
    return Critic(critic, accelerator, args.critic_learning_rate)
