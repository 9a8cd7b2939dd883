"""Every ```python block of README.md runs as written.

Each block is read from README.md (a README change is picked up) and executed unchanged, from an empty directory, with
only what the README says the reader brings before it: the names the block uses but does not define (``dataset``,
``tokenizer``, ``prompts``, ...) hold small toy-task data of the documented shape, and the placeholder paths it names
(``path/to/sft``, ``runs/rm``, ...) are links to the builtin tiny models. A README Python block without a setup here
fails :func:`test_every_readme_python_block_has_a_setup`, so a new block cannot go untested.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_python_blocks() -> list[str]:
    """The source of every fenced ```python block of README.md, in order."""
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _toy_rows(n: int, seed: int = 0) -> list[dict]:
    from rlhf_ext.zoo.toy import toy_preference_rows

    return toy_preference_rows(n, seed)


def _prompts(n: int):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["prompt"]} for r in _toy_rows(n, seed=1)])


def _pairs(n: int, seed: int = 0):
    from datasets import Dataset

    return Dataset.from_list(_toy_rows(n, seed))


def _segment_rm(paths) -> dict:
    return {"dataset": _pairs(16), "tokenizer": paths.tokenizer()}


def _segment_ppo(paths) -> dict:
    return {"prompts": _prompts(8), "tokenizer": paths.tokenizer(), "preference_pairs": _pairs(16)}


def _dense_ppo(paths) -> dict:
    return {"prompts": _prompts(8), "tokenizer": paths.tokenizer()}


def _online_dpo(paths) -> dict:
    import torch

    rewards = torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.3, 0.2]])  # [P, n]
    return {"rewards": rewards, "lengths": torch.tensor([[10, 20, 15], [5, 8, 6]]), "prompt_dataset": _prompts(4)}


def _continual_functions(paths) -> dict:
    import torch

    gen = torch.Generator().manual_seed(0)
    logp, prev_logp = -torch.rand(2, 5, generator=gen), -torch.rand(2, 5, generator=gen)  # [B, T]
    return {"logp": logp, "prev_logp": prev_logp, "completion_mask": torch.ones(2, 5, dtype=torch.long)}


def _continual_dpo(paths) -> dict:
    from transformers import AutoModelForCausalLM

    task0, task1 = {"test": _pairs(8, seed=2)}, {"train": _pairs(8, seed=3)}
    sft_model = AutoModelForCausalLM.from_pretrained(paths.sft)
    return {"sft_model": sft_model, "task0": task0, "task1": task1, "tok": paths.tokenizer()}


def _simulator(paths) -> dict:
    rows = _toy_rows(4, seed=4)
    prompts = [r["prompt"] for r in rows]
    return {
        "prompts": prompts,
        "responses": [r["chosen"] for r in rows],
        "a": [r["chosen"] for r in rows],
        "b": [r["rejected"] for r in rows],
        "preference_dataset": _pairs(8, seed=5),
        "eval_prompts": prompts,
    }


# the block's first line -> the names it uses but does not define, as the README's text describes them
SETUPS = {
    "from rlhf_ext.trl import SegmentRewardConfig, SegmentRewardTrainer": _segment_rm,
    "from rlhf_ext.trl import SegmentPPOConfig, SegmentPPOTrainer": _segment_ppo,
    "import re": _dense_ppo,
    "from rlhf_ext.online import select_pairs, OneStepAsyncRunner": _online_dpo,
    "from rlhf_ext.continual import kl_to_previous, backward_transfer, summarize": _continual_functions,
    "from rlhf_ext.trl import ContinualDPOConfig, ContinualDPOTrainer": _continual_dpo,
    "from rlhf_ext.sim import AnnotatorPool, GoldScorer, HFPolicy, BestOfNPolicy, win_rate": _simulator,
}


def _wrote_segment_config(ns, cwd) -> None:
    import json

    assert json.loads((cwd / "rm" / "segment_config.json").read_text())["entropy_cutoff"] == 2.0


def _wrote_a_ppo_checkpoint(ns, cwd) -> None:
    assert ns["trainer"].state.global_step > 0 and (cwd / "ppo").is_dir()


def _built_a_dense_trainer(ns, cwd) -> None:
    assert ns["polite"]([""], ["Thank you, and thank you."]) == [[(0, 9, 1.0), (15, 24, 1.0)]]


def _selected_and_trained(ns, cwd) -> None:
    sel = ns["sel"]
    assert (sel.chosen.tolist(), sel.rejected.tolist()) == ([1, 0], [0, 2])  # max - 0.001 * length, min likewise
    assert ns["out"].global_step > 0


def _the_commented_values(ns, cwd) -> None:
    assert ns["bwt"] == (0.6 - 0.8) / 0.8 and ns["kl"].ndim == 0


def _trained_and_scored(ns, cwd) -> None:
    assert set(ns["trainer"].implicit_reward_accuracy(ns["task0"]["test"])) >= {"accuracy", "margin", "num_pairs"}


def _scored_the_policies(ns, cwd) -> None:
    assert (ns["res"].num_prompts, ns["res"].num_comparisons) == (4, 8)  # 4 eval prompts x samples_per_prompt=2


# the block's first line -> what its comments say it did
CHECKS = {
    "from rlhf_ext.trl import SegmentRewardConfig, SegmentRewardTrainer": _wrote_segment_config,
    "from rlhf_ext.trl import SegmentPPOConfig, SegmentPPOTrainer": _wrote_a_ppo_checkpoint,
    "import re": _built_a_dense_trainer,
    "from rlhf_ext.online import select_pairs, OneStepAsyncRunner": _selected_and_trained,
    "from rlhf_ext.continual import kl_to_previous, backward_transfer, summarize": _the_commented_values,
    "from rlhf_ext.trl import ContinualDPOConfig, ContinualDPOTrainer": _trained_and_scored,
    "from rlhf_ext.sim import AnnotatorPool, GoldScorer, HFPolicy, BestOfNPolicy, win_rate": _scored_the_policies,
}
# the placeholder paths the blocks name -> which builtin model stands in for it
PLACEHOLDER_MODELS = {
    "path/to/sft": "sft",
    "my-sft": "sft",
    "runs/sft": "sft",
    "runs/my_policy": "sft",
    "runs/seq/task_00/policy": "sft",
    "runs/rm": "rm",
    "my-rm": "rm",
}


def test_every_readme_python_block_has_a_setup():
    firsts = [block.splitlines()[0] for block in readme_python_blocks()]
    missing = [first for first in firsts if first not in SETUPS]
    assert not missing, f"README python blocks with no setup in {__file__} (add one to SETUPS): {missing}"
    stale = set(SETUPS) - set(firsts)
    assert not stale, f"SETUPS rows for blocks README.md no longer has (remove them): {stale}"
    assert CHECKS.keys() == SETUPS.keys()


class _Paths:
    def __init__(self, sft: str, rm: str):
        self.sft, self.rm = sft, rm

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.sft)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_python_block_runs_as_written(index, tmp_path, monkeypatch, tiny_sft_path, cache_dir, one_torch_thread):
    from rlhf_ext.pipelines.builtins import resolve_model

    block = readme_python_blocks()[index]
    paths = _Paths(tiny_sft_path, resolve_model("builtin:tiny-segment-rm", cache_dir))
    monkeypatch.chdir(tmp_path)
    for placeholder, model in PLACEHOLDER_MODELS.items():
        if f'"{placeholder}"' in block:
            (tmp_path / placeholder).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(getattr(paths, model), tmp_path / placeholder)
    namespace = {"__name__": "__readme__", **SETUPS[block.splitlines()[0]](paths)}
    exec(compile(block, f"README.md python block {index + 1}", "exec"), namespace)
    CHECKS[block.splitlines()[0]](namespace, tmp_path)
