"""Sampling (HF, vLLM adapter) and reward functions used by online DPO."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from rlhf_ext.runtime.rewards import SegmentSequenceReward, SequenceClassifierReward, score
from rlhf_ext.runtime.sampling import (
    HFSampler,
    VLLMSampler,
    _response_lengths,
    encode_prompts,
    make_sampler,
    split_temperatures,
)
from rlhf_ext.zoo.builtins import resolve_reward
from rlhf_ext.zoo.toy import keyphrase_gold_reward

PROMPTS = [
    "Question: What should I know about glaciers?\nAnswer:",
    "Question: What should I know about the moon?\nAnswer:",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_split_temperatures():
    assert split_temperatures(8, [0.7, 1.0]) == [(0.7, 4), (1.0, 4)]
    assert split_temperatures(5, [0.7, 1.0]) == [(0.7, 3), (1.0, 2)]
    assert split_temperatures(1, [0.7, 1.0]) == [(0.7, 1)]
    with pytest.raises(ValueError, match="positive"):
        split_temperatures(4, [0.0])
    with pytest.raises(ValueError, match="at least one"):
        split_temperatures(4, [])


def test_response_lengths_count_up_to_the_first_eos():
    gen = torch.tensor([[5, 0, 1, 1], [5, 6, 7, 8], [0, 3, 0, 1]])
    n, trunc = _response_lengths(gen, [0])
    assert n.tolist() == [2, 4, 1] and trunc.tolist() == [False, True, False]


def test_hf_sampler_layout_temperatures_and_seed(tiny_sft_path, toy_tok):
    sampler = HFSampler(tiny_sft_path, toy_tok, max_new_tokens=24, temperatures=[0.7, 1.0], batch_size=4)
    calls = []
    generate = sampler.model.generate

    def recording_generate(**kw):
        (token_sampler,) = kw["logits_processor"]  # a seeded draw samples with its own generator
        warpers = [(type(w).__name__, getattr(w, "temperature", None)) for w in token_sampler.warpers]
        calls.append({"warpers": warpers, "do_sample": kw["do_sample"], "rows": len(kw["input_ids"])})
        return generate(**kw)

    sampler.model.generate = recording_generate
    rng = torch.random.get_rng_state()
    out = sampler.sample(PROMPTS, 5, seed=7)
    assert torch.equal(rng, torch.random.get_rng_state())  # a seeded draw leaves the global RNG alone
    assert len(out.texts) == 2 and all(len(row) == 5 for row in out.texts)
    assert out.temperatures == [0.7, 0.7, 0.7, 1.0, 1.0]
    assert out.num_tokens.shape == (2, 5) and (out.num_tokens <= 24).all() and (out.num_tokens >= 1).all()
    assert torch.equal(out.truncated, out.num_tokens.eq(24) & out.truncated)
    # 3 copies x 2 prompts at 0.7 (batches of 4 sequences), then 2 x 2 at 1.0; no top-k / top-p (paper 004); the
    # token sampler draws, greedy decoding emits its token
    temperature_07 = [("TemperatureLogitsWarper", 0.7)]
    assert [c["warpers"] for c in calls] == [temperature_07, temperature_07, []]
    assert [c["rows"] for c in calls] == [4, 2, 4]
    assert not any(c["do_sample"] for c in calls)
    again = sampler.sample(PROMPTS, 5, seed=7)
    assert again.texts == out.texts and torch.equal(again.num_tokens, out.num_tokens)
    assert out.num_chars().tolist() == [[float(len(t)) for t in row] for row in out.texts]


def test_chat_prompts_render_through_the_template(toy_tok):
    tok = toy_tok.__class__.from_pretrained(toy_tok.name_or_path)
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    (ids,) = encode_prompts(tok, [[{"role": "user", "content": "hi"}]])
    assert tok.decode(ids) == "hi\nA:"
    (cut,) = encode_prompts(tok, PROMPTS[:1], max_prompt_length=3)
    assert cut == tok(PROMPTS[0])["input_ids"][-3:]
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        encode_prompts(tok, [[{"role": "user", "content": "hi"}]])


def _fake_vllm(monkeypatch, record):
    class SamplingParams:
        def __init__(self, **kw):
            record.append(kw)
            self.kw = kw

    class Completion:
        def __init__(self, text, n_tok, reason):
            self.text, self.token_ids, self.finish_reason = text, list(range(n_tok)), reason

    class LLM:
        def __init__(self, **kw):
            self.kw = kw
            self.loaded = []
            self.reset = 0
            worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=self))
            self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=worker))

        def generate(self, prompts, params, use_tqdm=False):
            t = params.kw["temperature"]
            return [
                types.SimpleNamespace(
                    outputs=[
                        Completion(f"p{i}-t{t}-s{j}", 3 + j, "length" if j == 0 else "stop")
                        for j in range(params.kw["n"])
                    ]
                )
                for i, _ in enumerate(prompts)
            ]

        def load_weights(self, items):
            self.loaded.append(dict(items))

        def reset_prefix_cache(self):
            self.reset += 1

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=SamplingParams, LLM=LLM))


def test_vllm_sampler_adapter_layout_and_weight_sync(monkeypatch, toy_tok):
    record: list[dict] = []
    _fake_vllm(monkeypatch, record)
    sampler = VLLMSampler("some/path", toy_tok, max_new_tokens=16, temperatures=[0.7, 1.0], gpu_memory_utilization=0.5)
    assert sampler.llm.kw == {"model": "some/path", "gpu_memory_utilization": 0.5}
    out = sampler.sample(PROMPTS, 3, seed=11)
    assert out.texts == [["p0-t0.7-s0", "p0-t0.7-s1", "p0-t1.0-s0"], ["p1-t0.7-s0", "p1-t0.7-s1", "p1-t1.0-s0"]]
    assert out.temperatures == [0.7, 0.7, 1.0]
    assert out.num_tokens.tolist() == [[3, 4, 3], [3, 4, 3]]
    assert out.truncated.tolist() == [[True, False, True], [True, False, True]]
    assert [(r["n"], r["temperature"], r["top_k"], r["top_p"], r["max_tokens"], r["seed"]) for r in record] == [
        (2, 0.7, -1, 1.0, 16, 11),
        (1, 1.0, -1, 1.0, 16, 12),
    ]
    sampler.load_weights({"w": torch.ones(1)})
    assert list(sampler.llm.loaded[0]) == ["w"] and sampler.llm.reset == 1


def test_vllm_missing_is_a_clear_error(monkeypatch, toy_tok):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match="generation_backend='hf'"):
        VLLMSampler("x", toy_tok)
    with pytest.raises(ValueError, match="generation_backend"):
        make_sampler(
            "tpu",
            "x",
            toy_tok,
            max_new_tokens=4,
            temperatures=[1.0],
            batch_size=1,
            max_prompt_length=None,
            top_p=1.0,
            top_k=0,
        )


@pytest.mark.gpu
def test_vllm_sampler_on_gpu(tiny_sft_path, toy_tok):
    pytest.importorskip("vllm")
    sampler = make_sampler(
        "vllm",
        tiny_sft_path,
        toy_tok,
        max_new_tokens=16,
        temperatures=[0.7, 1.0],
        batch_size=8,
        max_prompt_length=None,
        top_p=1.0,
        top_k=0,
    )
    out = sampler.sample(PROMPTS, 4, seed=0)
    assert len(out.texts) == 2 and all(len(r) == 4 for r in out.texts)
    sampler.load_policy(tiny_sft_path)
    assert sampler.sample(PROMPTS, 4, seed=0).texts == out.texts


def test_score_checks_the_reward_output():
    with pytest.raises(ValueError, match="one score per"):
        score(lambda p, r: [1.0], ["a", "b"], ["x", "y"])
    with pytest.raises(ValueError, match="NaN"):
        score(lambda p, r: [0.0, float("nan")], ["a", "b"], ["x", "y"])
    assert score(keyphrase_gold_reward, ["p", "p"], ["backed by peer-reviewed evidence", "nope"]).tolist() == [1.0, 0.0]


@pytest.fixture(scope="module")
def reward_dirs(tmp_path_factory, tiny_sft_path):
    """A sequence-classification RM (SFT body, random head) saved twice: plain, and as a segment RM."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_ext.runtime.segment_data import save_segment_settings

    root = tmp_path_factory.mktemp("rms")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_sft_path, num_labels=1)
    tok = AutoTokenizer.from_pretrained(tiny_sft_path)
    for name in ("plain", "segment"):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    settings = {"entropy_cutoff": 2.0, "aggregation": "softmax", "tau": 0.5, "sft_model_name_or_path": tiny_sft_path}
    save_segment_settings(root / "segment", settings)
    return root


RESPONSES = [" Many people wonder about this.", " The facts about the moon are backed by peer-reviewed evidence. Ok."]


def test_sequence_classifier_reward_scores_rewardtrainer_text_and_ignores_padding(reward_dirs, toy_tok):
    rm = SequenceClassifierReward(str(reward_dirs / "plain"), batch_size=8)
    batched = rm(PROMPTS, RESPONSES)
    one_by_one = torch.cat(
        [
            SequenceClassifierReward(str(reward_dirs / "plain"), batch_size=1)([p], [r])
            for p, r in zip(PROMPTS, RESPONSES)
        ]
    )
    torch.testing.assert_close(batched, one_by_one, rtol=1e-5, atol=1e-5)
    # the text RewardTrainer trains on: prompt + response + EOS
    ids = toy_tok(PROMPTS[0] + RESPONSES[0] + toy_tok.eos_token, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        direct = rm.model(input_ids=ids).logits[0, 0]
    assert batched[0].item() == pytest.approx(direct.item(), abs=1e-5)


def test_segment_reward_is_the_segment_scorers_evaluation(reward_dirs):
    from rlhf_ext.runtime.token_scores import SegmentScorer

    batched = SegmentSequenceReward(reward_dirs / "segment", batch_size=8)(PROMPTS, RESPONSES)
    scorer = SegmentScorer(str(reward_dirs / "segment"))
    single = [scorer.score(p, r).evaluation for p, r in zip(PROMPTS, RESPONSES)]
    assert batched.tolist() == pytest.approx(single, abs=1e-5)


@pytest.mark.parametrize("kind", ["plain", "segment"])
def test_reward_model_objects_pickle_to_a_generator_process(reward_dirs, kind):
    """``generator_process`` sends the reward function to its process by pickle: a reward-model object's tokenizer
    lock must not stop it (it did: ``cannot pickle '_thread.lock'``), and the copy scores exactly as the original
    and has a lock of its own."""
    import pickle

    reward = (SegmentSequenceReward if kind == "segment" else SequenceClassifierReward)(str(reward_dirs / kind))
    expected = reward(PROMPTS, RESPONSES)  # used before it is sent, as a trainer's own evaluation does
    lock = reward.scorer.tokenizer_lock if kind == "segment" else reward._tokenizer_lock
    with lock:  # held while pickled: the copy's lock is a new one, free
        copy = pickle.loads(pickle.dumps(reward))
    copy_lock = copy.scorer.tokenizer_lock if kind == "segment" else copy._tokenizer_lock
    assert copy_lock is not lock and copy_lock.acquire(blocking=False)
    copy_lock.release()
    assert torch.equal(copy(PROMPTS, RESPONSES), expected)


def test_load_reward_resolves_every_kind(reward_dirs):
    assert resolve_reward("builtin:keyphrase-gold") is keyphrase_gold_reward
    assert resolve_reward("rlhf_ext.zoo.toy:keyphrase_gold_reward") is keyphrase_gold_reward
    assert isinstance(resolve_reward(str(reward_dirs / "segment")), SegmentSequenceReward)
    assert isinstance(resolve_reward(str(reward_dirs / "plain")), SequenceClassifierReward)
    assert isinstance(
        resolve_reward(str(reward_dirs / "segment"), kind="sequence_classification"), SequenceClassifierReward
    )
    with pytest.raises(ValueError, match="unknown builtin reward"):
        resolve_reward("builtin:nope")
    with pytest.raises(ValueError, match="could not be imported"):
        resolve_reward("no_such_module_xyz:fn")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_reward("/no/such/dir")
