"""Train a segment-level reward model (paper 003, section 2.2) from a recipe.

python launch/train_segment_rm.py --config recipes/segment_rm_tiny.yaml [--engine trl|openrlhf] [key=value ...]
accelerate launch launch/train_segment_rm.py --config my.yaml                    # TRL engine, N GPUs
torchrun --nproc_per_node 2 launch/train_segment_rm.py --config my.yaml          # TRL engine, 2 CPU processes
deepspeed launch/train_segment_rm.py --config my.yaml --engine openrlhf         # OpenRLHF engine, N GPUs
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import parse_recipe  # noqa: E402

from rlhf_ext.cli import print_rm_summary  # noqa: E402
from rlhf_ext.pipelines.segment_rm import SegmentRMRecipe, run_segment_rm  # noqa: E402

if __name__ == "__main__":
    print_rm_summary(run_segment_rm(parse_recipe(SegmentRMRecipe, __doc__)))
