#!/usr/bin/env bash
# The pip user's first hour, replayed: build the wheel, install it into a fresh venv outside the repository with the
# README's install lines, and run the main commands from an empty directory there (`make wheel-smoke`, also in CI).
#
#   1. pip install "rlhf-ext[trl]"                 -> rlhf-ext demo, zoo build, and README's commands for the TRL
#                                                     engine as README writes them (launch modules under python -m,
#                                                     torchrun with 2 CPU processes and accelerate launch; recipe,
#                                                     segment, plan and data commands; the tiny recipes)
#   2. pip install "rlhf-ext[trl,openrlhf-cpu]"     -> README's OpenRLHF commands that run on CPU (the Ray PPO recipe,
#      pip install --no-deps openrlhf==0.11.2          deepspeed --module, train_ppo_ray --help) and a launch module
#                                                     through `ray job submit`
#
# Lines that are README commands are README's text verbatim (tests/test_readme_commands.py checks it against the
# table in tests/helpers/readme.py, which also says why the others are not run here).
# Env: PYTHON (default python3), TORCH_INDEX (extra pip options for torch), WHEEL_SMOKE_DIR (default: a new temp dir).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="${WHEEL_SMOKE_DIR:-$(mktemp -d /tmp/rlhf-ext-wheel-smoke.XXXXXX)}"
mkdir -p "$WORK/dist" "$WORK/user" "$WORK/logs"
case "$WORK" in "$ROOT"/*) echo "WHEEL_SMOKE_DIR must be outside the repository" >&2; exit 2 ;; esac
START=$SECONDS

step() {  # [EXPECT=REGEX] [RC=N] step NAME COMMAND... : run from $WORK/user, log to $WORK/logs/NAME.log, exit code
    local name="$1" t0=$SECONDS rc=0  # must be RC (default 0); prints one line: the last log line matching EXPECT
    shift
    (cd "$WORK/user" && "$@") >"$WORK/logs/$name.log" 2>&1 || rc=$?
    if [ "$rc" -ne "${RC:-0}" ]; then
        printf 'FAIL  %-24s rc=%d (expected %d) after %ds; last lines of %s:\n' "$name" "$rc" "${RC:-0}" \
            $((SECONDS - t0)) "$WORK/logs/$name.log"
        tail -n 25 "$WORK/logs/$name.log" | sed 's/^/      /'
        exit 1
    fi
    printf 'ok    %-24s %4ds  %s\n' "$name" $((SECONDS - t0)) \
        "$(grep -E -e "${EXPECT:-.}" "$WORK/logs/$name.log" | tail -n 1 | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-90)"
}

echo "wheel smoke in $WORK"
"$PYTHON" -m pip wheel -q --no-deps -w "$WORK/dist" "$ROOT" >"$WORK/logs/build.log" 2>&1 || { tail "$WORK/logs/build.log"; exit 1; }
WHEEL="$(ls "$WORK"/dist/rlhf_ext-*.whl)"
echo "built $(basename "$WHEEL")"
"$PYTHON" -m venv "$WORK/venv"
V="$WORK/venv/bin"
"$V/python" -m pip install -q --upgrade pip >/dev/null 2>&1
# shellcheck disable=SC2086
"$V/python" -m pip install -q torch==2.13.0 ${TORCH_INDEX:-} >"$WORK/logs/install-torch.log" 2>&1
"$V/python" -m pip install -q "rlhf-ext[trl] @ file://$WHEEL" >"$WORK/logs/install-trl.log" 2>&1 \
    || { tail -n 20 "$WORK/logs/install-trl.log"; exit 1; }
echo "installed: $("$V/python" -c 'import importlib.metadata as m; print(*(f"{p} {m.version(p)}" for p in ("rlhf-ext", "torch", "transformers", "trl", "matplotlib")), sep=", ")')"

export PATH="$V:$PATH" RLHF_EXT_CACHE="$WORK/cache" HF_HOME="$WORK/hf" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TORCHDYNAMO_DISABLE=1 DS_BUILD_OPS=0 OMP_NUM_THREADS=1
unset PYTHONPATH RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT

# 1. rlhf-ext[trl]: the main job, the builtin models, then README's commands as written
EXPECT="demo finished" step demo rlhf-ext demo --out runs/demo
test -s "$WORK/user/runs/demo/report.html" || { echo "FAIL  demo wrote no report.html"; exit 1; }
EXPECT="tiny" step zoo-build rlhf-ext zoo build tiny-sft tiny-segment-rm
# "Segment-level reward models": my.yaml is the copy of segment_rm_tiny; the RM in runs/rm is the one `segment show` reads
EXPECT="segment_rm_tiny" step recipe-list rlhf-ext recipe list
step recipe-copy rlhf-ext recipe copy segment_rm_tiny my.yaml
EXPECT="held-out acc" step segment-rm rlhf-ext train segment-rm --config my.yaml segment.entropy_cutoff=1.5 train.output_dir=runs/rm
EXPECT="tides.html" step segment-show rlhf-ext segment show --model runs/rm --prompt "Question: What should I know about tides?\nAnswer:" \
   --response " Many people wonder about this. The facts about tides are backed by peer-reviewed evidence." \
   --html tides.html
EXPECT="on the policy's tokens" step segment-show-policy rlhf-ext segment show --model runs/rm \
   --prompt "Question: What should I know about tides?\nAnswer:" \
   --response " Many people wonder about this. The facts about tides are backed by peer-reviewed evidence." \
   --policy-tokenizer builtin:tiny
EXPECT="held-out acc" step rm-module python -m rlhf_ext.launch.train_segment_rm --config my.yaml
EXPECT="held-out acc" step rm-torchrun torchrun --nproc_per_node 2 -m rlhf_ext.launch.train_segment_rm --config my.yaml
EXPECT="held-out acc" step rm-accelerate accelerate launch -m rlhf_ext.launch.train_segment_rm --config my.yaml
# "Segment-level PPO" and the launchers of "Install into your own environment"
EXPECT="^ +[0-9]+ " step segment-ppo python -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_tiny
EXPECT="^ +[0-9]+ " step torchrun-2-processes torchrun --nproc_per_node 2 -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_tiny
EXPECT="^ +[0-9]+ " step ppo-accelerate accelerate launch -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_tiny
# "Dense rewards from any source": a user's own function in my_rewards.py (README's `polite`, counting its calls)
cat >"$WORK/user/my_rewards.py" <<'PY'
"""A user's dense reward function (README, "Your own function"): +1 on each "thank you"; each call is counted."""

import os
import re

CALLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "polite_calls.txt")


def polite(prompts, completions, **kwargs):  # a DenseRewardFunc
    with open(CALLS, "a") as f:  # one line per call (OpenRLHF's Ray actor calls it too)
        f.write(f"{len(completions)}\n")
    return [[(m.start(), m.end(), 1.0) for m in re.finditer("thank you", c.lower())] for c in completions]
PY
EXPECT="^ +[0-9]+ " step callable-source python -m rlhf_ext.launch.train_segment_ppo --config segment_ppo_callable_tiny model.reward_source=my_rewards.py:polite
calls() { wc -l <"$WORK/user/polite_calls.txt" 2>/dev/null || echo 0; }
[ "$(calls)" -eq 5 ] || { echo "FAIL  my_rewards.py:polite was called $(calls) times on TRL, not 5 (calibration + 4 steps)"; exit 1; }
# "Synthetic continual preference data" (offline backend)
EXPECT="continual-mixed" step data-configs rlhf-ext data configs
step data-generate rlhf-ext data generate continual-piecewise-preference -o runs/pp --num-samples 200
step data-dry-run rlhf-ext data generate continual-mixed -o runs/mixed --num-samples 50 --dry-run
step data-generate-mixed rlhf-ext data generate continual-mixed -o runs/mixed --num-samples 50
step data-validate rlhf-ext data validate runs/pp --judge rule -o runs/pp_report.json
step data-preview rlhf-ext data preview runs/pp --stage 1 -n 2
step data-swap rlhf-ext data transform preference_swap runs/pp -o runs/pp_noisy -p 0.1
step data-split rlhf-ext data transform split runs/pp -o runs/pp_resplit --test-ratio 0.2
step data-sample rlhf-ext data sample runs/pp -o runs/pp_small --keep-train 50
step data-merge rlhf-ext data merge runs/pp runs/mixed -o runs/both
step data-export rlhf-ext data export runs/pp -o runs/pp_jsonl --format jsonl
# "Iterative online DPO and one-step async", "Continual RLHF"
EXPECT="policy" step online-dpo rlhf-ext train online-dpo --config online_dpo_tiny
EXPECT="policy" step online-dpo-accelerate accelerate launch -m rlhf_ext.launch.train_online_dpo --config online_dpo_tiny
EXPECT="policy" step online-dpo-async rlhf-ext train online-dpo --config online_dpo_async_tiny
EXPECT="policy" step online-dpo-module python -m rlhf_ext.launch.train_online_dpo --config online_dpo_tiny online.num_generations=4 train.output_dir=runs/x
EXPECT="forgetting|transfer" step continual-dpo rlhf-ext train continual --config continual_dpo_tiny continual.continual_kl_coef=0.5 output_dir=runs/my_seq
EXPECT="forgetting|transfer" step continual-module python -m rlhf_ext.launch.train_continual --config continual_dpo_tiny continual.continual_kl_coef_schedule='[1.0, 0.0]'
# every sim compare method on the packaged task, two seeds in two spawned worker processes of the installed package
EXPECT="^\| token_ppo \|" step sim-compare-smoke rlhf-ext sim compare --config sim_compare --budget smoke --out runs/sim
grep -q '^| rules_ppo |' "$WORK/logs/sim-compare-smoke.log" || { echo "FAIL  sim compare printed no rules_ppo row"; exit 1; }
# what a person reads, piped: no FutureWarning, no \r-joined progress bars, no raw metric dicts
for log in demo zoo-build segment-rm segment-ppo online-dpo continual-dpo sim-compare-smoke; do
    f="$WORK/logs/$log.log"
    if grep -q "FutureWarning" "$f" || grep -q $'\r' "$f" || grep -qE "^\{'(loss|train_runtime)'" "$f"; then
        echo "FAIL  $log.log has a FutureWarning, a \\r progress bar or a raw metrics dict:"
        grep -nE "FutureWarning|^\{'" "$f" | head -n 5 | cut -c1-160 | sed 's/^/      /'
        exit 1
    fi
done
echo "ok    piped output clean       (no FutureWarning, no \\r, no raw dicts in $(cat "$WORK"/logs/{demo,zoo-build,segment-rm,segment-ppo,online-dpo,continual-dpo,sim-compare-smoke}.log | wc -l) lines)"

# 2. the OpenRLHF engine on CPU: the README's two install lines
"$V/python" -m pip install -q "rlhf-ext[trl,openrlhf-cpu] @ file://$WHEEL" >"$WORK/logs/install-openrlhf.log" 2>&1 \
    || { tail -n 20 "$WORK/logs/install-openrlhf.log"; exit 1; }
step install-openrlhf pip install --no-deps openrlhf==0.11.2
# "Segment-level PPO": the whole recipe through OpenRLHF's Ray PPO loop on CPU (the driver starts and stops its own Ray)
EXPECT="." step openrlhf-cpu python -m rlhf_ext.launch.train_segment_ppo --engine openrlhf --config segment_ppo_tiny train.bf16=true
EXPECT="." step openrlhf-callable-source python -m rlhf_ext.launch.train_segment_ppo --engine openrlhf --config segment_ppo_callable_tiny \
    model.reward_source=my_rewards.py:polite train.bf16=true
[ "$(calls)" -gt 6 ] || { echo "FAIL  my_rewards.py:polite was not called by OpenRLHF's experience maker ($(calls) calls)"; exit 1; }
# the plan (OpenRLHF recipes need ray): Phi-3-mini's config.json in the Hugging Face cache, as after a download of it
PHI3="$HF_HOME/hub/models--microsoft--Phi-3-mini-4k-instruct"
mkdir -p "$PHI3/refs" "$PHI3/snapshots/0000000000000000000000000000000000000000"
printf 0000000000000000000000000000000000000000 >"$PHI3/refs/main"
cp "$ROOT/tests/fixtures/phi3_mini_config.json" "$PHI3/snapshots/0000000000000000000000000000000000000000/config.json"
EXPECT="plan ok" step plan-paper rlhf-ext plan --config segment_ppo_paper --cluster 1x8
EXPECT="plan ok" step plan-openrlhf rlhf-ext plan --config segment_ppo_openrlhf --cluster 1x8
EXPECT="^error" RC=2 step plan-trl-refused rlhf-ext plan --config segment_ppo_paper --engine trl --cluster 1x8
EXPECT="plan ok" step plan-tiny rlhf-ext plan --config segment_ppo_tiny
EXPECT="held-out acc" step rm-deepspeed-my-yaml deepspeed --module rlhf_ext.launch.train_segment_rm --config my.yaml --engine openrlhf
EXPECT="^  --ext\.granularity" step train-ppo-ray-help python -m rlhf_ext.openrlhf.train_ppo_ray --help
EXPECT="Ray runtime started" step ray-start ray start --head --num-cpus 2 --include-dashboard=true --dashboard-host 127.0.0.1 --disable-usage-stats
trap 'ray stop --force >/dev/null 2>&1 || true' EXIT
EXPECT="succeeded" step ray-job-submit ray job submit --address http://127.0.0.1:8265 -- python -m \
    rlhf_ext.launch.train_segment_rm --config segment_rm_tiny train.output_dir="$WORK/user/runs/rm-ray" train.max_steps=4
ray stop --force >/dev/null 2>&1 || true
echo "wheel smoke passed in $((SECONDS - START)) s"
