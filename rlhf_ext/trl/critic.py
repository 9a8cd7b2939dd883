"""The GAE critic of :class:`~rlhf_ext.trl.segment_ppo.DensePPOTrainer` (paper 003 section 2.3 and Appendix C: PPO's
value model, initialised from the reward model, trained with a clipped value loss, lr 9e-6): values at rollout time,
one value-loss step per policy micro-batch, weights and optimizer state in each checkpoint's ``critic/``.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

from rlhf_ext.algos.ppo import clipped_value_loss
from rlhf_ext.runtime.token_scores import TokenScoreCapture, load_value_model, position_scores

logger = logging.getLogger(__name__)

#: Where a checkpoint keeps a trained critic's weights and (:data:`CRITIC_STATE_FILE`) optimizer state.
CRITIC_DIR = "critic"
CRITIC_STATE_FILE = "training_state.pt"


def critic_optimizer(critic: torch.nn.Module, lr: float, betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    """The critic's AdamW, fused (480 ms vs 84 ms per CPU step for SmolLM2-135M); the per-parameter one, with a
    warning saying why, where torch has no fused kernel for a parameter's device or dtype."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    params = list(critic.parameters())
    unsupported = sorted({f"{p.dtype} on {p.device.type}" for p in params
                          if not (p.is_floating_point() and p.device.type in devices)})  # fmt: skip
    if unsupported:
        logger.warning(
            "critic optimizer: torch has no fused AdamW for parameters of %s (fused kernels need floating-point "
            "parameters on %s); using the slower per-parameter AdamW",
            ", ".join(unsupported), "/".join(devices),
        )  # fmt: skip
    return torch.optim.AdamW(params, lr=lr, betas=betas, fused=not unsupported)


class Critic:
    """A value model and its fused AdamW, prepared by ``accelerator`` (single process or DDP).

    Attributes:
        model: the prepared value model (a sequence-classification model whose head is read at every position).
        optimizer: its AdamW (:func:`critic_optimizer`).
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
        """One clipped value-loss backward on a micro-batch (the rollout's ``old_values`` and ``returns`` ``[B, C]``);
        clip and step every ``accumulation`` micro-batches. Returns the detached loss and clip fraction."""
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
        """Its optimizer state and micro-step count into ``checkpoint/critic/``, next to the weights."""
        critic_dir = os.path.join(checkpoint, CRITIC_DIR)
        os.makedirs(critic_dir, exist_ok=True)
        state = {"optimizer": self.optimizer.state_dict(), "micro_steps": self.micro_steps}
        torch.save(state, os.path.join(critic_dir, CRITIC_STATE_FILE))

    def load(self, checkpoint: str) -> None:
        """Weights and optimizer state from ``checkpoint/critic/`` (the optimizer starts afresh, with a warning, when
        the checkpoint holds the weights only)."""
        critic_dir = os.path.join(checkpoint, CRITIC_DIR)
        if not os.path.isfile(os.path.join(critic_dir, "config.json")):
            raise ValueError(
                f"cannot resume the GAE critic from {checkpoint}: it has no {CRITIC_DIR}/ (was it saved by a run "
                "without a critic, e.g. advantage_estimator='reinforce'?); resume with the checkpoint's settings or "
                "start in a new output_dir"
            )
        model = self.accelerator.unwrap_model(self.model)
        saved = type(model).from_pretrained(critic_dir, dtype=next(model.parameters()).dtype)
        model.load_state_dict(saved.state_dict())
        del saved
        state_file = os.path.join(critic_dir, CRITIC_STATE_FILE)
        if not os.path.isfile(state_file):
            warnings.warn(
                f"{checkpoint} has the critic's weights but not its optimizer state ({CRITIC_DIR}/{CRITIC_STATE_FILE}: "
                "saved with save_only_model, or by an older rlhf-ext); the critic's optimizer starts afresh",
                stacklevel=2,
            )
            return
        state = torch.load(state_file, map_location="cpu", weights_only=True)
        fused = [group.get("fused") for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        for group, kernel in zip(self.optimizer.param_groups, fused):
            group["fused"] = kernel
        self.micro_steps = state["micro_steps"]


def gae_critic(args, critic: torch.nn.Module | None, source: str, accelerator, on_reward_funcs: bool) -> Critic | None:
    """The critic of a ``DensePPOConfig`` run: ``critic``, else a value model loaded from ``source``; ``None`` for
    the critic-free estimators (a warning suggests them ``on_reward_funcs``)."""
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
