"""README.md's shell commands and where each one runs (tests/test_readme_commands.py checks the table both ways).

`readme_commands` reads the ```bash blocks (fences without `bash` only show output and are skipped): physical lines
joined at a trailing `\\`, `# comments` stripped, whitespace runs collapsed, one command per line. `WHERE` maps every
such command to where it runs, as written:

- ``"ci"``: `.ci/run` (the CI entry point) runs it;
- ``"wheel-smoke"``: `scripts/wheel_smoke.sh` runs it (the built wheel in a fresh venv, from an empty directory);
- ``"pytest:PATH::TEST"``: that test file holds the command text and the test exists;
- ``"not run: REASON"``: it needs what CI does not have (a GPU, a cluster, a server, a file the user brings...).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _strip_comment(line: str) -> str:
    """`line` without a trailing `# comment` outside quotes (a `#` inside '...' or "..." is kept)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def shell_lines(text: str) -> list[str]:
    """Logical lines of shell `text`: `\\`-continuations joined, comments stripped, whitespace collapsed."""
    out: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = _strip_comment(raw).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = " ".join((pending + line).split())
        pending = ""
        if line:
            out.append(line)
    if pending.strip():
        out.append(" ".join(pending.split()))
    return out


def readme_commands(readme: Path = ROOT / "README.md") -> list[str]:
    """Every command of README's ```bash blocks, in order of appearance (duplicates kept once)."""
    blocks = re.findall(r"^```bash[ \t]*\n(.*?)^```", readme.read_text(encoding="utf-8"), flags=re.M | re.S)
    return list(dict.fromkeys(cmd for block in blocks for cmd in shell_lines(block)))


_PYPI = "not run: installs the published package from PyPI; the wheel smoke installs the built wheel with these extras"
_GPU_INSTALL = "not run: OpenRLHF's pins include flash-attn, which needs CUDA to build (CI is CPU-only)"
_CLUSTER = "not run: a multi-node Ray cluster (HEAD's address) and GPUs"
_SERVER_RECIPE = (
    "not run: a server in the background on the fixed port 5000; tests/openrlhf/test_remote_rm_e2e.py serves the same "
    "model on a free port and trains this recipe on it (TRL) and the Ray loop on its spans"
)
WHERE: dict[str, str] = {
    # Quickstart
    "make demo": "ci",
    "make fidelity BUDGET=smoke": "pytest:tests/test_fidelity_smoke.py::test_make_fidelity_smoke_runs_every_step",
    "make fidelity": "not run: the results of record take a few hours on 2 cores; its smoke budget runs in make test",
    "make test": "ci",
    # Install into your own environment
    'pip install "rlhf-ext[trl]"': _PYPI,
    'pip install "rlhf-ext[openrlhf]"': _GPU_INSTALL,
    'pip install "rlhf-ext[openrlhf,vllm]"': _GPU_INSTALL + "; vLLM needs CUDA",
    'pip install "rlhf-ext[trl,openrlhf-cpu]"': _PYPI,
    "pip install --no-deps openrlhf==0.11.2": "wheel-smoke",
    "python -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_tiny": "wheel-smoke",
    "torchrun --nproc_per_node 2 -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_tiny": "wheel-smoke",
    "accelerate launch -m rlhf_ext.launch.train_online_dpo --config online_dpo_tiny": "wheel-smoke",
    "ray job submit -- python -m rlhf_ext.launch.train_segment_ppo --engine openrlhf --config segment_ppo_openrlhf": (
        "not run: the recipe places vLLM engines and ZeRO-2 models on GPUs (CI is CPU-only)"
    ),
    # Segment-level reward models
    "rlhf-ext recipe list": "wheel-smoke",
    "rlhf-ext recipe copy segment_rm_tiny my.yaml": "wheel-smoke",
    "rlhf-ext train segment-rm --config my.yaml segment.entropy_cutoff=1.5 train.output_dir=runs/rm": "wheel-smoke",
    "python -m rlhf_ext.launch.train_segment_rm --config my.yaml": "wheel-smoke",
    "torchrun --nproc_per_node 2 -m rlhf_ext.launch.train_segment_rm --config my.yaml": "wheel-smoke",
    "accelerate launch -m rlhf_ext.launch.train_segment_rm --config my.yaml": "wheel-smoke",
    "deepspeed --module rlhf_ext.launch.train_segment_rm --config my.yaml --engine openrlhf": "wheel-smoke",
    (
        "deepspeed --module rlhf_ext.openrlhf.train_rm --model.model_name_or_path path/to/sft "
        "--data.dataset prefs.jsonl --data.prompt_key prompt --train.batch_size 128 --train.micro_batch_size 8 "
        "--adam.lr 1e-6 --ds.zero_stage 3 "
        "--ds.param_dtype bf16 --ext.entropy_cutoff 2.0 --ext.aggregation softmax --ext.tau 0.5 "
        "--ext.cache_dir /shared/cache"
    ): "not run: the user's SFT model and preference file (path/to/sft, prefs.jsonl) and GPUs (ZeRO-3, bf16)",
    'rlhf-ext segment show --model runs/rm --prompt "Question: What should I know about tides?\\nAnswer:" --response '
    '" Many people wonder about this. The facts about tides are backed by peer-reviewed evidence." --html tides.html': (
        "wheel-smoke"
    ),
    'rlhf-ext segment show --model runs/rm --prompt "Question: What should I know about tides?\\nAnswer:" --response '
    '" Many people wonder about this. The facts about tides are backed by peer-reviewed evidence." '
    "--policy-tokenizer builtin:tiny": "wheel-smoke",
    # Segment-level PPO
    "accelerate launch -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_tiny": "wheel-smoke",
    "rlhf-ext plan --config segment_ppo_paper --cluster 1x8": "wheel-smoke",
    "ray job submit -- python -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_paper": (
        "not run: Table 8's run, Phi-3 with vLLM rollouts on 8 GPUs"
    ),
    "python -m rlhf_ext.launch.train_segment_ppo --engine openrlhf --config segment_ppo_tiny train.bf16=true": (
        "wheel-smoke"
    ),
    (
        "ray job submit --address http://HEAD:8265 -- python -m rlhf_ext.openrlhf.train_ppo_ray "
        "--actor.model_name_or_path path/to/sft --reward.model_name_or_path runs/rm "
        "--data.prompt_dataset prompts.jsonl --data.input_key prompt "
        "--algo.advantage.estimator gae --algo.kl.init_coef 0.01 ...any OpenRLHF flag... --ext.granularity segment "
        "--ext.normalizer runs/ppo/normalizer.json"
    ): "not run: a template (HEAD, path/to/sft, prompts.jsonl, '...any OpenRLHF flag...') for a Ray cluster with GPUs",
    "python -m rlhf_ext.openrlhf.train_ppo_ray --help": "wheel-smoke",
    "rlhf-ext plan --config segment_ppo_openrlhf --cluster 1x8": "wheel-smoke",
    "rlhf-ext plan --config segment_ppo_paper --engine trl --cluster 1x8": "wheel-smoke",
    "rlhf-ext plan --config segment_ppo_tiny": "wheel-smoke",
    **{
        f"python -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_{source}_tiny": (
            "pytest:tests/pipelines/test_reward_source_recipes.py::test_source_recipe_trains_on_trl_as_the_readme_runs_it"
        )
        for source in ("callable", "rules", "prm", "span_rm")
    },
    "python -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_callable_tiny "
    "model.reward_source=my_rewards.py:polite": "wheel-smoke",
    "python -m rlhf_ext.launch.train_segment_ppo --engine openrlhf --config segment_ppo_callable_tiny "
    "model.reward_source=my_rewards.py:polite train.bf16=true": "wheel-smoke",
    'rlhf-ext serve rm --model "$(rlhf-ext zoo build tiny-segment-rm)" --port 5000 &': _SERVER_RECIPE,
    "python -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_server_tiny": _SERVER_RECIPE,
    (
        "python -m rlhf_ext.openrlhf.train_ppo_ray --actor.model_name_or_path path/to/sft "
        "--data.prompt_dataset prompts.jsonl --data.input_key prompt --algo.advantage.estimator reinforce "
        "--ext.granularity segment --ext.reward_source rules:rules.yaml"
    ): "not run: the user's SFT model, prompts and rules.yaml, and GPUs",
    'ray job submit --address http://HEAD:8265 --runtime-env-json \'{"pip": ["rlhf-ext[openrlhf]"]}\' -- python -m '
    "rlhf_ext.launch.train_segment_ppo --config segment_ppo_openrlhf": _CLUSTER,
    'ray job submit --address http://HEAD:8265 --runtime-env-json \'{"py_modules": ["./rlhf_ext"]}\' -- python -m '
    "rlhf_ext.launch.train_segment_ppo --config segment_ppo_openrlhf_2x8": _CLUSTER,
    # Synthetic continual preference data
    "rlhf-ext data configs": "wheel-smoke",
    "rlhf-ext data generate continual-piecewise-preference -o runs/pp --num-samples 200": "wheel-smoke",
    "rlhf-ext data generate continual-mixed -o runs/mixed --num-samples 50 --dry-run": "wheel-smoke",
    "rlhf-ext data generate continual-mixed -o runs/mixed --num-samples 50": "wheel-smoke",
    "rlhf-ext data generate continual-lipschitz -o runs/lip --num-samples 200 --workers 2": (
        "pytest:tests/cli/test_datagen_cli.py::test_workers_command_of_the_readme_writes_the_one_process_dataset"
    ),
    "rlhf-ext data generate my_tasks.yaml -o runs/mine --backend openai --api-base http://localhost:8000/v1 "
    "--model Qwen/Qwen2.5-7B-Instruct --max-concurrency 64": (
        "not run: the user's task file and an OpenAI-compatible server (vllm serve) on localhost:8000"
    ),
    "rlhf-ext data generate my_tasks.yaml -o runs/local --backend hf --model path/to/instruct-model": (
        "not run: the user's task file and a local instruct checkpoint that writes usable pairs, i.e. a GPU "
        "(SmolLM2-135M on CPU: 2 samples at 48-token limits took 121 s and both were cut off, exit 2)"
    ),
    "rlhf-ext data validate runs/pp --judge rule -o runs/pp_report.json": "wheel-smoke",
    "rlhf-ext data preview runs/pp --stage 1 -n 2": "wheel-smoke",
    "rlhf-ext data transform preference_swap runs/pp -o runs/pp_noisy -p 0.1": "wheel-smoke",
    "rlhf-ext data transform split runs/pp -o runs/pp_resplit --test-ratio 0.2": "wheel-smoke",
    "rlhf-ext data sample runs/pp -o runs/pp_small --keep-train 50": "wheel-smoke",
    "rlhf-ext data merge runs/pp runs/mixed -o runs/both": "wheel-smoke",
    "rlhf-ext data export runs/pp -o runs/pp_jsonl --format jsonl": "wheel-smoke",
    # Iterative online DPO and one-step async
    "rlhf-ext train online-dpo --config online_dpo_tiny": "wheel-smoke",
    "rlhf-ext train online-dpo --config online_dpo_async_tiny": "wheel-smoke",
    (
        "python -m rlhf_ext.launch.train_online_dpo --config online_dpo_tiny online.num_generations=4 "
        "train.output_dir=runs/x"
    ): "wheel-smoke",
    "accelerate launch -m rlhf_ext.launch.train_online_dpo --config online_dpo_paper": (
        "not run: an 8B policy with vLLM generation on GPUs"
    ),
    # Continual RLHF
    "rlhf-ext train continual --config continual_dpo_tiny continual.continual_kl_coef=0.5 output_dir=runs/my_seq": (
        "wheel-smoke"
    ),
    "python -m rlhf_ext.launch.train_continual --config continual_dpo_tiny "
    "continual.continual_kl_coef_schedule='[1.0, 0.0]'": "wheel-smoke",
}
