"""Segment-level PPO (paper 003, section 2.3) from a recipe — the package's headline entrypoint.

python launch/train_segment_ppo.py --config recipes/segment_ppo_tiny.yaml [key=value ...]
torchrun --nproc_per_node 2 launch/train_segment_ppo.py --config my.yaml        # TRL engine, 2 CPU processes
accelerate launch launch/train_segment_ppo.py --config my.yaml                  # TRL engine, your GPUs
deepspeed launch/train_segment_ppo.py --config my.yaml                          # TRL engine under deepspeed
python launch/train_segment_ppo.py --engine openrlhf --config recipes/segment_ppo_openrlhf.yaml   # Ray PPO
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import parse_recipe  # noqa: E402

from rlhf_ext.cli import print_ppo_summary  # noqa: E402
from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe, run_segment_ppo  # noqa: E402

if __name__ == "__main__":
    print_ppo_summary(run_segment_ppo(parse_recipe(SegmentPPORecipe, __doc__)))
