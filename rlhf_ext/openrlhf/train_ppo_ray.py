"""``python -m rlhf_ext.openrlhf.train_ppo_ray``: OpenRLHF 0.11.2's own ``openrlhf.cli.train_ppo_ray`` with rlhf-ext's
methods installed in the driver and in every Ray worker.

It takes every flag of OpenRLHF's CLI unchanged plus ``--ext.*``::

    ray job submit --address http://HEAD:8265 -- python -m rlhf_ext.openrlhf.train_ppo_ray \\
        --actor.model_name_or_path SFT --reward.model_name_or_path SEGMENT_RM --data.prompt_dataset prompts.jsonl \\
        ...any OpenRLHF flag... \\
        --ext.granularity segment --ext.normalizer normalizer.json          # paper 003 (dense segment rewards)
        --ext.continual_previous_model PREV --ext.continual_kl_coef 1.0      # paper 000 Eq. 7 (CPPO-style KL)
        --train.async_enable --train.async_queue_size 1                      # paper 001 (OpenRLHF's own flag)

``--ext`` flags (:data:`EXT_DEFAULTS`): segment rewards (unset ``entropy_cutoff`` / ``aggregation`` / ``tau``: the
reward model's ``segment_config.json``), continual RLHF (any ``continual_*`` flag makes the policy actor
:class:`~rlhf_ext.openrlhf.continual_actor.ContinualPolicyModelActor`), ``rollout_engine``, dense reward sources.

Before Ray places anything, :func:`preflight` refuses what OpenRLHF would silently ignore (:func:`check_args`) and
prints the placement and memory plan of :mod:`rlhf_ext.openrlhf.plan`, refusing a run that cannot be placed or fit.
Without GPUs (``hf`` engine) Ray starts with the *logical* GPUs the plan counts (bookkeeping only; on an existing
cluster ``ray start --head --num-gpus N``), with gloo, ``sdpa`` and the CPU patches of :mod:`rlhf_ext.openrlhf.compat`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from rlhf_ext.algos.continual_kl import ContinualKnobs
from rlhf_ext.algos.knobs import knob_specs
from rlhf_ext.algos.names import knob_defaults
from rlhf_ext.algos.ppo import ESTIMATORS
from rlhf_ext.algos.segment_dense import DenseRewardKnobs, Granularity, resolve_granularity
from rlhf_ext.algos.segment_reward import SegmentRewardKnobs
from rlhf_ext.algos.spans import SPAN_GRANULARITIES
from rlhf_ext.openrlhf.cli_runner import (
    ExtArgsError,
    exit_with_error,
    ext_argument_parser,
    flag_value,
    parsed_args,
    run_cli_module,
    split_ext_args,
)
from rlhf_ext.openrlhf.plan import SizeLookup, detect_cluster, plan_run, ray_address
from rlhf_ext.runtime.resources import Cluster, Plan, PlanError, model_size

logger = logging.getLogger("rlhf_ext.openrlhf.train_ppo_ray")  # by name: `python -m` runs it as __main__

#: ``--ext.*`` flags and their defaults (``None``: the reward model's recorded setting / unset).
EXT_DEFAULTS: dict[str, Any] = {
    # paper 003's dense rewards (DenseRewardKnobs; the normalizer comes fitted, as --ext.normalizer FILE)
    **{k: v for k, v in knob_defaults(DenseRewardKnobs).items() if not k.startswith("normalizer_")},
    # paper 003's segmentation (SegmentRewardKnobs); None = the reward model's recorded setting
    **dict.fromkeys(knob_defaults(SegmentRewardKnobs)),
    "normalizer": None,
    "reward_model_id": None,
    "reward_source": None,
    "step_separator": "\n",
    "rollout_engine": "auto",
    # paper 000 (ContinualActorSettings); None = not given: the continual actor is used only when one of them is given
    **dict.fromkeys([*knob_defaults(ContinualKnobs), "continual_previous_model", "continual_retention"]),
}
#: ``--ext.*`` flags that were renamed: an old flag is refused with the new name.
RENAMED_EXT_FLAGS: dict[str, str] = {
    "continual.previous_model": "continual_previous_model",
    "continual.kl_coef": "continual_kl_coef",
    "continual.estimator": "continual_kl_estimator",
    "continual.retention": "continual_retention",
}
#: The declared ranges of the numeric ``--ext.*`` flags (the knob dataclasses' fields).
EXT_SPECS = {**knob_specs(DenseRewardKnobs), **knob_specs(SegmentRewardKnobs), **knob_specs(ContinualKnobs)}
ROLLOUT_ENGINES = ("auto", "vllm", "hf")
#: Help and choices of the ``--ext.*`` flags that are no knob field.
EXT_EXTRA_HELP: dict[str, tuple[str, tuple | None]] = {
    "normalizer": ("A fitted location-aware normalizer file (paper 003 Eq. 6), e.g. runs/ppo/normalizer.json", None),
    "reward_model_id": ("The reward model the normalizer must have been fitted on (checked)", None),
    "rollout_engine": ("vllm (OpenRLHF's), hf (CPU) or auto: vllm when the cluster has GPUs", ROLLOUT_ENGINES),
    "continual_previous_model": ("The previous task's policy (paper 000 Eq. 7's pi_{t-1})", None),
    "continual_retention": ("kl: paper 000 Eq. 7; cppo: also CPPO's sample-wise weights", ("kl", "cppo")),
    "reward_source": (
        "A dense reward source instead of --reward.model_name_or_path: module:function, file.py:function, rules:FILE, "
        "prm:MODEL or segment-rm:DIR",
        None,
    ),
    "step_separator": ("prm: the text that ends a step (the process reward model is read there)", None),
}
PROG = "python -m rlhf_ext.openrlhf.train_ppo_ray"
HELP_DESCRIPTION = """OpenRLHF 0.11.2's own openrlhf.cli.train_ppo_ray with rlhf-ext's methods installed in the driver
and in every Ray worker: every OpenRLHF flag unchanged, plus the --ext.* flags below.

  paper 003 (dense segment rewards):  --ext.granularity segment --ext.normalizer runs/ppo/normalizer.json
  paper 000 (continual RLHF):         --ext.continual_previous_model PREV --ext.continual_kl_coef 1.0
  paper 001 (one-step async):         --train.async_enable --train.async_queue_size 1 (OpenRLHF's own flags)

On a machine without GPUs (the HF rollout engine) every role needs a logical GPU and DeepSpeed bf16:
  --actor.num_gpus_per_node 1 --ref.num_gpus_per_node 1 --reward.num_gpus_per_node 1
  --critic.num_gpus_per_node 1 --ds.param_dtype bf16
Before Ray starts, the run's placement and memory plan is printed and a run that cannot be placed is refused."""


#: The fix for an assertion of OpenRLHF's argument checks, where its message names none.
OPENRLHF_ASSERTION_FIXES = {
    "The number of sample batches must be greater than or equal to the effective number of actor processes.": (
        " (--rollout.batch_size x --rollout.n_samples_per_prompt / --rollout.micro_batch_size must be at least the "
        "actor's GPUs: lower --rollout.micro_batch_size or raise --rollout.batch_size)"
    ),
}
WORKER_ENV = "RLHF_EXT_OPENRLHF_WORKER"


def validate_ext(ext: dict[str, Any]) -> dict[str, Any]:
    """Check every ``--ext.*`` value in the driver, before Ray starts (the normalizer file and the previous task's
    model are loaded)."""
    from rlhf_ext.openrlhf.segment_ppo import validate_segment_ext

    ext = validate_segment_ext(ext)
    if any(ext[k] is not None for k in EXT_DEFAULTS if k.startswith("continual_")):
        from rlhf_ext.openrlhf.continual_actor import check_continual_ext

        check_continual_ext(ext)
    if ext["rollout_engine"] not in ROLLOUT_ENGINES:
        raise ExtArgsError(f"--ext.rollout_engine must be one of {', '.join(ROLLOUT_ENGINES)}")
    return ext


def parse_ext_args(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Split ``--ext.*`` flags off an OpenRLHF command line; returns (OpenRLHF argv, validated ext dict)."""
    return split_ext_args(argv, EXT_DEFAULTS, validate_ext, renamed=RENAMED_EXT_FLAGS, specs=EXT_SPECS)


def nest(ext: dict[str, Any]) -> SimpleNamespace:
    """``{"a": 1, "b.c": 2}`` -> ``namespace(a=1, b=namespace(c=2))``, by OpenRLHF's own hierarchiser."""
    from rlhf_ext.openrlhf.compat import import_shims

    with import_shims():
        from openrlhf.utils.config import hierarchize

    return getattr(hierarchize, "__wrapped__", hierarchize)(SimpleNamespace(**ext))


def resolve_rollout_engine(requested: str, cluster: Cluster) -> str:
    """``auto`` -> ``vllm`` when the cluster (not the driver's node) has real GPUs, ``hf`` otherwise (with a notice)."""
    if requested != "auto":
        return requested
    if cluster.total_gpus and not cluster.logical:
        return "vllm"
    why = "the cluster's GPUs are logical (no accelerator)" if cluster.total_gpus else "no GPUs in the cluster"
    logger.info("%s: rollouts use the HF generate engine (--ext.rollout_engine hf)", why)
    return "hf"


def check_args(args: Any) -> None:
    """Refuse settings the segment subclasses cannot honour (raises :class:`ExtArgsError`); ``args`` are OpenRLHF's
    after its fix-ups."""
    ext = args.ext
    dense = ext.granularity != "bandit"
    if not dense and args.reward.model_name_or_path:
        from rlhf_ext.runtime.segment_data import check_bandit_reward_model

        try:
            for path in args.reward.model_name_or_path.split(","):  # OpenRLHF takes a comma-separated list
                check_bandit_reward_model(ext.granularity, path, "--reward.model_name_or_path", "--ext.granularity")
        except ValueError as e:
            raise ExtArgsError(str(e)) from None
    estimator = args.algo.advantage.estimator
    if dense and estimator not in ESTIMATORS:
        raise ExtArgsError(
            f"--algo.advantage.estimator {estimator} shapes one scalar reward per sample; dense segment rewards "
            f"(--ext.granularity {ext.granularity}) need {' | '.join(ESTIMATORS)} (or --ext.granularity bandit)"
        )
    if dense:
        for name in ("normalize_enable", "stop_properly_penalty_coef", "overlong_buffer_len"):
            if getattr(args.reward, name) not in (None, False):
                raise ExtArgsError(
                    f"--reward.{name} acts on OpenRLHF's scalar reward, which dense segment rewards replace; drop "
                    "it (segment rewards are normalised by --ext.normalizer, paper 003 Eq. 6) or use "
                    "--ext.granularity bandit"
                )
        if args.train.agent_func_path:
            raise ExtArgsError(
                "--train.agent_func_path returns one score per sample; dense rewards need a reward model actor "
                "(--reward.model_name_or_path), --ext.reward_source, --reward.remote_url at `rlhf-ext serve rm`, or "
                "--ext.granularity bandit"
            )
        from rlhf_ext.openrlhf.segment_ppo import REWARDS_IN_MAKER

        urls = [u for u in args.reward.remote_url or [] if u != REWARDS_IN_MAKER]
        if len(urls) > 1:
            raise ExtArgsError("dense rewards from --reward.remote_url use one server; give one URL")
        if (ext.reward_source or urls) and ext.granularity not in SPAN_GRANULARITIES:
            raise ExtArgsError(
                f"--ext.granularity {ext.granularity} segments a reward model's token scores; rewards from "
                f"{'--ext.reward_source' if ext.reward_source else '--reward.remote_url'} come as spans: use "
                f"{' | '.join(SPAN_GRANULARITIES)}"
            )
        if ext.reward_source:
            from rlhf_ext.runtime.dense_sources import check_reward_source

            try:
                check_reward_source(ext.reward_source)
            except (ValueError, FileNotFoundError) as e:
                raise ExtArgsError(f"--ext.reward_source: {e}") from None
        needs_entropy = Granularity(ext.granularity).needs_entropy and not (ext.reward_source or urls)
        if args.algo.kl.init_coef <= 0 and needs_entropy:
            raise ExtArgsError(
                "segment rewards read entropies from the reference model: set --algo.kl.init_coef > 0 "
                "(or use --ext.granularity token/bandit)"
            )
    if ext.rollout_engine == "hf" and args.data.max_images_per_prompt > 0:
        raise ExtArgsError("the HF rollout engine generates text only; use --ext.rollout_engine vllm for images")


def worker_settings(ext: Any, methods: bool = True) -> dict[str, Any]:
    """What :func:`setup_worker` installs in each Ray worker (passed through an environment variable)."""
    return {
        "segment": methods,
        "continual": methods and any(getattr(ext, k) is not None for k in EXT_DEFAULTS if k.startswith("continual_")),
        "rollout_engine": ext.rollout_engine,
    }


def install(settings: dict[str, Any], driver: bool) -> None:
    """Install rlhf-ext's classes on OpenRLHF's modules in this process (idempotent)."""
    from rlhf_ext.openrlhf.compat import check_version, install_import_shims, patch_for_cpu

    if driver:
        check_version()
    else:  # Ray workers run only OpenRLHF code: placeholders for missing GPU packages may stay registered
        install_import_shims()
    patch_for_cpu(worker=not driver)
    from rlhf_ext.openrlhf import segment_ppo

    if settings.get("segment"):
        segment_ppo.install_in_process()
    if settings.get("continual"):
        from rlhf_ext.openrlhf.continual_actor import use_continual_actor

        use_continual_actor()
    if settings.get("rollout_engine") == "hf":
        from rlhf_ext.openrlhf import rollout

        rollout.install_in_process()
    if driver and settings.get("segment"):  # engines fetch no reward the experience maker computes
        import openrlhf.trainer.ray as ray_package

        ray_package.create_vllm_engines = segment_ppo.engines_without_maker_url(ray_package.create_vllm_engines)


def setup_worker() -> None:
    """``worker_process_setup_hook`` of every Ray worker the run starts."""
    install(json.loads(os.environ.get(WORKER_ENV, "{}")), driver=False)


def runtime_env(settings: dict[str, Any]) -> dict[str, Any]:
    """The job's runtime env: the worker hook that installs rlhf-ext in every Ray worker, and the driver's settings."""
    defaults = {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}
    env_vars = {WORKER_ENV: json.dumps(settings), **{k: os.environ.get(k, v) for k, v in defaults.items()}}
    passed = ("TORCHDYNAMO_DISABLE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "DS_BUILD_OPS")
    env_vars.update({name: os.environ[name] for name in passed if name in os.environ})
    return {"worker_process_setup_hook": "rlhf_ext.openrlhf.train_ppo_ray.setup_worker", "env_vars": env_vars}


def preflight(args: Any, cluster: Cluster, methods: bool = True, lookup: SizeLookup = model_size) -> Plan:
    """:func:`check_args`, then the placement and memory plan; the caller prints and refuses ``plan.problems``."""
    if methods:
        check_args(args)
    return plan_run(args, cluster, lookup)


def prepare(args: Any, ext: dict[str, Any], cluster: Cluster, methods: bool = True) -> Plan:
    """Right before OpenRLHF's ``train(args)``: attach ``args.ext``, run the pre-flight (raises :class:`PlanError` or
    :class:`ExtArgsError`), start Ray with the worker hook."""
    import ray

    attach_ext(args, ext)
    plan = preflight(args, cluster, methods)
    for line in plan.table().splitlines():
        logger.info(line)
    plan.refuse_if_unrunnable()
    if methods:
        route_rewards(args)
    if not ray.is_initialized():
        init: dict[str, Any] = {"runtime_env": runtime_env(worker_settings(args.ext, methods))}
        address = ray_address()
        if address is not None:
            init["address"] = address
        elif cluster.total_gpus == 0:  # logical GPUs: OpenRLHF's actors request them. Nothing runs on a GPU.
            # every bundle also reserves a (logical) CPU; the trainer and async queue actors need free ones
            need = plan.cluster.total_gpus
            init.update(address="local", num_gpus=need, num_cpus=need + (os.cpu_count() or 1))
            # Ray's workers run at niceness 15; here they do all of the run's work and starved beside busy processes
            os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(**init)
    return plan


def route_rewards(args: Any) -> None:
    """A dense granularity with ``--reward.remote_url`` asks that server for spans in the experience maker: the URL
    moves to ``args.ext.remote_url`` and ``--reward.remote_url`` becomes the marker ``REWARDS_IN_MAKER``."""
    from rlhf_ext.openrlhf.segment_ppo import REWARDS_IN_MAKER

    urls = [u for u in args.reward.remote_url or [] if u != REWARDS_IN_MAKER]
    if urls and args.ext.granularity != "bandit" and not args.train.agent_func_path:
        args.ext.remote_url = urls[0]
        args.reward.remote_url = [REWARDS_IN_MAKER]


def with_reward_source(rest: list[str], ext: dict[str, Any]) -> list[str]:
    """``--ext.reward_source`` replaces the reward model: refuse a second reward, mark the run as scored by the
    experience maker (before OpenRLHF's fix-ups, which then give the critic the actor's weights)."""
    if not ext.get("reward_source"):
        return rest
    for flag in ("--reward.model_name_or_path", "--reward.remote_url", "--train.agent_func_path"):
        if flag_value(rest, flag, None) is not None:
            raise ExtArgsError(f"--ext.reward_source and {flag} are two rewards; give one")
    from rlhf_ext.openrlhf.segment_ppo import REWARDS_IN_MAKER

    return [*rest, "--reward.remote_url", REWARDS_IN_MAKER]


def for_cluster(rest: list[str], ext: dict[str, Any], cluster: Cluster) -> tuple[list[str], dict[str, Any]]:
    """:func:`parse_ext_args`'s result with the rollout engine resolved for ``cluster`` (HF: one engine by default),
    the reward source routed and an unset granularity set to the source's default."""
    from rlhf_ext.runtime.dense_sources import absolute_source_spec

    rest = with_reward_source(rest, ext)
    spans = flag_value(rest, "--reward.remote_url", None) is not None  # a reward source or server answers in spans
    ext = {**ext, "rollout_engine": resolve_rollout_engine(ext["rollout_engine"], cluster),
           "reward_source": absolute_source_spec(ext.get("reward_source")),
           "granularity": resolve_granularity(ext["granularity"], spans)}  # fmt: skip
    if ext["rollout_engine"] == "hf" and flag_value(rest, "--vllm.num_engines", None) is None:
        rest = [*rest, "--vllm.num_engines", "1"]
    return rest, ext


def attach_ext(args: Any, ext: dict[str, Any]) -> None:
    """``args.ext`` for OpenRLHF's parsed arguments, and the settings the HF rollout engine needs without CUDA."""
    args.ext = nest(ext)
    if args.ext.rollout_engine != "hf":
        return
    changed = []
    if args.vllm.sync_backend != "gloo":
        args.vllm.sync_backend = "gloo"
        changed.append("--vllm.sync_backend gloo")
    if "flash" in str(args.ds.attn_implementation):
        args.ds.attn_implementation = "sdpa"
        changed.append("--ds.attn_implementation sdpa")
    if changed:
        logger.info("HF rollout engine: using %s", ", ".join(changed))


def plan_for_argv(argv: Sequence[str], cluster: Cluster, methods: bool = True, lookup: SizeLookup = model_size) -> Plan:
    """The pre-flight plan of ``python -m rlhf_ext.openrlhf.train_ppo_ray ARGV`` on ``cluster``, starting nothing.
    Raises :class:`ExtArgsError` or :class:`PlanError` (what OpenRLHF's own argument checks refuse)."""
    try:
        rest, ext = for_cluster(*parse_ext_args(argv), cluster)
    except ValueError as error:
        raise ExtArgsError(str(error)) from None
    try:
        args = parsed_args("openrlhf.cli.train_ppo_ray", rest)
    except AssertionError as error:
        raise PlanError(
            f"OpenRLHF refuses these arguments: {error}{OPENRLHF_ASSERTION_FIXES.get(str(error), '')}"
        ) from None
    attach_ext(args, ext)
    return preflight(args, cluster, methods, lookup)


def main(argv: Sequence[str] | None = None, methods: bool = True, cluster: Cluster | None = None) -> None:
    """Run OpenRLHF's ``train_ppo_ray`` CLI with ``--ext.*`` flags; a refused run exits with code 2 and one ``error:``
    line. ``methods=False`` installs only what a CPU needs (stock OpenRLHF PPO)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        knobs = (DenseRewardKnobs, SegmentRewardKnobs, ContinualKnobs)  # the --ext.* flags' types, choices, help
        print(ext_argument_parser(PROG, HELP_DESCRIPTION, knobs, EXT_DEFAULTS, EXT_EXTRA_HELP).format_help())
        print("OpenRLHF's flags (openrlhf.cli.train_ppo_ray --help):\n")
    try:
        rest, ext = parse_ext_args(argv)  # a bad --ext flag is refused before anything else
        with_reward_source(rest, ext)
    except ValueError as error:
        exit_with_error(error)
    cluster = cluster if cluster is not None else detect_cluster()
    rest, ext = for_cluster(rest, ext, cluster)
    install(worker_settings(nest(ext), methods), driver=True)  # before the CLI imports the classes it builds

    def before_train(args: Any) -> None:
        try:
            prepare(args, ext, cluster, methods)
        except (ExtArgsError, PlanError) as error:
            exit_with_error(error)

    run_cli_module("openrlhf.cli.train_ppo_ray", rest, before_train)


if __name__ == "__main__":
    from rlhf_ext.runtime.log import configure_cli_output

    configure_cli_output()
    main()
