"""IterativeDPOTrainer on the learnable toy task: improvement per iteration, resumption, ties, online async/sync."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback
from transformers.trainer_utils import TrainOutput
from trl import DPOTrainer

from rlhf_ext.trl import IterativeDPOTrainer
from rlhf_ext.zoo.toy import keyphrase_gold_reward
from tests.helpers.online_dpo_args import make_args

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompts():
    from rlhf_ext.zoo.toy import toy_preference_dataset

    ds = toy_preference_dataset(n_train=128, n_test=32, seed=0)
    return ds["train"], ds["test"]


class Crash(Exception):
    pass


class CrashAt(TrainerCallback):
    """Raise after optimizer step ``step`` of the DPO run whose output_dir contains ``where``."""

    def __init__(self, where: str, step: int):
        self.where, self.step, self.fired = where, step, False

    def on_step_end(self, args, state, control, **kwargs):
        if not self.fired and self.where in args.output_dir and state.global_step == self.step:
            self.fired = True
            raise Crash(f"killed at step {self.step} of {args.output_dir}")


class RecordData(TrainerCallback):
    """Record how many pairs each inner DPO run trains on."""

    def __init__(self):
        self.sizes: list[int] = []

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self.sizes.append(len(train_dataloader.dataset))


def _pairs(root: Path) -> list[str]:
    return [p.read_text() for p in sorted((root / "pairs").glob("iter_*/pairs.jsonl"))]


def _weights(path: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


class CountSteps(TrainerCallback):
    """Count the optimizer steps of every DPO run and record what goes through the Trainer's loggers."""

    def __init__(self):
        self.steps, self.logs = 0, []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


# ---------------------------------------------------------------------------------------------- TRL interface
def test_is_a_dpo_trainer_built_with_trls_arguments_in_grpo_order(tmp_path, tiny_sft_path, prompts):
    train, test = prompts
    args = make_args(tmp_path)
    trainer = IterativeDPOTrainer(tiny_sft_path, keyphrase_gold_reward, args, train, test)
    assert isinstance(trainer, DPOTrainer) and trainer.args is args
    assert trainer.reward_fn is keyphrase_gold_reward
    assert trainer.prompts == list(train["prompt"]) and list(trainer.train_dataset["prompt"]) == trainer.prompts
    assert trainer.eval_prompts == list(test["prompt"])[: args.eval_num_prompts]
    assert isinstance(trainer.model, torch.nn.Module) and trainer.processing_class is not None
    # the old order (model, args, prompts, ...) would put the config where the reward goes
    with pytest.raises(TypeError, match="argument order"):
        IterativeDPOTrainer(tiny_sft_path, args, train_dataset=train)
    with pytest.raises(ValueError, match="optimizers"):
        IterativeDPOTrainer(tiny_sft_path, keyphrase_gold_reward, args, train, optimizers=(object(), None))


def test_reward_funcs_takes_a_callable_a_path_a_loaded_model_or_a_list_of_one(
    tmp_path, tiny_sft_path, toy_tok, prompts
):
    from transformers import AutoModelForSequenceClassification

    from rlhf_ext.runtime.rewards import SequenceClassifierReward

    train, _ = prompts
    args = make_args(tmp_path)

    def build(reward, **kw):
        return IterativeDPOTrainer(tiny_sft_path, reward, args=args, train_dataset=train, **kw)

    assert build(keyphrase_gold_reward).reward_fn is keyphrase_gold_reward
    assert build([keyphrase_gold_reward]).reward_fn is keyphrase_gold_reward
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_sft_path, num_labels=1)
    rm_dir = tmp_path / "rm"
    rm.save_pretrained(rm_dir)
    toy_tok.save_pretrained(rm_dir)
    loaded, from_path = build([rm], processing_class=toy_tok).reward_fn, build(str(rm_dir)).reward_fn
    assert isinstance(loaded, SequenceClassifierReward) and isinstance(from_path, SequenceClassifierReward)
    texts = (["Tell me about cats.", "Tell me about dogs."], ["They purr.", "They bark."])
    assert torch.allclose(loaded(*texts), from_path(*texts), atol=1e-5) and loaded(*texts).shape == (2,)
    with pytest.raises(ValueError, match="one reward, got 2"):
        build([keyphrase_gold_reward, keyphrase_gold_reward])
    with pytest.raises(TypeError, match="reward_funcs must be"):
        build(3)
    with pytest.raises(ValueError, match="exactly one"):
        build(keyphrase_gold_reward, reward_fn=keyphrase_gold_reward)


def test_deprecated_keywords_warn_and_still_work(tmp_path, tiny_sft_path, prompts):
    train, test = prompts
    args = make_args(tmp_path)
    with pytest.warns(DeprecationWarning) as caught:
        old = IterativeDPOTrainer(
            tiny_sft_path, args=args, prompts=train, eval_prompts=test, reward_fn=keyphrase_gold_reward
        )
    messages = " | ".join(str(w.message) for w in caught)
    for name, new in (("prompts", "train_dataset"), ("eval_prompts", "eval_dataset"), ("reward_fn", "reward_funcs")):
        assert f"({name}=...) is deprecated" in messages and f"use {new}=" in messages
    new = IterativeDPOTrainer(tiny_sft_path, keyphrase_gold_reward, args, train, test)
    assert (old.prompts, old.eval_prompts, old.reward_fn) == (new.prompts, new.eval_prompts, new.reward_fn)
    evaluation = old.evaluate_policy(0)  # samples the eval prompts and scores them with the reward
    assert evaluation["num_responses"] == args.eval_num_prompts and evaluation["policy"] == 0
    with pytest.warns(DeprecationWarning, match="use reward_funcs="):
        by_name = IterativeDPOTrainer(tiny_sft_path, args=args, train_dataset=train, reward_model=str(tiny_sft_path))
    assert callable(by_name.reward_fn)
    with pytest.raises(ValueError, match="pass train_dataset= only"):
        IterativeDPOTrainer(tiny_sft_path, keyphrase_gold_reward, args, train, prompts=train)


def test_train_returns_a_train_output_with_the_dpo_steps_it_ran(tmp_path, tiny_sft_path, prompts):
    train, test = prompts
    counter = CountSteps()
    args = make_args(tmp_path)  # 2 iterations, accumulated pairs, batch 4, 1 epoch
    trainer = IterativeDPOTrainer(tiny_sft_path, keyphrase_gold_reward, args, train, test, callbacks=[counter])
    out = trainer.train()
    assert isinstance(out, TrainOutput)
    counts = [it["pairs"]["num_pairs"] for it in trainer.summary["iterations"]]
    expected = sum(math.ceil(sum(counts[: t + 1]) / 4) for t in range(2))
    assert expected > 0 and out.global_step == counter.steps == expected
    assert out.metrics["dpo_steps"] == expected and out.metrics["num_pairs"] == sum(counts)
    assert out.metrics["iterations"] == 2 and math.isfinite(out.training_loss) and out.training_loss > 0
    assert out.metrics["final_mean_reward"] == trainer.summary["eval"][-1]["mean_reward"]
    # the iterations' metrics go through the Trainer's loggers (callbacks' on_log), not print
    logged = [x for x in counter.logs if "pairs/num_pairs" in x]
    assert [x["iteration"] for x in logged] == [0, 1] and [x["pairs/num_pairs"] for x in logged] == counts
    assert [x["policy_eval/mean_reward"] for x in logged] == [e["mean_reward"] for e in trainer.summary["eval"][1:]]
    assert any(x.get("dpo_steps") == expected for x in counter.logs)
    # the finished run again: every step is on disk, no DPO step runs
    again = IterativeDPOTrainer(tiny_sft_path, keyphrase_gold_reward, args, train, test)
    out = again.train()
    assert out.global_step == 0 and out.metrics["dpo_steps"] == 0
    assert again.summary == json.loads(json.dumps(trainer.summary))


def test_peft_config_trains_an_adapter_per_iteration_and_saves_merged_policies(tmp_path, tiny_sft_path, prompts):
    peft = pytest.importorskip("peft")
    train, test = prompts
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = make_args(tmp_path, learning_rate=1e-3)
    trainer = IterativeDPOTrainer(tiny_sft_path, keyphrase_gold_reward, args, train, test, peft_config=lora)
    assert trainer.train().global_step > 0
    final = Path(trainer.summary["final_policy"])
    assert final.name == "policy_002" and not (final / "adapter_config.json").exists()
    a, b = _weights(str(final)), _weights(tiny_sft_path)
    assert a.keys() == b.keys()
    assert {n for n in a if not torch.equal(a[n], b[n])} == {
        f"model.layers.{i}.self_attn.{m}_proj.weight" for i in range(2) for m in "qv"
    }
    with pytest.raises(ValueError, match="online_mode='iterative' only"):
        IterativeDPOTrainer(
            tiny_sft_path, keyphrase_gold_reward, make_args(tmp_path, online_mode="online"), train, peft_config=lora
        )


# --------------------------------------------------------------------------------------------- learnable toy
def test_each_iteration_raises_the_mean_reward_of_the_policys_samples(tmp_path, tiny_sft_path, prompts, monkeypatch):
    train, test = prompts
    refs = []
    original = IterativeDPOTrainer._load_model

    def recording(self, path):
        refs.append(path)
        return original(self, path)

    monkeypatch.setattr(IterativeDPOTrainer, "_load_model", recording)
    sizes = RecordData()
    args = make_args(
        tmp_path,
        num_iterations=3,
        prompts_per_iteration=32,
        num_generations=8,
        max_completion_length=72,
        num_train_epochs=2,
        per_device_train_batch_size=8,
        lr_scheduler_type="cosine",
        warmup_steps=0.03,
        eval_num_prompts=32,
        eval_samples_per_prompt=8,
    )
    trainer = IterativeDPOTrainer(
        tiny_sft_path,
        args=args,
        train_dataset=train,
        eval_dataset=test,
        reward_funcs=keyphrase_gold_reward,
        callbacks=[sizes],
    )
    trainer.train()
    summary = trainer.summary
    evals = [e["mean_reward"] for e in summary["eval"]]
    collected = [it["pairs"]["mean_reward"] for it in summary["iterations"]]
    # held-out samples of pi_0 .. pi_3 (same prompts, same seed) and the n samples each iteration collects
    assert all(b > a + 0.01 for a, b in zip(evals, evals[1:])), evals
    assert all(b > a + 0.01 for a, b in zip(collected, collected[1:])), collected
    # accumulated pairs (paper: historical + new) and the SFT model as reference in every iteration
    counts = [it["pairs"]["num_pairs"] for it in summary["iterations"]]
    assert sizes.sizes == [sum(counts[: k + 1]) for k in range(3)]
    assert refs == [tiny_sft_path] * 3
    assert json.loads((tmp_path / "summary.json").read_text())["final_policy"].endswith("policy_003")
    # best vs worst of 8 under a 0/1 reward: every kept pair has margin 1, chosen from the key-phrase responses
    rows = [json.loads(x) for x in (tmp_path / "pairs/iter_000/pairs.jsonl").read_text().splitlines()]
    assert rows and all(r["chosen_reward"] == 1.0 and r["rejected_reward"] == 0.0 for r in rows)


# -------------------------------------------------------------------------------------------------- resuming
def test_a_killed_run_resumes_to_the_same_pairs_and_weights(tmp_path, tiny_sft_path, prompts, monkeypatch):
    train, test = prompts
    common = dict(num_iterations=3, reference="previous", pair_data="latest")
    refs: list[str] = []
    original = IterativeDPOTrainer._load_model

    def recording(self, path):
        refs.append(path)
        return original(self, path)

    monkeypatch.setattr(IterativeDPOTrainer, "_load_model", recording)

    def run(out, reward_fn=keyphrase_gold_reward, callbacks=(), **kw):
        args = make_args(out, **common, **kw)
        t = IterativeDPOTrainer(
            tiny_sft_path,
            args=args,
            train_dataset=train,
            eval_dataset=test,
            reward_funcs=reward_fn,
            callbacks=list(callbacks),
        )
        t.train()
        return t.summary

    sizes = RecordData()
    full = run(tmp_path / "full", callbacks=[sizes])
    assert refs == [
        tiny_sft_path,
        str(tmp_path / "full/_policies/policy_001"),
        str(tmp_path / "full/_policies/policy_002"),
    ]
    assert sizes.sizes == [
        json.loads((tmp_path / f"full/pairs/iter_{k:03d}/summary.json").read_text())["num_pairs"] for k in range(3)
    ]

    # kill 1: while scoring iteration 1's samples (calls: eval pi_0, collect 0, eval pi_1, collect 1)
    calls = {"n": 0}

    def dying_reward(p, r):
        calls["n"] += 1
        if calls["n"] == 4:
            raise Crash("killed while scoring")
        return keyphrase_gold_reward(p, r)

    out = tmp_path / "killed"
    with pytest.raises(Crash):
        run(out, reward_fn=dying_reward, save_strategy="steps", save_steps=1)
    assert [p.name for p in sorted((out / "pairs").iterdir()) if not p.name.startswith(".")] == ["iter_000"]
    # kill 2: after the first optimizer step of iteration 2's DPO run (a checkpoint exists from step 1)
    with pytest.raises(Crash):
        run(out, save_strategy="steps", save_steps=1, callbacks=[CrashAt("iter_002", 2)])
    assert (out / "iterations/iter_002/checkpoint-1").is_dir()
    resumed = run(out, save_strategy="steps", save_steps=1)

    assert _pairs(out) == _pairs(tmp_path / "full")  # same pairs, same order, none lost or duplicated
    for k in (1, 2, 3):
        a, b = _weights(full["eval"][k]["path"]), _weights(resumed["eval"][k]["path"])
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert [e["mean_reward"] for e in resumed["eval"]] == [e["mean_reward"] for e in full["eval"]]
    assert not list((out / "iterations/iter_002").glob("checkpoint-*"))  # cleaned once the iterate was saved
    assert not [p for p in (out / "_policies").iterdir() if p.name.startswith(".")]


class FakeHub:
    """``transformers.trainer.hf_api()`` for a push that stays on disk: records the files ``upload_folder`` sends
    (its ignore patterns applied by huggingface_hub's own filter)."""

    def __init__(self):
        self.uploaded: dict[str, Path] = {}

    def create_repo(self, name, **kwargs):
        return type("RepoUrl", (), {"repo_id": f"me/{name}"})()

    def upload_folder(self, folder_path, ignore_patterns=None, **kwargs):
        from huggingface_hub.utils import filter_repo_objects

        files = [p.relative_to(folder_path).as_posix() for p in Path(folder_path).rglob("*") if p.is_file()]
        kept = filter_repo_objects(files, ignore_patterns=ignore_patterns)
        self.uploaded = {name: Path(folder_path) / name for name in kept}


def test_push_to_hub_uploads_the_final_policy_only(tmp_path, tiny_sft_path, prompts, monkeypatch):
    """``output_dir`` holds every iteration's full weights; ``push_to_hub`` used to upload all of them next to the
    final model. Also after a resume that had nothing left to train (the trainer then holds the SFT model)."""
    import transformers.trainer

    train, _ = prompts
    args = make_args(tmp_path, num_iterations=2, prompts_per_iteration=4, num_generations=2)
    IterativeDPOTrainer(tiny_sft_path, keyphrase_gold_reward, args, train).train()
    resumed = IterativeDPOTrainer(tiny_sft_path, keyphrase_gold_reward, args, train)
    resumed.train()  # everything is done: no DPO run in this process
    hub = FakeHub()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    resumed.push_to_hub()
    weights = sorted(n for n in hub.uploaded if n.endswith(".safetensors"))
    assert weights == ["model.safetensors"], sorted(hub.uploaded)
    final = resumed.summary["final_policy"]
    assert final == str(tmp_path / "_policies" / "policy_002")
    pushed, expected, sft = (_weights(str(d)) for d in (tmp_path, final, tiny_sft_path))
    assert all(torch.equal(pushed[n], expected[n]) for n in expected)
    assert any(not torch.equal(pushed[n], sft[n]) for n in sft)  # the trained policy, not the SFT model


@pytest.mark.parametrize(
    ("old", "new", "value"), [("max_new_tokens", "max_completion_length", 24), ("num_samples", "num_generations", 6)]
)
def test_deprecated_aliases_set_trls_names(tmp_path, old, new, value):
    with pytest.warns(DeprecationWarning, match=f"use {new}="):
        args = make_args(tmp_path, **{new: 4, old: value})
    assert getattr(args, new) == value
    assert make_args(tmp_path, **{new: value}).settings() == args.settings()
    with pytest.raises(ValueError, match=f"{old} must be an integer >= "):  # checked under the name the user gave
        make_args(tmp_path, **{old: 0})


def test_resuming_with_different_settings_is_refused(tmp_path, tiny_sft_path, prompts):
    train, _ = prompts
    trainer = IterativeDPOTrainer(
        tiny_sft_path, args=make_args(tmp_path), train_dataset=train, reward_funcs=lambda p, r: torch.zeros(len(r))
    )
    trainer.open_run()
    other = IterativeDPOTrainer(
        tiny_sft_path,
        args=make_args(tmp_path, num_generations=6),
        train_dataset=train,
        reward_funcs=keyphrase_gold_reward,
    )
    with pytest.raises(ValueError, match="changed: num_generations: 4 -> 6"):  # run.json says num_samples
        other.train()
    for changed in ({"beta": 0.5}, {"learning_rate": 1e-2}):  # the inner DPO runs' settings count too
        rerun = IterativeDPOTrainer(tiny_sft_path, keyphrase_gold_reward, make_args(tmp_path, **changed), train)
        with pytest.raises(ValueError, match=rf"changed: {next(iter(changed))}: "):
            rerun.train()
    fresh = IterativeDPOTrainer(
        tiny_sft_path, args=make_args(tmp_path, resume=False), train_dataset=train, reward_funcs=keyphrase_gold_reward
    )
    with pytest.raises(FileExistsError, match="resume=True"):
        fresh.train()


def test_a_run_file_written_before_rundir_is_taken_over_when_its_settings_match(tmp_path, tiny_sft_path, prompts):
    from rlhf_ext.runtime.io import stable_hash

    train, _ = prompts
    trainer = IterativeDPOTrainer(tiny_sft_path, keyphrase_gold_reward, make_args(tmp_path), train)
    legacy = {"settings": trainer.args.settings(), "sft": tiny_sft_path, "prompts": stable_hash(trainer.prompts)}
    (tmp_path / "run.json").write_text(json.dumps(legacy))
    trainer.open_run()
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["kind"] == "iterative-dpo" and run["settings"]["num_samples"] == 4
    assert run["settings"]["sft"] == tiny_sft_path and run["settings"]["prompts"] == legacy["prompts"]
    (tmp_path / "run.json").write_text(json.dumps({**legacy, "sft": "another-model"}))
    with pytest.raises(ValueError, match="different settings") as err:
        trainer.open_run()
    assert "force" not in str(err.value)  # IterativeDPOTrainer has no force option (the message used to advise one)


# ------------------------------------------------------------------------------------------------- bad input
def test_all_ties_warn_and_skip_training(tmp_path, tiny_sft_path, prompts):
    train, _ = prompts
    trainer = IterativeDPOTrainer(
        tiny_sft_path, args=make_args(tmp_path), train_dataset=train, reward_funcs=lambda p, r: torch.zeros(len(r))
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    summary = trainer.summary
    messages = [str(w.message) for w in caught]
    assert sum("tied" in m for m in messages) == 2 and sum("skipping DPO" in m for m in messages) == 2
    assert summary["skipped_iterations"] == [0, 1]
    assert summary["final_policy"] == tiny_sft_path  # no training happened
    for it in summary["iterations"]:
        assert it["pairs"]["num_pairs"] == 0 and it["pairs"]["dropped"] == 8
    assert not (tmp_path / "iterations").exists()


def test_an_instantiated_sft_model_is_saved_once_as_policy_0(tmp_path, tiny_sft_path, toy_tok, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_sft_path)
    args = make_args(tmp_path, num_iterations=1)
    with pytest.raises(ValueError, match="processing_class"):
        IterativeDPOTrainer(model, args=args, train_dataset=prompts[0], reward_funcs=keyphrase_gold_reward)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = IterativeDPOTrainer(
            model,
            args=args,
            train_dataset=prompts[0],
            processing_class=toy_tok,
            reward_funcs=lambda p, r: torch.zeros(len(r)),
        )
        trainer.train()
    summary = trainer.summary
    assert any("skipping DPO" in str(w.message) for w in caught)
    saved = tmp_path / "_policies/policy_000"
    assert summary["final_policy"] == str(saved) and (saved / "tokenizer_config.json").is_file()
    original = load_file(str(Path(tiny_sft_path) / "model.safetensors"))
    assert all(torch.equal(original[k], v) for k, v in _weights(str(saved)).items())


def test_bad_configuration_and_inputs_are_clear_errors(tmp_path, tiny_sft_path, prompts):
    train, _ = prompts
    with pytest.raises(ValueError, match=">= 2"):
        make_args(tmp_path, num_generations=1)
    with pytest.raises(ValueError, match="selection_rule"):
        make_args(tmp_path, selection_rule="best")
    with pytest.raises(ValueError, match="reference"):
        make_args(tmp_path, reference="ema")
    with pytest.raises(ValueError, match="length_penalty"):
        make_args(tmp_path, length_penalty=-0.1)
    args = make_args(tmp_path)
    with pytest.raises(ValueError, match="exactly one"):
        IterativeDPOTrainer(tiny_sft_path, args=args, train_dataset=train)
    with pytest.raises(ValueError, match="no 'question' column"):
        IterativeDPOTrainer(
            tiny_sft_path, args=args, train_dataset=train, reward_funcs=keyphrase_gold_reward, prompt_key="question"
        )
    with pytest.raises(ValueError, match="empty"):
        IterativeDPOTrainer(tiny_sft_path, args=args, train_dataset=[], reward_funcs=keyphrase_gold_reward)
    wrong = IterativeDPOTrainer(tiny_sft_path, args=args, train_dataset=train, reward_funcs=lambda p, r: [0.0])
    with pytest.raises(ValueError, match="one score per"):
        wrong.train()


# ----------------------------------------------------------------------------------------------- online mode
@pytest.mark.parametrize("async_generation, process", [(True, False), (False, False), (True, True)])
def test_online_mode_trains_one_update_per_generated_batch(tmp_path, tiny_sft_path, prompts, async_generation, process):
    train, test = prompts
    args = make_args(
        tmp_path,
        online_mode="online",
        async_generation=async_generation,
        generator_process=process,
        generation_threads=1,
        max_steps=4,
        gradient_accumulation_steps=2,
    )
    trainer = IterativeDPOTrainer(
        tiny_sft_path, args=args, train_dataset=train, eval_dataset=test, reward_funcs=keyphrase_gold_reward
    )
    trainer.train()
    summary = trainer.summary
    runner = summary["runner"]
    if async_generation:
        assert runner["staleness"] == {0: 1, 1: 3}
        expected_versions = [0, 0, 1, 2]
    else:
        assert runner["staleness"] == {0: 4}
        expected_versions = [0, 1, 2, 3]
    assert [t[0] for t in runner["trained"]] == [0, 1, 2, 3]
    stored = [json.loads((tmp_path / f"pairs/iter_{i:03d}/summary.json").read_text()) for i in range(4)]
    assert [s["policy_version"] for s in stored] == expected_versions
    assert all(s["num_pairs"] == 8 for s in stored)  # micro-batch 4 x 2 accumulation steps, ties topped up
    a, b = _weights(summary["final_policy"]), load_file(str(Path(tiny_sft_path) / "model.safetensors"))
    assert any(not torch.equal(a[n], b[n]) for n in b)


def test_online_mode_resumes_from_the_last_checkpoint(tmp_path, tiny_sft_path, prompts):
    train, test = prompts

    def run(callbacks=()):
        args = make_args(tmp_path, online_mode="online", max_steps=5, save_strategy="steps", save_steps=1)
        t = IterativeDPOTrainer(
            tiny_sft_path,
            args=args,
            train_dataset=train,
            eval_dataset=test,
            reward_funcs=keyphrase_gold_reward,
            callbacks=list(callbacks),
        )
        t.train()
        return t.summary

    with pytest.raises(Crash):
        run([CrashAt("online", 3)])
    summary = run()
    assert summary["resumed_from_update"] == 2
    assert summary["runner"]["staleness"] == {0: 1, 1: 2}
    stored = sorted(p.name for p in (tmp_path / "pairs").iterdir() if not p.name.startswith("."))
    assert stored == [f"iter_{i:03d}" for i in range(5)]  # one dataset per update: none lost, none twice
    versions = [
        json.loads((tmp_path / f"pairs/iter_{i:03d}/summary.json").read_text())["policy_version"] for i in range(5)
    ]
    assert versions == [0, 0, 2, 2, 3]


def test_online_mode_generator_failure_reaches_the_caller_and_a_finished_run_is_not_redone(
    tmp_path, tiny_sft_path, prompts
):
    from rlhf_ext.online import AsyncRunnerError

    train, test = prompts
    args = make_args(tmp_path / "ties", online_mode="online", max_steps=2, max_fill_rounds=1)
    tied = IterativeDPOTrainer(
        tiny_sft_path, args=args, train_dataset=train, reward_funcs=lambda p, r: torch.zeros(len(r))
    )
    with pytest.raises(AsyncRunnerError, match="responses tied") as info:
        tied.train()
    assert isinstance(info.value.__cause__, RuntimeError)

    args = make_args(tmp_path / "done", online_mode="online", max_steps=2)
    first = IterativeDPOTrainer(
        tiny_sft_path, args=args, train_dataset=train, eval_dataset=test, reward_funcs=keyphrase_gold_reward
    )
    first.train()
    summary = first.summary
    calls = []
    again = IterativeDPOTrainer(
        tiny_sft_path, args=args, train_dataset=train, eval_dataset=test, reward_funcs=lambda p, r: calls.append(1)
    )
    again.train()
    assert again.summary == json.loads(json.dumps(summary)) and not calls
