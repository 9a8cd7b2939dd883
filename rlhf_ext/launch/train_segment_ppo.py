"""Segment-level PPO (paper 003, section 2.3) from a recipe: ``rlhf-ext train segment-ppo``.

python -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_tiny [key=value ...]
accelerate launch -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_paper           # TRL, your GPUs
ray job submit -- python -m rlhf_ext.launch.train_segment_ppo --engine openrlhf --config segment_ppo_openrlhf
"""

from rlhf_ext.launch import launch

if __name__ == "__main__":
    launch("train_segment_ppo")
