"""The demo pipeline with its training stages replaced by records of what they would train on.

The run loop, the run directory (settings, markers, ``force``), the data and label stages and the datasets derived
for training (``rm_data``, ``ppo_prompts``) are the real ones; SFT, the reward model, the normalizer, PPO, the
evaluation and the report only record the sizes of their inputs, so a rerun's choices are checked in seconds.
"""

from __future__ import annotations

from typing import Any

from rlhf_ext.demo import DemoPipeline


class RecordingDemo(DemoPipeline):
    def stage_sft(self, results) -> dict[str, Any]:
        return {"path": str(self.out / "sft")}

    def stage_rm(self, results) -> dict[str, Any]:
        from datasets import load_from_disk

        pairs = load_from_disk(self.rm_recipe(results, self.out / "rm").data.train)
        return {"path": str(self.out / "rm"), "eval": {}, "train_pairs": len(pairs["train"])}

    def stage_normalizer(self, results) -> dict[str, Any]:
        return {"path": None}

    def stage_ppo(self, results) -> dict[str, Any]:
        from datasets import load_from_disk

        recipe = self.ppo_recipe(results, self.out / "ppo", results["rm"]["path"], None)
        return {
            "path": str(self.out / "ppo"),
            "curve": [],
            "prompts": len(load_from_disk(recipe.data.prompts)["train"]),
        }

    def stage_eval(self, results) -> dict[str, Any]:
        return {}

    def stage_report(self, results) -> dict[str, Any]:
        return {}
