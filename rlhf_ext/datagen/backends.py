"""The inference backends behind the interface of :mod:`rlhf_ext.datagen.chat`: ``offline``, ``hf`` and ``openai``
(:mod:`rlhf_ext.datagen.openai_backend`); :func:`make_backend` builds the one a config asks for. The mappers' parsers
read every answer, the offline backend's too, so the same code path is exercised everywhere.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from rlhf_ext.datagen.chat import (
    REQUEST_KINDS,
    Backend,
    BackendUnavailable,
    ChatCompletion,
    ChatRequest,
    RequestRejected,
)
from rlhf_ext.datagen.mappers import format_pair
from rlhf_ext.datagen.openai_backend import OpenAIBackend
from rlhf_ext.datagen.phrasebank import PhraseBank, compose_prompt, compose_response, rubric_for


class OfflineBackend(Backend):
    """Deterministic, model-free answers composed from the request's ``context`` with the phrase bank (see
    :mod:`rlhf_ext.datagen.phrasebank`), seeded by ``request.seed``.

    * ``prompt``: :func:`compose_prompt` for ``context["objective_kind"]`` and ``context["seed_words"]``.
    * ``pair``: a chosen response that follows ``context["style"]`` and a rejected one that violates it, in the
      ``CHOSEN:``/``REJECTED:`` format.
    * ``response``: one response with ``context["stance"]`` (follow / violate / unstated).
    * ``judge``: ``A`` or ``B`` by gold score of ``context["a"]`` vs ``context["b"]``; ``TIE`` (unparseable) on ties.
    """

    name = "offline"

    def __init__(self, bank: PhraseBank, markers_per_response: int = 2):
        self.bank = bank
        self.markers = markers_per_response

    async def complete(self, request: ChatRequest) -> ChatCompletion:
        return ChatCompletion(self.answer(request))

    def answer(self, request: ChatRequest) -> str:
        ctx = request.context
        rng = random.Random(request.seed)
        if request.kind == "prompt":
            return compose_prompt(self.bank, ctx["objective_kind"], list(ctx["seed_words"]), rng)
        if request.kind == "judge":
            rubric = rubric_for(ctx["style"], self.bank)
            a, b = rubric.score(ctx["a"]), rubric.score(ctx["b"])
            return "A" if a > b else "B" if b > a else "TIE"
        common = dict(
            style=ctx["style"],
            objective_kind=ctx["objective_kind"],
            seed_words=list(ctx["seed_words"]),
            axes=[tuple(a) for a in ctx.get("axes", ())],
            markers=self.markers,
        )
        if request.kind == "pair":
            chosen = compose_response(self.bank, stance="follow", rng=rng, **common)
            rejected = compose_response(self.bank, stance="violate", rng=rng, **common)
            return format_pair(chosen, rejected)
        if request.kind == "response":
            return compose_response(self.bank, stance=ctx["stance"], rng=rng, **common)
        raise ValueError(f"unknown request kind {request.kind!r}; expected one of {', '.join(REQUEST_KINDS)}")

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "markers_per_response": self.markers}


class HFBackend(Backend):
    """A local transformers causal LM, one request at a time in a worker thread (deterministic per request seed), with
    the tokenizer's chat template when it has one; ``max_tokens`` is clamped to the model's context."""

    name = "hf"

    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32"):
        self.model_spec, self.device, self.dtype = model, device, dtype
        self._model = self._tokenizer = self._executor = None

    async def start(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlhf-ext-hf")
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlhf_ext.zoo.builtins import resolve_model

        try:
            path = resolve_model(self.model_spec)
            self._tokenizer = AutoTokenizer.from_pretrained(path)
            self._model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, self.dtype))
        except (OSError, ValueError, RuntimeError) as e:
            raise BackendUnavailable(
                f"cannot load the hf model {self.model_spec!r} ({type(e).__name__}: {e}); pass a local checkpoint "
                "directory, builtin:smollm2 or builtin:tiny-sft (no model hub on this machine)"
            ) from e
        self._model.to(self.device).eval()

    async def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._model = None

    async def complete(self, request: ChatRequest) -> ChatCompletion:
        if self._executor is None:
            raise RuntimeError("HFBackend.start() must be awaited before complete()")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._generate, request)

    def _generate(self, request: ChatRequest) -> ChatCompletion:
        import torch

        tok, model = self._tokenizer, self._model
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
        else:
            text = "\n\n".join(m["content"] for m in request.messages) + "\n\n"
        enc = tok(text, return_tensors="pt", add_special_tokens=False)
        ids = enc["input_ids"].to(self.device)
        context = getattr(model.config, "max_position_embeddings", None) or 2048
        room = context - ids.shape[1]
        if room < 1:
            raise RequestRejected(f"prompt has {ids.shape[1]} tokens; the model's context is {context}")
        max_new = min(request.max_tokens, room)
        torch.manual_seed(request.seed)
        sampling = request.temperature > 0
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=enc["attention_mask"].to(self.device),
                max_new_tokens=max_new,
                do_sample=sampling,
                temperature=request.temperature if sampling else None,
                top_p=1.0 if sampling else None,
                top_k=0 if sampling else None,
                pad_token_id=pad,
            )
        new = out[0, ids.shape[1] :].tolist()
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        finished = bool(new) and new[-1] in eos_ids
        finish = "stop" if finished or len(new) < max_new else "length"
        return ChatCompletion(tok.decode(new, skip_special_tokens=True), finish_reason=finish)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "model": self.model_spec}


def make_backend(spec, bank: PhraseBank | None = None) -> Backend:
    """Build the backend a :class:`~rlhf_ext.datagen.schema.GenerationSpec` asks for."""
    if spec.backend == "offline":
        from rlhf_ext.datagen.phrasebank import load_phrase_bank

        bank = bank if bank is not None else load_phrase_bank(spec.phrase_bank)
        return OfflineBackend(bank, spec.markers_per_response)
    if spec.backend == "hf":
        return HFBackend(spec.model)
    if spec.backend == "openai":
        return OpenAIBackend(
            api_base=spec.api_base,
            model=spec.model,
            api_key_env=spec.api_key_env,
            max_concurrency=spec.max_concurrency,
            timeout=spec.request_timeout,
            max_retries=spec.max_retries,
        )
    raise ValueError(f"unknown backend {spec.backend!r}; choose offline, hf or openai")
