"""Sampling, scoring and pair collection for online DPO (engine-free; ``transformers`` / vLLM imported on use).

Samplers (paper 004, Algorithm 2 step 4: "sample n responses at two temperatures", no top-k / top-p):

- :class:`HFSampler` — ``transformers`` ``generate`` (CPU or one GPU).
- :class:`VLLMSampler` — vLLM, when it is installed on a GPU machine (imported only when constructed).

Both return :class:`Samples` with the ``[P][n]`` response texts in a fixed layout (for each prompt, the responses of
the first temperature, then the second ...), and load new policy weights with ``load_weights(state_dict)`` (used by
the asynchronous runner) or ``load_policy(path)`` (a saved iterate).

Reward functions have the signature ``reward_fn(prompts, responses) -> tensor[N]`` (one score per response; a
prompt is repeated for each of its responses). Three are built in: :class:`SequenceClassifierReward` (any
``AutoModelForSequenceClassification`` reward model, scored on the same text TRL's ``RewardTrainer`` trains on),
:class:`SegmentSequenceReward` (the sequence evaluation ``e_phi`` of a segment reward model, paper 003 Eq. 4) and any
user callable (e.g. the simulator's annotators). :func:`load_reward` builds one from a recipe string.

:func:`score_and_select` scores ``[P][n]`` samples and forms one pair per prompt with
:func:`~rlhf_ext.online.select_pairs`; :class:`OnlinePairGenerator` is the generator side of per-batch online DPO
(thread or process).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlhf_ext.online.selection import select_pairs

RewardFn = Callable[[list[Any], list[str]], "Tensor | Sequence[float]"]
DEFAULT_TEMPERATURES = (0.7, 1.0)


def split_temperatures(n: int, temperatures: Sequence[float]) -> list[tuple[float, int]]:
    """``[(temperature, count)]``: ``n`` samples split as evenly as possible (earlier temperatures get the extra)."""
    temps = [float(t) for t in temperatures]
    if not temps:
        raise ValueError("temperatures must list at least one sampling temperature (the paper uses [0.7, 1.0])")
    if any(not math.isfinite(t) or t <= 0 for t in temps):
        raise ValueError(f"sampling temperatures must be positive numbers; got {temps}")
    if n < 1:
        raise ValueError(f"the number of samples per prompt must be >= 1; got {n}")
    k = len(temps)
    counts = [n // k + (i < n % k) for i in range(k)]
    return [(t, c) for t, c in zip(temps, counts) if c > 0]


def is_conversation(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def render_prompt(tokenizer, prompt: Any) -> tuple[str, bool]:
    """The text the policy continues: a plain prompt as is, chat messages through the chat template."""
    if is_conversation(prompt):
        if tokenizer.chat_template is None:
            raise ValueError("the prompts are chat messages but the tokenizer has no chat template; set one")
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True), True
    if not isinstance(prompt, str):
        raise TypeError(f"a prompt must be text or a list of chat messages, got {type(prompt).__name__}")
    return prompt, False


def encode_prompts(tokenizer, prompts: Sequence[Any], max_prompt_length: int | None = None) -> list[list[int]]:
    """Token ids of each prompt as TRL's DPOTrainer tokenises it (plain text with the tokenizer's special tokens,
    rendered chat without), cut from the left to ``max_prompt_length``."""
    out = []
    for p in prompts:
        text, is_chat = render_prompt(tokenizer, p)
        ids = tokenizer(text, add_special_tokens=not is_chat)["input_ids"]
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            ids = ids[len(ids) - max_prompt_length :]
        out.append(ids)
    return out


@dataclass
class Samples:
    """``n`` responses for each of ``P`` prompts.

    Attributes:
        texts: ``[P][n]`` decoded responses (special tokens removed).
        num_tokens: ``[P, n]`` long — generated tokens up to and including EOS.
        truncated: ``[P, n]`` bool — the response hit ``max_new_tokens`` without EOS.
        temperatures: ``[n]`` sampling temperature of each column.
    """

    texts: list[list[str]]
    num_tokens: Tensor
    truncated: Tensor
    temperatures: list[float]

    def flat(self) -> list[str]:
        return [t for row in self.texts for t in row]

    def num_chars(self) -> Tensor:
        """``[P, n]`` response lengths in characters (the unit of the paper's Eq. 9)."""
        return torch.tensor([[len(t) for t in row] for row in self.texts], dtype=torch.float32)


def _response_lengths(gen: Tensor, eos_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """``[B]`` tokens up to and including the first EOS (``T`` if none) and ``[B]`` bool truncated, for ``[B, T]``."""
    is_eos = torch.isin(gen, torch.tensor(list(eos_ids), device=gen.device))
    has = is_eos.any(dim=1)
    first = is_eos.int().argmax(dim=1)
    return torch.where(has, first + 1, gen.shape[1]).cpu(), (~has).cpu()


def _assemble(per_temp: list[tuple[float, int, list[str], Tensor, Tensor]], num_prompts: int) -> Samples:
    """Interleave per-temperature results (each ``[P * c]``, prompt-major) into the ``[P][n]`` layout."""
    texts: list[list[str]] = [[] for _ in range(num_prompts)]
    tokens, truncs, temps = [], [], []
    for temp, c, t_texts, t_tokens, t_trunc in per_temp:
        for i in range(num_prompts):
            texts[i].extend(t_texts[i * c : (i + 1) * c])
        tokens.append(t_tokens.view(num_prompts, c))
        truncs.append(t_trunc.view(num_prompts, c))
        temps.extend([temp] * c)
    return Samples(texts, torch.cat(tokens, dim=1), torch.cat(truncs, dim=1), temps)


class HFSampler:
    """Sample with ``transformers`` ``generate`` (``do_sample``, no top-k / top-p unless set).

    Args:
        model: a causal LM (used as is) or a checkpoint path.
        tokenizer: the policy's tokenizer.
        max_new_tokens: response length limit.
        temperatures: the temperatures ``n`` is split across (paper: 0.7 and 1.0).
        batch_size: sequences per ``generate`` call.
        max_prompt_length: prompts are cut from the left to this many tokens.
        top_p, top_k: nucleus / top-k filtering (paper: none, i.e. 1.0 and 0).
        device: where the sampling model runs (default: CUDA if available).
    """

    def __init__(
        self,
        model,
        tokenizer,
        max_new_tokens: int = 256,
        temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
        batch_size: int = 64,
        max_prompt_length: int | None = None,
        top_p: float = 1.0,
        top_k: int = 0,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperatures = list(temperatures)
        self.batch_size = batch_size
        self.max_prompt_length = max_prompt_length
        self.top_p, self.top_k = top_p, top_k
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype
        self.model = None
        if isinstance(model, str | Path):
            self.load_policy(model)
        else:
            self.model = model.to(self.device).eval()
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token")
        self.pad_id = pad
        eos = self.model.generation_config.eos_token_id
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos)

    def load_policy(self, path: str | Path) -> None:
        """Sample from the checkpoint at ``path`` from now on."""
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype).to(self.device).eval()

    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        """Install new policy weights (same architecture), e.g. published by the learner."""
        self.model.load_state_dict(state_dict)

    def release(self) -> None:
        """Free the sampling model (before training on the same device)."""
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.no_grad()
    def sample(
        self,
        prompts: Sequence[Any],
        n: int,
        temperatures: Sequence[float] | None = None,
        seed: int | None = None,
    ) -> Samples:
        """``n`` responses per prompt, split across ``temperatures`` (default: the sampler's).

        With ``seed`` the draw is reproducible and the global RNG is left untouched (main thread only; the
        asynchronous generator thread passes no seed).
        """
        if self.model is None:
            raise RuntimeError("the sampler has no model loaded; call load_policy(path) first")
        groups = split_temperatures(n, temperatures or self.temperatures)
        encoded = encode_prompts(self.tokenizer, prompts, self.max_prompt_length)
        rng = torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else [])
        with rng if seed is not None else contextlib.nullcontext():
            if seed is not None:
                torch.manual_seed(seed)
            per_temp = [(t, c, *self._generate(encoded, c, t)) for t, c in groups]
        return _assemble(per_temp, len(encoded))

    def _generate(self, encoded: list[list[int]], copies: int, temperature: float):
        seqs = [ids for ids in encoded for _ in range(copies)]
        texts: list[str] = []
        lengths, truncated = [], []
        for start in range(0, len(seqs), self.batch_size):
            chunk = seqs[start : start + self.batch_size]
            width = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, s in enumerate(chunk):  # left padding: the response starts at column `width` for every row
                ids[i, width - len(s) :] = torch.tensor(s)
                mask[i, width - len(s) :] = 1
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                do_sample=True,
                temperature=temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                max_new_tokens=self.max_new_tokens,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_ids,
                use_cache=True,
            )
            gen = out[:, width:]
            n_tok, trunc = _response_lengths(gen, self.eos_ids)
            # keep tokens up to the first EOS (generate pads finished rows with the pad id, which may differ)
            keep = torch.arange(gen.shape[1], device=gen.device).unsqueeze(0) < n_tok.to(gen.device).unsqueeze(1)
            texts.extend(self.tokenizer.batch_decode(gen.masked_fill(~keep, self.pad_id), skip_special_tokens=True))
            lengths.append(n_tok)
            truncated.append(trunc)
        return texts, torch.cat(lengths), torch.cat(truncated)


class VLLMSampler:
    """Sample with vLLM (GPU). Same interface as :class:`HFSampler`.

    Args:
        model: checkpoint path of the initial policy.
        tokenizer: the policy's tokenizer (prompts are tokenised here, exactly as for HF, and passed as token ids).
        gpu_memory_utilization: share of GPU memory vLLM may take (the trainer shares the GPU).
        llm: an existing ``vllm.LLM`` to use instead of creating one.
        llm_kwargs: extra ``vllm.LLM`` arguments (``tensor_parallel_size``, ``dtype``, ``max_model_len`` ...).
    """

    def __init__(
        self,
        model: str | Path,
        tokenizer,
        max_new_tokens: int = 256,
        temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
        max_prompt_length: int | None = None,
        top_p: float = 1.0,
        top_k: int = 0,
        gpu_memory_utilization: float = 0.3,
        llm=None,
        **llm_kwargs: Any,
    ):
        try:
            vllm = importlib.import_module("vllm")
        except ImportError as e:
            raise ImportError(
                "generation_backend='vllm' needs vLLM: `pip install rlhf-ext[vllm]` on a CUDA machine, or use "
                "generation_backend='hf'"
            ) from e
        self._sampling_params = vllm.SamplingParams
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperatures = list(temperatures)
        self.max_prompt_length = max_prompt_length
        self.top_p = top_p
        self.top_k = top_k if top_k > 0 else -1  # vLLM: -1 disables top-k
        if llm is None:
            llm = vllm.LLM(model=str(model), gpu_memory_utilization=gpu_memory_utilization, **llm_kwargs)
        self.llm = llm

    def sample(
        self,
        prompts: Sequence[Any],
        n: int,
        temperatures: Sequence[float] | None = None,
        seed: int | None = None,
    ) -> Samples:
        groups = split_temperatures(n, temperatures or self.temperatures)
        encoded = encode_prompts(self.tokenizer, prompts, self.max_prompt_length)
        per_temp = []
        for g, (temp, c) in enumerate(groups):
            params = self._sampling_params(
                n=c,
                temperature=temp,
                top_p=self.top_p,
                top_k=self.top_k,
                max_tokens=self.max_new_tokens,
                seed=None if seed is None else seed + g,
            )
            outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in encoded], params, use_tqdm=False)
            texts, tokens, truncs = [], [], []
            for out in outputs:
                for comp in out.outputs:
                    texts.append(comp.text)
                    tokens.append(len(comp.token_ids))
                    truncs.append(comp.finish_reason == "length")
            per_temp.append((temp, c, texts, torch.tensor(tokens), torch.tensor(truncs)))
        return _assemble(per_temp, len(encoded))

    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        """Load new policy weights into the running engine (TRL's colocate path) and drop its prefix cache."""
        model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        model.load_weights(state_dict.items())
        self.llm.reset_prefix_cache()

    def load_policy(self, path: str | Path) -> None:
        """Load the weights of the checkpoint at ``path`` (same architecture) into the engine."""
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path} has no .safetensors weights to load into vLLM")
        state: dict[str, Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        self.load_weights(state)

    def release(self) -> None:
        """vLLM keeps its memory (``gpu_memory_utilization``) for the whole run."""


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
    ``RewardTrainer`` builds it, and the score is the model's output at the last real token."""

    def __init__(self, model, tokenizer=None, batch_size: int = 32, device: str | torch.device | None = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(model, str | Path):
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model))
            model = AutoModelForSequenceClassification.from_pretrained(str(model), num_labels=1, dtype=torch.float32)
        if tokenizer is None:
            raise ValueError("pass tokenizer= when the reward model is already instantiated")
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
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
        from rlhf_ext.segment.data import pad_sequences

        ids = []
        for p, r in zip(prompts, responses):
            text, is_chat = self._text(p, r)
            ids.append(self.tokenizer(text, add_special_tokens=not is_chat)["input_ids"])
        out = []
        for start in range(0, len(ids), self.batch_size):
            chunk = ids[start : start + self.batch_size]
            input_ids = pad_sequences(chunk, self.pad_id, "right", torch.long).to(self.device)
            mask = pad_sequences([[1] * len(s) for s in chunk], 0, "right", torch.long).to(self.device)
            out.append(self.model(input_ids=input_ids, attention_mask=mask).logits[:, 0].float().cpu())
        return torch.cat(out) if out else torch.zeros(0)


class SegmentSequenceReward:
    """Score with a segment reward model's sequence evaluation ``e_phi(x, y)`` (paper 003, Eq. 4): the SFT model
    segments each response by entropy, the reward model scores each segment's last token, and the segment rewards
    are aggregated — the same :func:`~rlhf_ext.segment.evaluate_sequences` path training uses."""

    def __init__(self, reward_model: str | Path, sft_model: str | None = None, batch_size: int = 16, device=None):
        from rlhf_ext.segment.scoring import SegmentScorer

        self.scorer = SegmentScorer(str(reward_model), sft_model=sft_model)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.scorer.reward_model.to(self.device)
        self.scorer.sft_model.to(self.device)
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, prompts: list[Any], responses: list[str]) -> Tensor:
        from rlhf_ext.segment.core import evaluate_sequences
        from rlhf_ext.segment.data import pad_sequences, sft_token_entropy, tokenize_pair
        from rlhf_ext.segment.scoring import token_scores

        tok = self.scorer.tokenizer
        rows = []
        for p, r in zip(prompts, responses):
            resp = [{"role": "assistant", "content": r}] if is_conversation(p) else r
            rows.append(tokenize_pair({"prompt": p, "chosen": resp, "rejected": resp}, tok))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        out = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            seqs = [row["chosen_ids"] for row in chunk]
            ids = pad_sequences(seqs, pad, "right", torch.long).to(self.device)
            mask = pad_sequences([[1] * len(s) for s in seqs], 0, "right", torch.long).to(self.device)
            action = [[0] * row["prompt_len"] + [1] * (len(s) - row["prompt_len"]) for row, s in zip(chunk, seqs)]
            action_mask = pad_sequences(action, 0, "right", torch.long).bool().to(self.device)
            entropy = sft_token_entropy(self.scorer.sft_model, ids, mask)
            scores = token_scores(self.scorer.reward_model, ids, mask)
            ev = evaluate_sequences(
                scores, entropy, action_mask, self.scorer.cutoff, self.scorer.aggregation, self.scorer.tau
            )
            out.append(ev.values.float().cpu())
        return torch.cat(out) if out else torch.zeros(0)


def keyphrase_gold_reward(prompts: list[Any], responses: list[str]) -> Tensor:
    """The toy task's gold reward (``builtin:keyphrase-gold``): 1 if the response contains a key phrase, else 0."""
    from rlhf_ext.testing.toy import has_key_phrase

    return torch.tensor([float(has_key_phrase(r)) for r in responses])


BUILTIN_REWARDS: dict[str, RewardFn] = {"builtin:keyphrase-gold": keyphrase_gold_reward}


def load_reward(
    spec: str,
    kind: str = "auto",
    batch_size: int = 32,
    sft_model: str | None = None,
    device: str | torch.device | None = None,
) -> RewardFn:
    """A reward function from a recipe string.

    ``spec`` is ``builtin:keyphrase-gold``, ``module.path:callable`` (a user function or a factory's result, e.g.
    the simulator's annotators), a reward-model checkpoint directory, or the hub id of a sequence classifier.
    ``kind`` for checkpoints: ``segment`` (a segment reward model, scored by ``e_phi``), ``sequence_classification``,
    or ``auto`` (segment if the directory has rlhf-ext's ``segment_config.json``).
    """
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if spec.startswith("builtin:"):
        raise ValueError(f"unknown builtin reward {spec!r}; choose one of {', '.join(BUILTIN_REWARDS)}")
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
                f"sequence classifier), 'module:function' or one of {', '.join(BUILTIN_REWARDS)}"
            )
        return SequenceClassifierReward(spec, batch_size=batch_size, device=device)  # a hub id
    from rlhf_ext.segment.data import SEGMENT_CONFIG_NAME

    if kind == "auto":
        kind = "segment" if (path / SEGMENT_CONFIG_NAME).is_file() else "sequence_classification"
    if kind == "segment":
        return SegmentSequenceReward(path, sft_model=sft_model, batch_size=batch_size, device=device)
    if kind == "sequence_classification":
        return SequenceClassifierReward(str(path), batch_size=batch_size, device=device)
    raise ValueError(f"reward kind must be 'auto', 'segment' or 'sequence_classification'; got {kind!r}")


def make_sampler(
    backend: str,
    policy: str | Path,
    tokenizer,
    *,
    max_new_tokens: int,
    temperatures: Sequence[float],
    batch_size: int,
    max_prompt_length: int | None,
    top_p: float,
    top_k: int,
    vllm_kwargs: dict[str, Any] | None = None,
):
    """``hf``, ``vllm``, or ``auto`` (vLLM when importable and CUDA is available, else HF)."""
    if backend == "auto":
        backend = "vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None else "hf"
    common = dict(
        max_new_tokens=max_new_tokens,
        temperatures=temperatures,
        max_prompt_length=max_prompt_length,
        top_p=top_p,
        top_k=top_k,
    )
    if backend == "hf":
        return HFSampler(str(policy), tokenizer, batch_size=batch_size, **common)
    if backend == "vllm":
        return VLLMSampler(str(policy), tokenizer, **common, **(vllm_kwargs or {}))
    raise ValueError(f"generation_backend must be 'auto', 'hf' or 'vllm'; got {backend!r}")


# ------------------------------------------------------------------------------------------- pair collection
@dataclass(frozen=True)
class SelectionSettings:
    """How :func:`score_and_select` forms pairs (paper 004, Eq. 9; see :func:`~rlhf_ext.online.select_pairs`)."""

    rule: str = "max_min"
    length_penalty: float = 0.0
    length_unit: str = "chars"
    tie_tolerance: float = 0.0

    @classmethod
    def from_args(cls, args) -> SelectionSettings:
        """From an :class:`~rlhf_ext.trl.IterativeDPOConfig`."""
        return cls(args.selection_rule, args.length_penalty, args.length_unit, args.tie_tolerance)


def score_and_select(
    prompts: list[Any],
    ids: list[int],
    samples,
    reward_fn: RewardFn,
    settings: SelectionSettings,
    generator: torch.Generator,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Score ``samples`` (``[P][n]`` responses of ``prompts``) and pick one pair per prompt (Eq. 9).

    Returns the pair rows (one dict per kept prompt, in prompt order) and statistics of the scored samples.
    """
    n = len(samples.temperatures)
    flat_prompts = [p for p in prompts for _ in range(n)]
    rewards = score(reward_fn, flat_prompts, samples.flat()).view(len(prompts), n)
    lengths = samples.num_chars() if settings.length_unit == "chars" else samples.num_tokens.float()
    sel = select_pairs(
        rewards,
        lengths=lengths,
        rule=settings.rule,
        length_penalty=settings.length_penalty,
        texts=samples.texts,
        tie_tolerance=settings.tie_tolerance,
        generator=generator,
    )
    rows = []
    for j, (i, c, r) in enumerate(zip(sel.prompt_index.tolist(), sel.chosen.tolist(), sel.rejected.tolist())):
        rows.append(
            {
                "prompt": prompts[i],
                "chosen": samples.texts[i][c],
                "rejected": samples.texts[i][r],
                "chosen_reward": float(rewards[i, c]),
                "rejected_reward": float(rewards[i, r]),
                "margin": float(sel.margin[j]),
                "reward_margin": float(sel.reward_margin[j]),
                "prompt_id": ids[i],
                "chosen_index": c,
                "rejected_index": r,
                "chosen_temperature": samples.temperatures[c],
                "rejected_temperature": samples.temperatures[r],
            }
        )
    stats = {
        "num_prompts": len(prompts),
        "num_samples": n,
        "dropped": sel.dropped,
        "mean_reward": float(rewards.mean()),
        "mean_reward_by_temperature": {
            str(t): float(rewards[:, [j for j, tt in enumerate(samples.temperatures) if tt == t]].mean())
            for t in dict.fromkeys(samples.temperatures)
        },
        "mean_margin": float(sel.reward_margin.mean()) if len(sel) else 0.0,
        "mean_max_min_gap": float((rewards.max(1).values - rewards.min(1).values).mean()),
        "mean_length_chars": float(samples.num_chars().mean()),
        "truncated_fraction": float(samples.truncated.float().mean()),
    }
    return rows, stats


class OnlinePairGenerator:
    """The generator side of online DPO (paper 001): for each batch, sample ``num_samples`` responses for as many
    prompts as pairs are still needed, score them, select pairs; prompts whose responses tie are replaced by the
    next prompts, at most ``max_fill_rounds`` times. Runs in the runner's thread or, pickled, in its process (the
    sampler is then built there on first use; ``reward_fn`` must be picklable).

    Prompts are taken in a fixed shuffled order (``seed``), wrapping around.
    """

    def __init__(
        self,
        prompts: list[Any],
        pairs_per_update: int,
        num_samples: int,
        max_fill_rounds: int,
        selection: SelectionSettings,
        reward_fn: RewardFn,
        sampler_spec: dict[str, Any],
        seed: int,
        sampler=None,
    ):
        self.prompts = prompts
        self.pairs_per_update = pairs_per_update
        self.num_samples = num_samples
        self.max_fill_rounds = max_fill_rounds
        self.selection = selection
        self.reward_fn = reward_fn
        self.sampler_spec = sampler_spec
        self.order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed))
        self.cursor = 0
        self._sampler = sampler
        if sampler is not None:
            sampler.load_policy(sampler_spec["policy"])
        else:
            if sampler_spec["backend"] == "vllm":
                raise ValueError("generator_process needs generation_backend='hf' (vLLM runs its own engine process)")
            try:
                pickle.dumps(reward_fn)
            except Exception as e:
                raise ValueError(
                    f"generator_process pickles the reward function to the generator process, but {reward_fn!r} "
                    f"cannot be pickled ({e}); use a module-level function or a reward-model object"
                ) from e

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_sampler": None}

    @property
    def sampler(self):
        if self._sampler is None:
            self._sampler = make_sampler(**self.sampler_spec)
        return self._sampler

    def _take(self, m: int) -> tuple[list[Any], list[int]]:
        pos = (self.cursor + torch.arange(m)) % len(self.prompts)
        self.cursor += m
        ids = self.order[pos].tolist()
        return [self.prompts[i] for i in ids], ids

    def generate(self, index: int, version: int) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for _ in range(self.max_fill_rounds + 1):
            prompts, ids = self._take(self.pairs_per_update - len(rows))
            samples = self.sampler.sample(prompts, self.num_samples)
            new, _ = score_and_select(
                prompts, ids, samples, self.reward_fn, self.selection, torch.Generator().manual_seed(index)
            )
            rows.extend(new)
            if len(rows) == self.pairs_per_update:
                return rows
        raise RuntimeError(
            f"online batch {index}: only {len(rows)} of {self.pairs_per_update} prompts gave a preference pair after "
            f"{self.max_fill_rounds + 1} sampling rounds (the others' {self.num_samples} responses tied). Use a "
            "reward with finer resolution, more samples per prompt (num_samples), or a larger max_fill_rounds."
        )

    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.sampler.load_weights(weights)
