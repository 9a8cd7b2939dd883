"""Adapters for TRL 1.16: subclasses of TRL's trainers that call rlhf-ext's pure tensor functions.

Importing this package imports ``trl`` (about 5 s); ``import rlhf_ext`` alone does not.
"""

from rlhf_ext.trl.continual_dpo import ContinualDPOConfig, ContinualDPOTrainer
from rlhf_ext.trl.kl_sft import KLRegularizedSFTTrainer, KLSFTConfig
from rlhf_ext.trl.online_dpo import IterativeDPOConfig, IterativeDPOTrainer
from rlhf_ext.trl.segment_ppo import DensePPOConfig, DensePPOTrainer, SegmentPPOConfig, SegmentPPOTrainer
from rlhf_ext.trl.segment_reward import SegmentPreferenceCollator, SegmentRewardConfig, SegmentRewardTrainer

__all__ = [
    "ContinualDPOConfig",
    "ContinualDPOTrainer",
    "IterativeDPOConfig",
    "IterativeDPOTrainer",
    "DensePPOConfig",
    "DensePPOTrainer",
    "SegmentPPOConfig",
    "SegmentPPOTrainer",
    "KLRegularizedSFTTrainer",
    "KLSFTConfig",
    "SegmentPreferenceCollator",
    "SegmentRewardConfig",
    "SegmentRewardTrainer",
]
