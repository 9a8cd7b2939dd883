"""The string-valued enums of :mod:`rlhf_ext.algos` share one base class, :class:`StrEnum` (a member *is* its string,
``Granularity.BANDIT == "bandit"``, with equal hash, and ``str``/f-strings give the bare value on Python 3.10 too);
:func:`knob_defaults` and :func:`knob_values` read the knob dataclasses.
"""

from __future__ import annotations

from dataclasses import fields
from enum import Enum
from typing import Any


class StrEnum(str, Enum):
    """A ``str`` whose allowed values are the members of an ``Enum`` (cf. verl's ``AdvantageEstimator(str, Enum)``)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """The members' string values, in definition order."""
        return tuple(member.value for member in cls)


def knob_defaults(*knob_classes: type) -> dict[str, Any]:
    """``{field name: default}`` of knob dataclasses (for command-line flag tables such as OpenRLHF's ``--ext.*``)."""
    out: dict[str, Any] = {}
    for cls in knob_classes:
        for f in fields(cls):
            out[f.name] = f.default_factory() if callable(f.default_factory) else f.default
    return out


def knob_values(obj: Any, knob_class: type) -> dict[str, Any]:
    """``{field name: value}`` of ``obj`` for the fields of knob dataclass ``knob_class`` (a recipe section or config
    that embeds it), to pass the knobs on under the same names."""
    return {f.name: getattr(obj, f.name) for f in fields(knob_class)}


def post_init_next(obj: Any, cls: type) -> None:
    """Run the next ``__post_init__`` after ``cls`` in ``obj``'s MRO, if any: knob dataclasses are listed *before*
    TRL's config class in a config's bases (so TRL's fields come first and ``Config("out_dir")`` still means
    ``output_dir``), and this keeps TRL's own ``__post_init__`` running."""
    parent = getattr(super(cls, obj), "__post_init__", None)
    if parent is not None:
        parent()
