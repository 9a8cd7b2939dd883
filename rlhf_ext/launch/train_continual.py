"""Continual RLHF over a task sequence (paper 000): ``rlhf-ext train continual``.

python -m rlhf_ext.launch.train_continual --config continual_dpo_tiny [key=value ...]
deepspeed --module rlhf_ext.launch.train_continual --config my.yaml train.trl_args='{deepspeed: ds_zero2.json}'
(``algorithm: ppo`` trains the policy with the ``ppo`` section's keys: ``ppo.trl_args='{deepspeed: ...}'``)
"""

from rlhf_ext.launch import launch

if __name__ == "__main__":
    launch("train_continual")
