#!/usr/bin/env bash
# The tiny colocated run on CPU: a random ~80k-parameter Qwen3-style model (built here, no download)
# learns a synthetic task with a verifiable reward through the real loop (SGLang engine, Megatron
# actor, local Ray) on 2 CPU cores.
#   EXP_DIR         where the model, data and run outputs go (default: runs/tiny-cpu in the repository)
#   --tiny-model F  (or TINY_MODEL=F) the tiny model's family from relax.tools.tiny_model (default qwen3; qwen3_5
#                   is the hybrid Gated DeltaNet Qwen3.5, qwen3_5_moe its MoE variant)
#   TINY_MODEL_DIR  a tiny model that relax.tools.tiny_model built for that family, run instead of building one
#                   into $EXP_DIR/model (the e2e tests build each family once and start many runs)
#   RELAX_DRY_RUN=1 stop after `relax train --dry-run` (CI checks every run-*.sh this way)
# Extra arguments are passed to `relax train` and override the flags below.
# Each run of this script is a new run that replaces the previous one's record in $EXP_DIR/output
# (--overwrite-output-dir), as it rebuilds the model and the data; `--load DIR` resumes a run and continues
# its record instead.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXP_DIR="${EXP_DIR:-$repo/runs/tiny-cpu}"
python="${RELAX_PYTHON:-$repo/.venv/bin/python}"

family="${TINY_MODEL:-qwen3}"
train_args=()  # everything but --tiny-model goes to `relax train`
while (($#)); do
    case "$1" in
        --tiny-model=*) family="${1#*=}"; shift ;;
        --tiny-model)
            [[ $# -ge 2 ]] || { echo "run-tiny-cpu.sh: --tiny-model needs a family (qwen3, qwen3_5, ...)" >&2; exit 2; }
            family="$2"; shift 2 ;;
        *) train_args+=("$1"); shift ;;
    esac
done

model_dir="${TINY_MODEL_DIR:-$EXP_DIR/model}"
data="$EXP_DIR/data/copy_digit.jsonl"
held_out="$EXP_DIR/data/copy_digit_held_out.jsonl"  # the eval set: rows drawn with another seed
# All are rebuilt every run (seconds, deterministic), so an upgraded task or model never meets stale files; a
# TINY_MODEL_DIR is the caller's to keep current, and must be of the family asked for.
if [[ -n "${TINY_MODEL_DIR:-}" ]]; then
    grep -qs "\"family\": \"$family\"" "$model_dir/relax_tiny_model.json" || {
        echo "run-tiny-cpu.sh: TINY_MODEL_DIR=$model_dir holds no tiny $family model (its relax_tiny_model.json):" \
             "build one with python -m relax.tools.tiny_model --family $family --out DIR, or unset TINY_MODEL_DIR" >&2
        exit 2
    }
else
    "$python" -m relax.tools.tiny_model --family "$family" --out "$model_dir" >/dev/null
fi
"$python" -m relax.rollout.synthetic --task copy_digit --num-rows 2000 --out "$data" >/dev/null
"$python" -m relax.rollout.synthetic --task copy_digit --num-rows 16 --seed 1 --out "$held_out" >/dev/null

args=(
    --device cpu
    --hf-checkpoint "$model_dir"
    # The prompt as it is ("copy 1:", the digit two tokens before the answer), lr 5e-3 and group-centred rewards
    # without the std division (Dr. GRPO): with a chat template around the prompt (14 tokens between the digit
    # and the answer), lr 1e-2 and GRPO's std division, the policy often settled on one digit for every prompt
    # before it learned to read the prompt (mean reward about 0.6; docs/benchmarks.md).
    # 16 prompts a step and the lr's cosine decay to 0 (docs/benchmarks.md): with 8 prompts a step, half the runs
    # settled on one digit for every prompt before they learned to read it; with 16 at a constant lr, a run could
    # learn the task and lose it late (Adam moves each weight by up to about the lr at every step, a step with no
    # gradient included).
    --input-key prompt --label-key label
    --num-steps 80
    --rollout-batch-size 16 --n-samples-per-prompt 8 --rollout-max-response-len 2 --rollout-temperature 1.0
    --global-batch-size 128 --micro-batch-size 16
    --advantage-estimator grpo --no-normalize-advantages-by-std
    --lr 5e-3 --lr-decay-style cosine --min-lr 0 --weight-decay 0.0 --clip-grad 1.0
    --num-nodes 1 --num-devices-per-node 1
    --output-dir "$EXP_DIR/output" --overwrite-output-dir
)
given() { [[ " ${train_args[*]} " == *" $1 "* ]]; }
# The training prompts; --eval-only trains on none and --load-rollout-data replays saved rollouts instead (both
# refuse --prompt-data and --rollout-shuffle). --eval-only's other training flags above are checked but unused.
if ! given --eval-only && ! given --load-rollout-data; then
    args+=(--prompt-data "$data" --rollout-shuffle)
fi
# pass@1, 2 and 4 of the policy on the held-out set before the first step, every 10 steps and after the last (once
# under --eval-only); not under --debug-train-only, which starts no engines to evaluate on. The reward function
# scores the rollouts and the evaluations: --debug-train-only has neither, and refuses it.
if ! given --debug-train-only; then
    args+=(--reward-fn copy_digit --eval-prompt-data held_out "$held_out" --eval-n-samples-per-prompt 4)
    if ! given --eval-only; then
        args+=(--eval-interval 10)
    fi
fi
# With the engine on devices of its own (--no-colocate), each step trains on samples of the weights before the
# previous step's update (with --partial-rollout, most of a batch is the previous step's surplus), and lr 5e-3 moves
# the policy far in one step: taken as on-policy, half of the runs settled on one digit for every prompt. The
# engine's logprobs as PPO's old policy put the clip's trust region around the policy that drew the samples
# (docs/benchmarks.md). --use-tis excludes it; the colocated run is left as it is.
if { given --no-colocate || given --partial-rollout; } && ! given --use-tis && ! given --use-rollout-logprobs; then
    args+=(--use-rollout-logprobs)
fi
if [[ "${RELAX_DRY_RUN:-0}" == 1 ]]; then
    args+=(--dry-run)
fi
exec "$python" -m relax.cli train "${args[@]}" "${train_args[@]}"
