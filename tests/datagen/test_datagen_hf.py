"""The ``hf`` backend: a local transformers model behind the same interface (tiny model; SmolLM2 opt-in)."""

from __future__ import annotations

import asyncio

import pytest

from rlhf_ext.datagen import ChatRequest, HFBackend, RequestRejected, generate_dataset


def run(coro):
    return asyncio.run(coro)


def test_hf_backend_is_seeded_per_request_and_reports_truncation(tiny_base_path):
    async def go():
        backend = HFBackend(tiny_base_path)
        await backend.start()
        try:
            msgs = [{"role": "user", "content": "Ask a question about gravity."}]
            a = await backend.complete(ChatRequest("prompt", msgs, seed=1, max_tokens=6, temperature=1.0))
            b = await backend.complete(ChatRequest("prompt", msgs, seed=1, max_tokens=6, temperature=1.0))
            c = await backend.complete(ChatRequest("prompt", msgs, seed=2, max_tokens=6, temperature=1.0))
            g1 = await backend.complete(ChatRequest("prompt", msgs, seed=1, max_tokens=6, temperature=0.0))
            g2 = await backend.complete(ChatRequest("prompt", msgs, seed=2, max_tokens=6, temperature=0.0))
            long = [{"role": "user", "content": "gravity " * 600}]
            with pytest.raises(RequestRejected, match="the model's context is 512"):
                await backend.complete(ChatRequest("prompt", long, seed=1, max_tokens=6, temperature=1.0))
            return a, b, c, g1, g2
        finally:
            await backend.close()

    a, b, c, g1, g2 = run(go())
    assert a == b and a.text != c.text  # same seed, same sample; another seed, another sample
    assert g1 == g2  # greedy ignores the seed
    assert a.finish_reason == "length"  # a random model does not stop within 6 tokens


def test_generate_with_the_hf_backend_counts_what_it_cannot_use(tmp_path, tiny_base_path):
    """A random 2-layer model never finishes an answer: every sample is skipped as truncated, and counted."""
    config = {
        "name": "hf",
        "generation": {
            "backend": "hf",
            "model": tiny_base_path,
            "response_mode": "judged",
            "max_tokens_prompt": 8,
            "max_tokens_response": 8,
        },
        "tasks": [
            {
                "name": "t",
                "objective": "Ask a physics question.",
                "preference": "Explain it like I'm five.",
                "domain": {"physics": {"seed_words": ["gravity", "orbit"]}},
                "num_samples": 3,
            }
        ],
    }
    ds = generate_dataset(config, tmp_path / "out", progress=False)
    assert ds.metadata["stats"] == {"generated": 0, "missing": 0, "planned": 3, "skipped": 3}
    assert ds.run_stats["skipped:truncated"] == 3
    assert ds.metadata["generator"]["backend"] == "hf" and len(ds[0]["train"]) == 0


@pytest.mark.real_model
def test_smollm2_generates_a_small_dataset(tmp_path, cache_dir):
    """SmolLM2-135M-Instruct through the hf backend (opt-in: RLHF_EXT_REAL_MODEL=1; a few minutes on CPU)."""
    ds = generate_dataset(
        "continual-piecewise-qa",
        tmp_path / "out",
        num_samples=1,
        overrides=[
            "generation.backend=hf",
            "generation.model=builtin:smollm2",
            "generation.max_tokens_prompt=160",
            "generation.max_tokens_response=600",
            "generation.temperature=0.7",
        ],
        progress=False,
    )
    stats = ds.metadata["stats"]
    assert stats["generated"] + stats["skipped"] == stats["planned"] == 4 and stats["missing"] == 0
