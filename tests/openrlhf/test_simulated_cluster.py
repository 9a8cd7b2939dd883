"""A simulated two-node cluster: ``ray start --head`` plus ``ray start --address`` on this machine, one logical GPU per
node, and the real ``python -m rlhf_ext.openrlhf.train_ppo_ray`` path submitted to it through ``RAY_ADDRESS`` (as under
``ray job submit``) for 2 PPO steps each:

1. on-policy, every model colocated (``--train.colocate_all``) with the HF engines in the shared placement group,
   two policy ranks (ZeRO-2 over gloo across the nodes) and ``--ds.packing_samples``: every role on both nodes;
2. one-step async with colocation: OpenRLHF colocates the DeepSpeed models on one node's GPU and gives the rollout
   engine the other node's GPU, so the policy's weights reach the engine across nodes after each step.

It proves the driver reads the cluster (not its own device), that placement matches the plan, that the worker setup
hook installs rlhf-ext on every node, and weight sync across nodes. One slow test; the Ray processes it starts are
stopped by pid even when it fails (``tests/helpers/ray_cluster.py``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray_ppo")]

DRIVER = (
    "import sys; from rlhf_ext.runtime.log import configure_cli_output; configure_cli_output(); "
    "from rlhf_ext.openrlhf.train_ppo_ray import main; main(sys.argv[1:])"
)
ROLES = {"policymodel": "actor", "reference": "ref", "reward": "reward", "critic": "critic", "rollout": "engine"}


def _role(actor_class: str) -> str | None:
    name = actor_class.lower()
    return next((role for key, role in ROLES.items() if key in name), None)


def _placed(actors: list[dict], job: str, nodes: dict[str, str]) -> dict[str, list[str]]:
    """role -> the (named) nodes its actors ran on, for one job."""
    out: dict[str, list[str]] = {}
    for a in actors:
        role = _role(a["cls"])
        if a["job"] == job and role:
            if a["node"] not in nodes:
                nodes[a["node"]] = "ab"[len(nodes)]
            out.setdefault(role, []).append(nodes[a["node"]])
    return {role: sorted(where) for role, where in out.items()}


def test_two_node_cluster_runs_the_real_loop_with_roles_on_both_nodes(tmp_path, tiny_sft_path, cache_dir):
    from rlhf_ext.pipelines.builtins import resolve_model
    from rlhf_ext.zoo.toy import toy_preference_dataset
    from tests.helpers.openrlhf_runs import run_logged, tiny_ppo_argv
    from tests.helpers.ray_cluster import actor_nodes, local_cluster

    rm = resolve_model("builtin:tiny-segment-rm", cache_dir)
    prompts = tmp_path / "prompts.jsonl"
    data = toy_preference_dataset(n_train=8, n_test=4, seed=0)["train"]
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in data["prompt"]))
    common = ["--algo.advantage.estimator", "reinforce", "--ext.rollout_engine", "hf", "--ext.granularity", "segment"]
    runs = {
        "colocated_packed": [
            "--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2", "--reward.num_gpus_per_node", "2",
            "--train.colocate_all", "--vllm.num_engines", "2", "--ds.packing_samples", "--ds.zero_stage", "2",
        ],
        "async_colocated": [
            "--train.colocate_all", "--train.async_enable", "--train.async_queue_size", "1", "--vllm.num_engines", "1",
        ],
    }  # fmt: skip
    summary: dict[str, dict] = {}
    nodes: dict[str, str] = {}
    with local_cluster(gpus_per_node=1) as address:
        seen_jobs: set[str] = set()
        for name, flags in runs.items():
            out = tmp_path / name
            argv = tiny_ppo_argv(tiny_sft_path, rm, str(prompts), out) + common + flags
            steps, wall = run_logged([sys.executable, "-c", DRIVER, *argv], tmp_path / f"{name}.log", 900, address)
            log = (tmp_path / f"{name}.log").read_text()
            assert sorted(steps) == [1, 2], f"see {tmp_path / f'{name}.log'}"
            actors = actor_nodes(address)
            jobs = {a["job"] for a in actors if _role(a["cls"]) == "actor"} - seen_jobs
            assert len(jobs) == 1
            job = jobs.pop()
            seen_jobs.add(job)
            summary[name] = {"nodes": _placed(actors, job, nodes), "wall_s": round(wall, 1), "steps": sorted(steps),
                             "reward": [steps[1]["reward"], steps[2]["reward"]]}  # fmt: skip
            for step in steps.values():
                assert math.isfinite(step["reward"]) and math.isfinite(step["policy_loss"])
            assert "cluster: 2 nodes x 1 GPU (logical GPUs: computing on CPUs; Ray cluster, logical GPUs)" in log
            summary[name]["log"] = str(tmp_path / f"{name}.log")
            summary[name]["staleness"] = [steps[1].get("staleness"), steps[2].get("staleness")]
            if name == "colocated_packed":
                assert "packing_samples=True" in log  # OpenRLHF's own print of the arguments it trains with
    (Path(tmp_path) / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    packed, asynchronous = summary["colocated_packed"]["nodes"], summary["async_colocated"]["nodes"]
    # every role of the colocated run has one rank on each node
    assert packed["actor"] == packed["ref"] == packed["reward"] == packed["engine"] == ["a", "b"]
    # async: the DeepSpeed models share one node's GPU, the engine has the other one; one step of staleness
    assert asynchronous["actor"] == asynchronous["ref"] == asynchronous["reward"]
    assert len(asynchronous["engine"]) == 1 and asynchronous["engine"] != asynchronous["actor"]
    assert summary["async_colocated"]["staleness"] == [0.0, 1.0]
