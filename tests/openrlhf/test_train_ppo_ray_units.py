"""The pieces of ``rlhf_ext.openrlhf.train_ppo_ray`` that need no Ray cluster: the HF rollout engine's sampling, the
driver's refusals, the placeholder vLLM module, and the segment experience maker's reward handling."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlhf_ext.openrlhf import rollout
from rlhf_ext.openrlhf.compat import SamplingParams


def test_gumbel_max_samples_the_softmax():
    """Property: argmax(logits + noise) over many independent seeds is distributed as softmax(logits)."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    n = 20000
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 13
    choices = (logits + rollout.gumbel_noise(seeds, step=3, vocab_size=5)).argmax(-1)
    freq = torch.bincount(choices, minlength=5).float() / n
    expected = logits.softmax(-1)
    # 4.5 standard errors of a binomial proportion
    assert torch.all((freq - expected).abs() <= 4.5 * (expected * (1 - expected) / n).sqrt()), (freq, expected)


def test_noise_depends_only_on_seed_step_and_token():
    a = rollout.gumbel_noise(torch.tensor([5, 9, 5]), 2, 11)
    torch.testing.assert_close(a[0], a[2])
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(a[0], rollout.gumbel_noise(torch.tensor([5]), 3, 11)[0])


def test_process_logits_top_k_top_p_by_hand():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = rollout.process_logits(scores, 1.0, top_k=-1, top_p=0.7)  # 0.5 < 0.7 <= 0.8: keep the top two
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    kept = rollout.process_logits(scores, 1.0, top_k=3, top_p=1.0)
    assert torch.isfinite(kept).tolist() == [[True, True, True, False]]
    torch.testing.assert_close(rollout.process_logits(scores, 0.5, -1, 1.0), scores / 0.5)


@pytest.fixture(scope="module")
def engine(tiny_sft_path):
    """The engine class itself (no Ray actor): ``generate_batch`` is plain Python."""
    return rollout._HFRolloutEngine(model=tiny_sft_path, seed=3)


def test_rollouts_do_not_depend_on_batching(engine, toy_tok):
    """Two prompts generated together or one at a time give the same tokens (same weights version, same
    occurrence number): how OpenRLHF's dispatch batches requests cannot change a seeded run."""
    prompts = [toy_tok("Question: What should I know about tides?\nAnswer:")["input_ids"],
               toy_tok("Question: Why do cats purr?\nAnswer:")["input_ids"]]  # fmt: skip
    params = SamplingParams(temperature=1.0, max_tokens=12, logprobs=1)
    together = engine.generate_batch(prompts, params)
    engine._occurrences.clear()
    alone = [engine.generate_batch([p], params)[0] for p in prompts]
    for a, b in zip(together, alone):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason in ("stop", "length")
        la = [next(iter(d.values())).logprob for d in a.outputs[0].logprobs]
        lb = [next(iter(d.values())).logprob for d in b.outputs[0].logprobs]
        assert la == pytest.approx(lb, abs=1e-5) and all(v <= 0 for v in la)
    # a second sample of the same prompt is a different draw
    again = engine.generate_batch(prompts[:1], params)[0]
    assert again.outputs[0].token_ids != alone[0].outputs[0].token_ids


def test_rollout_logprobs_match_the_model(engine, toy_tok):
    """The reported log-probabilities are the temperature-processed model's (what vLLM's processed_logprobs mode
    reports and OpenRLHF's importance-sampling correction compares against)."""
    prompt = toy_tok("Question: What should I know about tides?\nAnswer:")["input_ids"]
    out = engine.generate_batch([prompt], SamplingParams(temperature=0.7, max_tokens=6, logprobs=1))[0].outputs[0]
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(prompt) - 1 : -1].float() / 0.7
    expected = logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    got = torch.tensor([next(iter(d.values())).logprob for d in out.logprobs])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_load_weights_bumps_the_version_and_rejects_foreign_weights(engine):
    state = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    version = engine.version
    assert engine.load_weights(state) == version + 1
    with pytest.raises(ValueError, match="do not match the rollout model"):
        engine.load_weights({"not.a.weight": torch.zeros(1)})


def _driver(*flags: str) -> subprocess.CompletedProcess:
    argv = ["--actor.model_name_or_path", "/nonexistent", "--reward.model_name_or_path", "/nonexistent", *flags]
    code = "import sys; from rlhf_ext.openrlhf.train_ppo_ray import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--algo.advantage.estimator", "rloo", "--rollout.n_samples_per_prompt", "2"], "shapes one scalar reward"),
        (["--reward.normalize_enable"], "--reward.normalize_enable acts on OpenRLHF's scalar reward"),
        (["--reward.stop_properly_penalty_coef", "0.5"], "--reward.stop_properly_penalty_coef acts on"),
        (["--ds.ring_attn_size", "2"], "--ds.ring_attn_size 2 needs ring-flash-attn"),
        (["--train.agent_func_path", "agent.py"], "--train.agent_func_path returns one score per sample"),
        (["--ext.granularity", "segmnt"], "--ext.granularity must be one of"),
        (["--ext.continual_kl_coeff", "1"], "unknown option --ext.continual_kl_coeff"),
        (["--ext.continual.kl_coef", "1"], "--ext.continual.kl_coef was renamed to --ext.continual_kl_coef"),
        (["--ext.continual_kl_coef", "-1"], "--ext.continual_kl_coef must be a number >= 0; got -1.0"),
        (["--ext.tau", "nan"], "--ext.tau must be a number > 0; got nan"),
        # issue 23 item 11: these three used to start Ray first and fail inside its workers
        (["--ext.normalizer", "/nonexistent/normalizer.json"], "normalizer file /nonexistent/normalizer.json does not"),
        (["--ext.normalizer", "{NAN_NORMALIZER}"], "normalizer w_mu must be a finite number; got nan"),
        (["--ext.continual_previous_model", "/nonexistent/prev"], "--ext.continual_previous_model: model "),
        (["--ext.reward_source", "rules:r.yaml"], "--ext.reward_source and --reward.model_name_or_path are two"),
    ],
)
def test_driver_refuses_before_ray_starts(flags, message, tmp_path):
    """One line naming the flag the user gave and the fix, exit code 2, and no Ray cluster was started. Flags that
    reach the check only as what OpenRLHF derives from them (``packing_samples``, ``remote_url="agent"``) are named
    as the user gave them: the check runs after OpenRLHF's fix-ups (issue 25, B)."""
    bad = tmp_path / "normalizer.json"
    bad.write_text('{"format": "rlhf_ext.LocationNormalizer/1", "kind": "global", "w_mu": NaN, "b_mu": 0.0}')
    proc = _driver(*[f.replace("{NAN_NORMALIZER}", str(bad)) for f in flags])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Started a local Ray instance" not in proc.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ext.reward_source", "rules:/nonexistent/rules.yaml"], "--ext.reward_source: rules file"),
        (["--ext.reward_source", "no_such_module_xyz:f"], "--ext.reward_source: reward source 'no_such_module_xyz:f'"),
        (["--ext.reward_source", "rules:r.yaml", "--ext.granularity", "token"], "rewards from --ext.reward_source"),
    ],
)
def test_bad_reward_source_is_refused_before_ray_starts(flags, message):
    code = "import sys; from rlhf_ext.openrlhf.train_ppo_ray import main; main(sys.argv[1:])"
    argv = ["--actor.model_name_or_path", "/nonexistent", "--algo.advantage.estimator", "reinforce", *flags]
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Started a local Ray instance" not in proc.stderr


def test_help_lists_the_ext_flags():
    """``--help`` printed the module docstring's raw reST and a bare list of ``--ext`` names; it is an argparse group
    generated from the knob dataclasses (types, choices, help) and says which flags a CPU run needs."""
    from rlhf_ext.algos.segment_dense import GRANULARITIES
    from rlhf_ext.openrlhf.train_ppo_ray import EXT_DEFAULTS

    proc = _driver("--help")
    assert proc.returncode == 0
    ours, _, openrlhf = proc.stdout.partition("OpenRLHF's flags (openrlhf.cli.train_ppo_ray --help):")
    assert "--actor.model_name_or_path" in openrlhf
    assert not any(markup in ours for markup in ("``", ":func:", ":class:", ":mod:"))
    group = ours.split("rlhf-ext flags (--ext.*):\n")[1]
    assert [line.split()[0] for line in group.splitlines() if line.startswith("  --ext.")] == [
        f"--ext.{k}" for k in EXT_DEFAULTS
    ]
    assert f"--ext.granularity {{{','.join(GRANULARITIES)}}}" in group and "--ext.tau FLOAT" in group
    assert "--ext.chunk_size INT Tokens per segment for granularity chunk (an integer >= 1) (default: 4)" in " ".join(
        group.split()
    )
    assert "--critic.num_gpus_per_node 1 --ds.param_dtype bf16" in ours  # what a CPU run needs


def test_placeholder_vllm_gives_a_clear_error():
    code = (
        "from rlhf_ext.openrlhf.compat import install_import_shims; install_import_shims(); import vllm\n"
        "assert not hasattr(vllm, '__version__')\n"
        "vllm.SamplingParams(temperature=0.5, max_tokens=3)\n"
        "vllm.__version__\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "GPUPackageMissing: vllm.__version__: 'vllm' is not installed" in proc.stderr
    assert "--ext.rollout_engine hf" in proc.stderr


def test_dense_rewards_are_clipped_per_token_like_the_scalar():
    from rlhf_ext.openrlhf import segment_ppo

    kl = torch.zeros(2, 3)
    dense = torch.tensor([[20.0, -30.0, 1.0], [0.5, 0.0, 0.0]])
    setattr(kl, segment_ppo.DENSE_ATTR, dense)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]]).bool()
    out = segment_ppo.dense_aware_compute_reward(torch.zeros(2), 0.0, kl, action_mask=mask, reward_clip_range=(-10, 10))
    torch.testing.assert_close(out, torch.tensor([[10.0, -10.0, 1.0], [0.5, 0.0, 0.0]]))


def test_logged_reward_survives_openrlhf_length_penalty_step():
    """OpenRLHF's length-penalty step copies ``rewards`` (0 for dense runs) into info["reward"]; the logged reward
    must stay the summed dense reward (it read 0.0 before)."""
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    from rlhf_ext.openrlhf import segment_ppo

    args = SimpleNamespace(
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator="reinforce", gamma=1.0, lambd=1.0, no_std_norm=False)),
        rollout=SimpleNamespace(n_samples_per_prompt=1, max_new_tokens=None),
        reward=SimpleNamespace(clip_range=(-10, 10), model_name_or_path=None, overlong_buffer_len=None,
                               stop_properly_penalty_coef=None),
        data=SimpleNamespace(max_len=64),
        ext=SimpleNamespace(granularity="token", interpolation="even_split", entropy_cutoff=None, aggregation=None,
                            tau=None, normalizer=None, reward_model_id=None, chunk_size=4),
    )  # fmt: skip
    maker = segment_ppo.SegmentExperienceMaker(
        None, None, None, None, FixedKLController(0.0), SimpleNamespace(args=args), tokenizer=None
    )
    mask = torch.tensor([[1, 1, 1, 0]]).bool()
    exp = Experience(
        sequences=torch.zeros(1, 6, dtype=torch.long), attention_mask=torch.ones(1, 6, dtype=torch.long),
        action_mask=mask, kl=torch.zeros(1, 4), info={},
    )  # fmt: skip
    exp.index = [0]
    exp.rewards = torch.tensor([[0.0, 0.0, 1.0, 2.0, 3.0, 0.0]])  # per-token RM scores, [B, T]
    maker.attach_dense_rewards([exp], None)
    summed = exp.info["reward"].clone()
    assert summed.item() != 0 and math.isfinite(summed.item())
    maker.compute_advantages_and_returns([exp])
    torch.testing.assert_close(exp.info["reward"], summed)


def test_micro_batch_is_fitted_to_the_world_size(caplog):
    """``deepspeed --num_accelerators 2`` with the tiny recipe (batch 16, micro 16) failed with DeepSpeed's
    "Gradient accumulation steps: 0"; the micro batch is now lowered to fit, and impossible splits are named."""
    from rlhf_ext.config import per_device_micro_batch

    assert per_device_micro_batch(16, 16, 2) == 8 and "using micro batch 8" in caplog.text
    assert per_device_micro_batch(16, 4, 2) == 4
    with pytest.raises(ValueError, match="not divisible by the 3 processes"):
        per_device_micro_batch(16, 4, 3)
    with pytest.raises(ValueError, match="not a multiple of train.micro_batch_size 3"):
        per_device_micro_batch(16, 3, 2)


def test_empty_eval_set_is_skipped_not_crashed():
    """Without --eval.dataset OpenRLHF evaluates on 1% of the training rows: none below 100 rows."""
    from rlhf_ext.openrlhf.segment_rm import SegmentRewardModelTrainer

    printed = []
    trainer = object.__new__(SegmentRewardModelTrainer)
    trainer.strategy = SimpleNamespace(print=printed.append)
    assert trainer.evaluate([], steps=3) is None and trainer.evaluate([], steps=4) is None
    assert len(printed) == 1 and "eval set is empty (pass --eval.dataset)" in printed[0]


def test_builtin_model_is_built_outside_a_distributed_launch(tmp_path, monkeypatch):
    """Under torchrun/deepspeed (WORLD_SIZE > 1) a builtin model is built in a plain subprocess: building one in the
    rank itself deadlocked (the build joined the launch's process group while the other rank waited on the lock)."""
    from rlhf_ext.pipelines.builtins import resolve_model

    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    path = resolve_model("builtin:tiny", tmp_path)
    assert (tmp_path / "models" / "tiny" / "config.json").exists() and path == str(tmp_path / "models" / "tiny")


def test_running_the_library_module_points_to_the_runnable_one():
    """``python -m rlhf_ext.openrlhf.segment_ppo --help`` exited 0 and did nothing."""
    proc = subprocess.run([sys.executable, "-m", "rlhf_ext.openrlhf.segment_ppo", "--help"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "python -m rlhf_ext.openrlhf.train_ppo_ray" in proc.stderr


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not EPHEMERAL_RANGE.exists(), reason="Linux's ephemeral port range is read from /proc")
def test_ray_rendezvous_ports_are_outside_the_ephemeral_range():
    """OpenRLHF's model groups took their torch.distributed port from ``bind(0)`` (the kernel's ephemeral range),
    released it and bound it again later; with two Ray runs starting at once (CI's two test workers) another process
    received the port in between and the policy actor died with ``EADDRINUSE``. In a Ray worker the port now comes
    from below the ephemeral range, which the kernel never hands out, and is free when chosen."""
    code = (
        "from rlhf_ext.openrlhf.compat import patch_for_cpu, import_shims\n"
        "patch_for_cpu(worker=True)\n"
        "with import_shims():\n"
        "    from openrlhf.trainer.ray.launcher import BaseDistributedActor\n"
        "print('PORTS', *[BaseDistributedActor._get_free_port() for _ in range(20)])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    low = int(EPHEMERAL_RANGE.read_text().split()[0])
    ports = [int(p) for p in proc.stdout.split("PORTS ")[-1].split()]
    assert len(ports) == 20 and all(20000 <= p < low for p in ports), ports
    for port in ports:  # free: the run's process group can bind it
        with socket.socket() as sock:
            sock.bind(("", port))


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("my_rewards.py:polite", "{cwd}/my_rewards.py:polite"),
        ("sub/r.py:Credit", "{cwd}/sub/r.py:Credit"),
        ("rules:rules.yaml", "rules:{cwd}/rules.yaml"),
        ("rules:builtin:toy-keyphrase", "rules:builtin:toy-keyphrase"),
        ("my_package.rewards:polite", "my_package.rewards:polite"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("prm:/models/prm", "prm:/models/prm"),
    ],
)
def test_a_relative_reward_source_reaches_the_ray_actors_as_an_absolute_path(spec, expected, tmp_path, monkeypatch):
    """OpenRLHF's Ray actors load ``--ext.reward_source`` in their own working directory: a relative file becomes
    absolute in the driver (it used to stay relative and fail in the actor, or load another file)."""
    from rlhf_ext.openrlhf.train_ppo_ray import for_cluster, parse_ext_args
    from rlhf_ext.runtime.resources import Cluster

    monkeypatch.chdir(tmp_path)
    argv = ["--actor.model_name_or_path", "/m/sft", "--ext.granularity", "segment", "--ext.reward_source", spec]
    _, ext = for_cluster(*parse_ext_args(argv), Cluster((0,)))
    assert ext["reward_source"] == expected.format(cwd=tmp_path)


@pytest.mark.parametrize("address", [None, "ray://head:10001"])
def test_the_local_ray_the_driver_starts_runs_its_workers_at_normal_priority(address, tiny_sft_path, monkeypatch):
    """Ray starts workers at niceness 15; on a CPU machine they do all of the run's work and starved beside any other
    busy process (README's CPU line did not finish in 15 min beside two busy loops; 2 min idle). The local Ray the
    driver starts gets ``RAY_worker_niceness=0``; a cluster the user started keeps its own setting."""
    import ray

    from rlhf_ext.openrlhf.cli_runner import parsed_args
    from rlhf_ext.openrlhf.train_ppo_ray import for_cluster, parse_ext_args, prepare
    from rlhf_ext.runtime.resources import Cluster

    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    monkeypatch.setattr("rlhf_ext.openrlhf.train_ppo_ray.ray_address", lambda: address)
    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw, niceness=os.environ.get("RAY_worker_niceness")))  # noqa: SIM112
    cpu = Cluster((0,))
    argv = ["--actor.model_name_or_path", tiny_sft_path, "--reward.model_name_or_path", tiny_sft_path,
            "--ds.param_dtype", "bf16", "--ext.granularity", "bandit"]  # fmt: skip
    rest, ext = for_cluster(*parse_ext_args(argv), cpu)
    prepare(parsed_args("openrlhf.cli.train_ppo_ray", rest), ext, cpu)
    assert seen["niceness"] == (None if address else "0")
    assert seen.get("address") == (address or "local")
