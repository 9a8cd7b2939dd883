"""An OpenRLHF rollout engine double: ``generate`` answers every prompt with the same given token ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace


@dataclass
class FixedRolloutEngine:
    """Stands in for the vLLM / HF engine that ``SingleTurnAgentExecutor.execute`` awaits: every prompt gets
    ``response_ids`` (decoded with ``tokenizer`` for the text), finished by EOS, without log-probs."""

    tokenizer: object
    response_ids: list[int]
    prompts_seen: list[list[int]] = field(default_factory=list)

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None) -> SimpleNamespace:
        self.prompts_seen.append(list(prompt_token_ids))
        text = self.tokenizer.decode(self.response_ids, skip_special_tokens=False)
        output = SimpleNamespace(token_ids=list(self.response_ids), text=text, finish_reason="stop", logprobs=None)
        return SimpleNamespace(prompt_token_ids=list(prompt_token_ids), outputs=[output])
