"""Import shims so OpenRLHF 0.11.2's modules import on a machine without flash-attn or vLLM (e.g. CPU CI).

OpenRLHF imports ``flash_attn`` and ``vllm`` at module import time (``models/ring_attn_utils.py``,
``trainer/ray/vllm_engine.py``, ``trainer/ppo_utils/samples_generator.py``), although the code paths that *use* them
(packed samples / ring attention, vLLM rollouts and weight sync) never run on CPU. :func:`install_import_shims`
registers stand-in modules under exactly the names OpenRLHF 0.11.2 imports — only when ``importlib.util.find_spec``
says the real package is missing — whose functions and classes raise a clear ``RuntimeError`` when actually used.

What is shimmed (``grep -rn "flash_attn\\|vllm" openrlhf/``, OpenRLHF 0.11.2):

==================================================  =========================================================
module                                              names
==================================================  =========================================================
``flash_attn.bert_padding``                         ``index_first_axis``, ``pad_input``, ``unpad_input``
                                                    (``rearrange`` is einops' own function, re-exported)
``flash_attn.utils.distributed``                    ``all_gather``
``vllm``                                            ``SamplingParams``, ``AsyncEngineArgs``, ``AsyncLLMEngine``
``vllm.inputs`` / ``vllm.utils``                    ``TokensPrompt`` / ``random_uuid``
``vllm.distributed.device_communicators.pynccl``    ``PyNcclCommunicator`` (imported inside a function)
``vllm.distributed.utils``                          ``StatelessProcessGroup`` (imported inside a function)
==================================================  =========================================================

Deliberately *not* shimmed: ``flash_attn.ops.triton.cross_entropy``. OpenRLHF's ``log_probs_from_logits`` tries to
import it and falls back to a pure-torch path on ``ImportError``; the stand-in ``flash_attn`` package has an empty
``__path__``, so that import still fails with ``ModuleNotFoundError`` and the fallback runs.

Prefer the scoped form, :func:`import_shims`: register the stand-ins, import the OpenRLHF modules (which keep
references to the names they imported), and unregister them again. While a stand-in is in ``sys.modules`` other
libraries' availability checks can see it: transformers' checks also look at distribution metadata and still report
the package missing, but TRL 1.16's ``is_vllm_available()`` trusts ``importlib.util.find_spec`` alone and then fails
to parse a version, so importing e.g. ``trl.generation`` while the ``vllm`` stand-in is registered raises. After
:func:`import_shims` (or :func:`remove_import_shims`) nothing of the stand-ins is visible; an OpenRLHF code path that
imports ``vllm`` / ``flash_attn`` lazily then fails with ``ModuleNotFoundError``, which is the truth on a CPU machine.
On a GPU machine with the real packages installed all of this does nothing.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any, NoReturn

SHIM_MARKER = "__rlhf_ext_shim__"

#: package -> {module: names OpenRLHF 0.11.2 imports from it}
SHIMS: dict[str, dict[str, tuple[str, ...]]] = {
    "flash_attn": {
        "flash_attn": (),
        "flash_attn.bert_padding": ("index_first_axis", "pad_input", "unpad_input"),
        "flash_attn.utils": (),
        "flash_attn.utils.distributed": ("all_gather",),
    },
    "vllm": {
        "vllm": ("SamplingParams", "AsyncEngineArgs", "AsyncLLMEngine"),
        "vllm.inputs": ("TokensPrompt",),
        "vllm.utils": ("random_uuid",),
        "vllm.distributed": (),
        "vllm.distributed.device_communicators": (),
        "vllm.distributed.device_communicators.pynccl": ("PyNcclCommunicator",),
        "vllm.distributed.utils": ("StatelessProcessGroup",),
    },
}
_PIP_NAME = {"flash_attn": "flash-attn", "vllm": "vllm"}
_WHAT = {"flash_attn": "flash-attn (packed samples / ring attention)", "vllm": "vLLM (rollouts / weight sync)"}


def _unavailable_message(qualname: str) -> str:
    package = qualname.split(".", 1)[0]
    return (
        f"{qualname} needs {_WHAT[package]} on a GPU machine. This process uses rlhf-ext's CPU stand-in for "
        f"'{package}' (rlhf_ext.openrlhf.compat.install_import_shims), which only lets OpenRLHF's modules import; "
        f"install the real package (pip install {_PIP_NAME[package]}) on a CUDA machine to use this path."
    )


def _raise(qualname: str) -> NoReturn:
    raise RuntimeError(_unavailable_message(qualname))


class _UnavailableMeta(type):
    """Class-level attribute access (``AsyncLLMEngine.from_engine_args``, ``StatelessProcessGroup.create``) raises."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        _raise(f"{cls.__module__}.{cls.__qualname__}.{name}")


def _stand_in(module: str, name: str) -> Any:
    qualname = f"{module}.{name}"
    if name[0].isupper():

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _raise(qualname)

        return _UnavailableMeta(name, (), {"__init__": __init__, "__module__": module, SHIM_MARKER: True})

    def function(*args: Any, **kwargs: Any) -> NoReturn:
        _raise(qualname)

    function.__name__ = function.__qualname__ = name
    function.__module__ = module
    setattr(function, SHIM_MARKER, True)
    return function


def _module_getattr(module: str):
    def __getattr__(name: str) -> Any:
        raise AttributeError(f"module {module!r} has no attribute {name!r}: {_unavailable_message(module)}")

    return __getattr__


def _make_module(name: str, names: tuple[str, ...]) -> types.ModuleType:
    mod = types.ModuleType(name, f"rlhf-ext stand-in for {name} (see rlhf_ext.openrlhf.compat)")
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    mod.__path__ = []  # a package with no location: unknown submodules raise ModuleNotFoundError
    mod.__getattr__ = _module_getattr(name)
    setattr(mod, SHIM_MARKER, True)
    for attr in names:
        setattr(mod, attr, _stand_in(name, attr))
    if name == "flash_attn.bert_padding":
        try:  # flash-attn re-exports einops' rearrange; it is plain tensor reshaping, no GPU needed
            from einops import rearrange
        except ImportError:  # pragma: no cover - einops is an OpenRLHF dependency
            rearrange = _stand_in(name, "rearrange")
        mod.rearrange = rearrange
    return mod


def is_shim(module: Any) -> bool:
    """True for a stand-in module, class or function installed by :func:`install_import_shims`."""
    return bool(getattr(module, SHIM_MARKER, False))


def install_import_shims() -> list[str]:
    """Register stand-ins for ``flash_attn`` and ``vllm`` when (and only when) they are not installed.

    Idempotent and safe to call before every OpenRLHF import. Returns the module names registered by this call
    (empty when the real packages exist or the stand-ins are already in place).
    """
    installed: list[str] = []
    for package, modules in SHIMS.items():
        existing = sys.modules.get(package)
        if existing is not None and is_shim(existing):
            continue
        if importlib.util.find_spec(package) is not None:
            continue
        for name, names in modules.items():
            mod = _make_module(name, names)
            sys.modules[name] = mod
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, mod)
            installed.append(name)
    return installed


def remove_import_shims(names: list[str] | None = None) -> list[str]:
    """Unregister stand-in modules (``names``, default: all of them); real modules are never touched."""
    candidates = names if names is not None else [m for modules in SHIMS.values() for m in modules]
    removed = []
    for name in candidates:
        if is_shim(sys.modules.get(name)):
            del sys.modules[name]
            removed.append(name)
    return removed


@contextlib.contextmanager
def import_shims() -> Iterator[list[str]]:
    """Stand-ins registered for the duration of the block (for importing OpenRLHF modules), removed afterwards.

    Yields the names registered by this block; stand-ins that were already registered before it stay."""
    installed = install_import_shims()
    try:
        yield installed
    finally:
        remove_import_shims(installed)
