"""Run an unmodified OpenRLHF CLI module (``openrlhf.cli.train_rm``, ``train_ppo_ray`` ...) with our ``--ext.*`` flags
stripped from its command line and its final ``train(args)`` routed through a hook (:func:`run_cli_module`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from rlhf_ext.algos.knobs import KnobSpec, knob_specs, parse_value

if TYPE_CHECKING:
    import argparse


class ExtArgsError(ValueError):
    """A command-line setting rlhf-ext cannot honour (raised in the driver, before Ray or DeepSpeed start)."""


def exit_with_error(message: object) -> NoReturn:
    """End a ``python -m rlhf_ext.openrlhf.*`` module on a user error: one ``error: ...`` line, exit code 2 (as the
    ``rlhf-ext`` command line and argparse do)."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(2)


def ext_argument_parser(
    prog: str, description: str, knob_classes: Sequence[type], defaults: dict[str, Any], extra: dict[str, tuple]
) -> argparse.ArgumentParser:
    """The ``--ext.*`` flags as an argparse group (for ``--help``) from the knob dataclasses that declare them (type,
    choices, help, default); ``extra``: flags that are no knob field, ``{key: (help, choices or None)}``."""
    import argparse
    import enum
    import typing

    def formatter(prog: str) -> argparse.HelpFormatter:  # the same text on every terminal
        return argparse.RawDescriptionHelpFormatter(prog, max_help_position=40, width=120)

    parser = argparse.ArgumentParser(prog=prog, description=description, add_help=False, formatter_class=formatter)
    group = parser.add_argument_group("rlhf-ext flags (--ext.*)")
    fields: dict[str, tuple[Any, Any, KnobSpec | None]] = {}
    for cls in knob_classes:
        hints, specs = typing.get_type_hints(cls), knob_specs(cls)
        for f in dataclasses.fields(cls):
            fields[f.name] = (f, hints[f.name], specs.get(f.name))
    for key, default in defaults.items():
        choices: Any = None
        if key in fields:
            f, hint, spec = fields[key]
            if type(None) in typing.get_args(hint):  # X | None: X's choices
                hint = next(a for a in typing.get_args(hint) if a is not type(None))
            text = f.metadata.get("help", "")
            if spec is not None:
                text = f"{text} ({spec.describe()})".strip()
            elif isinstance(hint, type) and issubclass(hint, enum.Enum):
                choices = [e.value for e in hint]
            elif typing.get_origin(hint) is typing.Literal:
                choices = list(typing.get_args(hint))
            kind = None if spec is None else ("int" if spec.integer else "float")
        else:
            text, choices = extra[key]
            kind = None
        metavar = "{" + ",".join(map(str, choices)) + "}" if choices else (kind or "VALUE").upper()
        group.add_argument(f"--ext.{key}", default=default, choices=choices, metavar=metavar,
                           help=f"{text} (default: {'unset' if default is None else default})")  # fmt: skip
    return parser


def split_ext_args(
    argv: Sequence[str],
    defaults: dict[str, Any],
    validate: Callable[[dict[str, Any]], dict[str, Any]],
    renamed: dict[str, str] | None = None,
    specs: dict[str, KnobSpec] | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """Split ``--ext.key value`` / ``--ext.key=value`` options from an OpenRLHF command line; returns (remaining argv,
    ``defaults`` updated and passed through ``validate``). Values with a knob spec in ``specs`` are range-checked; a
    key in ``renamed`` (old -> new) is refused with its new name. Raises :class:`ExtArgsError` (or ``KnobError``)."""
    argv = list(argv)
    rest: list[str] = []
    ext = dict(defaults)
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--ext."):
            rest.append(arg)
            continue
        key, eq, value = arg[len("--ext.") :].partition("=")
        if not eq:
            if i >= len(argv):
                raise ExtArgsError(f"--ext.{key} needs a value")
            value = argv[i]
            i += 1
        if key not in defaults and key in (renamed or {}):
            raise ExtArgsError(f"--ext.{key} was renamed to --ext.{renamed[key]}")
        if key not in defaults:
            raise ExtArgsError(f"unknown option --ext.{key}; valid: {', '.join('--ext.' + k for k in defaults)}")
        spec = (specs or {}).get(key)
        ext[key] = parse_value(spec, value, f"--ext.{key}") if spec is not None else value
    return rest, validate(ext)


#: The name the rewritten CLI calls instead of its own ``train(args)`` (see :func:`run_cli_module`).
TRAIN_HOOK = "__rlhf_ext_train__"


def _cli_code(module: str):
    """OpenRLHF CLI ``module`` compiled with the last statement of its ``__main__`` block, ``train(args)``, replaced
    by ``__rlhf_ext_train__(train, args)``; returns (code, module spec)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)
    tree = ast.parse(spec.loader.get_source(module), spec.origin)
    main = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'"]
    last = main[-1].body[-1] if main else None
    if not (isinstance(last, ast.Expr) and ast.unparse(last) == "train(args)"):
        raise RuntimeError(
            f"{module} no longer ends with `train(args)` under `if __name__ == '__main__'`; rlhf-ext's OpenRLHF "
            "adapters need openrlhf==0.11.2"
        )
    names = [ast.Name("train", ast.Load()), ast.Name("args", ast.Load())]
    last.value = ast.Call(ast.Name(TRAIN_HOOK, ast.Load()), names, [])
    ast.fix_missing_locations(tree)
    return compile(tree, spec.origin, "exec"), spec


def run_cli_module(module: str, argv: Sequence[str], before_train: Callable[[Any], Any]) -> None:
    """Execute OpenRLHF CLI ``module`` as ``__main__`` with ``argv``; ``before_train(args)`` runs right before the
    CLI's ``train(args)``, after argparse *and* every fix-up of its ``__main__`` block."""
    import runpy

    from rlhf_ext.openrlhf.compat import import_shims

    code, spec = _cli_code(module)

    def train_hook(train: Callable[[Any], Any], args: Any) -> Any:
        before_train(args)
        return train(args)

    saved = sys.argv
    sys.argv = [spec.origin, *argv]
    try:
        with import_shims():  # the CLI module imports OpenRLHF modules that import flash_attn / vllm
            runpy._run_module_code(code, {TRAIN_HOOK: train_hook}, "__main__", spec, spec.parent)
    finally:
        sys.argv = saved


class _Parsed(Exception):
    """Carries the parsed arguments out of a CLI module that stops before training."""


def parsed_args(module: str, argv: Sequence[str]) -> Any:
    """The arguments OpenRLHF CLI ``module`` would train with for ``argv`` (after its fix-ups); nothing runs."""

    def stop(args: Any) -> None:
        raise _Parsed(args)

    try:
        run_cli_module(module, argv, stop)
    except _Parsed as parsed:
        return parsed.args[0]
    raise RuntimeError(f"{module} did not reach train(args)")


def flag_value(argv: Sequence[str], flag: str, default: Any) -> Any:
    """The value of ``flag`` in an argv list (``--flag value`` or ``--flag=value``), else ``default``."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return default


def flags_from_mapping(options: dict[str, Any]) -> list[str]:
    """``{"ds.adam_offload": True, "actor.adam.lr": 1e-6}`` -> ``["--ds.adam_offload", "--actor.adam.lr", "1e-06"]``."""
    out: list[str] = []
    for key, value in options.items():
        flag = f"--{key.lstrip('-')}"
        if value is True:
            out.append(flag)
        elif value is not False and value is not None:
            out += [flag, *(map(str, value) if isinstance(value, list | tuple) else [str(value)])]
    return out
