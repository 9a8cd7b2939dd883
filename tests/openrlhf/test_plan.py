"""The pre-flight plan (issue 25): OpenRLHF's placement and per-GPU memory, checked before Ray places anything.

A-D are the four ways a run used to fail only after models loaded on rented GPUs; each has a test here that failed
before the plan existed. Phi-3-mini is sized from its real ``config.json`` (written to a temporary directory: no hub).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_ext.recipes import recipe_names
from rlhf_ext.runtime.resources import Cluster, GiB, parse_cluster, training_state

# microsoft/Phi-3-mini-4k-instruct's config.json (the wheel smoke puts the same file into its Hugging Face cache)
PHI3_MINI = json.loads((Path(__file__).parents[1] / "fixtures" / "phi3_mini_config.json").read_text())
PHI3_PARAMS = 3_821_079_552  # the count the hub shows for Phi-3-mini


@pytest.fixture(scope="module")
def phi3(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / "Phi-3-mini-4k-instruct"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(PHI3_MINI))
    return str(path)


def _recipe(name: str, phi3: str, *overrides: str):
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe
    from rlhf_ext.recipes import recipe_path

    return load_recipe(SegmentPPORecipe, recipe_path(name), [f"model.sft_model={phi3}", *overrides])


def _plan(recipe, cluster: Cluster):
    from rlhf_ext.pipelines.segment_ppo import plan_segment_ppo

    return plan_segment_ppo(recipe, cluster)


def _flags(argv: list[str]) -> dict[str, str]:
    return {f: v for f, v in zip(argv, argv[1:] + [""]) if f.startswith("--")}


# ------------------------------------------------------------------------------------------------ the arithmetic
def test_model_size_counts_phi3_mini_exactly(phi3):
    from rlhf_ext.runtime.resources import model_size

    size = model_size(phi3)
    assert size.params == PHI3_PARAMS
    assert size.lm_head_params == 32064 * 3072  # untied output embedding
    assert size.value_model_params == PHI3_PARAMS - 32064 * 3072 + 3072
    assert (size.layers, size.hidden, size.kv_heads, size.head_dim, size.vocab) == (32, 3072, 32, 96, 32064)


def test_training_state_follows_the_zero_paper():
    """ZeRO paper, section 3.1: 2P weights + 2P grads + 12P optimizer, sharded stage by stage over 8 ranks."""
    p = 1_000_000_000
    assert training_state(p, 0, 8) == (2e9, 2e9, 12e9)
    assert training_state(p, 1, 8) == (2e9, 2e9, 1.5e9)
    assert training_state(p, 2, 8) == (2e9, 0.25e9, 1.5e9)
    assert training_state(p, 3, 8) == (0.25e9, 0.25e9, 1.5e9)
    assert training_state(p, 2, 8, offload_optimizer=True) == (2e9, 0.25e9, 0.0)
    assert training_state(p, 3, 8, mixed_precision=False) == (4e9, 4e9, 8e9)  # fp32 DDP: nothing sharded


def test_simulated_placement_packs_then_spreads():
    from rlhf_ext.openrlhf.plan import Group, simulate

    groups = [Group(6, {"actor": 6}), Group(4, {"vllm": 4}), Group(4, {"critic": 4}, packed=False)]
    assert simulate(groups, Cluster((8, 8))) is None
    assert groups[0].nodes == [0] * 6  # one node holds the whole group
    assert groups[1].nodes == [1] * 4  # node 0 has 2 free: the group goes where it fits whole
    assert groups[2].nodes == [1, 1, 0, 1]  # loose actors go to the emptiest node one by one (ties: lowest index)
    assert simulate([Group(10, {"actor": 10}), Group(7, {"vllm": 7})], Cluster((8, 8))) == "vllm (7 GPUs)"


# ------------------------------------------------------------------------------------------------------------- A
ISSUE_A = [  # what openrlhf_argv produced for segment_ppo_openrlhf on 8 GPUs before the fix
    "--actor.num_gpus_per_node", "8", "--ref.num_gpus_per_node", "8", "--reward.num_gpus_per_node", "8",
    "--critic.num_gpus_per_node", "8", "--vllm.num_engines", "8", "--train.colocate_all", "--train.async_enable",
    "--train.async_queue_size", "1", "--rollout.batch_size", "128", "--rollout.micro_batch_size", "16",
    "--train.batch_size", "128", "--train.micro_batch_size", "16", "--data.max_len", "2048",
    "--ds.param_dtype", "bf16", "--ext.granularity", "segment",
]  # fmt: skip


def test_A_async_with_colocation_asking_for_16_gpus_on_8_is_refused(phi3):
    from rlhf_ext.openrlhf.train_ppo_ray import plan_for_argv

    argv = ["--actor.model_name_or_path", phi3, "--reward.model_name_or_path", phi3, *ISSUE_A]
    plan = plan_for_argv(argv, parse_cluster("1x8"))
    assert plan.problems and "wait forever for vllm (8 GPUs)" in plan.problems[0]
    assert "the run asks for 16 GPUs" in plan.problems[0] and "drop --train.async_enable" in plan.problems[0]
    # the shipped recipe now splits the node: 4 colocated model GPUs + 4 vLLM GPUs, and fits 80 GiB
    recipe = _recipe("segment_ppo_openrlhf", phi3)
    fixed = _plan(recipe, parse_cluster("1x8"))
    assert fixed.problems == [] and [g.count for g in fixed.gpus] == [4, 4]
    models = next(g for g in fixed.gpus if "actor" in g.roles)
    assert models.static / GiB == pytest.approx(52.7, abs=0.05) and models.peak < 80 * GiB


def test_A_is_refused_at_launch_before_ray_starts(phi3):
    """``python -m rlhf_ext.openrlhf.train_ppo_ray`` with the issue's flags on a stated 8-GPU cluster: exit 2, one
    line, no Ray."""
    code = (
        "import sys; from rlhf_ext.openrlhf.train_ppo_ray import main; "
        "from rlhf_ext.runtime.resources import parse_cluster; main(sys.argv[1:], cluster=parse_cluster('1x8'))"
    )
    argv = ["--actor.model_name_or_path", phi3, "--reward.model_name_or_path", phi3, *ISSUE_A]
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: OpenRLHF would wait forever for vllm (8 GPUs)" in proc.stderr
    assert "Traceback" not in proc.stderr and "Started a local Ray instance" not in proc.stderr


# ------------------------------------------------------------------------------------------------------------- B
def test_B_dynamic_batching_forces_packing_which_the_check_now_sees_and_supports(phi3):
    """OpenRLHF turns ``--train.dynamic_batch_enable`` into ``packing_samples=True`` after parsing; the check sees
    the fixed-up arguments (it used to run before them) and segment rewards now support packing. (Ring attention and
    agent functions, the other two flags, are refused with their own names: test_train_ppo_ray_units.)"""
    from rlhf_ext.openrlhf.cli_runner import parsed_args
    from rlhf_ext.openrlhf.train_ppo_ray import attach_ext, for_cluster, parse_ext_args, preflight

    argv = ["--actor.model_name_or_path", phi3, "--reward.model_name_or_path", phi3, "--train.dynamic_batch_enable",
            "--ext.granularity", "segment"]  # fmt: skip
    cpu = Cluster((0,))
    rest, ext = for_cluster(*parse_ext_args(argv), cpu)
    args = parsed_args("openrlhf.cli.train_ppo_ray", rest)
    assert args.ds.packing_samples and args.rollout.max_tokens_per_gpu == args.train.max_tokens_per_gpu
    attach_ext(args, ext)
    assert args.ds.attn_implementation == "sdpa"  # OpenRLHF asked for flash-attention with packing; CPU: sdpa
    assert preflight(args, cpu).problems == []


# ------------------------------------------------------------------------------------------------------------- C
def _ray_node(gpus: int, accelerator: str | None, alive: bool = True) -> dict:
    resources = {"CPU": 32.0, "GPU": float(gpus), "memory": 1e12}
    if accelerator:
        resources[f"accelerator_type:{accelerator}"] = 1.0
    return {"Alive": alive, "Resources": resources, "NodeID": "x"}


def test_C_engine_and_gpu_counts_come_from_the_cluster_not_the_driver(phi3):
    """This test process has no CUDA, like a head node under ``ray job submit``: a 2 x 8 GPU cluster still gets vLLM
    rollouts, its GPU counts and ``num_nodes``; a cluster of logical GPUs (no accelerator) gets the HF engine."""
    import torch

    from rlhf_ext.openrlhf.plan import cluster_from_ray_nodes
    from rlhf_ext.openrlhf.train_ppo_ray import resolve_rollout_engine
    from rlhf_ext.pipelines.segment_ppo import openrlhf_argv

    assert not torch.cuda.is_available()
    nodes = [_ray_node(0, None), _ray_node(8, "H100"), _ray_node(8, "H100"), _ray_node(8, "H100", alive=False)]
    cluster = cluster_from_ray_nodes(nodes, 79.2)
    assert cluster.gpus == (8, 8, 0) and cluster.gpus_per_node == 0  # the head node holds no GPU
    gpu_nodes = cluster_from_ray_nodes(nodes[1:], 79.2)
    assert (gpu_nodes.gpus, gpu_nodes.logical, gpu_nodes.gpu_memory_gib) == ((8, 8), False, 79.2)
    assert resolve_rollout_engine("auto", gpu_nodes) == "vllm"
    logical = cluster_from_ray_nodes([_ray_node(4, None), _ray_node(4, None)], None)
    assert logical.logical and resolve_rollout_engine("auto", logical) == "hf"

    for name, models, engines, rollout_micro in (("segment_ppo_openrlhf", "4", "8", "16"),
                                                 ("segment_ppo_paper", "8", "16", "8")):  # fmt: skip
        flags = _flags(openrlhf_argv(_recipe(name, phi3), "p.jsonl", None, gpu_nodes))
        assert flags["--actor.num_nodes"] == flags["--critic.num_nodes"] == "2"
        assert flags["--actor.num_gpus_per_node"] == flags["--reward.num_gpus_per_node"] == models
        assert flags["--vllm.num_engines"] == engines and "--train.colocate_all" in flags
        # one rollout micro batch per actor rank at least (128 prompts x 1 sample over 8 / 16 ranks)
        assert flags["--rollout.micro_batch_size"] == rollout_micro
        assert "--ext.rollout_engine" not in flags  # auto: vLLM, decided from the cluster
    flags = _flags(openrlhf_argv(_recipe("segment_ppo_openrlhf", phi3), "p.jsonl", None, Cluster((0,))))
    assert flags["--ext.rollout_engine"] == "hf" and "--actor.num_nodes" not in flags


def test_C_the_2x8_recipe_fits_two_nodes_and_is_refused_on_one(phi3):
    recipe = _recipe("segment_ppo_openrlhf_2x8", phi3)
    plan = _plan(recipe, parse_cluster("2x8"))
    assert plan.problems == []
    assert "  node 0 (8 GPUs): actor+ref+critic+reward 8" in plan.lines and "  node 1 (8 GPUs): vllm 8" in plan.lines
    one_node = _plan(_recipe("segment_ppo_openrlhf_2x8", phi3), parse_cluster("1x8"))
    assert "the run asks for 16 GPUs" in one_node.problems[0]


# ------------------------------------------------------------------------------------------------------------- D
def test_D_segment_ppo_paper_on_trl_cannot_fit_80gb_and_the_recipe_now_fits(phi3):
    """Policy and critic each hold fp32 weights, gradients and Adam under DDP on the TRL engine: 16 bytes per
    parameter, ~57 + 55 GiB per GPU before the frozen models. The packaged recipe runs on OpenRLHF and fits."""
    trl = _plan(_recipe("segment_ppo_paper", phi3, "engine=trl"), parse_cluster("1x8"))
    roles = {r.role: r for r in trl.roles}
    assert roles["policy"].static == 16 * PHI3_PARAMS
    assert roles["critic"].static == 16 * roles["critic"].size.value_model_params
    assert trl.problems and "critic" in trl.problems[0] and "engine: openrlhf" in trl.problems[0]
    assert trl.gpus[0].static / GiB == pytest.approx(140.5, abs=0.05)
    paper = _plan(_recipe("segment_ppo_paper", phi3), parse_cluster("1x8"))
    assert paper.problems == [] and paper.gpus[0].static / GiB == pytest.approx(40.4, abs=0.05)
    assert paper.gpus[0].peak < 80 * GiB
    # the other fix the refusal names: critic-free REINFORCE with the policy under ZeRO-3
    zero3 = _plan(
        _recipe("segment_ppo_paper", phi3, "engine=trl", "ppo.advantage_estimator=reinforce",
                "train.trl_args={deepspeed: {zero_optimization: {stage: 3}}}"),
        parse_cluster("1x8"),
    )  # fmt: skip
    assert zero3.problems == [] and {r.role for r in zero3.roles} == {"policy", "ref", "reward"}


def test_vllm_share_too_small_for_the_weights_and_one_sequence_is_refused(phi3):
    plan = _plan(
        _recipe("segment_ppo_paper", phi3, "train.openrlhf_args={vllm.gpu_memory_utilization: 0.08}"),
        parse_cluster("1x8"),
    )
    assert any("cannot hold the weights and one 2048-token sequence" in p for p in plan.problems)


# ------------------------------------------------------------------------------------------------ the command line
def test_plan_command_prints_the_table_and_refuses_with_exit_code_2(phi3):
    from click.testing import CliRunner

    from rlhf_ext.cli import main

    runner = CliRunner()
    refused = runner.invoke(main, ["plan", "--config", "segment_ppo_paper", "--engine", "trl", "--cluster", "1x8",
                                   f"model.sft_model={phi3}"])  # fmt: skip
    assert refused.exit_code == 2, refused.output
    assert "  critic     fp32 DDP, grad ckpt" in refused.output and "140.5" in refused.output
    assert "error: 8 x GPU (every model on each) would hold 140.5 GiB" in refused.output
    ok = runner.invoke(main, ["plan", "--config", "segment_rm_paper", "--cluster", "2x8", f"model.sft_model={phi3}"])
    assert ok.exit_code == 0, ok.output
    assert "  reward     ZeRO-3 x16, grad ckpt" in ok.output and ok.output.rstrip().endswith("plan ok")
    other = runner.invoke(main, ["plan", "--config", "online_dpo_tiny", "--cluster", "1x8"])
    assert other.exit_code == 2 and "plans segment PPO and segment reward-model recipes" in other.output
    bad = runner.invoke(main, ["plan", "--config", "segment_ppo_tiny", "--cluster", "8"])
    assert bad.exit_code == 2 and "--cluster must be auto or NODESxGPUS" in bad.output


def test_segment_rm_paper_fits_with_zero3_by_hand(phi3):
    """OpenRLHF's train_rm with ZeRO-3 over 8 GPUs: 16 bytes per parameter / 8 of the value model."""
    from rlhf_ext.config import load_recipe
    from rlhf_ext.pipelines.plan import segment_rm_plan
    from rlhf_ext.pipelines.segment_rm import SegmentRMRecipe
    from rlhf_ext.recipes import recipe_path

    recipe = load_recipe(SegmentRMRecipe, recipe_path("segment_rm_paper"), [f"model.sft_model={phi3}"])
    plan = segment_rm_plan(recipe, parse_cluster("1x8"))
    value_params = PHI3_PARAMS - 32064 * 3072 + 3072
    assert plan.roles[0].static == 16 * value_params / 8 and plan.problems == []


@pytest.mark.parametrize("name", [n for n in recipe_names() if "segment" in n])
def test_every_packaged_segment_recipe_plans_on_one_node_of_8_gpus(name, phi3):
    """Every packaged segment recipe gets a plan; on 1 x 8 GPUs of 80 GiB only the two-node recipe is refused."""
    from rlhf_ext.config import load_recipe, read_yaml
    from rlhf_ext.pipelines.plan import segment_rm_plan
    from rlhf_ext.pipelines.segment_ppo import SegmentPPORecipe, plan_segment_ppo
    from rlhf_ext.pipelines.segment_rm import SegmentRMRecipe
    from rlhf_ext.recipes import recipe_path

    path = recipe_path(name)
    ppo = "ppo" in read_yaml(path)
    overrides = [] if "tiny" in name or "smollm2" in name else [f"model.sft_model={phi3}"]
    recipe = load_recipe(SegmentPPORecipe if ppo else SegmentRMRecipe, path, overrides)
    plan = (plan_segment_ppo if ppo else segment_rm_plan)(recipe, parse_cluster("1x8"))
    assert bool(plan.problems) == (name == "segment_ppo_openrlhf_2x8"), plan.table()
    assert plan.table().splitlines()[1] == "cluster: 1 node x 8 GPUs (80 GiB each; stated)"


def test_bandit_granularity_on_a_segment_rm_is_refused_and_on_a_bandit_rm_allowed(phi3, tmp_path):
    """Issue 22 item 1, OpenRLHF half: ``--reward.model_name_or_path <segment RM> --ext.granularity bandit`` trained
    on the RM's last-token score, not e_phi, without a word. Refused with the fix; a bandit RM (cutoff inf: one
    segment, e_phi is the last-token score) and ``segment_as_bandit`` (e_phi) are allowed."""
    import math
    import shutil

    from rlhf_ext.openrlhf.train_ppo_ray import ExtArgsError, plan_for_argv
    from rlhf_ext.runtime.segment_data import save_segment_settings

    settings = {"entropy_cutoff": 2.0, "aggregation": "softmax", "tau": 0.5, "sft_model": phi3}
    segment_rm, bandit_rm = tmp_path / "segment_rm", tmp_path / "bandit_rm"
    for path, cutoff in ((segment_rm, 2.0), (bandit_rm, math.inf)):
        shutil.copytree(phi3, path)
        save_segment_settings(path, {**settings, "entropy_cutoff": cutoff})

    def argv(rm, granularity):
        return ["--actor.model_name_or_path", phi3, "--reward.model_name_or_path", str(rm),
                "--algo.advantage.estimator", "reinforce", "--ext.granularity", granularity]  # fmt: skip

    with pytest.raises(ExtArgsError) as err:
        plan_for_argv(argv(segment_rm, "bandit"), parse_cluster("1x8"))
    assert str(err.value) == (
        f"--reward.model_name_or_path {segment_rm} is a segment reward model (entropy cutoff 2): --ext.granularity "
        "'bandit' would train on its last-token score, which it was not trained to give; use --ext.granularity "
        "'segment_as_bandit' (its sequence score e_phi as one reward per response) or 'segment' (dense segment rewards)"
    )
    with pytest.raises(ExtArgsError, match="is a segment reward model"):  # OpenRLHF's comma-separated list
        plan_for_argv(argv(f"{bandit_rm},{segment_rm}", "bandit"), parse_cluster("1x8"))
    for rm, granularity in ((bandit_rm, "bandit"), (segment_rm, "segment_as_bandit"), (phi3, "bandit")):
        plan_for_argv(argv(rm, granularity), parse_cluster("1x8"))  # no ExtArgsError
