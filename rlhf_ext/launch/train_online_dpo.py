"""Iterative (paper 004) or one-step asynchronous (paper 001) online DPO: ``rlhf-ext train online-dpo``.

python -m rlhf_ext.launch.train_online_dpo --config online_dpo_tiny [key=value ...]
accelerate launch -m rlhf_ext.launch.train_online_dpo --config my_online_dpo.yaml
"""

from rlhf_ext.launch import launch

if __name__ == "__main__":
    launch("train_online_dpo")
