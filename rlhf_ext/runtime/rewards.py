"""Reward functions ``reward_fn(prompts, responses) -> tensor[N]`` (one score per response) and :func:`load_reward`,
which builds one from a recipe string: :class:`SequenceClassifierReward`, :class:`SegmentSequenceReward` (e_phi of a
segment reward model, paper 003 Eq. 4) or any user callable. ``builtin:`` names: :func:`rlhf_ext.zoo.resolve_reward`."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlhf_ext.runtime.io import PicklableLock
from rlhf_ext.runtime.sampling import is_conversation
from rlhf_ext.runtime.segment_data import pad_responses, segment_model_dir

RewardFn = Callable[[list[Any], list[str]], "Tensor | Sequence[float]"]


# ------------------------------------------------------------------------------------------------------ rewards
def score(reward_fn: RewardFn, prompts: Sequence[Any], responses: Sequence[str]) -> Tensor:
    """Call ``reward_fn`` and check its output: a finite float tensor with one score per response."""
    out = reward_fn(list(prompts), list(responses))
    rewards = torch.as_tensor(out, dtype=torch.float32).detach().cpu().flatten()
    if rewards.numel() != len(responses):
        raise ValueError(
            f"the reward function returned {rewards.numel()} scores for {len(responses)} responses; it must return "
            "one score per (prompt, response)"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("the reward function returned NaN or inf scores; check the reward model / function")
    return rewards


class SequenceClassifierReward:
    """Score with a sequence-classification reward model (``num_labels=1``), e.g. one trained by TRL's
    ``RewardTrainer``: the text is ``prompt + response`` plus EOS (chat prompts through the chat template), as
    ``RewardTrainer`` builds it, and the score is the model's output at the last real token. Thread-safe (forward
    passes run concurrently; tokenisation takes a lock)."""

    def __init__(self, model, tokenizer=None, batch_size: int = 32, device: str | torch.device | None = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(model, str | Path):
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model))
            model = AutoModelForSequenceClassification.from_pretrained(str(model), num_labels=1, dtype=torch.float32)
        if tokenizer is None:
            raise ValueError("pass tokenizer= when the reward model is already instantiated")
        self.model, self.tokenizer, self.batch_size = model.to(self.device).eval(), tokenizer, batch_size
        self._tokenizer_lock = PicklableLock()  # a fast tokenizer may refuse two threads at once ("Already borrowed")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def _text(self, prompt: Any, response: str) -> tuple[str, bool]:
        if is_conversation(prompt):
            messages = list(prompt) + [{"role": "assistant", "content": response}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False), True
        eos = self.tokenizer.eos_token or ""
        text = prompt + response
        return (text if text.endswith(eos) else text + eos), False

    @torch.no_grad()
    def __call__(self, prompts: list[Any], responses: list[str]) -> Tensor:
        ids = []
        with self._tokenizer_lock:
            for p, r in zip(prompts, responses):
                text, is_chat = self._text(p, r)
                ids.append(self.tokenizer(text, add_special_tokens=not is_chat)["input_ids"])
        out = []
        for start in range(0, len(ids), self.batch_size):
            chunk = ids[start : start + self.batch_size]
            input_ids, mask, _ = pad_responses(chunk, [0] * len(chunk), self.pad_id, self.device)
            out.append(self.model(input_ids=input_ids, attention_mask=mask).logits[:, 0].float().cpu())
        return torch.cat(out) if out else torch.zeros(0)


class SegmentSequenceReward:
    """Score with a segment reward model's sequence evaluation ``e_phi(x, y)`` (paper 003, Eq. 4), the path training
    uses (:func:`~rlhf_ext.segment.evaluate_sequences`); thread-safe. Also a TRL reward function
    (``reward_funcs=[SegmentSequenceReward("runs/rm")]``, logged under the directory's name), unlike a plain
    ``reward_funcs="runs/rm"``, which would train on the last-token score the model was not trained to give."""

    def __init__(self, reward_model: str | Path, sft_model: str | None = None, batch_size: int = 16, device=None):
        from rlhf_ext.runtime.token_scores import SegmentScorer

        self.scorer = SegmentScorer(str(reward_model), sft_model=sft_model)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.scorer.reward_model.to(self.device)
        self.scorer.sft_model.to(self.device)
        self.batch_size = batch_size
        self.__name__ = Path(reward_model).name  # TRL logs rewards/<name>/mean

    @torch.no_grad()
    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> Tensor:
        """``[N]`` e_phi of each (prompt, completion); a completion is text or a list of assistant messages."""

        def response(prompt: Any, completion: Any) -> Any:
            if isinstance(completion, list) or not is_conversation(prompt):
                return completion
            return [{"role": "assistant", "content": completion}]

        tok = self.scorer.tokenizer
        rows = [self.scorer.encode(p, response(p, c)) for p, c in zip(prompts, completions)]
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        out = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            batch = pad_responses([r["chosen_ids"] for r in chunk], [r["prompt_len"] for r in chunk], pad, self.device)
            out.append(self.scorer.evaluate(*batch).values.float().cpu())
        return torch.cat(out) if out else torch.zeros(0)


def segment_reward_as_e_phi(reward: Any, where: str) -> Any:
    """A reward given where a reward model is accepted (``reward_funcs``), with a segment reward model scored by e_phi:
    its directory becomes :class:`SegmentSequenceReward`; a segment reward model already loaded (as a sequence
    classifier it would be scored at its last token) is a ``ValueError`` naming the fix; anything else is returned
    unchanged."""
    path = segment_model_dir(reward)
    if path is None:
        return reward
    if isinstance(reward, str | Path):
        return SegmentSequenceReward(path)
    raise ValueError(
        f"{where} is a segment reward model ({path}) loaded as a sequence classifier, which would score only its "
        f"last token; pass its directory {str(path)!r} instead (scored by its sequence evaluation e_phi)"
    )


def reward_sources(args: Any, reward_funcs, reward_model, environment_factory) -> tuple[list | None, bool]:
    """The reward of a ``DensePPOConfig`` run (:class:`~rlhf_ext.trl.segment_ppo.DensePPOTrainer`): GRPO's
    ``reward_funcs`` as a list (a segment reward model's directory scored by its e_phi) or ``None``, and
    whether the run trains on GRPO's sequence rewards (reward functions or an environment's reward) rather than a
    segment reward model (``reward_model`` or ``args.reward_model_path``); refuses both and neither. Sets an unset
    ``args.granularity`` to the source's default (:func:`~rlhf_ext.algos.segment_dense.resolve_granularity`)."""
    if isinstance(reward_funcs, list) and not reward_funcs:
        reward_funcs = None
    if reward_funcs is not None:  # a segment reward model's directory is scored by e_phi, not at its last token
        funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        reward_funcs = [segment_reward_as_e_phi(f, f"reward_funcs[{i}]") for i, f in enumerate(funcs)]
    has_segment_rm = reward_model is not None or args.reward_model_path is not None
    if reward_funcs is not None and has_segment_rm:
        raise ValueError(
            "DensePPOTrainer got both reward_funcs= and a segment reward model (DensePPOConfig."
            "reward_model_path / reward_model=): pass only one — drop reward_funcs to train on segment rewards, "
            "or unset reward_model_path/reward_model to train on the reward functions' sequence reward"
        )
    # GRPO's reward sources (reward_funcs, or an environment's reward) give a sequence-level reward
    uses_reward_funcs = reward_funcs is not None or (not has_segment_rm and environment_factory is not None)
    if not uses_reward_funcs and not has_segment_rm:
        raise ValueError(
            "DensePPOTrainer needs a reward: set DensePPOConfig.reward_model_path (or reward_model=) for "
            "segment rewards, or pass reward_funcs= for a sequence-level reward as in GRPO"
        )
    from rlhf_ext.algos.segment_dense import resolve_granularity

    args.granularity = resolve_granularity(args.granularity, spans=uses_reward_funcs)
    if uses_reward_funcs:
        from rlhf_ext.algos.spans import check_span_granularity

        check_span_granularity(args.granularity)
    return reward_funcs, uses_reward_funcs


def load_reward(
    spec: str,
    kind: str = "auto",
    batch_size: int = 32,
    sft_model: str | None = None,
    device: str | torch.device | None = None,
) -> RewardFn:
    """A reward function from a recipe string: ``module.path:callable``, a reward-model checkpoint directory, or the
    hub id of a sequence classifier (``builtin:`` names are refused). ``kind`` for checkpoints: ``segment`` (scored
    by ``e_phi``), ``sequence_classification``, or ``auto`` (segment if the directory has ``segment_config.json``)."""
    if spec.startswith("builtin:"):
        raise ValueError(f"{spec!r} is a builtin name: resolve it with rlhf_ext.zoo.resolve_reward({spec!r})")
    path = Path(spec)
    if not path.exists() and ":" in spec:
        module, _, name = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(
                f"reward function {spec!r} could not be imported ({e}); use 'package.module:function'"
            ) from e
        if not callable(fn):
            raise ValueError(f"reward function {spec!r} is not callable")
        return fn
    if not path.exists():
        if kind == "segment" or spec.startswith(("/", ".")) or spec.count("/") != 1:
            raise FileNotFoundError(
                f"reward model {spec!r} does not exist; give a reward-model checkpoint directory (or a hub id of a "
                "sequence classifier) or 'module:function'"
            )
        return SequenceClassifierReward(spec, batch_size=batch_size, device=device)  # a hub id
    if kind == "auto":
        kind = "segment" if segment_model_dir(path) is not None else "sequence_classification"
    if kind == "segment":
        return SegmentSequenceReward(path, sft_model=sft_model, batch_size=batch_size, device=device)
    if kind == "sequence_classification":
        return SequenceClassifierReward(str(path), batch_size=batch_size, device=device)
    raise ValueError(f"reward kind must be 'auto', 'segment' or 'sequence_classification'; got {kind!r}")
