#!/usr/bin/env bash
# The pip user's first hour, replayed: build the wheel, install it into a fresh venv outside the repository with the
# README's install lines, and run the main commands from an empty directory there (`make wheel-smoke`, also in CI).
#
#   1. pip install "rlhf-ext[trl]"                 -> rlhf-ext demo, zoo build, the four tiny recipes (TRL engine),
#                                                     a launch module under torchrun (2 CPU processes)
#   2. pip install "rlhf-ext[trl,openrlhf-cpu]"     -> the segment RM with --engine openrlhf (OpenRLHF + DeepSpeed on
#      pip install --no-deps openrlhf==0.11.2          CPU), and a launch module through `ray job submit`
#
# Env: PYTHON (default python3), TORCH_INDEX (extra pip options for torch), WHEEL_SMOKE_DIR (default: a new temp dir).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="${WHEEL_SMOKE_DIR:-$(mktemp -d /tmp/rlhf-ext-wheel-smoke.XXXXXX)}"
mkdir -p "$WORK/dist" "$WORK/user" "$WORK/logs"
case "$WORK" in "$ROOT"/*) echo "WHEEL_SMOKE_DIR must be outside the repository" >&2; exit 2 ;; esac
START=$SECONDS

step() {  # step NAME COMMAND... : run from $WORK/user, log to $WORK/logs/NAME.log, one line of outcome
    local name="$1" t0=$SECONDS rc=0
    shift
    (cd "$WORK/user" && "$@") >"$WORK/logs/$name.log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        printf 'FAIL  %-24s rc=%d after %ds; last lines of %s:\n' "$name" "$rc" $((SECONDS - t0)) "$WORK/logs/$name.log"
        tail -n 25 "$WORK/logs/$name.log" | sed 's/^/      /'
        exit 1
    fi
    printf 'ok    %-24s %4ds  %s\n' "$name" $((SECONDS - t0)) \
        "$(grep -E "${EXPECT:-.}" "$WORK/logs/$name.log" | tail -n 1 | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-90)"
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

# 1. rlhf-ext[trl]: the main job, the builtin models, the four tiny recipes, torchrun
EXPECT="demo finished" step demo rlhf-ext demo --out runs/demo
test -s "$WORK/user/runs/demo/report.html" || { echo "FAIL  demo wrote no report.html"; exit 1; }
EXPECT="tiny" step zoo-build rlhf-ext zoo build tiny-sft tiny-segment-rm
EXPECT="held-out acc" step segment-rm rlhf-ext train segment-rm --config segment_rm_tiny train.output_dir=runs/rm
EXPECT="^ +[0-9]+ " step segment-ppo rlhf-ext train segment-ppo --config segment_ppo_tiny train.output_dir=runs/ppo
EXPECT="policy" step online-dpo rlhf-ext train online-dpo --config online_dpo_tiny train.output_dir=runs/dpo
EXPECT="forgetting|transfer" step continual-dpo rlhf-ext train continual --config continual_dpo_tiny output_dir=runs/continual
EXPECT="^ +[0-9]+ " step torchrun-2-processes torchrun --nproc_per_node 2 -m rlhf_ext.launch.train_segment_ppo \
    --config segment_ppo_tiny train.output_dir=runs/ppo-ddp train.max_steps=2 train.micro_batch_size=8
# every sim compare method on the packaged task, two seeds in two spawned worker processes of the installed package
EXPECT="^\| token_ppo \|" step sim-compare-smoke rlhf-ext sim compare --config sim_compare --budget smoke --out runs/sim
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
    && "$V/python" -m pip install -q --no-deps openrlhf==0.11.2 >>"$WORK/logs/install-openrlhf.log" 2>&1 \
    || { tail -n 20 "$WORK/logs/install-openrlhf.log"; exit 1; }
EXPECT="held-out acc" step segment-rm-openrlhf rlhf-ext train segment-rm --config segment_rm_tiny --engine openrlhf \
    train.output_dir=runs/rm-openrlhf train.max_steps=4
EXPECT="Ray runtime started" step ray-start ray start --head --num-cpus 2 --include-dashboard=true --dashboard-host 127.0.0.1 --disable-usage-stats
trap 'ray stop --force >/dev/null 2>&1 || true' EXIT
EXPECT="succeeded" step ray-job-submit ray job submit --address http://127.0.0.1:8265 -- python -m \
    rlhf_ext.launch.train_segment_rm --config segment_rm_tiny train.output_dir="$WORK/user/runs/rm-ray" train.max_steps=4
ray stop --force >/dev/null 2>&1 || true
echo "wheel smoke passed in $((SECONDS - START)) s"
