"""``python -m rlhf_ext.openrlhf.train_ppo_ray``: OpenRLHF 0.11.2's own ``openrlhf.cli.train_ppo_ray`` with rlhf-ext's
methods installed in the driver and in every Ray worker.

It takes every flag of OpenRLHF's CLI unchanged plus ``--ext.*``::

    ray job submit --address http://HEAD:8265 -- python -m rlhf_ext.openrlhf.train_ppo_ray \\
        --actor.model_name_or_path SFT --reward.model_name_or_path SEGMENT_RM --data.prompt_dataset prompts.jsonl \\
        ...any OpenRLHF flag... \\
        --ext.granularity segment --ext.normalizer normalizer.json          # paper 003 (dense segment rewards)
        --ext.continual_previous_model PREV --ext.continual_kl_coef 1.0      # paper 000 Eq. 7 (CPPO-style KL)
        --train.async_enable --train.async_queue_size 1                      # paper 001 (OpenRLHF's own flag)

``--ext`` flags (:data:`EXT_DEFAULTS`):

* segment rewards — ``granularity`` (``segment`` | ``token`` | ``bandit`` | ``bandit_as_segment`` |
  ``segment_as_bandit``), ``interpolation``, ``entropy_cutoff`` / ``aggregation`` / ``tau`` (default: the reward
  model's ``segment_config.json``), ``normalizer`` (a fitted :class:`~rlhf_ext.segment.LocationNormalizer` file),
  ``reward_model_id``. ``bandit`` runs the same subclasses with the scalar reward at the last token: identical to
  stock OpenRLHF (tested), which makes it the control arm of paper 003's Table 1.
* continual RLHF — ``continual_previous_model``, ``continual_kl_coef``, ``continual_kl_estimator``,
  ``continual_retention`` (:class:`~rlhf_ext.openrlhf.continual_actor.ContinualActorSettings`); the policy actor
  becomes :class:`~rlhf_ext.openrlhf.continual_actor.ContinualPolicyModelActor` when any ``continual_*`` flag is
  given (the first task of a sequence has no ``previous_model``: its KL term is 0 and logged as ``prev_task_kl``).
* ``rollout_engine`` — ``vllm`` (OpenRLHF's), ``hf`` (:mod:`rlhf_ext.openrlhf.rollout`, CPU) or ``auto`` (vLLM when
  CUDA is available, else HF with a one-line notice).

Running on a machine without GPUs (``hf`` engine, :func:`cpu_settings`): OpenRLHF's actors and placement groups ask
Ray for GPUs, so the driver starts Ray with *logical* GPU resources — bookkeeping only, every actor computes on
the CPU; on an existing cluster (``ray job submit``, ``RAY_ADDRESS``) start it with ``ray start --head --num-gpus N``.
DeepSpeed runs with gloo, attention with ``sdpa``, and OpenRLHF's ``torch.cuda.current_device()`` call sites get
the CPU (:func:`rlhf_ext.openrlhf.compat.patch_for_cpu`).

Settings OpenRLHF would silently ignore with dense rewards (``--reward.normalize_enable``,
``--reward.stop_properly_penalty_coef``, ``--reward.overlong_buffer_len``), group estimators other than the ones
defined on dense rewards, and ``--ds.packing_samples`` are refused by :func:`check_args` before Ray starts.
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
from rlhf_ext.algos.segment_dense import DenseRewardKnobs
from rlhf_ext.algos.segment_reward import SegmentRewardKnobs
from rlhf_ext.openrlhf.cli_runner import ExtArgsError, exit_with_error, run_cli_module, split_ext_args

logger = logging.getLogger("rlhf_ext.openrlhf.train_ppo_ray")  # by name: `python -m` runs it as __main__

#: ``--ext.*`` flags and their defaults (``None``: the reward model's recorded setting / unset).
EXT_DEFAULTS: dict[str, Any] = {
    # paper 003's dense rewards (DenseRewardKnobs; the normalizer comes fitted, as --ext.normalizer FILE)
    **{k: v for k, v in knob_defaults(DenseRewardKnobs).items() if not k.startswith("normalizer_")},
    # paper 003's segmentation (SegmentRewardKnobs); None = the reward model's recorded setting
    **dict.fromkeys(knob_defaults(SegmentRewardKnobs)),
    "normalizer": None,
    "reward_model_id": None,
    "rollout_engine": "auto",
    # paper 000: ContinualKnobs + the previous task's model + retention (ContinualActorSettings). None = not given: the
    # continual actor is used only when one of them is given, with the knobs' defaults for the others
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
EXT_SPECS = {**knob_specs(SegmentRewardKnobs), **knob_specs(ContinualKnobs)}
ROLLOUT_ENGINES = ("auto", "vllm", "hf")
WORKER_ENV = "RLHF_EXT_OPENRLHF_WORKER"


def validate_ext(ext: dict[str, Any]) -> dict[str, Any]:
    """Check every ``--ext.*`` value in the driver, before Ray starts: the segment flags and the normalizer file
    (:func:`~rlhf_ext.openrlhf.segment_ppo.validate_segment_ext`), the continual flags and the previous task's model
    (:func:`~rlhf_ext.openrlhf.continual_actor.check_continual_ext`), the rollout engine."""
    from rlhf_ext.openrlhf.segment_ppo import validate_segment_ext

    ext = validate_segment_ext(ext)
    if any(ext[k] is not None for k in EXT_DEFAULTS if k.startswith("continual_")):
        from rlhf_ext.openrlhf.continual_actor import check_continual_ext

        check_continual_ext(ext)
    if ext["rollout_engine"] not in ROLLOUT_ENGINES:
        raise ExtArgsError(f"--ext.rollout_engine must be one of {', '.join(ROLLOUT_ENGINES)}")
    return ext


def parse_ext_args(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Split ``--ext.*`` flags off an OpenRLHF command line; returns (OpenRLHF argv, validated ext dict). Numeric
    values are checked against their knobs' declared ranges (:data:`EXT_SPECS`)."""
    return split_ext_args(argv, EXT_DEFAULTS, validate_ext, renamed=RENAMED_EXT_FLAGS, specs=EXT_SPECS)


def nest(ext: dict[str, Any]) -> SimpleNamespace:
    """``{"a": 1, "b.c": 2}`` -> ``namespace(a=1, b=namespace(c=2))``, by OpenRLHF's own
    hierarchiser (as its dotted flags are nested)."""
    from rlhf_ext.openrlhf.compat import import_shims

    with import_shims():
        from openrlhf.utils.config import hierarchize

    return getattr(hierarchize, "__wrapped__", hierarchize)(SimpleNamespace(**ext))


def resolve_rollout_engine(requested: str, cuda: bool | None = None) -> str:
    """``auto`` -> ``vllm`` with CUDA, ``hf`` without (with a one-line notice); explicit choices are kept."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if requested != "auto":
        return requested
    if cuda:
        return "vllm"
    logger.info("no CUDA device: rollouts use the HF generate engine (--ext.rollout_engine hf)")
    return "hf"


def check_args(args: Any) -> None:
    """Refuse, before Ray starts, settings the segment subclasses cannot honour (raises :class:`ExtArgsError`)."""
    ext = args.ext
    dense = ext.granularity != "bandit"
    estimator = args.algo.advantage.estimator
    if dense and estimator not in ESTIMATORS:
        raise ExtArgsError(
            f"--algo.advantage.estimator {estimator} shapes one scalar reward per sample; dense segment rewards "
            f"(--ext.granularity {ext.granularity}) need {' | '.join(ESTIMATORS)} (or --ext.granularity bandit)"
        )
    if args.ds.packing_samples:
        raise ExtArgsError("rlhf-ext's segment subclasses do not support --ds.packing_samples; drop the flag")
    if dense:
        for flag, value in (
            ("--reward.normalize_enable", args.reward.normalize_enable),
            ("--reward.stop_properly_penalty_coef", args.reward.stop_properly_penalty_coef),
            ("--reward.overlong_buffer_len", args.reward.overlong_buffer_len),
        ):
            if value not in (None, False):
                raise ExtArgsError(
                    f"{flag} acts on OpenRLHF's scalar reward, which dense segment rewards replace; drop it (segment "
                    f"rewards are normalised by --ext.normalizer, paper 003 Eq. 6) or use --ext.granularity bandit"
                )
        if args.reward.remote_url:
            raise ExtArgsError(
                "--reward.remote_url returns one score per sample; dense segment rewards need the per-token scores "
                "of a reward model actor (--reward.model_name_or_path) or --ext.granularity bandit"
            )
        if args.algo.kl.init_coef <= 0:
            raise ExtArgsError(
                "segment rewards read entropies from the reference model: set --algo.kl.init_coef > 0 "
                "(or use --ext.granularity token/bandit)"
            )
    if ext.rollout_engine == "hf" and args.data.max_images_per_prompt > 0:
        raise ExtArgsError("the HF rollout engine generates text only; use --ext.rollout_engine vllm for images")


def cpu_settings(args: Any) -> list[str]:
    """Settings a run with the HF rollout engine needs on a machine without CUDA; returns what was changed."""
    changed = []
    if args.vllm.sync_backend != "gloo":
        args.vllm.sync_backend = "gloo"
        changed.append("--vllm.sync_backend gloo")
    if "flash" in str(args.ds.attn_implementation):
        args.ds.attn_implementation = "sdpa"
        changed.append("--ds.attn_implementation sdpa")
    if not args.vllm.num_engines:
        args.vllm.num_engines = 1
        changed.append("--vllm.num_engines 1")
    return changed


def logical_gpus(args: Any) -> int:
    """How many GPU bundles OpenRLHF's actors and placement groups will ask Ray for (upper bound)."""
    roles = [args.actor, args.ref, args.reward, args.critic]
    return sum(r.num_nodes * r.num_gpus_per_node for r in roles) + (args.vllm.num_engines or 0)


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


def setup_worker() -> None:
    """``worker_process_setup_hook`` of every Ray worker the run starts."""
    install(json.loads(os.environ.get(WORKER_ENV, "{}")), driver=False)


def prepare(args: Any, ext: dict[str, Any], methods: bool = True) -> Any:
    """Called with OpenRLHF's parsed arguments right before its ``train(args)``: attach ``args.ext``, check, adapt
    to the CPU, start Ray with the worker hook (the driver's classes were installed before the CLI imported them)."""
    import ray
    import torch

    args.ext = nest(ext)
    if methods:
        check_args(args)
    cpu = not torch.cuda.is_available()
    if args.ext.rollout_engine == "hf":
        changed = cpu_settings(args)
        if changed:
            logger.info("HF rollout engine: using %s", ", ".join(changed))
    settings = worker_settings(args.ext, methods)
    if not ray.is_initialized():
        env_vars = {
            WORKER_ENV: json.dumps(settings),
            "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
            "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
            "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
        }
        for name in (
            "TORCHDYNAMO_DISABLE",
            "HF_HUB_OFFLINE",
            "TRANSFORMERS_OFFLINE",
            "HF_DATASETS_OFFLINE",
            "DS_BUILD_OPS",
        ):
            if name in os.environ:
                env_vars[name] = os.environ[name]
        runtime_env = {
            "worker_process_setup_hook": "rlhf_ext.openrlhf.train_ppo_ray.setup_worker",
            "env_vars": env_vars,
        }
        init: dict[str, Any] = {"runtime_env": runtime_env}
        if cpu and not os.environ.get("RAY_ADDRESS"):
            # Logical GPUs: OpenRLHF's actors request num_gpus=1 and {"GPU": 1} bundles. Nothing runs on a GPU.
            init["num_gpus"] = logical_gpus(args)
            init["num_cpus"] = max(os.cpu_count() or 1, init["num_gpus"])
        ray.init(**init)
    return args


def main(argv: Sequence[str] | None = None, methods: bool = True) -> None:
    """Run OpenRLHF's ``train_ppo_ray`` CLI with ``--ext.*`` flags (see the module docstring).

    ``methods=False`` installs only what running on a CPU needs (the HF rollout engine, the CPU patches): stock
    OpenRLHF PPO, the reference the tests compare ``--ext.granularity bandit`` against."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        print("rlhf-ext flags:\n" + "".join(f"  --ext.{k} (default: {v})\n" for k, v in EXT_DEFAULTS.items()))
        print("OpenRLHF's flags (openrlhf.cli.train_ppo_ray --help):\n")
    try:
        rest, ext = parse_ext_args(argv)
    except ValueError as error:
        exit_with_error(error)
    ext["rollout_engine"] = resolve_rollout_engine(ext["rollout_engine"])
    install(worker_settings(nest(ext), methods), driver=True)  # before the CLI imports the classes it builds

    def postprocess(args: Any) -> Any:
        try:
            return prepare(args, ext, methods)
        except ExtArgsError as error:
            exit_with_error(error)

    run_cli_module("openrlhf.cli.train_ppo_ray", rest, postprocess)


if __name__ == "__main__":
    from rlhf_ext.runtime.log import configure_cli_output

    configure_cli_output()
    main()
