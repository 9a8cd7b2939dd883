"""``segment_evaluation``: e_phi (paper 003 Eq. 4) of a segment reward model loaded any way, equal to what the
inference scorer and the trainer compute, and not the last-token score a plain ``forward`` returns."""

from __future__ import annotations

import copy
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rlhf_ext.runtime.segment_data import (
    collate_segment_pairs,
    pad_sequences,
    prepare_segment_dataset,
    save_segment_settings,
    tokenize_pair,
)
from rlhf_ext.runtime.token_scores import SegmentView
from rlhf_ext.segment import segment_evaluation

CUTOFF, TAU = 1.0, 0.5


@pytest.fixture(scope="module")
def segment_rm_dir(tmp_path_factory, tiny_sft_path, toy_tok) -> str:
    """A segment reward model checkpoint as the trainers write it: weights (here the SFT model's body with a random
    score head: the equalities do not depend on training) plus ``segment_config.json``."""
    from transformers import AutoModelForSequenceClassification

    out = tmp_path_factory.mktemp("segment_rm")
    torch.manual_seed(3)
    AutoModelForSequenceClassification.from_pretrained(tiny_sft_path, num_labels=1).save_pretrained(out)
    toy_tok.save_pretrained(out)
    save_segment_settings(
        out,
        {"entropy_cutoff": CUTOFF, "aggregation": "softmax", "tau": TAU, "sft_model_name_or_path": tiny_sft_path},
    )
    return str(out)


def encode(examples, tok) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Toy responses (the ``chosen`` of each example) tokenised as the scorer does, right padded: ``[B, T]`` ids,
    mask and response mask."""
    rows = [tokenize_pair(example, tok) for example in examples]
    seqs = [r["chosen_ids"] for r in rows]
    ids = pad_sequences(seqs, tok.pad_token_id, "right", torch.long)
    mask = pad_sequences([[1] * len(s) for s in seqs], 0, "right", torch.long)
    response = pad_sequences([[0] * r["prompt_len"] + [1] * (len(s) - r["prompt_len"]) for r, s in zip(rows, seqs)],
                             0, "right", torch.long).bool()  # fmt: skip
    return ids, mask, response


@pytest.fixture(scope="module")
def batch(toy_tok, toy_data):
    """Three toy responses tokenised as the scorer does."""
    return encode([toy_data["test"][i] for i in range(3)], toy_tok)


@pytest.fixture(scope="module")
def loaded(segment_rm_dir, tiny_sft_path):
    """The reward model as a user loads it (plain transformers) and the SFT model."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(segment_rm_dir, num_labels=1).eval()
    return rm, AutoModelForCausalLM.from_pretrained(tiny_sft_path).eval()


def test_equals_eq4_from_plain_forward_passes_and_differs_from_the_last_token_score(loaded, batch):
    """e_phi = tau * logsumexp(r_seg / tau), r_seg = the model's own (last-token) output on the prefix that ends at
    each segment's last token: recomputed here from plain forward passes, one per segment end."""
    rm, sft = loaded
    ids, mask, response = batch
    ev = segment_evaluation(rm, ids, mask, response, sft_model=sft)
    assert (ev.segments.counts >= 2).all()  # the cutoff really splits every response
    with torch.no_grad():
        for b in range(ids.shape[0]):
            ends = ev.segments.ends[b].nonzero().flatten().tolist()
            r_seg = torch.stack([rm(input_ids=ids[b : b + 1, : e + 1]).logits[0, 0] for e in ends])
            assert ev.values[b].item() == pytest.approx((TAU * torch.logsumexp(r_seg / TAU, 0)).item(), abs=1e-6)
        last_token_score = rm(input_ids=ids, attention_mask=mask).logits[:, 0]
    assert (ev.values - last_token_score).abs().min() > 1e-3


def test_equals_the_segment_scorer_and_the_segment_reward(segment_rm_dir, loaded, batch, toy_tok, toy_data):
    from rlhf_ext.runtime.rewards import SegmentSequenceReward
    from rlhf_ext.runtime.token_scores import SegmentScorer

    rm, sft = loaded
    ids, mask, response = batch
    ours = segment_evaluation(rm, ids, mask, response, sft_model=sft).values
    scorer = SegmentScorer(segment_rm_dir)
    with pytest.warns(DeprecationWarning, match="entropy_cutoff"):  # the old name still answers
        assert scorer.cutoff == scorer.entropy_cutoff == 1.0  # the fixture model's recorded cutoff
    rows = [toy_data["test"][i] for i in range(3)]
    from_scorer = torch.tensor([scorer.score(r["prompt"], r["chosen"]).evaluation for r in rows])
    torch.testing.assert_close(ours, from_scorer, atol=1e-6, rtol=0)
    reward = SegmentSequenceReward(segment_rm_dir, device="cpu")(
        [r["prompt"] for r in rows], [r["chosen"] for r in rows]
    )
    torch.testing.assert_close(ours, reward, atol=1e-6, rtol=0)


def test_equals_the_trainers_evaluation(segment_rm_dir, loaded, tiny_sft_path, toy_tok, toy_data, tmp_path):
    """The sequence evaluations the TRL trainer's loss is built on (its ``outputs.logits``), chosen then rejected."""
    from rlhf_ext.trl import SegmentPreferenceCollator, SegmentRewardConfig, SegmentRewardTrainer

    rm, _ = loaded
    prepared = prepare_segment_dataset(toy_data["test"].select(range(4)), toy_tok, sft_model_name_or_path=tiny_sft_path)
    args = SegmentRewardConfig(output_dir=str(tmp_path), entropy_cutoff=CUTOFF, tau=TAU, use_cpu=True, report_to="none")
    trainer = SegmentRewardTrainer(model=rm, args=args, train_dataset=prepared, processing_class=toy_tok)
    examples = [prepared[i] for i in range(4)]
    with torch.no_grad():
        _, outputs = trainer.compute_loss(rm, SegmentPreferenceCollator(toy_tok.pad_token_id)(examples), True)
    batch = collate_segment_pairs(examples, toy_tok.pad_token_id)
    ours = segment_evaluation(rm, batch["input_ids"], batch["attention_mask"], batch["action_mask"],
                              entropy=batch["entropy"])  # fmt: skip
    torch.testing.assert_close(ours.values, outputs.logits.squeeze(-1), atol=1e-6, rtol=0)


def test_settings_default_to_the_model_directory_and_padding_side_and_segment_ends_agree(loaded, batch):
    """No ``settings=``: read from the directory the model was loaded from. Left padding gives the same values
    (positions from the mask), and so do the segment ends of the first evaluation passed back in."""
    rm, sft = loaded
    ids, mask, response = batch
    explicit = segment_evaluation(rm, ids, mask, response, sft_model=sft, entropy_cutoff=CUTOFF,
                                  aggregation="softmax", tau=TAU)  # fmt: skip
    implicit = segment_evaluation(rm, ids, mask, response, sft_model=sft)
    torch.testing.assert_close(implicit.values, explicit.values, atol=0, rtol=0)
    from_ends = segment_evaluation(rm, ids, mask, response, segment_ends=explicit.segments.ends)
    torch.testing.assert_close(from_ends.values, explicit.values, atol=1e-6, rtol=0)
    lengths = mask.sum(1)
    left = [torch.cat([t[b, lengths[b] :], t[b, : lengths[b]]]) for t in (ids, mask, response) for b in range(3)]
    l_ids, l_mask, l_resp = (torch.stack(left[i * 3 : i * 3 + 3]) for i in range(3))
    left_padded = segment_evaluation(rm, l_ids, l_mask, l_resp, sft_model=sft)
    torch.testing.assert_close(left_padded.values, explicit.values, atol=1e-5, rtol=0)


def test_openrlhf_reward_model_gives_the_same_e_phi(segment_rm_dir, loaded, batch):
    """OpenRLHF's reward model class (what ``get_llm_for_sequence_regression`` builds) with the same weights."""
    pytest.importorskip("openrlhf")
    from transformers import AutoConfig, LlamaModel, LlamaPreTrainedModel

    from rlhf_ext.openrlhf.compat import import_shims

    with import_shims():  # OpenRLHF imports flash-attn at import time; a CPU machine has none
        from openrlhf.models.model import _get_reward_model

    rm, sft = loaded
    ids, mask, response = batch
    config = AutoConfig.from_pretrained(segment_rm_dir)
    config.normalize_reward = False
    ort = _get_reward_model(LlamaPreTrainedModel, LlamaModel, "score")(config).eval()
    ort.load_state_dict(rm.state_dict())
    ours = segment_evaluation(ort, ids, mask, response, sft_model=sft, settings=segment_rm_dir)
    torch.testing.assert_close(ours.values, segment_evaluation(rm, ids, mask, response, sft_model=sft).values,
                               atol=1e-5, rtol=0)  # fmt: skip


def test_missing_settings_and_segmentation_are_named(loaded, batch):
    from transformers import AutoModelForSequenceClassification

    rm, _ = loaded
    ids, mask, response = batch
    with pytest.raises(ValueError, match="needs sft_model=, entropy= or segment_ends="):
        segment_evaluation(rm, ids, mask, response)
    config = copy.deepcopy(rm.config)
    config._name_or_path = ""  # a model built in memory, not loaded from a directory
    bare = AutoModelForSequenceClassification.from_config(config)
    with pytest.raises(ValueError, match="pass settings=<reward model directory>"):
        segment_evaluation(bare, ids, mask, response, entropy=torch.zeros_like(ids, dtype=torch.float))


def _same(a, b) -> bool:
    """Exactly equal results of a scorer call: a ``SequenceEvaluation`` (every tensor) or a ``SegmentView``."""
    if isinstance(a, SegmentView):
        return a == b
    parts = lambda ev: (ev.values, ev.seg_rewards, ev.segments.ids, ev.segments.ends)  # noqa: E731
    return all(torch.equal(x, y) for x, y in zip(parts(a), parts(b)))


def test_one_scorer_shared_by_8_threads_gives_every_caller_its_own_exact_answer(segment_rm_dir, toy_tok, toy_data):
    """320 calls of random kinds and batch sizes (``evaluate`` on 1-8 responses, ``score`` of one), each with one
    torch thread, run serially and then by 8 threads at once on ONE SegmentScorer: every result is exactly the serial
    one. (Before: the score head's output was kept in one slot per model, so a forward in one thread overwrote
    another's: errors from another thread's shapes, and wrong e_phi without an error.)"""
    from rlhf_ext.runtime.async_runner import torch_threads
    from rlhf_ext.runtime.token_scores import SegmentScorer

    scorer = SegmentScorer(segment_rm_dir)
    rng = random.Random(0)
    rows = [toy_data["test"][i] for i in range(64)]
    calls = []
    for _ in range(320):
        if rng.random() < 0.25:
            row = rng.choice(rows)
            calls.append((scorer.score, (row["prompt"], row["chosen"])))
        else:
            calls.append((scorer.evaluate, encode(rng.sample(rows, rng.randint(1, 8)), toy_tok)))

    def call(i: int):
        fn, args = calls[i]
        with torch_threads(1):
            return fn(*args)

    serial = [call(i) for i in range(len(calls))]
    start = threading.Barrier(8)
    with ThreadPoolExecutor(8, initializer=start.wait) as pool:
        futures = [pool.submit(call, i) for i in range(len(calls))]
    errors = [f.exception() for f in futures if f.exception() is not None]
    mismatches = sum(not _same(f.result(), s) for f, s in zip(futures, serial) if f.exception() is None)
    assert (len(calls), len(errors), mismatches) == (320, 0, 0), errors[:3]


def test_one_token_score_capture_shared_by_threads_keeps_each_forward_for_its_caller(loaded, toy_tok, toy_data):
    """A trainer's capture object used by several threads: each pops the scores of its own forward pass."""
    from rlhf_ext.runtime.async_runner import torch_threads
    from rlhf_ext.runtime.token_scores import TokenScoreCapture

    rm, _ = loaded
    capture = TokenScoreCapture(rm)
    batches = [encode([toy_data["test"][i] for i in range(j, j + 1 + j % 4)], toy_tok) for j in range(48)]

    def forward_and_pop(ids, mask, _):
        with torch_threads(1), torch.no_grad():
            rm(input_ids=ids, attention_mask=mask)
            return capture.pop()

    try:
        serial = [forward_and_pop(*b) for b in batches]
        with ThreadPoolExecutor(8) as pool:
            threaded = list(pool.map(lambda b: forward_and_pop(*b), batches))
    finally:
        capture.remove()
    assert all(torch.equal(a, b) for a, b in zip(threaded, serial))


def test_reward_functions_shared_by_threads_give_the_serial_scores(segment_rm_dir, toy_data):
    """The two checkpoint reward functions, each called by 8 threads at once with random batches (one torch thread per
    call), return exactly the serial scores (tokenisation under a lock: a fast tokenizer refuses two threads)."""
    from rlhf_ext.runtime.async_runner import torch_threads
    from rlhf_ext.runtime.rewards import SegmentSequenceReward, SequenceClassifierReward

    rng = random.Random(1)
    rows = [toy_data["test"][i] for i in range(64)]
    batches = [rng.sample(rows, rng.randint(1, 6)) for _ in range(64)]
    for reward in (SegmentSequenceReward(segment_rm_dir, device="cpu"), SequenceClassifierReward(segment_rm_dir)):

        def call(batch, reward=reward):
            with torch_threads(1):
                return reward([r["prompt"] for r in batch], [r["chosen"] for r in batch])

        serial = [call(b) for b in batches]
        with ThreadPoolExecutor(8) as pool:
            threaded = list(pool.map(call, batches))
        assert all(torch.equal(a, b) for a, b in zip(threaded, serial)), type(reward).__name__
