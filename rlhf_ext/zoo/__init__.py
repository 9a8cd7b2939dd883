"""``builtin:`` names: tiny models built from config, SmolLM2-135M from a package on disk, the toy key-phrase task,
its tokenizer and gold reward. Resolving a name never trains anything (see :mod:`rlhf_ext.pipelines.builtins`)."""

from rlhf_ext.zoo.builtins import (
    PREFIX,
    BuiltinNotBuiltError,
    is_builtin,
    load_preference_dataset,
    resolve_dataset,
    resolve_model,
    resolve_reward,
)

__all__ = [
    "PREFIX",
    "BuiltinNotBuiltError",
    "is_builtin",
    "load_preference_dataset",
    "resolve_dataset",
    "resolve_model",
    "resolve_reward",
]
