"""``rlhf-ext segment show --json`` writes strict JSON: a non-finite score (a diverged reward model) is ``null``, not
the bare ``NaN`` that no JSON parser accepts."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from click.testing import CliRunner


def _refuse_constant(name: str) -> float:
    raise ValueError(f"not JSON: {name}")


def test_segment_show_json_writes_non_finite_scores_as_null(tmp_path, cache_dir):
    from transformers import AutoModelForSequenceClassification

    from rlhf_ext.cli import main
    from rlhf_ext.pipelines.builtins import resolve_model

    source = Path(resolve_model("builtin:tiny-segment-rm", cache_dir))
    diverged = tmp_path / "diverged-rm"
    model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1)
    with torch.no_grad():
        model.score.weight.fill_(math.nan)  # every token score is NaN
    shutil.copytree(source, diverged)  # tokenizer and segment settings
    model.save_pretrained(diverged)

    result = CliRunner().invoke(
        main, ["segment", "show", "--model", str(diverged), "--prompt", "Question: Owls?\nAnswer:", "--response",
               " Owls hunt at night.", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    view = json.loads(result.stdout, parse_constant=_refuse_constant)
    assert view["evaluation"] is None
    assert view["rewards"] == [None] * len(view["segments"]) and view["segments"]
    assert all(isinstance(h, float) and math.isfinite(h) for h in view["start_entropy"])  # finite values stay
