"""A simulator policy that needs no model: the same responses, with given token counts, for every seed."""

from __future__ import annotations

import torch

from rlhf_ext.runtime.sampling import Samples


class FixedPolicy:
    """``sample(prompts, n, seed)`` returns ``texts[i]`` (``num_tokens[i]`` tokens, not truncated) ``n`` times for
    prompt ``i``; no ``logprobs``, so ``win_rate`` needs ``compute_kl=False``."""

    def __init__(self, texts: list[str], num_tokens: list[int]):
        if len(texts) != len(num_tokens):
            raise ValueError("one token count per response")
        self.texts, self.num_tokens, self.name = texts, num_tokens, "fixed"

    def sample(self, prompts: list[str], n: int, seed: int) -> Samples:
        rows = [[text] * n for text in self.texts]
        tokens = torch.tensor([[count] * n for count in self.num_tokens])
        return Samples(rows, tokens, torch.zeros(len(rows), n, dtype=torch.bool), [1.0] * n)
