"""Segment-level PPO on OpenRLHF 0.11.2's Ray pipeline (paper 003, section 2.3), installed by
:func:`install_in_process` in the driver and every Ray worker:

* ``SegmentReferenceModelActor`` — the reference actor also returns the entropy ``[B, A]`` (one pass over its logits).
* ``SegmentRewardModelActor`` — the reward-model actor returns the score at *every* position ``[B, T]``.
* ``SegmentExperienceMaker`` — dense rewards (:func:`rlhf_ext.segment.dense_segment_rewards`, as the TRL trainer),
  placed by OpenRLHF's ``compute_reward`` where the scalar would be; with ``--ext.reward_source`` or a reward server
  it maps the source's spans onto the policy's tokens (:func:`rlhf_ext.runtime.spans.dense_rewards`) instead.

``--ext.granularity bandit`` hands OpenRLHF the score at the last token: exactly stock OpenRLHF (tested end to end).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import ray
import torch

from rlhf_ext.algos.knobs import check_knob
from rlhf_ext.algos.location_norm import LocationNormalizer
from rlhf_ext.algos.ppo import ESTIMATORS, group_mean_baseline, last_token_index
from rlhf_ext.algos.segment_dense import (
    DenseRewardKnobs,
    Granularity,
    SegmentationMonitor,
    dense_segment_rewards,
    resolve_granularity,
    segmentation_rates,
)
from rlhf_ext.algos.segment_reward import SegmentRewardKnobs, logprobs_and_entropy
from rlhf_ext.openrlhf.compat import import_shims
from rlhf_ext.runtime.calibration import load_normalizer
from rlhf_ext.runtime.token_scores import TokenScoreCapture

with import_shims():
    import openrlhf.models.utils as openrlhf_model_utils
    import openrlhf.trainer.ppo_trainer  # noqa: F401  (imported here so install_in_process finds it loaded)
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ray.launcher import ReferenceModelActor, RewardModelActor

DENSE_ATTR = "_rlhf_ext_dense_rewards"
#: ``--reward.remote_url`` value standing for "the experience maker scores the rollouts" (OpenRLHF then builds no
#: reward-model actor); rollout engines are created without it (:func:`engines_without_maker_url`).
REWARDS_IN_MAKER = "rlhf-ext:experience-maker"
WEIGHTS_VERSION = "weights_version"  # reported per response by the HF rollout engine


def validate_segment_ext(ext: dict[str, Any]) -> dict[str, Any]:
    """Check the segment ``--ext.*`` values (again, for values set in Python) and load ``--ext.normalizer``, so that a
    missing, malformed or poisoned normalizer file is refused in the driver before Ray starts."""
    ext = dict(ext)
    try:
        DenseRewardKnobs(
            granularity=ext["granularity"], interpolation=ext["interpolation"], chunk_size=ext["chunk_size"]
        )
    except ValueError as e:
        raise ValueError(f"--ext.{e}") from None
    for name in ("entropy_cutoff", "tau"):
        if ext[name] is not None:
            ext[name] = check_knob(SegmentRewardKnobs, name, ext[name], f"--ext.{name}")
    if ext["normalizer"]:
        load_normalizer(ext["normalizer"], reward_model=ext["reward_model_id"])
    return ext


def per_token(rewards: torch.Tensor, action_mask: torch.Tensor) -> bool:
    """Whether an experience's ``rewards`` are a reward model actor's per-token scores ``[B, T]`` (``T`` = prompt +
    response, so wider than the ``[B, A]`` action mask) rather than one reward per sample (``[B]``, or ``[B, 1]`` as
    OpenRLHF stacks remote / agent rewards)."""
    return rewards.dim() == 2 and rewards.shape[1] > action_mask.shape[1]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ------------------------------------------------------------------------------------------------- Ray actors
def padded(packed: torch.Tensor, attention_mask: torch.Tensor, ring_attn_group: Any = None) -> torch.Tensor:
    """``[1, N]`` per-token values of a ``--ds.packing_samples`` forward (``N = attention_mask.sum()``, ``[1, ceil(N /
    r)]`` per rank with ring attention of size ``r``) -> ``[B, T]`` rows, zeros at the padding, by OpenRLHF's
    ``gather_and_pad_tensor``: each row gets exactly its own values, so segments never cross samples."""
    from openrlhf.models.ring_attn_utils import gather_and_pad_tensor

    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    pad = 0
    if ring_attn_group is not None:
        import torch.distributed as dist

        size = dist.get_world_size(group=ring_attn_group)
        pad = (size - indices.numel() % size) % size
    return gather_and_pad_tensor(packed, ring_attn_group, pad, indices, *attention_mask.shape)


class _SegmentReferenceActor(ReferenceModelActor.__ray_actor_class__):
    """Reference actor that also returns the entropy of the distribution each action token was sampled from."""

    def forward(
        self,
        sequences: torch.LongTensor,
        action_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        return_output=False,
        packed_seq_lens: list[int] | None = None,
        mm_train_inputs_list=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log_probs [B, A], entropy [B, A])`` from one forward of the reference model: action ``j`` is token
        ``T - A + j``, scored by the ``Actor``'s (fp32, tempered) logits before it (packed: :func:`padded`)."""
        if mm_train_inputs_list and any(mm_train_inputs_list):
            raise ValueError("segment rewards are not supported for vision-language inputs")
        device = _device()
        sequences, attention_mask = sequences.to(device), attention_mask.to(device)
        a = action_mask.shape[1]
        group = self.strategy.ring_attn_group
        with torch.no_grad():
            output = self.model(sequences, None, attention_mask, return_output=True, ring_attn_group=group,
                                packed_seq_lens=packed_seq_lens)  # fmt: skip
            logits = output["logits"]  # logits at t predict t + 1
            if self.strategy.args.ds.packing_samples:  # [1, N, V] over the real tokens of all rows (this rank's)
                from openrlhf.models.ring_attn_utils import unpad_and_slice_tensor

                labels = unpad_and_slice_tensor(sequences, attention_mask, group)[2]  # the rolled sequences
                log_probs, entropy = logprobs_and_entropy(logits, labels)
                log_probs, entropy = (padded(x, attention_mask, group)[:, -a - 1 : -1] for x in (log_probs, entropy))
            else:  # only the A positions whose distributions sampled the action tokens
                log_probs, entropy = logprobs_and_entropy(logits[:, -a - 1 : -1], sequences[:, -a:])
            mask = action_mask.to(device).float()
        return (log_probs * mask).to("cpu"), (entropy * mask).to("cpu")


class _SegmentRewardActor(RewardModelActor.__ray_actor_class__):
    """Reward-model actor that returns the score at every position ``[B, T]`` (one forward, no extra cost)."""

    def init_model_from_pretrained(self, strategy, pretrain):
        super().init_model_from_pretrained(strategy, pretrain)
        self._capture = TokenScoreCapture(self.model)

    def forward(self, sequences, attention_mask=None, packed_seq_lens=None, pad_sequence=False) -> torch.Tensor:
        """``[B, T]`` scores (``--ds.packing_samples``: the head scored ``[1, N]`` packed tokens, :func:`padded`)."""
        device = _device()
        attention_mask = attention_mask.to(device)
        with torch.no_grad():
            self.model(
                sequences.to(device),
                attention_mask,
                ring_attn_group=self.strategy.ring_attn_group,
                pad_sequence=True,
                packed_seq_lens=packed_seq_lens,
            )
            scores = self._capture.pop().float()
            if self.strategy.args.ds.packing_samples:
                scores = padded(scores, attention_mask, self.strategy.ring_attn_group)
        return scores.to("cpu")


SegmentReferenceModelActor = ray.remote(num_gpus=1)(_SegmentReferenceActor)
SegmentRewardModelActor = ray.remote(num_gpus=1)(_SegmentRewardActor)


# ------------------------------------------------------------------------------------------ experience maker
_stock_compute_reward = getattr(openrlhf_model_utils.compute_reward, "__wrapped__", openrlhf_model_utils.compute_reward)


def dense_aware_compute_reward(r, kl_coef, kl, action_mask=None, reward_clip_range=None):
    """OpenRLHF's ``compute_reward`` plus the ``[B, A]`` dense rewards the segment experience maker attaches to ``kl``
    (with ``r = 0``): ``clip(dense) - kl_coef * kl``, ``clip`` being ``--reward.clip_range`` per token."""
    reward = _stock_compute_reward(r, kl_coef, kl, action_mask=action_mask, reward_clip_range=reward_clip_range)
    dense = getattr(kl, DENSE_ATTR, None)
    if dense is None:
        return reward
    if reward_clip_range:
        dense = dense.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    return reward + dense.to(reward.dtype)


dense_aware_compute_reward.__wrapped__ = _stock_compute_reward


class SegmentExperienceMaker(RemoteExperienceMaker):
    """OpenRLHF's experience maker with dense segment rewards (paper 003, Algorithm 1 lines 23-27)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        ext = validate_segment_ext({k: v for k, v in vars(self.args.ext).items() if k != "continual"})
        self.source = reward_source(ext)
        ext["granularity"] = resolve_granularity(ext["granularity"], spans=self.source is not None)
        self.ext = ext
        self.dense = ext["granularity"] != "bandit" or self.source is not None
        from rlhf_ext.runtime.segment_data import resolve_segment_settings

        reward_path = getattr(getattr(self.args, "reward", None), "model_name_or_path", None)
        self.entropy_cutoff, self.aggregation, self.tau = resolve_segment_settings(
            reward_path and str(reward_path), ext["entropy_cutoff"], ext["aggregation"], ext["tau"]
        )
        path = ext["normalizer"]
        self.normalizer = load_normalizer(path, reward_model=ext["reward_model_id"]) if path else LocationNormalizer()
        self.monitor = SegmentationMonitor.for_normalizer(self.normalizer, ext["granularity"])
        if self.dense and self.advantage_estimator not in ESTIMATORS:
            raise ValueError(
                f"dense segment rewards need --algo.advantage.estimator {' | '.join(ESTIMATORS)} (got "
                f"{self.advantage_estimator}); the other estimators shape a scalar reward"
            )
        self._batches = 0
        self._first_version: float | None = None
        self._ref_entropies: list[torch.Tensor] | None = None

    def _flatten_results(self, refs, duplicate_factor):
        results = super()._flatten_results(refs, duplicate_factor)
        if results and isinstance(results[0], tuple):  # the segment reference actor: (log_probs, entropy)
            self._ref_entropies = [entropy for _, entropy in results]
            return [log_probs for log_probs, _ in results]
        return results

    @torch.no_grad()
    def make_experience_batch(self, rollout_samples):
        """OpenRLHF's, plus ``info["staleness"]`` per sample when the rollout engine reports weights versions (the HF
        engine does): policy updates before this batch minus the sample's version (0 on-policy, 1 with one-step async,
        paper 001), counted from the first batch's version."""
        versions = [s.info[WEIGHTS_VERSION].float() for s in rollout_samples if WEIGHTS_VERSION in s.info]
        if len(versions) == len(rollout_samples) and versions:
            if self._first_version is None:
                self._first_version = float(versions[0].min())
            expected = self._first_version + self._batches
            for sample, version in zip(rollout_samples, versions):
                sample.info["staleness"] = expected - version
        self._batches += 1
        return super().make_experience_batch(rollout_samples)

    @torch.no_grad()
    def make_experience(self, samples_list):
        self._ref_entropies = None
        from_source = [self.source_rewards(s) for s in samples_list] if self.source is not None else None
        experiences = super().make_experience(samples_list)
        if from_source is None:
            self.attach_dense_rewards(experiences, self._ref_entropies)
        else:
            self.attach_source_rewards(experiences, from_source)
        return experiences

    @staticmethod
    def attach_source_rewards(experiences, batches) -> None:
        """Attach each experience's :class:`~rlhf_ext.runtime.spans.DenseBatch`: rewards ``[B, A]``, sums as
        ``info["reward"]``."""
        for exp, batch in zip(experiences, batches):
            setattr(exp.kl, DENSE_ATTR, batch.rewards.to(exp.action_mask.device))
            exp.info["reward"] = batch.sequence_reward
            exp.info["segments_per_response"] = batch.segments_per_response.float()

    def source_rewards(self, samples):
        """The dense rewards ``[B, A]`` of one batch from ``--ext.reward_source`` (or the reward server);
        ``samples.rewards`` becomes the zero placeholder, so OpenRLHF calls no reward model."""
        from rlhf_ext.runtime.spans import completion_offsets, dense_rewards, parse_outputs

        mask = samples.action_mask.bool()
        completion_ids = samples.sequences[:, -mask.shape[1] :]
        texts, _, _ = completion_offsets(self.tokenizer, completion_ids, mask)
        ids = [row[m].tolist() for row, m in zip(completion_ids, mask)]
        name = getattr(self.source, "__name__", type(self.source).__name__)
        answer = self.source(prompts=list(samples.prompts), completions=texts, completion_ids=ids)
        output = parse_outputs(name, answer, len(texts), [len(i) for i in ids])
        samples.rewards = torch.zeros(len(texts), dtype=torch.float32)
        return dense_rewards([output], [1.0], self.tokenizer, completion_ids, mask, **self._dense_knobs())

    def _dense_knobs(self) -> dict[str, Any]:
        """The settings both dense-reward paths pass: read at call time (tests replace ``normalizer`` after init)."""
        return {
            "normalizer": self.normalizer,
            "granularity": self.ext["granularity"],
            "interpolation": self.ext["interpolation"],
            "aggregation": self.aggregation,
            "tau": self.tau,
        }

    @torch.no_grad()
    def compute_advantages_and_returns(self, experiences):
        """OpenRLHF's, on dense rewards; ``reinforce_baseline`` subtracts the prompt group's mean summed dense reward at
        each response's last token (as :func:`rlhf_ext.algos.ppo.ppo_advantages`, which the TRL engine calls)."""
        if not self.dense:
            return super().compute_advantages_and_returns(experiences)
        dense = [getattr(e.kl, DENSE_ATTR) for e in experiences]
        if self.advantage_estimator == "reinforce_baseline":
            n = self.args.rollout.n_samples_per_prompt
            indices = torch.tensor([i for e in experiences for i in e.index])
            summed = torch.cat([d.sum(dim=1) for d in dense])
            ordered = torch.empty_like(summed)
            ordered[indices] = summed  # OpenRLHF's prompt order: rows grouped by prompt, n apart
            baseline = group_mean_baseline(ordered, n)[indices].split([len(e.index) for e in experiences])
            for e, d, b in zip(experiences, dense, baseline):
                shifted = d.scatter_add(1, last_token_index(e.action_mask)[:, None], -b[:, None].to(d.dtype))
                setattr(e.kl, DENSE_ATTR, shifted)
        # OpenRLHF copies ``rewards`` (the zero placeholder) into info["reward"]: keep the summed dense reward there
        summed_rewards = [e.info["reward"] for e in experiences]
        experiences = super().compute_advantages_and_returns(experiences)
        for e, reward in zip(experiences, summed_rewards):
            e.info["reward"] = reward
        return experiences

    def attach_dense_rewards(self, experiences, entropies: list[torch.Tensor] | None) -> None:
        """Replace each experience's ``[B, T]`` reward-model scores by dense rewards attached to its ``kl``
        (``rewards`` 0, ``info["reward"]`` their sum). ``bandit``: ``rewards`` becomes the score at the last response
        token; rewards given per sample (``[B]`` or ``[B, 1]``) are kept."""
        if not self.dense:  # the score at the last token (normalized at p = 1 if a normalizer is given)
            for exp in experiences:
                scores = exp.rewards
                if per_token(scores, exp.action_mask):
                    mask = exp.action_mask.bool()
                    bandit = dense_segment_rewards(scores[:, -mask.shape[1] :], mask, normalizer=self.normalizer,
                                                   granularity=Granularity.BANDIT)  # fmt: skip
                    scores = bandit.sequence_reward
                exp.rewards = scores.float()
                exp.info["reward"] = exp.rewards
            return
        needs_entropy = Granularity(self.ext["granularity"]).needs_entropy
        if needs_entropy and entropies is None:
            raise ValueError(
                "segment rewards need the reference model's entropies: enable the reference model "
                "(--algo.kl.init_coef > 0) and run with rlhf_ext's segment PPO launcher"
            )
        for i, exp in enumerate(experiences):
            scores = exp.rewards
            if not per_token(scores, exp.action_mask):
                raise ValueError(
                    "the reward model returned one score per sample; segment rewards need the per-token scores of "
                    "SegmentRewardModelActor (precomputed rewards / --reward.remote_url only work with "
                    "--ext.granularity bandit)"
                )
            action_mask = exp.action_mask.bool()
            a = action_mask.shape[1]
            entropy = entropies[i] if needs_entropy else None
            knobs = {"entropy_cutoff": self.entropy_cutoff, "chunk_size": self.ext["chunk_size"], **self._dense_knobs()}
            dense = dense_segment_rewards(scores[:, -a:], action_mask, entropy, **knobs)
            setattr(exp.kl, DENSE_ATTR, dense.rewards)
            exp.rewards = torch.zeros(scores.shape[0], dtype=torch.float32)
            exp.info["reward"] = dense.sequence_reward
            exp.info["segments_per_response"] = dense.segments.counts.float()
            self._monitor_segmentation(exp, dense.segments.counts, action_mask, entropies[i] if entropies else None)

    def _monitor_segmentation(self, exp, counts: torch.Tensor, action_mask: torch.Tensor, entropy) -> None:
        """The reward-hacking monitor (:class:`SegmentationMonitor`): its rates in ``info`` (the batch's value for
        every sample, so OpenRLHF's mean logs it); a one-line warning the first time either passes 1.5x."""
        rates = segmentation_rates(counts, action_mask, entropy, self.entropy_cutoff)
        for name, value in self.monitor.values(rates).items():
            if math.isfinite(value):
                exp.info[name] = torch.full((counts.shape[0],), value, dtype=torch.float32)
        message = self.monitor.check(rates, self._batches)
        if message is not None:
            logging.getLogger("rlhf_ext").warning(message)


def reward_source(ext: dict[str, Any]):
    """The dense reward source of a run: ``--ext.reward_source``, or the reward server of ``--reward.remote_url``
    asked for spans (moved to ``ext["remote_url"]`` by the launcher), or None (a reward-model actor scores)."""
    if ext.get("reward_source"):
        from rlhf_ext.zoo.builtins import resolve_reward_source

        return resolve_reward_source(ext["reward_source"], step_separator=ext.get("step_separator") or "\n")
    if ext.get("remote_url"):
        from rlhf_ext.runtime.remote_reward import RemoteSegmentReward

        return RemoteSegmentReward(ext["remote_url"], spans=True)
    return None


def engines_without_maker_url(create):
    """``create_vllm_engines`` (or the HF drop-in) giving engines no reward URL if it is :data:`REWARDS_IN_MAKER`."""
    if hasattr(create, "_rlhf_ext_maker_url"):
        return create

    def create_engines(*args, remote_rm_url=None, **kwargs):
        if remote_rm_url == [REWARDS_IN_MAKER] or remote_rm_url == REWARDS_IN_MAKER:
            remote_rm_url = None
        return create(*args, remote_rm_url=remote_rm_url, **kwargs)

    create_engines._rlhf_ext_maker_url = True
    create_engines.__wrapped__ = create
    return create_engines


# ----------------------------------------------------------------------------------------------- installation
def install_in_process() -> None:
    """Patch this process's OpenRLHF modules (idempotent): experience maker, reward placement, Ray actor classes."""
    import openrlhf.trainer.ppo_trainer as ppo_trainer_module
    import openrlhf.trainer.ppo_utils.experience_maker as experience_maker_module
    import openrlhf.trainer.ray.launcher as launcher_module

    experience_maker_module.compute_reward = dense_aware_compute_reward
    experience_maker_module.RemoteExperienceMaker = SegmentExperienceMaker
    ppo_trainer_module.RemoteExperienceMaker = SegmentExperienceMaker
    launcher_module.ReferenceModelActor = SegmentReferenceModelActor
    launcher_module.RewardModelActor = SegmentRewardModelActor


if __name__ == "__main__":  # `python -m rlhf_ext.openrlhf.segment_ppo` used to exit 0 and do nothing
    raise SystemExit(
        "rlhf_ext.openrlhf.segment_ppo is a library module; run OpenRLHF's PPO with segment rewards as "
        "`python -m rlhf_ext.openrlhf.train_ppo_ray --help`"
    )
