"""The pre-flight plan of an OpenRLHF 0.11.2 Ray PPO run: where ``train_ppo_ray`` will place every role, whether the
cluster can hold it, and what each GPU will carry — from the arguments *after* OpenRLHF's own fix-ups, before Ray
places anything.

:func:`placement_groups` follows ``openrlhf/cli/train_ppo_ray.py::train`` step by step, :func:`simulate` places the
groups as Ray's PACK strategy would (a group that does not fit waits forever), :func:`plan_run` adds the per-GPU memory
of every role (:mod:`rlhf_ext.runtime.resources`) and the fixes, :func:`detect_cluster` reads the cluster a run gets.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlhf_ext.runtime.resources import (
    Cluster,
    GiB,
    GPUGroup,
    ModelSize,
    Plan,
    RoleMemory,
    activation_bytes,
    kv_bytes_per_token,
    model_size,
    size_or_fallback,
    training_state,
)

logger = logging.getLogger(__name__)

SizeLookup = Callable[[str], ModelSize]


@dataclass
class Group:
    """One of ``train_ppo_ray``'s placement requests: ``bundles`` one-GPU bundles (a PACK placement group) or, when
    not ``packed``, that many loose one-GPU actors. ``members``: role -> ranks (rank ``r`` on bundle ``r``)."""

    bundles: int
    members: dict[str, int] = field(default_factory=dict)
    packed: bool = True
    nodes: list[int] = field(default_factory=list)  # node of each bundle, after :func:`simulate`

    @property
    def name(self) -> str:
        return "+".join(self.members) or "shared"


def _world(role: Any) -> int:
    return role.num_nodes * role.num_gpus_per_node


def placement_groups(args: Any) -> tuple[list[Group], list[str]]:
    """The placement requests of ``train_ppo_ray.train(args)``, in its order, and the layout errors OpenRLHF would
    raise (an assertion or a bundle index out of range) after Ray started."""
    a, train, vllm = args.actor, args.train, args.vllm
    kl = args.algo.kl.init_coef > 0
    groups: list[Group] = []
    problems: list[str] = []

    def same_shape(x: Any, y: Any, names: str, flag: str) -> None:
        if (x.num_nodes, x.num_gpus_per_node) != (y.num_nodes, y.num_gpus_per_node):
            problems.append(
                f"{flag} needs the same --{names.replace('+', '/--')}.num_nodes and .num_gpus_per_node (OpenRLHF "
                f"asserts it): got {x.num_nodes}x{x.num_gpus_per_node} and {y.num_nodes}x{y.num_gpus_per_node}"
            )

    def place(role: str, role_args: Any, pg: Group | None) -> None:
        n = _world(role_args)
        if pg is not None:
            if n > pg.bundles:
                problems.append(
                    f"the {role} has {n} ranks but the placement group it is colocated into has {pg.bundles} GPUs "
                    f"(Ray: bundle index out of range): set --{role}.num_nodes/num_gpus_per_node like the actor's"
                )
            pg.members[role] = n
        else:
            groups.append(Group(n, {role: n}, packed=role_args.num_gpus_per_node > 1))

    shared = None
    if train.colocate_actor_ref or train.colocate_all:
        if kl:
            same_shape(a, args.ref, "actor+ref", "--train.colocate_actor_ref/--train.colocate_all")
        shared = Group(_world(a))
        groups.append(shared)
    engines, tp = vllm.num_engines or 0, vllm.tensor_parallel_size
    if engines > 0:
        if train.colocate_all and not train.async_enable:
            if _world(a) != engines * tp:
                problems.append(
                    f"--train.colocate_all puts the vLLM engines on the actor's GPUs, so --vllm.num_engines x "
                    f"--vllm.tensor_parallel_size ({engines} x {tp}) must equal the actor's GPUs ({_world(a)}); "
                    "OpenRLHF asserts it after Ray starts"
                )
            shared.members["vllm"] = engines * tp
        else:
            groups.append(Group(engines * tp, {"vllm": engines * tp}))
    place("actor", a, shared)
    if kl:
        place("ref", args.ref, shared)
    pg = shared if train.colocate_all else None
    critic = bool(args.critic.model_name_or_path)
    if critic and train.colocate_critic_reward:
        same_shape(args.critic, args.reward, "critic+reward", "--train.colocate_critic_reward")
        pg = Group(_world(args.critic))
        groups.append(pg)
    if critic:
        place("critic", args.critic, pg)
    if not args.reward.remote_url:
        place("reward", args.reward, pg)
    return groups, problems


def simulate(groups: list[Group], cluster: Cluster) -> str | None:
    """Place ``groups`` on the cluster's nodes in order (Ray PACK: one node if one has room, else the emptiest nodes
    first; loose actors on the emptiest node). Returns the first group that cannot be placed, as text, or None."""
    free = list(cluster.gpus)
    for g in groups:
        if sum(free) < g.bundles:
            return f"{g.name} ({g.bundles} GPUs)"
        fits = [i for i, f in enumerate(free) if f >= g.bundles]
        for _ in range(g.bundles):
            if g.packed and fits:
                node = min(fits, key=lambda i: (free[i], i))  # the tightest node that holds the whole group
            else:
                node = max(range(len(free)), key=lambda i: (free[i], -i))
            free[node] -= 1
            g.nodes.append(node)
    return None


# ---------------------------------------------------------------------------------------------------------- memory
def _tokens(args: Any, train: bool) -> int:
    """Tokens in one micro batch on one GPU (split by ring attention)."""
    if args.train.dynamic_batch_enable:
        tokens = args.train.max_tokens_per_gpu if train else (args.rollout.max_tokens_per_gpu or 0)
    else:
        micro = args.train.micro_batch_size if train else args.rollout.micro_batch_size
        tokens = micro * args.data.max_len
    return max(tokens // max(args.ds.ring_attn_size, 1), 1)


def role_memory(role: str, args: Any, size: ModelSize | None, cluster: Cluster) -> RoleMemory:
    """Bytes per GPU of one role of the run (see :mod:`rlhf_ext.runtime.resources` for the formulas)."""
    ds = args.ds
    ckpt = bool(args.actor.gradient_checkpointing_enable)
    if role == "vllm":
        util = args.vllm.gpu_memory_utilization
        tp = args.vllm.tensor_parallel_size
        out = RoleMemory("vllm", f"{args.vllm.num_engines} engines, tp {tp}, util {util:g}", size)
        if size is None:
            return out
        out.params = size.params
        weights = 2.0 * size.params / tp
        if cluster.gpu_memory_gib and cluster.total_gpus:
            out.vllm = util * cluster.gpu_memory_gib * GiB
            kv_tokens = (out.vllm - weights) / kv_bytes_per_token(size, tp)
            out.note = f"weights {weights / GiB:.1f} GiB, KV cache ~{max(kv_tokens, 0) / 1e3:.0f}k tokens"
        else:
            out.vllm = weights
            out.note = "weights only: GPU memory unknown"
        return out
    role_args = getattr(args, role)
    world = _world(role_args) // max(ds.tensor_parallel_size, 1)
    trainable = role in ("actor", "critic")
    lm_head = role in ("actor", "ref")
    zero = ds.zero_stage
    setup = f"ZeRO-{zero} x{world}" if trainable or zero == 3 else "bf16 frozen"
    out = RoleMemory(role, setup + (", grad ckpt" if trainable and ckpt else ""), size)
    if size is None:
        out.note = "size unknown"
        return out
    params = size.params if lm_head else size.value_model_params
    out.params = params
    bytes_per_param = 0.5 if ds.load_in_4bit else 2.0
    if trainable and ds.lora.rank == 0:
        w, g, o = training_state(params, zero, world, offload_optimizer=ds.adam_offload)
        out.weights, out.grads, out.optimizer = w * bytes_per_param / 2.0, g, o
    else:
        out.weights = bytes_per_param * params / (world if zero == 3 else 1)
        if trainable:
            out.note = "LoRA: adapter states not counted"
    if getattr(role_args, "offload", False):
        out.weights, out.note = 0.0, "weights offloaded to CPU (--" + role + ".offload)"
    infer = activation_bytes(size, _tokens(args, train=False), training=False, checkpointing=ckpt, lm_head=lm_head)
    out.activations = infer
    if trainable:
        step = activation_bytes(size, _tokens(args, train=True), training=True, checkpointing=ckpt, lm_head=lm_head)
        out.activations = max(infer, step)
    return out


def _gpu_groups(groups: list[Group], roles: dict[str, RoleMemory], args: Any) -> list[GPUGroup]:
    """GPUs holding the same set of roles, with their exact (``static``) and estimated (``peak``) bytes; a GPU shared
    with vLLM peaks in generation or in training (each without what ``--ds/--vllm.enable_sleep`` puts to sleep)."""
    kinds = Counter(tuple(r for r, ranks in g.members.items() if b < ranks) for g in groups for b in range(g.bundles))
    out = []
    for members, count in kinds.items():
        mems = [roles[r] for r in members if r in roles]
        known = all(m.size is not None for m in mems)
        ds_static = sum(m.static for m in mems if m.role != "vllm")
        act = max((m.activations for m in mems), default=0.0)
        vllm = next((m.static for m in mems if m.role == "vllm"), 0.0)
        if vllm and len(members) > 1:
            gen = vllm + (0.0 if args.ds.enable_sleep else ds_static)
            awake = 0.0 if args.vllm.enable_sleep else vllm
            static, peak = max(gen, ds_static + awake), max(gen, ds_static + awake + act)
        else:
            static, peak = ds_static + vllm, ds_static + vllm + act
        label = f"{count} x GPU with {'+'.join(members)}"
        out.append(GPUGroup(label, count, list(members), static if known else None, peak if known else None))
    return out


def plan_run(args: Any, cluster: Cluster, lookup: SizeLookup = model_size, title: str = "train_ppo_ray") -> Plan:
    """The plan of ``train_ppo_ray`` with ``args`` (after OpenRLHF's fix-ups) on ``cluster``."""
    plan = Plan(title, cluster)
    groups, plan.problems = placement_groups(args)
    need = sum(g.bundles for g in groups)
    hf = getattr(getattr(args, "ext", None), "rollout_engine", "vllm") == "hf"
    engines = args.vllm.num_engines or 0
    if cluster.total_gpus == 0:  # a CPU run starts its own Ray with exactly the logical GPUs the run asks for
        plan.cluster = cluster = Cluster((need,), None, "CPU only: Ray started with logical GPUs", logical=True)
    if hf:  # the HF engines take the placement vLLM's would (rlhf_ext.openrlhf.rollout), computing on the CPU
        for g in groups:
            g.members = {("hf-gen" if r == "vllm" else r): n for r, n in g.members.items()}
    if engines:
        hybrid = args.train.colocate_all and not args.train.async_enable
        where = "the actor's GPUs (hybrid)" if hybrid else "GPUs of their own"
        kind = "HF generate engines (CPU, --ext.rollout_engine hf)" if hf else "vLLM engines"
        plan.lines.append(f"rollouts: {engines} {kind} x tp {args.vllm.tensor_parallel_size} on {where}")
        if not hf and cluster.logical:
            plan.problems.append(
                "vLLM needs real GPUs and this cluster's are logical (no accelerator type): use --ext.rollout_engine hf"
            )
    if args.ds.ring_attn_size > 1 and hf:
        plan.problems.append(
            f"--ds.ring_attn_size {args.ds.ring_attn_size} needs ring-flash-attn on CUDA GPUs; without them use "
            "--ds.ring_attn_size 1 (--ds.packing_samples alone runs on CPU)"
        )
    unplaced = simulate(groups, cluster)
    asks = ", ".join(f"{g.name} {g.bundles}" for g in groups)
    plan.lines.append(f"placement (Ray PACK, simulated): {asks} = {need} GPU bundles of {cluster.total_gpus}")
    for node in range(cluster.num_nodes):
        on_node = [f"{g.name} {g.nodes.count(node)}" for g in groups if node in g.nodes]
        gpus = cluster.gpus[node]
        plan.lines.append(f"  node {node} ({gpus} GPU{'s' if gpus != 1 else ''}): {', '.join(on_node) or '-'}")
    if unplaced:
        cause = "colocate the models (--train.colocate_all) or lower --*.num_gpus_per_node / --vllm.num_engines"
        if args.train.colocate_all and args.train.async_enable and engines:
            half = max(cluster.gpus_per_node // 2, 1)
            cause = (
                f"with --train.async_enable, --train.colocate_all colocates only the DeepSpeed models (OpenRLHF "
                f"0.11.2): the {engines} vLLM engines get {engines * args.vllm.tensor_parallel_size} GPUs of their "
                f"own; give vLLM GPUs of its own, e.g. --vllm.num_engines {half * cluster.num_nodes} with "
                f"--actor/--ref/--critic/--reward.num_gpus_per_node {half} (rlhf-ext's recipes do this), or drop "
                "--train.async_enable"
            )
        plan.problems.insert(
            0,
            f"OpenRLHF would wait forever for {unplaced}: the run asks for {need} GPUs ({asks}) and the cluster has "
            f"{cluster.total_gpus}; {cause}",
        )

    lookup = functools.cache(lookup)  # the reference is the actor's model, the critic usually the reward model's
    policy = size_or_fallback(lookup, args.actor.model_name_or_path, None)
    sizes = dict.fromkeys(("actor", "ref", "vllm"), policy)
    for r in ("reward", "critic"):
        sizes[r] = size_or_fallback(lookup, getattr(args, r).model_name_or_path, policy)
    members = [r for r in ("actor", "ref", "critic", "reward", "vllm") if any(r in g.members for g in groups)]
    roles = {r: role_memory(r, args, sizes[r], cluster) for r in members if not (r == "vllm" and hf)}
    for r in roles.values():
        if r.size is not None and r.size.assumed and not r.note:
            r.note = r.size.assumed
    plan.roles = list(roles.values())
    plan.gpus = _gpu_groups(groups, roles, args)
    vllm = roles.get("vllm")
    if vllm is not None and vllm.size is not None and cluster.gpu_memory_gib:
        tp = args.vllm.tensor_parallel_size
        needed = 2.0 * vllm.size.params / tp + args.data.max_len * kv_bytes_per_token(vllm.size, tp)
        if vllm.vllm < needed:
            plan.problems.append(
                f"vLLM's share ({args.vllm.gpu_memory_utilization:g} x {cluster.gpu_memory_gib:g} GiB) cannot hold "
                f"the weights and one {args.data.max_len}-token sequence ({needed / GiB:.1f} GiB): raise "
                "--vllm.gpu_memory_utilization or --vllm.tensor_parallel_size"
            )
    if cluster.total_gpus and not cluster.gpu_memory_gib:
        plan.lines.append("memory: not checked (GPU memory unknown)")
    plan.check_memory()
    return plan


# --------------------------------------------------------------------------------------------------------- cluster
def ray_address() -> str | None:
    """The cluster ``ray.init()`` would connect to (``RAY_ADDRESS``, or a cluster ``ray start`` recorded), else None."""
    from ray._private.services import canonicalize_bootstrap_address

    try:
        return canonicalize_bootstrap_address(None)
    except (ConnectionError, ValueError):
        return None


def _gpu_memory_gib() -> float | None:
    """Total memory of GPU 0 of the node this runs on, by NVML (sees every GPU whatever CUDA_VISIBLE_DEVICES)."""
    try:
        import ray._private.thirdparty.pynvml as nvml

        nvml.nvmlInit()
        try:
            return nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0)).total / GiB
        finally:
            nvml.nvmlShutdown()
    except Exception:  # no NVIDIA driver: logical GPUs
        return None


def cluster_from_ray_nodes(nodes: list[dict[str, Any]], gpu_memory_gib: float | None) -> Cluster:
    """The cluster described by ``ray.nodes()``: alive nodes' GPUs; logical when no node reports an accelerator
    type (``ray start --num-gpus N`` on machines without NVIDIA GPUs)."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive", True))]
    gpus = tuple(sorted((int(n.get("Resources", {}).get("GPU", 0)) for n in alive), reverse=True))
    real = any(k.startswith("accelerator_type:") for n in alive for k in n.get("Resources", {}))
    source = "Ray cluster" if real or not any(gpus) else "Ray cluster, logical GPUs"
    return Cluster(gpus or (0,), gpu_memory_gib if real else None, source, logical=not real and any(gpus))


def detect_cluster() -> Cluster:
    """The cluster a run gets: the Ray cluster it connects to (``RAY_ADDRESS`` or ``ray start``; its nodes' GPUs and,
    by NVML on one GPU node, their memory, connecting briefly), else this machine's GPUs."""
    address = ray_address()
    if address is None:
        import torch

        gpus = torch.cuda.device_count()
        memory = torch.cuda.get_device_properties(0).total_memory / GiB if gpus else None
        return Cluster((gpus,), memory, "this machine, no Ray cluster")
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        nodes = ray.nodes()
        memory = None
        gpu_nodes = [
            n for n in nodes if n.get("Alive") and any(k.startswith("accelerator_type:") for k in n["Resources"])
        ]
        if gpu_nodes:
            probe = ray.remote(num_cpus=0)(_gpu_memory_gib)
            strategy = NodeAffinitySchedulingStrategy(gpu_nodes[0]["NodeID"], soft=False)
            memory = ray.get(probe.options(scheduling_strategy=strategy).remote(), timeout=120)
        return cluster_from_ray_nodes(nodes, memory)
    finally:
        ray.shutdown()
