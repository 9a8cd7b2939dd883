"""Launchable training modules: ``python -m rlhf_ext.launch.<name>`` under any launcher a TRL or OpenRLHF user has.

Each module is the matching ``rlhf-ext train ...`` command (same options, same recipes, same error messages), written
so that launchers which take a script or module path can start it::

    python -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_tiny
    torchrun --nproc_per_node 2 -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_tiny
    accelerate launch -m rlhf_ext.launch.train_segment_rm --config my_rm.yaml
    deepspeed --module rlhf_ext.launch.train_segment_rm --config my_rm.yaml --engine openrlhf
    ray job submit -- python -m rlhf_ext.launch.train_segment_ppo --engine openrlhf --config segment_ppo_openrlhf

``deepspeed`` appends ``--local_rank=N`` to the arguments; the rank is read from the environment, so it is dropped.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

#: launch module name -> ``rlhf-ext`` subcommand it runs
COMMANDS: dict[str, tuple[str, ...]] = {
    "train_segment_rm": ("train", "segment-rm"),
    "train_segment_ppo": ("train", "segment-ppo"),
    "train_online_dpo": ("train", "online-dpo"),
    "train_continual": ("train", "continual"),
}


def strip_local_rank(argv: Sequence[str]) -> list[str]:
    """``argv`` without the ``--local_rank=N`` / ``--local_rank N`` (or ``--local-rank``) that deepspeed inserts."""
    args = iter(argv)
    out: list[str] = []
    for arg in args:
        if arg.split("=", 1)[0] not in ("--local_rank", "--local-rank"):
            out.append(arg)
        elif "=" not in arg:
            next(args, None)  # its value
    return out


def launch(module: str, argv: Sequence[str] | None = None) -> None:
    """Run the ``rlhf-ext`` subcommand of launch module ``module`` with ``argv`` (default: ``sys.argv[1:]``)."""
    from rlhf_ext.cli import main

    args = strip_local_rank(sys.argv[1:] if argv is None else argv)
    main([*COMMANDS[module], *args], prog_name="rlhf-ext")
