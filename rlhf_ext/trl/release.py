"""Freeing a finished Trainer run by reference counting, without ``gc.collect()``: ``accelerate``'s ``free_memory``
collects on every call (a third of a second here) because TRL / accelerate patch models with reference cycles (a
method bound to the module stored on it); these functions break the cycles and drop the references instead.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch


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
    reference), freed by reference counting once the cycles are broken; a model in ``given_models`` (the user's) keeps
    its forward. With CUDA, dropping the models also runs one collection, and the device cache is emptied."""
    trainer.optimizer = trainer.lr_scheduler = None
    handler = getattr(trainer, "callback_handler", None)
    if handler is not None:
        handler.optimizer = handler.lr_scheduler = None
    if not keep_model:
        for model in (getattr(trainer, "model", None), getattr(trainer, "ref_model", None)):
            if isinstance(model, torch.nn.Module) and not any(m in given_models for m in model.modules()):
                # the forwards stored on module instances (TRL's fused LM head, accelerate's _original_forward /
                # _old_forward) are reference cycles that keep every weight alive until a full collection
                for module in model.modules():
                    for name in ("forward", "_original_forward", "_old_forward"):
                        module.__dict__.pop(name, None)
        trainer.model = trainer.model_wrapped = trainer.ref_model = None
        if handler is not None:
            handler.model = None
    if getattr(trainer, "accelerator", None) is not None:
        release_accelerator(trainer.accelerator)
    if torch.cuda.is_available():
        if not keep_model:
            gc.collect()
        torch.cuda.empty_cache()
