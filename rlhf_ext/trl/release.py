"""Freeing a finished Trainer run by reference counting, without ``gc.collect()``.

``accelerate``'s ``free_memory`` / ``release_memory`` run a full garbage collection on every call (a third of a
second in a process that has imported torch, transformers and TRL), and a model TRL or accelerate patched is only
freed by one: a method bound to the module and stored on the module is a reference cycle. The functions here break
those cycles and drop the references, so what a run held is freed at once, deterministically.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch


def drop_instance_forwards(model: torch.nn.Module) -> None:
    """Remove the ``forward`` stored on the instances of ``model``'s modules: TRL's fused LM head
    (``add_fused_lm_head``, on the policy and the reference of every DPO run), accelerate's mixed precision
    (``_original_forward``) and hooks (``_old_forward``) bind the module into a method stored on that same module,
    a reference cycle that keeps every weight alive until a full garbage collection. Only for a model being released
    that nothing else uses: its class's ``forward`` is what remains."""
    for module in model.modules():
        for name in ("forward", "_original_forward", "_old_forward"):
            module.__dict__.pop(name, None)


def release_accelerator(accelerator) -> None:
    """``Accelerator.free_memory()`` without its ``gc.collect()`` and device-cache flush: destroy the DeepSpeed
    engine and drop the accelerator's references to what it prepared (models, optimizers, schedulers,
    dataloaders)."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is not None:
        wrapped.engine.destroy()
        accelerator.deepspeed_engine_wrapped = None
    accelerator._models, accelerator._optimizers, accelerator._schedulers, accelerator._dataloaders = [], [], [], []
    accelerator.step = 0


@contextlib.contextmanager
def free_memory_without_collection(accelerator) -> Iterator[None]:
    """Within: ``accelerator.free_memory()`` is :func:`release_accelerator`. ``Trainer``'s training loop calls it
    first ("reset everything") on the accelerator its ``__init__`` has just built, which holds nothing to collect."""

    def free_memory(*objects):
        release_accelerator(accelerator)
        return [None] * len(objects)

    accelerator.free_memory = free_memory
    try:
        yield
    finally:
        del accelerator.free_memory  # (the closure on the accelerator is a cycle)


def release_trainer_run(trainer: Any, keep_model: bool, given_models: Any = ()) -> None:
    """Drop a finished ``Trainer`` run's optimizer and scheduler (and, unless ``keep_model``, its policy and
    reference) so the next run does not hold them in memory.

    They are freed by reference counting, at once and without a garbage collection (a full ``gc.collect()`` costs a
    third of a second in such a process): the reference cycles that would need one are broken first
    (:func:`drop_instance_forwards` on each model, :func:`release_accelerator`). A model in ``given_models`` (one the
    user passed in, a container supporting ``in``) is theirs to keep, with whatever forward they gave it. With a CUDA
    device, dropping the models also runs one collection (a safety net for cycles made elsewhere, e.g. by user
    callbacks) and empties the device cache."""
    trainer.optimizer = trainer.lr_scheduler = None
    handler = getattr(trainer, "callback_handler", None)
    if handler is not None:
        handler.optimizer = handler.lr_scheduler = None
    if not keep_model:
        for model in (getattr(trainer, "model", None), getattr(trainer, "ref_model", None)):
            if isinstance(model, torch.nn.Module) and not any(m in given_models for m in model.modules()):
                drop_instance_forwards(model)
        trainer.model = trainer.model_wrapped = trainer.ref_model = None
        if handler is not None:
            handler.model = None
    if getattr(trainer, "accelerator", None) is not None:
        release_accelerator(trainer.accelerator)
    if torch.cuda.is_available():
        if not keep_model:
            gc.collect()
        torch.cuda.empty_cache()
