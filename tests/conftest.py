"""Shared offline fixtures: tokenizers, tiny models, the SFT'd builtin model, the toy preference task."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
# Ray starts its worker processes at niceness 15 (RAY_worker_niceness), so next to the other xdist worker's CPU-bound
# tests a Ray run's actors got almost no CPU: one run took 400+ s in CI and did not finish in 12 min beside two busy
# loops here. The tests' Ray instances inherit this environment and run their workers at the tests' own priority.
os.environ.setdefault("RAY_worker_niceness", "0")
# The local test servers (chat completions, reward model) are reached directly whatever proxy the machine sets: the
# `openai` backend takes HTTP(S)_PROXY / NO_PROXY from the environment (tests that check this set them themselves).
for _proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
    os.environ.pop(_proxy, None)
    os.environ.pop(_proxy.lower(), None)

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402

# Property tests draw the same examples on every run (derandomize) and replay no failure saved by an earlier run (no
# example database): a test that passes or fails by the day's draw blocks every submission. A failing example is
# printed in the report, to be reproduced with @example.
hypothesis_settings.register_profile("deterministic", derandomize=True, database=None)
hypothesis_settings.load_profile("deterministic")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    real = os.environ.get("RLHF_EXT_REAL_MODEL") == "1"
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if "real_model" in item.keywords and not real:
            item.add_marker(pytest.mark.skip(reason="loads SmolLM2-135M; set RLHF_EXT_REAL_MODEL=1 to run"))


@pytest.fixture()
def one_torch_thread():
    """Run the test with one torch thread (generation-heavy tests: 2 xdist workers share 2 cores)."""
    from rlhf_ext.runtime.async_runner import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """One cache shared by all xdist workers of a run (built models are locked and renamed atomically)."""
    root = os.environ.get("RLHF_EXT_TEST_CACHE")
    if root is None:
        root = str(tmp_path_factory.getbasetemp().parent / "rlhf_ext_cache")
    os.environ["RLHF_EXT_CACHE"] = root
    return root


@pytest.fixture(scope="session")
def gpt2_tok():
    from rlhf_ext.zoo.tokenizer import gpt2_tokenizer

    return gpt2_tokenizer()


@pytest.fixture(scope="session")
def tiny_sft_path(cache_dir) -> str:
    """The builtin tiny model after SFT on the toy task (built once per run, ~30 s)."""
    from rlhf_ext.pipelines.builtins import resolve_model

    return resolve_model("builtin:tiny-sft", cache_dir)


@pytest.fixture(scope="session")
def tiny_base_path(cache_dir) -> str:
    from rlhf_ext.pipelines.builtins import resolve_model

    return resolve_model("builtin:tiny", cache_dir)


@pytest.fixture(scope="session")
def toy_tok(tiny_base_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_base_path)


@pytest.fixture(scope="session")
def toy_data():
    from rlhf_ext.zoo.toy import toy_preference_dataset

    return toy_preference_dataset(n_train=256, n_test=64, seed=0)
