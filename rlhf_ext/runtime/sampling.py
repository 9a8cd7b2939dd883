"""Sampling for online DPO and the simulator (paper 004, Algorithm 2 step 4: "sample n responses at two
temperatures", no top-k / top-p): :class:`HFSampler` (``transformers`` ``generate``) and :class:`VLLMSampler`.

Both return :class:`Samples` (``[P][n]`` texts: for each prompt, the responses of the first temperature, then the
second ...) and load new weights with ``load_weights(state_dict)`` or ``load_policy(path)``. A draw with ``seed=`` is
reproducible: the HF sampler then draws every token with its own ``torch.Generator`` (:class:`SeededTokenSampler`),
never touching the process-wide RNG the training thread uses.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlhf_ext.runtime.io import stable_hash

DEFAULT_TEMPERATURES = (0.7, 1.0)


def sampling_seed(seed: int, *position: Any) -> int:
    """The seed of one draw of a run seeded with ``seed``, at ``position`` (e.g. ``"online", batch_index,
    fill_round``): the same in every run with that seed, on every process, and different for every position."""
    return int(stable_hash(seed, *position), 16) % (2**31 - 1)


class SeededTokenSampler:
    """A ``generate`` logits processor that draws each next token itself, with its own ``torch.Generator``.

    It applies transformers' warpers (temperature, top-k, top-p, in that order), draws one token per row with
    ``generator`` and leaves only that token finite, so greedy decoding emits it: the draw depends on ``generator``
    only (seeded like the global RNG, it draws the same tokens as ``do_sample=True``). Use :meth:`generate_kwargs`.
    ``token_logprobs``: per generated position, the ``[B]`` log-probability of the drawn token.
    """

    def __init__(self, generator: torch.Generator, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        warpers = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
        warpers += [TopKLogitsWarper(top_k=top_k)] if top_k else []
        warpers += [TopPLogitsWarper(top_p=top_p)] if top_p < 1.0 else []
        self.warpers = LogitsProcessorList(warpers)
        self.generator = generator
        self.token_logprobs: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        warped = self.warpers(input_ids, scores)
        token = torch.multinomial(torch.softmax(warped, dim=-1), num_samples=1, generator=self.generator)
        self.token_logprobs.append(warped.log_softmax(dim=-1).gather(1, token).squeeze(1))
        return torch.full_like(warped, -math.inf).scatter(1, token, 0.0)

    def generate_kwargs(self) -> dict[str, Any]:
        """The ``generate`` keyword arguments that sample through this processor."""
        from transformers import LogitsProcessorList

        return {"do_sample": False, "logits_processor": LogitsProcessorList([self])}


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
    """``n`` responses for each of ``P`` prompts: ``texts`` ``[P][n]`` (special tokens removed), ``num_tokens``
    ``[P, n]`` (up to and including EOS), ``truncated`` ``[P, n]`` (hit ``max_new_tokens`` without EOS) and the
    ``[n]`` ``temperatures`` of the columns."""

    texts: list[list[str]]
    num_tokens: Tensor
    truncated: Tensor
    temperatures: list[float]

    def flat(self) -> list[str]:
        return [t for row in self.texts for t in row]

    def num_chars(self) -> Tensor:
        """``[P, n]`` response lengths in characters (the unit of paper 004 Eq. 9)."""
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
    """Sample with ``transformers`` ``generate`` from ``model`` (a causal LM or a checkpoint path), ``n`` responses
    split across ``temperatures`` (paper: 0.7 and 1.0; no top-p / top-k), prompts cut from the left to
    ``max_prompt_length`` tokens, ``batch_size`` sequences per ``generate`` call."""

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
        self.tokenizer, self.max_new_tokens, self.temperatures = tokenizer, max_new_tokens, list(temperatures)
        self.batch_size, self.max_prompt_length, self.top_p, self.top_k = batch_size, max_prompt_length, top_p, top_k
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype, self.model = dtype, None
        if isinstance(model, str | Path):
            self.load_policy(model)
        else:
            self.model = model.to(self.device).eval()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self.pad_id is None:
            raise ValueError("the tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token")
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
        self, prompts: Sequence[Any], n: int, temperatures: Sequence[float] | None = None, seed: int | None = None
    ) -> Samples:
        """``n`` responses per prompt, split across ``temperatures`` (default: the sampler's); with ``seed`` drawn by a
        :class:`SeededTokenSampler` (reproducible in any thread), else by transformers from the global RNG."""
        if self.model is None:
            raise RuntimeError("the sampler has no model loaded; call load_policy(path) first")
        groups = split_temperatures(n, temperatures or self.temperatures)
        encoded = encode_prompts(self.tokenizer, prompts, self.max_prompt_length)
        generator = None if seed is None else torch.Generator(self.device).manual_seed(seed)
        per_temp = [(t, c, *self._generate(encoded, c, t, generator)) for t, c in groups]
        return _assemble(per_temp, len(encoded))

    def _generate(self, encoded: list[list[int]], copies: int, temperature: float, generator: torch.Generator | None):
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
            if generator is None:  # transformers' sampling from the global RNG
                sampling = {"do_sample": True, "temperature": temperature, "top_p": self.top_p, "top_k": self.top_k}
            else:
                sampling = SeededTokenSampler(generator, temperature, self.top_k, self.top_p).generate_kwargs()
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                **sampling,
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
    """Sample with vLLM (GPU); same interface as :class:`HFSampler` (prompts tokenised here, as for HF). ``llm``: an
    existing ``vllm.LLM`` to use, else one is made with ``gpu_memory_utilization`` and ``llm_kwargs``."""

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
        self.tokenizer, self.max_new_tokens, self.temperatures = tokenizer, max_new_tokens, list(temperatures)
        self.max_prompt_length, self.top_p = max_prompt_length, top_p
        self.top_k = top_k if top_k > 0 else -1  # vLLM: -1 disables top-k
        if llm is None:
            llm = vllm.LLM(model=str(model), gpu_memory_utilization=gpu_memory_utilization, **llm_kwargs)
        self.llm = llm

    def sample(
        self, prompts: Sequence[Any], n: int, temperatures: Sequence[float] | None = None, seed: int | None = None
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
            comps = [comp for out in outputs for comp in out.outputs]
            tokens = torch.tensor([len(comp.token_ids) for comp in comps])
            truncs = torch.tensor([comp.finish_reason == "length" for comp in comps])
            per_temp.append((temp, c, [comp.text for comp in comps], tokens, truncs))
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
        self.load_weights({name: t for f in files for name, t in load_file(str(f)).items()})

    def release(self) -> None:
        """vLLM keeps its memory (``gpu_memory_utilization``) for the whole run."""


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
