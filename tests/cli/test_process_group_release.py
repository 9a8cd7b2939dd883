"""A command run under torchrun/accelerate/deepspeed destroys the process group it trained in before Python exits.

Left to interpreter finalization, gloo's worker threads can still hold tensors; torch then aborts the process
("terminate called without an active exception", SIGABRT), which failed the wheel smoke's 2-process torchrun run
after training had finished (pytorch/pytorch#179291 describes the race)."""

from __future__ import annotations

import torch.distributed as dist

from rlhf_ext.cli import main


def test_a_command_destroys_the_process_group_it_ran_in(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        main(["recipe", "list"], standalone_mode=False)
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_command_without_a_process_group_runs_as_before():
    assert not dist.is_initialized()
    main(["recipe", "list"], standalone_mode=False)
    assert not dist.is_initialized()
