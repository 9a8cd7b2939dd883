"""``python -m rlhf_ext.openrlhf.train_rm`` / ``deepspeed --module rlhf_ext.openrlhf.train_rm``: OpenRLHF's
``train_rm`` with the segment reward model of paper 003. Takes every ``openrlhf.cli.train_rm`` flag plus ``--ext.*``:

    --ext.entropy_cutoff 2.0   --ext.aggregation softmax   --ext.tau 0.5
    --ext.sft_model PATH       --ext.entropy_batch_size 8  --ext.max_prompt_length N   --ext.cache_dir DIR
"""

import sys

from rlhf_ext.algos.knobs import KnobError
from rlhf_ext.openrlhf.cli_runner import ExtArgsError, exit_with_error
from rlhf_ext.openrlhf.segment_rm import run_train_rm

if __name__ == "__main__":
    try:
        run_train_rm(sys.argv[1:])
    except (ExtArgsError, KnobError) as error:
        exit_with_error(error)
