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


def test_a_response_cut_away_by_a_long_prompt_says_so():
    """Issue 23 item 15: a prompt that filled max_length left only the closing EOS of each response, reported as
    "an empty chosen or rejected response"."""
    assert pair_defect([5, 6, 7, EOS], [5, 6, 7, EOS], 3, EOS, max_length=4) == "no_room"
    assert pair_defect([5, 6, EOS], [5, 6, 8, EOS], 2, EOS, max_length=8) == "empty"  # room left: the data's own


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
            "rejected response: rows 6, 7, 1 with identical chosen and rejected responses: rows 8)",
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
        "train_dataset: none of its 3 preference pairs is usable (2 with an empty chosen or rejected response: rows "
        "0, 1, 1 with identical chosen and rejected responses: rows 2); check the chosen / rejected columns (recipe "
        "keys data.chosen_key / data.rejected_key) and max_length"
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
        "error: train_dataset: none of its 3 preference pairs is usable (2 with an empty chosen or rejected response: "
        "rows 0, 1, 1 with identical chosen and rejected responses: rows 2); check the chosen / rejected columns "
        "(recipe keys data.chosen_key / data.rejected_key) and max_length"
    ]
    assert "Traceback" not in result.output


def test_the_command_line_names_the_rows_whose_prompt_used_up_max_length(tmp_path, tiny_sft_path):
    from rlhf_ext.cli import main

    long_prompt = "Question: " + "What should I know about owls and bees? " * 40 + "\nAnswer:"
    rows = [{"prompt": long_prompt, "chosen": " Owls hoot.", "rejected": " Bees sting."}] * 3
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["train", "segment-rm", "--config", "segment_rm_tiny", f"data.train={data}", "data.max_length=64",
            f"model.sft_model={tiny_sft_path}", f"train.output_dir={tmp_path / 'rm'}"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: train_dataset: none of its 3 preference pairs is usable (3 with no response token left after a "
        "prompt that used up max_length (raise data.max_length or set a smaller data.max_prompt_length): rows 0, 1, "
        "2); check the chosen / rejected columns (recipe keys data.chosen_key / data.rejected_key) and max_length"
    ]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "Q", "chosen": "y", "rejected": ',
         "data file '{data}', line 3: not valid JSON (Expecting value at column 44); fix or remove that line (one "
         "JSON object per line)"),
        ('{"prompt": "Q", "chosen": null, "rejected": "n"}',
         "row 2 of the preference data: column 'chosen' must hold text or chat messages, got NoneType"),
    ],
)  # fmt: skip
def test_a_bad_row_of_a_data_file_is_named(line, message, tmp_path, tiny_sft_path):
    """Issue 23 item 15: a malformed line was a pandas traceback ("Expected object or value at position 42"), a null
    response a message without its row."""
    from rlhf_ext.cli import main

    good = json.dumps({"prompt": "Q", "chosen": " yes.", "rejected": " no."})
    data = tmp_path / "pairs.jsonl"
    data.write_text(f"{good}\n{good}\n{line}\n{good}\n")
    args = ["train", "segment-rm", "--config", "segment_rm_tiny", f"data.train={data}",
            f"model.sft_model={tiny_sft_path}", f"train.output_dir={tmp_path / 'rm'}"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert [x for x in result.output.splitlines() if x.startswith("error:")] == [f"error: {message.format(data=data)}"]
