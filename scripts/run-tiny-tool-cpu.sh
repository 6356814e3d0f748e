#!/usr/bin/env bash
# The tiny multi-turn tool-use run on CPU: a tiny tool-chat Qwen3-style model, warm-started on demonstrations
# (relax.tools.tool_task: it calls the calculator in about 40% of its answers), learns by RL to multiply two 2-digit
# numbers (relax.rollout.synthetic's multiply task, exact-answer reward) by calling the calculator, through the real
# loop (SGLang engine, Megatron actor, local Ray, multi-turn rollout) on 2 CPU cores.
#   EXP_DIR         where the model, data and run outputs go (default: runs/tiny-tool-cpu in the repository)
#   --without-tool  the same run with no tool: the prompts show none and no call is run (the model's answers from
#                   its head; the reward the tool is measured against)
#   TOOL_MODEL_DIR  a model that relax.tools.tool_task built, run instead of building one into $EXP_DIR/model (the e2e
#                   test builds it once for two runs)
#   RELAX_DRY_RUN=1 stop after `relax train --dry-run` (CI checks every run-*.sh this way)
# Extra arguments are passed to `relax train` and override the flags below.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXP_DIR="${EXP_DIR:-$repo/runs/tiny-tool-cpu}"
python="${RELAX_PYTHON:-$repo/.venv/bin/python}"

with_tool=1
train_args=()  # everything but --without-tool goes to `relax train`
for arg in "$@"; do
    if [[ "$arg" == --without-tool ]]; then with_tool=0; else train_args+=("$arg"); fi
done

model_dir="${TOOL_MODEL_DIR:-$EXP_DIR/model}"
data="$EXP_DIR/data/multiply.jsonl"
if [[ -n "${TOOL_MODEL_DIR:-}" ]]; then
    [[ -f "$model_dir/config.json" ]] || {
        echo "run-tiny-tool-cpu.sh: TOOL_MODEL_DIR=$model_dir holds no model: build one with" \
             "python -m relax.tools.tool_task --out DIR, or unset TOOL_MODEL_DIR" >&2
        exit 2
    }
elif [[ "${RELAX_DRY_RUN:-0}" == 1 ]]; then
    "$python" -m relax.tools.tool_task --out "$model_dir" --steps 0 >/dev/null  # the dry run trains nothing
else
    "$python" -m relax.tools.tool_task --out "$model_dir"  # seeded; about 9 minutes on a shared 2-core machine
fi
"$python" -m relax.rollout.synthetic --task multiply --num-rows 2000 --out "$data" >/dev/null

args=(
    --device cpu
    --hf-checkpoint "$model_dir"
    --input-key prompt --label-key label --apply-chat-template
    --prompt-data "$data" --rollout-shuffle
    --reward-fn multiply
    --num-steps 20
    # the call, the tool turn and the answer are about 100 tokens
    --rollout-batch-size 8 --n-samples-per-prompt 8 --rollout-max-response-len 128 --rollout-temperature 1.0
    --global-batch-size 64 --micro-batch-size 16
    --advantage-estimator grpo --no-normalize-advantages-by-std
    --lr 1e-3 --weight-decay 0.0 --clip-grad 1.0
    --num-nodes 1 --num-devices-per-node 1
    --output-dir "$EXP_DIR/output" --overwrite-output-dir
)
if ((with_tool)); then
    args+=(--tools calculator --max-turns 2)  # one call, then the answer
fi
if [[ "${RELAX_DRY_RUN:-0}" == 1 ]]; then
    args+=(--dry-run)
fi
exec "$python" -m relax.cli train "${args[@]}" "${train_args[@]}"
