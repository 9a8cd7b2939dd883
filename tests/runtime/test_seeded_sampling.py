"""Seeded sampling draws with its own generator: the same tokens as transformers' sampling from an equally seeded
global RNG, whatever else uses the global RNG meanwhile (a generator thread shares it with the training thread)."""

from __future__ import annotations

import itertools
from contextlib import contextmanager

import pytest
import torch

from rlhf_ext.algos.pair_selection import OnlineDPOKnobs
from rlhf_ext.runtime.pair_collection import OnlinePairGenerator
from rlhf_ext.runtime.sampling import HFSampler, SeededTokenSampler, sampling_seed

PROMPTS = [
    "Question: What should I know about glaciers?\nAnswer:",
    "Question: What should I know about the moon?\nAnswer:",
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def response_length_reward(prompts: list, responses: list[str]) -> torch.Tensor:
    """A reward that rarely ties: the response's length in characters."""
    return torch.tensor([float(len(r)) for r in responses])


#: Never the same seed twice, so no two disturbed generations see the same global RNG.
RESEEDS = itertools.count(100)


@contextmanager
def reseeding_the_global_rng_at_every_forward(model: torch.nn.Module):
    """What another thread's ``torch.manual_seed`` (``Trainer``'s ``set_seed``) or random draws do to a generation
    running meanwhile: the global RNG changes between its steps, differently every time."""

    def reseed(module: torch.nn.Module, args: tuple) -> None:
        torch.manual_seed(next(RESEEDS))

    hook = model.register_forward_pre_hook(reseed)
    try:
        yield
    finally:
        hook.remove()


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 20, 0.9)])
def test_the_seeded_draw_is_transformers_own_draw(tiny_sft_path, toy_tok, temperature, top_k, top_p):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_sft_path).eval()
    batch = toy_tok([PROMPTS[0]] * 4, return_tensors="pt")
    common = dict(**batch, max_new_tokens=24, pad_token_id=toy_tok.pad_token_id)
    torch.manual_seed(3)
    stock = model.generate(
        **common, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, output_scores=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    sampler = SeededTokenSampler(torch.Generator().manual_seed(3), temperature, top_k, top_p)
    ours = model.generate(**common, **sampler.generate_kwargs())
    assert torch.equal(ours, stock.sequences)
    # the behaviour log-probs of the drawn tokens: what sampling mode's scores give
    drawn = ours[:, batch["input_ids"].shape[1] :]
    stock_logprobs = torch.stack(stock.scores, dim=1).log_softmax(-1).gather(-1, drawn.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(torch.stack(sampler.token_logprobs, dim=1), stock_logprobs)


def test_a_seeded_draw_does_not_depend_on_other_use_of_the_global_rng(tiny_sft_path, toy_tok):
    sampler = HFSampler(tiny_sft_path, toy_tok, max_new_tokens=24, temperatures=[0.7, 1.0], batch_size=8)
    clean = sampler.sample(PROMPTS, 4, seed=5)
    with reseeding_the_global_rng_at_every_forward(sampler.model):
        disturbed = sampler.sample(PROMPTS, 4, seed=5)
    assert disturbed.texts == clean.texts
    assert torch.equal(disturbed.num_tokens, clean.num_tokens)


def test_an_online_batch_is_the_same_in_every_run_with_the_same_seed(tiny_sft_path, toy_tok, toy_data):
    """Per-batch online DPO (paper 001) generates in a thread; each batch's sampling is seeded from (seed, batch
    index, fill round), so the batch does not depend on the global RNG the training thread uses."""

    def batch(index: int) -> list[dict]:
        sampler = HFSampler(tiny_sft_path, toy_tok, max_new_tokens=24, temperatures=[0.7], batch_size=8)
        generator = OnlinePairGenerator(
            prompts=[row["prompt"] for row in toy_data["train"].select(range(32))],
            pairs_per_update=4,
            max_fill_rounds=4,
            selection=OnlineDPOKnobs(num_generations=4),
            reward_fn=response_length_reward,
            sampler_spec={"policy": tiny_sft_path},
            seed=11,
            sampler=sampler,
        )
        generator.cursor = 4 * index
        with reseeding_the_global_rng_at_every_forward(sampler.model):
            return generator.generate(index, version=0)

    first = batch(2)
    torch.manual_seed(12345)
    assert batch(2) == first
    assert batch(3) != first


def test_sampling_seeds_are_stable_and_differ_by_position():
    seeds = {sampling_seed(0, "online", index, fill_round) for index in range(4) for fill_round in range(3)}
    assert len(seeds) == 12 and all(0 <= s < 2**31 - 1 for s in seeds)
    assert sampling_seed(0, "online", 2, 1) == 894751220  # a digest of the position: the same on every process
    assert sampling_seed(1, "online", 2, 1) != 894751220
