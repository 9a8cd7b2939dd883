"""Repository wrapper of ``python -m rlhf_ext.launch.train_segment_ppo`` (the module ships in the wheel; use that)."""

from rlhf_ext.launch import launch

if __name__ == "__main__":
    launch("train_segment_ppo")
