"""``builtin:continual-*`` datasets: the packaged generator configs of the same name, generated once with the offline
backend into the cache (no network), and :func:`load_continual_dataset`, which reads a saved dataset or a builtin."""

from __future__ import annotations

from pathlib import Path

from rlhf_ext.datagen.dataset import ContinualDataset
from rlhf_ext.datagen.generate import generate_dataset
from rlhf_ext.runtime.io import atomic_directory, build_once, default_cache_dir

PREFIX = "builtin:"
BUILTIN_CONTINUAL_DATASETS = (
    "continual-lipschitz",
    "continual-piecewise-preference",
    "continual-piecewise-qa",
    "continual-mixed",
)
BUILTIN_CONTINUAL_SAMPLES = 200


def is_builtin(spec: str) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def resolve_continual_dataset(
    spec: str, cache_dir: str | Path | None = None, num_samples: int = BUILTIN_CONTINUAL_SAMPLES
) -> str:
    """The directory of a ``builtin:continual-*`` dataset: the packaged config of the same name with ``num_samples``
    samples per task, generated offline once into ``<cache>/datasets/<name>-n<num_samples>``."""
    name = spec[len(PREFIX) :] if is_builtin(spec) else spec
    if name not in BUILTIN_CONTINUAL_DATASETS:
        raise ValueError(
            f"unknown builtin continual dataset {spec!r}; choose one of "
            f"{', '.join(PREFIX + n for n in BUILTIN_CONTINUAL_DATASETS)}"
        )
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dest = root / "datasets" / f"{name}-n{num_samples}"

    def build(path: Path) -> None:
        with atomic_directory(path) as tmp:
            generate_dataset(name, tmp, num_samples=num_samples, progress=False)

    return str(build_once(dest, build, "continual_dataset.json"))


def load_continual_dataset(path: str | Path) -> ContinualDataset:
    """Load a saved continual dataset (or build a ``builtin:`` one into the cache): its stages' ``DatasetDict``s in
    order, with ``.metadata``."""
    if is_builtin(path):
        path = resolve_continual_dataset(path)
    return ContinualDataset.load(path)
