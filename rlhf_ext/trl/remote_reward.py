"""``RemoteSegmentReward``: a TRL ``reward_funcs`` entry scored by ``rlhf-ext serve rm`` (defined engine-free in
:mod:`rlhf_ext.runtime.remote_reward`, which OpenRLHF's launcher uses too)."""

from rlhf_ext.runtime.remote_reward import API_KEY_ENV, RemoteRewardError, RemoteSegmentReward

__all__ = ["API_KEY_ENV", "RemoteRewardError", "RemoteSegmentReward"]
