"""Make OpenRLHF 0.11.2 importable and runnable on a CPU-only machine, without changing it on a GPU machine.

Two idempotent pieces, no-ops where they are not needed, pinned to ``openrlhf==0.11.2`` (:func:`check_version`):

* :func:`install_import_shims` — when ``flash_attn`` / ``vllm`` (imported by OpenRLHF at module level) are missing,
  placeholder modules whose functions and classes raise a ``RuntimeError`` naming the GPU package (other attributes:
  :class:`GPUPackageMissing`); ``flash_attn.bert_padding``'s helpers are real CPU implementations (so
  ``--ds.packing_samples`` runs through ``sdpa``) and ``vllm.SamplingParams`` is :class:`SamplingParams`.
  :func:`import_shims` registers them for a ``with`` block only: while ``vllm`` is a placeholder, TRL 1.16's
  ``is_vllm_available()`` fails to parse its version.
* :func:`patch_for_cpu` — without CUDA, replaces what calls CUDA unconditionally: DeepSpeed's shared-memory comm-op
  build, ``setup_distributed`` (gloo), ``all_reduce``/``all_gather``, ``torch.cuda.synchronize`` and the optimizer
  config (``torch_adam``). In Ray workers also ``torch.cuda.current_device()`` and the replay buffer target the CPU,
  and rendezvous ports come from :func:`free_port`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

OPENRLHF_VERSION = "0.11.2"

#: Names OpenRLHF 0.11.2 imports at module level from GPU-only packages; imports it guards with ``try/except
#: ImportError`` (``flash_attn.ops``) are left missing on purpose, so its CPU fallback runs.
_SHIMS: dict[str, dict[str, str]] = {
    "flash_attn": {},
    "flash_attn.bert_padding": dict.fromkeys(("index_first_axis", "pad_input", "rearrange", "unpad_input"), "cpu"),
    "flash_attn.utils": {},
    "flash_attn.utils.distributed": {"all_gather": "func"},
    "vllm": {"SamplingParams": "cpu", "LLM": "class", "AsyncEngineArgs": "class", "AsyncLLMEngine": "class"},
    "vllm.inputs": {"TokensPrompt": "class"},
    "vllm.utils": {"random_uuid": "func"},
}
_SHIM_MARKER = "__rlhf_ext_shim__"


@dataclass
class SamplingParams:
    """The fields of ``vllm.SamplingParams`` OpenRLHF 0.11.2 sets (``SamplesGenerator``, its agent executors); the
    HF rollout engine (:mod:`rlhf_ext.openrlhf.rollout`) reads them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    min_tokens: int = 0
    skip_special_tokens: bool = True
    logprobs: int | None = None
    stop: list[str] | None = None


def index_first_axis(x: Any, indices: Any) -> Any:
    """flash-attn's ``index_first_axis``: ``x[indices]`` for ``x`` of shape ``[N, ...]`` (differentiable)."""
    return x[indices]


def unpad_input(hidden_states: Any, attention_mask: Any, unused_mask: Any = None) -> tuple:
    """flash-attn's ``unpad_input``: ``[B, T, ...]`` -> the real tokens ``[N, ...]`` in row-major order, their flat
    ``indices`` ``[N]``, ``cu_seqlens`` ``[B + 1]`` (int32), the longest row and the row lengths ``[B]``."""
    import torch

    masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = masks.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(masks.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max()), attention_mask.sum(dim=-1, dtype=torch.int32)


def pad_input(hidden_states: Any, indices: Any, batch: int, seqlen: int) -> Any:
    """flash-attn's ``pad_input``, the inverse of :func:`unpad_input`: ``[N, ...]`` -> ``[batch, seqlen, ...]`` with
    zeros at the padding (differentiable)."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:]).index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


def _cpu_implementation(name: str) -> Any:
    if name == "rearrange":
        from einops import rearrange

        return rearrange
    return globals()[name]  # index_first_axis, unpad_input, pad_input, SamplingParams (plain data OpenRLHF builds)


class GPUPackageMissing(AttributeError):
    """An attribute of a placeholder GPU package was read (an ``AttributeError``, so ``hasattr`` probes say no)."""


def _missing_attribute(package: str):
    def __getattr__(name: str):
        if name.startswith("__") and name not in ("__version__",):
            raise AttributeError(name)
        raise GPUPackageMissing(
            f"{package}.{name}: '{package}' is not installed on this machine (rlhf-ext registered a placeholder so "
            f"OpenRLHF imports on CPU). Install {'flash-attn' if package == 'flash_attn' else 'vllm'} on a GPU "
            f"machine, or on CPU run PPO with --ext.rollout_engine hf."
        )

    return __getattr__


def _unavailable(package: str, name: str):
    message = (
        f"{package}.{name} is not available: '{package}' is not installed on this machine. This OpenRLHF code path "
        f"needs a GPU install (`pip install {'flash-attn' if package == 'flash_attn' else 'vllm'}`)."
    )

    def raiser(*args: Any, **kwargs: Any):
        raise RuntimeError(message)

    return raiser, message


def install_import_shims() -> list[str]:
    """Register placeholder ``flash_attn`` / ``vllm`` modules if (and only if) the real ones are missing; returns the
    module names that were shimmed (empty on a GPU machine with both installed)."""
    installed = []
    for root in ("flash_attn", "vllm"):
        if root in sys.modules or importlib.util.find_spec(root) is not None:
            continue
        for name, attrs in _SHIMS.items():
            if name.split(".")[0] != root:
                continue
            module = types.ModuleType(name)
            setattr(module, _SHIM_MARKER, True)
            module.__path__ = []  # a package, so submodules resolve
            # for find_spec() (transformers' probe): no __file__ nor __version__, so "not installed", the truth
            module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            module.__getattr__ = _missing_attribute(root)
            for attr, kind in attrs.items():
                if kind == "cpu":
                    setattr(module, attr, _cpu_implementation(attr))
                    continue
                raiser, message = _unavailable(root, attr)
                placeholder = type(attr, (), {"__init__": raiser, "__doc__": message}) if kind == "class" else raiser
                setattr(module, attr, placeholder)
            sys.modules[name] = module
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, module)
            installed.append(name)
    return installed


def is_shim(module_name: str) -> bool:
    """True if ``module_name`` is one of our placeholder modules rather than the real package."""
    return bool(getattr(sys.modules.get(module_name), _SHIM_MARKER, False))


def remove_import_shims(names: list[str] | None = None) -> list[str]:
    """Unregister placeholder modules (``names``, default: all of them); real modules are never touched."""
    candidates = names if names is not None else list(_SHIMS)
    removed = [name for name in candidates if is_shim(name)]
    for name in removed:
        del sys.modules[name]
    return removed


@contextlib.contextmanager
def import_shims() -> Iterator[list[str]]:
    """Placeholders registered for the duration of the block (to import OpenRLHF modules), unregistered afterwards.
    Yields the names this block registered; placeholders registered before it stay."""
    installed = install_import_shims()
    try:
        yield installed
    finally:
        remove_import_shims(installed)


def check_version() -> None:
    from importlib.metadata import version

    found = version("openrlhf")
    if found != OPENRLHF_VERSION:
        raise RuntimeError(
            f"rlhf-ext's OpenRLHF adapters are written against openrlhf=={OPENRLHF_VERSION} (they subclass private "
            f"parts of it); found {found}. Install `openrlhf=={OPENRLHF_VERSION}`."
        )


def free_port() -> int:
    """A free TCP port to bind later (a torch.distributed rendezvous), from ``[20000, low)``: above Ray's worker ports
    and below the kernel's ephemeral range (``low``), so no process receives it as OpenRLHF's port-0 choice can
    (``EADDRINUSE`` when two Ray runs start at once). Falls back to port 0 where that range is empty."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.Random()  # seeded from the OS: the training RNGs stay untouched
    for _ in range(64):
        port = pick.randrange(20000, low) if low > 20000 else 0
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError(f"no free TCP port in [20000, {low}); free some ports and rerun")


def ensure_single_process_env() -> None:
    """Fill in the torch.distributed rendezvous variables for a plain ``python`` run (launchers set them)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    defaults = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def _cpu_setup_distributed(self, timeout: timedelta = timedelta(minutes=60)) -> None:
    """``DeepspeedStrategy.setup_distributed`` without CUDA: gloo backend and a ``cpu`` device mesh."""
    import deepspeed
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    if self.full_determinism:
        transformers.enable_full_determinism(self.seed)
    else:
        transformers.set_seed(self.seed)
    if self.args.local_rank != -1:
        os.environ["LOCAL_RANK"] = str(self.args.local_rank)
    ensure_single_process_env()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    self.world_size = dist.get_world_size()
    dp_size = self.world_size // self.ring_attn_size // self.ds_tensor_parallel_size
    self.ds_device_mesh = init_device_mesh(
        "cpu", (dp_size, self.ring_attn_size, self.ds_tensor_parallel_size), mesh_dim_names=("dp", "sp", "tp")
    )
    self.setup_ring_attn(self.ds_device_mesh)
    samples = self.train_batch_size * self.ring_attn_size * self.ds_tensor_parallel_size
    self.accumulated_gradient = samples // self.micro_train_batch_size // self.world_size


def _cpu_all_reduce(self, data, op: str = "mean"):
    """``DeepspeedStrategy.all_reduce`` for CPU tensors (the stock one moves them to ``cuda.current_device()``)."""
    import torch
    import torch.distributed as dist

    if op not in ("mean", "max", "sum"):
        raise ValueError(f"op must be mean, max or sum, got {op!r}")
    if isinstance(data, dict):
        return {k: _cpu_all_reduce(self, v, op) for k, v in data.items()}
    is_tensor = isinstance(data, torch.Tensor)
    tensor = (data.detach().clone() if is_tensor else torch.tensor([float(data)])).cpu()
    if op == "mean":
        tensor = tensor / self.world_size
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor if is_tensor else tensor.item()


def _cpu_all_gather(self, data):
    import torch
    import torch.distributed as dist

    if isinstance(data, dict):
        return {k: _cpu_all_gather(self, v) for k, v in data.items()}
    tensor = data if isinstance(data, torch.Tensor) else torch.tensor([float(data)])
    out = [torch.zeros_like(tensor) for _ in range(self.world_size)]
    dist.all_gather(out, tensor)
    return torch.cat(out)


def _with_torch_adam(original):
    def get_ds_train_config(self, optim_dict=None, **kwargs):
        config = original(self, optim_dict, **kwargs)
        optimizer = config.get("optimizer")
        if optimizer is not None and optimizer.get("type") in ("Adam", "AdamW"):
            optimizer.setdefault("params", {})["torch_adam"] = True
        return config

    get_ds_train_config.__wrapped__ = original
    return get_ds_train_config


def _cpu_replay_buffer_init(original):
    def __init__(self, *args, **kwargs):
        import torch

        current = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0  # the stock __init__ formats f"cuda:{current_device()}"
        try:
            original(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = current
        self.target_device = torch.device("cpu")

    __init__.__wrapped__ = original
    return __init__


_PATCHED = False
_WORKER_PATCHED = False


def patch_for_cpu(worker: bool = False) -> bool:
    """Apply the CPU patches if CUDA is unavailable (``worker``: also the Ray-worker ones, see the module
    docstring). Returns True if patches are (now) active."""
    global _PATCHED, _WORKER_PATCHED
    import torch

    if torch.cuda.is_available():
        return False
    if worker and not _WORKER_PATCHED:
        with import_shims():
            from openrlhf.trainer.ppo_utils import replay_buffer
            from openrlhf.trainer.ray import launcher

        launcher.BaseDistributedActor._get_free_port = staticmethod(free_port)

        torch.cuda.current_device = lambda: torch.device("cpu")
        buffer_cls = replay_buffer.NaiveReplayBuffer
        buffer_cls.__init__ = _cpu_replay_buffer_init(getattr(buffer_cls.__init__, "__wrapped__", buffer_cls.__init__))
        _WORKER_PATCHED = True
    if _PATCHED:
        return True
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")  # `import a.b.torch as x` binds the real torch
    ds_comm_torch.build_shm_op = lambda: None
    with import_shims():
        from openrlhf.utils.deepspeed import deepspeed as ds_strategy

    strategy_cls = ds_strategy.DeepspeedStrategy
    strategy_cls.setup_distributed = _cpu_setup_distributed
    strategy_cls.all_reduce = _cpu_all_reduce
    strategy_cls.all_gather = _cpu_all_gather
    strategy_cls.get_ds_train_config = _with_torch_adam(strategy_cls.get_ds_train_config)
    torch.cuda.synchronize = lambda *args, **kwargs: None
    _PATCHED = True
    return True
