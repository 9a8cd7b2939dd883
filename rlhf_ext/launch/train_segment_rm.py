"""Train a segment-level reward model (paper 003, section 2.2) from a recipe: ``rlhf-ext train segment-rm``.

python -m rlhf_ext.launch.train_segment_rm --config segment_rm_tiny [--engine trl|openrlhf] [key=value ...]
torchrun --nproc_per_node 2 -m rlhf_ext.launch.train_segment_rm --config my_rm.yaml      # TRL, 2 CPU processes
deepspeed --module rlhf_ext.launch.train_segment_rm --config my_rm.yaml --engine openrlhf  # OpenRLHF, N GPUs
"""

from rlhf_ext.launch import launch

if __name__ == "__main__":
    launch("train_segment_rm")
