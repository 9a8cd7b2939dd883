"""The pre-flight plan of a recipe (``rlhf-ext plan --config RECIPE [--cluster auto|NODESxGPUS]``), before any model
loads: the same check every launch of the recipe runs first. OpenRLHF PPO recipes:
:func:`rlhf_ext.pipelines.segment_ppo.plan_segment_ppo`. Segment reward-model and TRL recipes (one process per GPU):
every GPU holds every model of the job (:func:`_trl_role`). Model sizes come from each model's config
(:func:`size_of`); a reward model or critic that does not exist yet is sized as the SFT model it is trained from.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from rlhf_ext.runtime.resources import (
    Cluster,
    GPUGroup,
    ModelSize,
    ModelSizeUnknown,
    Plan,
    RoleMemory,
    activation_bytes,
    kv_bytes_per_token,
    model_size,
    size_or_fallback,
    training_state,
)


def size_of(spec: str) -> ModelSize:
    """:func:`~rlhf_ext.runtime.resources.model_size` that also knows ``builtin:`` models (built or not)."""
    from rlhf_ext.zoo.builtins import PREFIX, builtin_model_dir, is_builtin, toy_tokenizer

    if not is_builtin(spec):
        return model_size(spec)
    name = spec[len(PREFIX) :]
    built = builtin_model_dir(name)
    if (built / "config.json").exists():
        from transformers import AutoConfig

        return model_size(spec, config=AutoConfig.from_pretrained(built))
    if name.startswith("tiny"):
        from rlhf_ext.zoo.models import tiny_config

        return model_size(spec, config=tiny_config(toy_tokenizer()))
    raise ModelSizeUnknown(f"{spec} is not built yet: `rlhf-ext zoo build {name}`")


def local_cluster() -> Cluster:
    """The cluster of a TRL launch: ``WORLD_SIZE`` processes, ``LOCAL_WORLD_SIZE`` per node, one GPU each (a plain
    ``python`` run: this machine's first GPU, or the CPU)."""
    import torch

    if not torch.cuda.is_available():
        return Cluster((0,), None, "this machine")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30
    return Cluster((local,) * max(world // local, 1), memory, "this launch")


def deepspeed_stage(trl_args: dict[str, Any]) -> int | None:
    """The ZeRO stage of ``train.trl_args.deepspeed`` (a DeepSpeed config dict or file), or None (DDP)."""
    config = trl_args.get("deepspeed")
    if config is None:
        return None
    if isinstance(config, str):
        with open(config) as f:
            config = json.load(f)
    return int(config.get("zero_optimization", {}).get("stage", 0))


# -------------------------------------------------------------------------------------------------------- TRL jobs
def _trl_role(
    role: str,
    size: ModelSize | None,
    cluster: Cluster,
    zero: int | None,
    *,
    trainable: bool,
    lm_head: bool,
    tokens: int,
    checkpointing: bool,
) -> RoleMemory:
    """One model of a TRL job on each GPU. TRL loads models in fp32; the trained policy is DeepSpeed's (bf16 ZeRO
    shards) when ``zero`` is set, else fp32 under DDP; the frozen models and the PPO critic are prepared by accelerate
    without DeepSpeed (a full fp32 copy on every GPU)."""
    world = max(cluster.total_gpus, 1)
    deepspeed = zero is not None and trainable and role == "policy"
    setup = f"ZeRO-{zero} x{world}" if deepspeed else ("fp32 DDP" if trainable else "fp32 frozen")
    out = RoleMemory(role, setup + (", grad ckpt" if trainable and checkpointing else ""), size)
    if size is None:
        out.note = "size unknown"
        return out
    params = size.params if lm_head else size.value_model_params
    out.params = params
    if deepspeed:
        out.weights, out.grads, out.optimizer = training_state(params, zero, world)
    elif trainable:
        out.weights, out.grads, out.optimizer = training_state(params, 0, 1, mixed_precision=False)
    else:
        out.weights = 4.0 * params
    out.activations = activation_bytes(size, tokens, trainable, checkpointing, lm_head)
    out.note = size.assumed
    return out


def trl_plan(title: str, cluster: Cluster, roles: list[RoleMemory], fix: str) -> Plan:
    """Every GPU of a TRL job holds every model (one process per GPU); the plan's memory check adds ``fix``."""
    plan = Plan(title, cluster, roles=roles)
    n = max(cluster.total_gpus, 1)
    known = all(r.size is not None for r in roles)
    static = sum(r.static for r in roles)
    peak = static + max((r.activations for r in roles), default=0.0)
    label = f"{n} x GPU (every model on each)" if cluster.total_gpus else "the CPU process"
    plan.gpus = [GPUGroup(label, n, [r.role for r in roles], static if known else None, peak if known else None)]
    plan.check_memory()
    plan.problems = [f"{p}; {fix}" for p in plan.problems]
    return plan


def trl_segment_ppo_plan(recipe, cluster: Cluster) -> Plan:
    """Policy, reference, reward model and (GAE) critic of ``DensePPOTrainer`` on every GPU (paper 003's PPO)."""
    t, data = recipe.train, recipe.data
    zero = deepspeed_stage(t.trl_args)
    policy = size_or_fallback(size_of, recipe.model.sft_model, None)
    reward = size_or_fallback(size_of, recipe.model.reward_model, policy)
    tokens = t.micro_batch_size * (data.max_prompt_length + data.max_completion_length)
    ckpt = t.gradient_checkpointing
    role = functools.partial(_trl_role, cluster=cluster, zero=zero, tokens=tokens, checkpointing=ckpt)
    roles = [
        role("policy", policy, trainable=True, lm_head=True),
        role("ref", policy, trainable=False, lm_head=True),
        role("reward", reward, trainable=False, lm_head=False),
    ]
    if recipe.ppo.advantage_estimator == "gae":
        fallback = reward or policy  # a reward source's run: the critic starts from the policy
        critic = size_or_fallback(size_of, recipe.model.critic_model, fallback) if recipe.model.critic_model else None
        roles.append(role("critic", critic or fallback, trainable=True, lm_head=False))
    if policy is not None:  # HF generate's KV cache of one micro batch of rollouts (fp32 model)
        kv = 2 * kv_bytes_per_token(policy) * tokens
        roles[0].activations = max(roles[0].activations, kv)
    fix = (
        "the TRL engine's GAE critic is trained without ZeRO (fp32 weights, gradients and Adam on every GPU): use "
        "engine: openrlhf (its critic is sharded by DeepSpeed; `rlhf-ext plan --config segment_ppo_paper`), or "
        "ppo.advantage_estimator: reinforce with DeepSpeed ZeRO-3 (train.trl_args: {deepspeed: <config with "
        "zero_optimization.stage 3>}), or a smaller model"
        if recipe.ppo.advantage_estimator == "gae"
        else "shard the policy with DeepSpeed ZeRO-3 (train.trl_args: {deepspeed: <config with "
        "zero_optimization.stage 3>}) or use a smaller model"
    )
    return trl_plan(f"segment PPO (TRL, {recipe.model.sft_model})", cluster, roles, fix)


def segment_rm_plan(recipe, cluster: Cluster) -> Plan:
    """The reward model of a :class:`~rlhf_ext.pipelines.segment_rm.SegmentRMRecipe` on every GPU: OpenRLHF's
    ``train_rm`` under DeepSpeed (bf16, ``train.zero_stage`` over every GPU) or TRL's ``RewardTrainer`` (fp32 DDP, or
    ``train.trl_args.deepspeed``). A micro batch holds chosen and rejected: ``2 * micro_batch_size`` sequences (the
    SFT model that segments the data runs once, before training)."""
    t = recipe.train
    size = size_or_fallback(size_of, recipe.model.sft_model, None)
    tokens = 2 * t.micro_batch_size * recipe.data.max_length
    ckpt = t.gradient_checkpointing
    world = max(cluster.total_gpus, 1)
    if recipe.engine == "openrlhf":
        zero = int(t.openrlhf_args.get("ds.zero_stage", t.zero_stage))
        role = RoleMemory("reward", f"ZeRO-{zero} x{world}" + (", grad ckpt" if ckpt else ""), size)
        if size is not None:
            role.params = size.value_model_params
            offload = bool(t.openrlhf_args.get("ds.adam_offload"))
            state = training_state(role.params, zero, world, offload_optimizer=offload)
            role.weights, role.grads, role.optimizer = state
            role.activations = activation_bytes(size, tokens, True, ckpt, lm_head=False)
        title = f"segment reward model (OpenRLHF train_rm, {recipe.model.sft_model})"
    else:
        role = _trl_role("policy", size, cluster, deepspeed_stage(t.trl_args), trainable=True, lm_head=False,
                         tokens=tokens, checkpointing=ckpt)  # fmt: skip
        role.role = "reward"
        title = f"segment reward model (TRL, {recipe.model.sft_model})"
    fix = "use DeepSpeed ZeRO-3 (train.zero_stage: 3 on OpenRLHF, train.trl_args.deepspeed on TRL) or more GPUs"
    return trl_plan(title, cluster, [role], fix)
