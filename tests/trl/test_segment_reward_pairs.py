"""Preference pairs that carry no preference (an empty response, or two identical ones) are dropped with a warning
that counts them, and a dataset with none usable left is one clear error (such pairs used to train a reward model
at chance, silently)."""

from __future__ import annotations

import json
import logging

import pytest
from click.testing import CliRunner
from datasets import Dataset

from rlhf_ext.runtime.segment_data import DatasetFormatError
from rlhf_ext.trl.args import CPU_RUN
from rlhf_ext.trl.segment_reward import pair_defect

EOS = 0


@pytest.mark.parametrize(
    "chosen, rejected, prompt_len, defect",
    [
        ([5, 6, 7, EOS], [5, 6, 8, EOS], 2, None),
        ([5, 6, 7, EOS], [5, 6, 7, EOS], 2, "identical"),
        ([5, 6, EOS], [5, 6, 8, EOS], 2, "empty"),  # an empty response is its closing EOS alone
        ([5, 6, 7, EOS], [5, 6], 2, "empty"),
        ([5, 6, EOS], [5, 6, EOS], 2, "empty"),
        ([7], [8], 0, None),  # one token and no EOS is a response
    ],
)
def test_pair_defect(chosen, rejected, prompt_len, defect):
    assert pair_defect(chosen, rejected, prompt_len, EOS) == defect


def _pairs(toy_data, bad_rows: list[dict]) -> Dataset:
    good = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in toy_data["train"].select(range(6))]
    return Dataset.from_list(good + bad_rows)


BAD_ROWS = [
    {"prompt": "Question: What should I know about owls?\nAnswer:", "chosen": "", "rejected": " Owls hunt at night."},
    {"prompt": "Question: What should I know about owls?\nAnswer:", "chosen": " Owls hoot.", "rejected": ""},
    {
        "prompt": "Question: What should I know about bees?\nAnswer:",
        "chosen": " Bees sting.",
        "rejected": " Bees sting.",
    },
]


def test_uninformative_pairs_are_dropped_with_a_warning_that_counts_them(tmp_path, tiny_sft_path, toy_tok, toy_data,
                                                                         caplog):  # fmt: skip
    from rlhf_ext.trl import SegmentRewardConfig, SegmentRewardTrainer

    args = SegmentRewardConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, **CPU_RUN, seed=0)
    with caplog.at_level(logging.WARNING, logger="rlhf_ext"):
        trainer = SegmentRewardTrainer(
            tiny_sft_path, args=args, train_dataset=_pairs(toy_data, BAD_ROWS), processing_class=toy_tok
        )
    warnings = [r for r in caplog.records if r.name == "rlhf_ext.trl.segment_reward"]
    assert [(r.levelno, r.getMessage()) for r in warnings] == [
        (
            logging.WARNING,
            "train_dataset: dropped 3 of 9 preference pairs that carry no preference (2 with an empty chosen or "
            "rejected response, 1 with identical chosen and rejected responses)",
        )
    ]
    assert len(trainer.train_dataset) == 6
    assert not any(pair_defect(r["chosen_ids"], r["rejected_ids"], r["prompt_len"], EOS) for r in trainer.train_dataset)


def test_no_usable_pair_is_one_clear_error(tmp_path, tiny_sft_path, toy_tok):
    from rlhf_ext.trl import SegmentRewardConfig, SegmentRewardTrainer

    args = SegmentRewardConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, **CPU_RUN, seed=0)
    with pytest.raises(DatasetFormatError) as info:
        SegmentRewardTrainer(
            tiny_sft_path, args=args, train_dataset=Dataset.from_list(BAD_ROWS), processing_class=toy_tok
        )
    assert str(info.value) == (
        "train_dataset: none of its 3 preference pairs is usable (2 with an empty chosen or rejected response, 1 "
        "with identical chosen and rejected responses); check the chosen / rejected columns (recipe keys "
        "data.chosen_key / data.rejected_key) and max_length"
    )


def test_the_command_line_reports_a_dataset_without_usable_pairs_in_one_line(tmp_path, tiny_sft_path):
    from rlhf_ext.cli import main

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in BAD_ROWS))
    out = tmp_path / "rm"
    result = CliRunner().invoke(
        main,
        ["train", "segment-rm", "--config", "segment_rm_tiny", f"data.train={data}", f"model.sft_model={tiny_sft_path}",
         f"train.output_dir={out}"],
    )  # fmt: skip
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: train_dataset: none of its 3 preference pairs is usable (2 with an empty chosen or rejected response, "
        "1 with identical chosen and rejected responses); check the chosen / rejected columns (recipe keys "
        "data.chosen_key / data.rejected_key) and max_length"
    ]
    assert "Traceback" not in result.output
