#!/usr/bin/env bash
# GRPO on Qwen3-4B (math, rule-based reward) on one node of 8 NVIDIA GPUs, each shared by the Megatron
# actor (DP 8) and one of 8 SGLang engines of one GPU (colocated: the two release their memory in turn).
#   bash scripts/run-qwen3-4B-8xgpu.sh                    # reads $EXP_DIR/models/Qwen3-4B
#   RELAX_DRY_RUN=1 bash scripts/run-qwen3-4B-8xgpu.sh    # check the flags, print the settings, stop
# Paths and switches: scripts/common.sh. Extra arguments are appended to relax train's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/common.sh
source scripts/models/qwen3-4B.sh
preset_defaults Qwen3-4B

RUN_ARGS=(
    --device cuda
    --num-nodes "${NUM_NODES:-1}" --num-devices-per-node "${NUM_DEVICES_PER_NODE:-8}" --colocate
    --rollout-batch-size 32 --micro-batch-size 1
    --use-dynamic-batch-size --max-tokens-per-device 16384
    --rollout-num-devices-per-engine 1
    --sglang-mem-fraction-static 0.7
)

relax_train "${MODEL_ARGS[@]}" "${PRESET_ARGS[@]}" "${RUN_ARGS[@]}" "$@"
