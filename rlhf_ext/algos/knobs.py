"""Knob ranges, declared once next to each knob and checked by one function.

A numeric knob is a dataclass field made by :func:`knob` (``tau: float = knob(0.5, gt=0, help="...")``), its range
kept beside the field. :func:`check_value` checks a value against it at every entry point (:func:`check_knobs` in
``__post_init__``, the recipe loader, OpenRLHF's ``--ext.*`` flags and the command line via :func:`parse_value`); a bad
value is one :class:`KnobError` line: ``train.num_train_epochs must be a number > 0; got 0``.

Numbers are finite unless ``inf=True``; an ``int`` knob takes integers only; booleans and strings are not numbers;
``None`` only where the annotation allows it; a list knob is checked item by item.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, get_args, get_origin, get_type_hints

#: The largest seed: numpy's generators take seeds in [0, 2**32 - 1].
MAX_SEED = 2**32 - 1


class KnobError(ValueError):
    """A knob's value is outside its declared range (or not a number); the message names the knob."""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


@dataclass(frozen=True)
class Range:
    """``ge <= x``, ``gt < x``, ``x <= le``, ``x < lt`` (each optional); ``inf``: ``+inf`` is allowed too."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    inf: bool = False

    def contains(self, x: float) -> bool:
        """Whether the number ``x`` lies in the range (NaN never does)."""
        if math.isnan(x) or (math.isinf(x) and not (self.inf and x > 0)):
            return False
        return (
            (self.ge is None or x >= self.ge)
            and (self.gt is None or x > self.gt)
            and (self.le is None or x <= self.le or (self.inf and x == math.inf))
            and (self.lt is None or x < self.lt or (self.inf and x == math.inf))
        )

    def describe(self, integer: bool = False) -> str:
        """``a number > 0``, ``an integer in [1, 100]``, ``a number in (0, 1]``, ``a number >= 0 (or inf)``."""
        low = (">=", self.ge) if self.ge is not None else (">", self.gt) if self.gt is not None else None
        high = ("<=", self.le) if self.le is not None else ("<", self.lt) if self.lt is not None else None
        what = "an integer" if integer else "a finite number" if not (low or high or self.inf) else "a number"
        if low and high:
            left, right = "[" if low[0] == ">=" else "(", "]" if high[0] == "<=" else ")"
            text = f"{what} in {left}{_num(low[1])}, {_num(high[1])}{right}"
        elif low or high:
            op, bound = low or high
            text = f"{what} {op} {_num(bound)}"
        else:
            text = what
        return text + (" (or inf)" if self.inf else "")


@dataclass(frozen=True)
class KnobSpec:
    """A knob's range plus what its annotation allows: ``integer`` values, ``None`` (``optional``), a list
    (``sequence``: the range applies to each item)."""

    range: Range
    integer: bool = False
    optional: bool = False
    sequence: bool = False

    def describe(self, item: bool = False) -> str:
        """The allowed values in words (``item``: one item of a list knob)."""
        text = self.range.describe(self.integer)
        if item:
            return text
        if self.sequence:
            text = f"a list of items each {text}"
        return text + (", or null" if self.optional else "")


_RANGES: dict[dataclasses.Field, Range] = {}
"""The range of each knob field, kept beside the field rather than in its metadata: transformers'
``HfArgumentParser`` (TRL's command line) passes every metadata entry to argparse's ``add_argument``, which takes
``help`` but no ``range`` (5.24 copies it with ``dict(field.metadata)``)."""


def _knob_field(default: Any, default_factory: Any, help: str, rng: Range) -> Any:
    f = dataclasses.field(default=default, default_factory=default_factory, metadata={"help": help})
    _RANGES[f] = rng
    return f


def knob(
    default: Any = MISSING,
    *,
    default_factory: Any = MISSING,
    help: str = "",
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    inf: bool = False,
) -> Any:
    """A dataclass field with a declared range (``ge``/``gt``/``le``/``lt``, ``inf``: +inf allowed); ``help`` is
    the field's help text (``HfArgumentParser`` shows it)."""
    return _knob_field(default, default_factory, help, Range(ge=ge, gt=gt, le=le, lt=lt, inf=inf))


def seed_knob(default: int = 0, help: str = "Random seed.") -> Any:
    """A random seed: an integer in ``[0, MAX_SEED]`` (numpy's range)."""
    return knob(default, ge=0, le=MAX_SEED, help=help)


def knob_like(cls: type, name: str, default: Any = MISSING, *, help: str | None = None) -> Any:
    """A field with the range of knob ``cls.name`` (one declaration) and its own default: a section where the knob
    may be unset (``None`` = the reward model's recorded value) or defaults differently."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return _knob_field(default, MISSING, f.metadata.get("help", "") if help is None else help, _RANGES[f])


def _spec_of(annotation: Any, rng: Range) -> KnobSpec:
    optional = False
    tp = annotation
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        optional = len(args) < len(get_args(tp))
        (tp,) = args
    sequence = get_origin(tp) in (list, tuple)
    if sequence:
        tp = next(a for a in get_args(tp) if a is not Ellipsis)
    if tp not in (int, float):
        raise TypeError(f"a knob with a range must be int or float (or a list of them); got {annotation!r}")
    return KnobSpec(rng, integer=tp is int, optional=optional, sequence=sequence)


@functools.cache
def knob_specs(cls: type) -> dict[str, KnobSpec]:
    """``{field name: KnobSpec}`` of the fields of dataclass ``cls`` declared with :func:`knob`."""
    hints = get_type_hints(cls)
    return {f.name: _spec_of(hints[f.name], _RANGES[f]) for f in dataclasses.fields(cls) if f in _RANGES}


def _check_number(spec: KnobSpec, value: Any, name: str) -> int | float:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or (spec.integer and not isinstance(value, int)) or not spec.range.contains(value):
        raise KnobError(f"{name} must be {spec.describe(item=spec.sequence)}; got {value!r}")
    return value if spec.integer else float(value)


def check_value(spec: KnobSpec, value: Any, name: str) -> Any:
    """``value`` (ints as given, other numbers as ``float``) if it fits ``spec``; :class:`KnobError` naming ``name``
    otherwise."""
    if value is None:
        if spec.optional:
            return None
        raise KnobError(f"{name} must be {spec.describe()}; got null")
    if spec.sequence:
        if not isinstance(value, list | tuple):
            raise KnobError(f"{name} must be {spec.describe()}; got {value!r}")
        items = [_check_number(spec, v, f"{name}[{i}]") for i, v in enumerate(value)]
        return type(value)(items)
    return _check_number(spec, value, name)


def check_knob(cls: type, name: str, value: Any, label: str | None = None) -> Any:
    """Check ``value`` against the declared range of knob ``cls.name`` (for functions that take a knob as an argument,
    e.g. :func:`rlhf_ext.algos.segment_reward.segment_boundaries`'s cutoff); errors name ``label`` (default
    ``name``)."""
    return check_value(knob_specs(cls)[name], value, label or name)


def check_knobs(obj: Any, prefix: str = "") -> None:
    """Check every ranged field of dataclass instance ``obj`` in place (called by the knob dataclasses'
    ``__post_init__``); errors name ``prefix + field``."""
    for name, spec in knob_specs(type(obj)).items():
        setattr(obj, name, check_value(spec, getattr(obj, name), prefix + name))


def _parse_number(text: str, integer: bool) -> Any:
    text = text.strip()
    for convert in (int, float) if integer else (float,):  # '2.0' for an integer knob: refused later as not an int
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_value(spec: KnobSpec, text: Any, name: str) -> Any:
    """A command-line value (``--ext.tau 0.5``, ``--cutoff inf``; ``none``/``null`` for an optional knob; a comma-
    separated list for a list knob) as a checked number; :class:`KnobError` naming ``name`` otherwise."""
    if not isinstance(text, str):
        return check_value(spec, text, name)
    if spec.optional and text.strip().lower() in ("none", "null", ""):
        return None
    if spec.sequence:
        return check_value(spec, [_parse_number(t, spec.integer) for t in text.strip("[]").split(",")], name)
    return check_value(spec, _parse_number(text, spec.integer), name)
