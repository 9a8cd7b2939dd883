"""A CPU rollout engine for OpenRLHF 0.11.2's Ray PPO loop: Hugging Face ``generate`` in place of vLLM.

:class:`HFRolloutEngine` is a Ray actor with the part of the vLLM ``RolloutRayActor`` interface OpenRLHF calls:
``generate_responses`` (``RolloutRayActor``'s own), ``generate`` (the requests that arrive together as one left-padded
``model.generate`` batch, by Gumbel-max with noise that is a pure function of engine seed, weights version, prompt,
sample number, step and token: rollouts do not depend on batching), ``load_weights`` (through the Ray object store,
:func:`broadcast_to_hf_engines`, instead of vLLM's NCCL group) and no-op KV-cache / sleep controls.

Chosen with ``--ext.rollout_engine hf`` (or ``auto`` without CUDA); for CPU runs and tests: on GPUs vLLM is faster.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from dataclasses import dataclass
from typing import Any

import ray
import torch

from rlhf_ext.openrlhf.compat import SamplingParams, import_shims
from rlhf_ext.openrlhf.segment_ppo import WEIGHTS_VERSION

with import_shims():
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
    from openrlhf.utils.agent import SingleTurnAgentExecutor

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixing function (lowbias32) on an int64 tensor holding values in ``[0, 2**32)``."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(row_seeds: torch.Tensor, step: int, vocab_size: int) -> torch.Tensor:
    """``[B, V]`` standard Gumbel noise, a pure function of ``(row_seeds[b], step, token)``; ``row_seeds`` ``[B]``
    int64 in ``[0, 2**32)``."""
    row = _hash32(row_seeds * 0x9E3779B1 + step)  # [B]
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=row_seeds.device)
    bits = _hash32(row[:, None] + tokens[None, :] * 0x85EBCA77)  # [B, V]
    uniform = (bits.double() + 0.5) / 2.0**32  # in (0, 1)
    return -torch.log(-torch.log(uniform)).float()


def process_logits(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's order of logit processing: temperature (``<= 0``: greedy, unscaled), top-k, top-p. ``[B, V]`` ->
    ``[B, V]`` with ``-inf`` outside the kept set."""
    scores = scores.float()
    if temperature > 0:
        scores = scores / temperature
    if top_k is not None and 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        remove_sorted = cumulative - sorted_scores.softmax(-1) >= top_p  # keep the smallest set reaching top_p
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, -math.inf)
    return scores


class _GumbelSampler:
    """A ``LogitsProcessor`` that turns ``generate``'s greedy search into exact sampling (Gumbel-max) with
    batch-independent noise, and records the processed log-probabilities for the rollout log-probs."""

    def __init__(self, row_seeds: torch.Tensor, prompt_width: int, params: SamplingParams, keep_logprobs: bool):
        self.row_seeds, self.prompt_width = row_seeds, prompt_width
        self.params, self.keep_logprobs = params, keep_logprobs
        self.logprobs: list[torch.Tensor] = []  # [B] per generated token: log-prob of the sampled token
        self._last: torch.Tensor | None = None  # [B, V] processed log-probs of the step whose token is not known yet

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        p = self.params
        self.finish(input_ids[:, -1])  # the token the previous step sampled
        scores = process_logits(scores, p.temperature, p.top_k, p.top_p)
        if self.keep_logprobs:
            self._last = scores.log_softmax(-1)
        if p.temperature <= 0:
            return scores
        step = input_ids.shape[1] - self.prompt_width
        return scores + gumbel_noise(self.row_seeds, step, scores.shape[-1])

    def finish(self, sampled: torch.Tensor) -> None:
        """Record the log-prob of ``sampled`` (``[B]``) under the pending step's distribution (no [B, T, V] kept)."""
        if self._last is not None:
            self.logprobs.append(self._last.gather(1, sampled[:, None]).squeeze(1))
            self._last = None


@dataclass
class _Logprob:
    logprob: float


@dataclass
class _CompletionOutput:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS) or "length"
    logprobs: list[dict[int, _Logprob]] | None = None


@dataclass
class _RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[_CompletionOutput]


def request_seed(engine_seed: int, version: int, prompt_token_ids: list[int], occurrence: int) -> int:
    """A 32-bit seed for one request: the same prompt's k-th sample in a weights version gets the same noise."""
    digest = hashlib.blake2b(repr((engine_seed, version, tuple(prompt_token_ids), occurrence)).encode(), digest_size=4)
    return int.from_bytes(digest.digest(), "little")


class _HFRolloutEngine(RolloutRayActor.__ray_actor_class__):
    """See the module docstring. Built by :func:`create_hf_rollout_engines`."""

    def __init__(
        self,
        model: str,
        seed: int = 0,
        agent_func_path: str | None = None,
        remote_rm_url: str | list[str] | None = None,
        **_vllm_only: Any,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlhf_ext.openrlhf.compat import patch_for_cpu

        patch_for_cpu()
        if agent_func_path:
            from openrlhf.trainer.ray.vllm_engine import _load_agent_executor

            self.executor = _load_agent_executor(agent_func_path)
        else:
            self.executor = SingleTurnAgentExecutor(remote_rm_url)
        self._mm_pad_token_ids = None
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.model.requires_grad_(False)
        self.seed = int(seed)
        self.version = 0
        self._occurrences: dict[tuple[int, ...], int] = {}
        self._pending: list[tuple[list[int], SamplingParams, asyncio.Future]] = []
        self._flush: asyncio.Task | None = None
        self._running = 0

    # --------------------------------------------------------------------------------------- generation
    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None) -> _RequestOutput:
        if multi_modal_data:
            raise ValueError("the HF rollout engine generates text only; use vLLM for vision-language prompts")
        future = asyncio.get_running_loop().create_future()
        self._pending.append((list(prompt_token_ids), sampling_params, future))
        if self._flush is None:
            self._flush = asyncio.ensure_future(self._generate_pending())
        return await future

    async def _generate_pending(self) -> None:
        # Let every request of the dispatch(es) already on the event loop arrive, then generate them together.
        seen = -1
        while seen != len(self._pending):
            seen = len(self._pending)
            for _ in range(4):
                await asyncio.sleep(0)
        batch, self._pending, self._flush = self._pending, [], None
        groups: dict[tuple, list[int]] = {}
        for i, (_, params, _) in enumerate(batch):
            key = (params.temperature, params.top_p, params.top_k, params.max_tokens, params.min_tokens,
                   params.logprobs is not None, params.skip_special_tokens)  # fmt: skip
            groups.setdefault(key, []).append(i)
        self._running = len(batch)
        try:
            for indices in groups.values():
                outputs = self.generate_batch([batch[i][0] for i in indices], batch[indices[0]][1])
                for i, out in zip(indices, outputs):
                    batch[i][2].set_result(out)
        except Exception as error:  # every waiting request gets the error (the executor re-raises it)
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(error)
        finally:
            self._running = 0

    @torch.no_grad()
    def generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[_RequestOutput]:
        """Sample one response per prompt (token ids) with one left-padded ``generate`` call."""
        if params.stop:
            raise ValueError("the HF rollout engine does not support stop strings; use EOS")
        tok = self.tokenizer
        eos = tok.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        seeds = []
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[i, width - len(prompt) :] = 1
            key = tuple(prompt)
            occurrence = self._occurrences.get(key, 0)
            self._occurrences[key] = occurrence + 1
            seeds.append(request_seed(self.seed, self.version, prompt, occurrence))
        sampler = _GumbelSampler(torch.tensor(seeds, dtype=torch.int64), width, params, params.logprobs is not None)
        max_new = int(params.max_tokens) if params.max_tokens is not None else 16
        sequences = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=params.min_tokens or None,
            logits_processor=[sampler],
            eos_token_id=eos,
            pad_token_id=pad,
            num_beams=1,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        new = sequences[:, width:]
        is_eos = new == eos
        has_eos = is_eos.any(dim=1)
        lengths = torch.where(
            has_eos, is_eos.int().argmax(dim=1) + 1, torch.full_like(has_eos, new.shape[1], dtype=torch.long)
        )
        sampler.finish(new[:, -1])
        logprobs = torch.stack(sampler.logprobs, dim=1) if sampler.logprobs else None  # [B, new]
        outputs = []
        for i, prompt in enumerate(prompts):
            ids = new[i, : lengths[i]].tolist()
            lp = None
            if logprobs is not None:
                lp = [{t: _Logprob(float(v))} for t, v in zip(ids, logprobs[i, : lengths[i]].tolist())]
            text = tok.decode(ids, skip_special_tokens=params.skip_special_tokens)
            finish = "stop" if has_eos[i] else "length"
            outputs.append(_RequestOutput(prompt, [_CompletionOutput(ids, text, finish, lp)]))
        return outputs

    async def generate_responses(self, *args: Any, **kwargs: Any) -> list[dict]:
        """OpenRLHF's ``generate_responses``; each response also reports its weights version
        (``extra_logs["weights_version"]``), from which the experience maker logs ``staleness``."""
        responses = await super().generate_responses(*args, **kwargs)
        for response in responses:
            response["extra_logs"] = {**(response.get("extra_logs") or {}), WEIGHTS_VERSION: float(self.version)}
        return responses

    # --------------------------------------------------------------------------------- engine bookkeeping
    def get_num_unfinished_requests(self) -> int:
        return len(self._pending) + self._running

    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> int:
        """Load the policy's parameters (names as in the HF model); returns the new weights version."""
        missing, unexpected = self.model.load_state_dict(named_tensors, strict=False)
        tied = {k for k in missing if k.endswith("lm_head.weight") and self.model.config.tie_word_embeddings}
        if unexpected or set(missing) - tied:
            raise ValueError(
                f"weights from the policy do not match the rollout model (missing {sorted(set(missing) - tied)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}); LoRA policies need vLLM"
            )
        self.version += 1
        self._occurrences.clear()
        return self.version

    async def _no_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's KV-cache and sleep controls: no-ops (no KV-cache pool)."""

    reset_prefix_cache = sleep = wake_up = pause_generation = resume_generation = _no_kv_cache

    async def init_process_group(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the HF rollout engine receives weights through Ray (load_weights), not a process group")


HFRolloutEngine = ray.remote(_HFRolloutEngine)


def create_hf_rollout_engines(
    num_engines: int,
    tensor_parallel_size: int,
    pretrain: str,
    seed: int,
    full_determinism: bool = False,
    enable_prefix_caching: bool = False,
    enforce_eager: bool = False,
    max_model_len: int | None = None,
    shared_pg: Any = None,
    *args: Any,
    agent_func_path: str | None = None,
    remote_rm_url: str | list[str] | None = None,
    max_images_per_prompt: int = 0,
    **kwargs: Any,
) -> list:
    """Drop-in for ``openrlhf.trainer.ray.create_vllm_engines``: ``num_engines`` HF engines seeded ``seed + i`` and
    placed as vLLM's (bundle ``i`` of ``shared_pg`` with 0.2 GPU, else of a PACK group of their own). The GPUs are Ray
    bookkeeping only: the engines generate on the CPU."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if max_images_per_prompt > 0:
        raise ValueError("the HF rollout engine generates text only; use vLLM for vision-language prompts")
    if tensor_parallel_size != 1:
        raise ValueError("the HF rollout engine does not shard models; set --vllm.tensor_parallel_size 1")
    gpus = 0.2 if shared_pg is not None else 1
    if shared_pg is None:
        shared_pg = placement_group([{"GPU": 1, "CPU": 1}] * num_engines, strategy="PACK")
        ray.get(shared_pg.ready())
    return [
        HFRolloutEngine.options(
            num_cpus=gpus,
            num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=shared_pg, placement_group_capture_child_tasks=True, placement_group_bundle_index=i
            ),
        ).remote(model=pretrain, seed=seed + i, agent_func_path=agent_func_path, remote_rm_url=remote_rm_url)
        for i in range(num_engines)
    ]


def broadcast_to_hf_engines(trainer: Any) -> None:
    """``ActorPPOTrainer.broadcast_to_vllm`` for HF engines: every rank takes part in gathering each ZeRO-3 shard;
    rank 0 sends the full parameters once through the Ray object store to every engine."""
    import deepspeed
    import torch.distributed as dist

    args = trainer.strategy.args
    model = trainer.actor.model.module
    rank0 = dist.get_rank() == 0
    named: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=args.ds.zero_stage == 3):
            if rank0:
                named[name] = param.data.detach().to("cpu", copy=True)
    if rank0:
        ref = ray.put(named)
        ray.get([engine.load_weights.remote(ref) for engine in trainer.vllm_engines])
    dist.barrier()


def _hf_aware(original, replacement):
    """``ActorPPOTrainer`` method that does ``replacement`` when the run's engines are HF engines."""

    def method(self, *args, **kwargs):
        if getattr(getattr(self.strategy.args, "ext", None), "rollout_engine", "vllm") == "hf":
            return replacement(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    method.__wrapped__ = original
    return method


def _in_canonical_order(original):
    """``SamplesGenerator._generate_vllm`` returning its experiences sorted by (prompt, sequence), not in completion
    order: the order sets the summation order of losses, so only this makes two runs with one seed equal bit for bit."""

    def method(self, *args, **kwargs):
        experiences, prompts_consumed, exhausted = original(self, *args, **kwargs)
        experiences = sorted(experiences, key=lambda e: (e.prompts[0], e.sequences[0].tolist()))
        return experiences, prompts_consumed, exhausted

    method.__wrapped__ = original
    return method


def install_in_process() -> None:
    """Use HF engines in this process (idempotent): ``create_vllm_engines`` and samples in a canonical order
    (driver), and the policy actor's weight sync (Ray workers)."""
    import openrlhf.trainer.ray as ray_package
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
    from openrlhf.trainer.ray import ppo_actor

    ray_package.create_vllm_engines = create_hf_rollout_engines
    if not hasattr(SamplesGenerator._generate_vllm, "__wrapped__"):
        SamplesGenerator._generate_vllm = _in_canonical_order(SamplesGenerator._generate_vllm)
    cls = ppo_actor.ActorPPOTrainer
    if not hasattr(cls.broadcast_to_vllm, "__wrapped__"):
        cls._init_vllm_sync_group = _hf_aware(cls._init_vllm_sync_group, lambda self, backend: None)
        cls.broadcast_to_vllm = _hf_aware(cls.broadcast_to_vllm, broadcast_to_hf_engines)
