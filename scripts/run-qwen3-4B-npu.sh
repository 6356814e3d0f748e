#!/usr/bin/env bash
# GRPO on Qwen3-4B (math, rule-based reward) on one Atlas A3 node: 16 NPUs, each shared by the Megatron
# actor (TP 2 x DP 8) and one of 8 SGLang engines of 2 NPUs (colocated, memory released in turn).
#   MODEL_DIR=/models/Qwen3-4B DATA=/data/dapo-math-17k.jsonl bash scripts/run-qwen3-4B-npu.sh
#   RELAX_DRY_RUN=1 bash scripts/run-qwen3-4B-npu.sh       # check the flags, print the settings, stop
# Extra arguments are appended to relax train's. docs/npu.md: the image, the cluster, each variable.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/common.sh
source scripts/models/qwen3-4B.sh

MODEL_DIR="${MODEL_DIR:-/models/Qwen3-4B}"
DATA="${DATA:-/data/dapo-math-17k.jsonl}"
OUTPUT_DIR="${OUTPUT_DIR:-runs/qwen3-4B-npu}"
NUM_NODES="${NUM_NODES:-1}"
NUM_DEVICES_PER_NODE="${NUM_DEVICES_PER_NODE:-16}"

RUN_ARGS=(
    --device npu
    --hf-checkpoint "$MODEL_DIR"
    --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
    --reward-fn math
    --advantage-estimator grpo
    --num-steps 200
    --rollout-batch-size 32 --n-samples-per-prompt 8
    --rollout-max-response-len 8192 --rollout-temperature 1.0
    --global-batch-size 256 --micro-batch-size 1
    --use-dynamic-batch-size --max-tokens-per-device 16384
    --num-nodes "$NUM_NODES" --num-devices-per-node "$NUM_DEVICES_PER_NODE" --colocate
    --rollout-num-devices-per-engine 2
    --tensor-model-parallel-size 2 --sequence-parallel
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --bf16 --use-distributed-optimizer
    --lr 1e-6 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0
    --sglang-mem-fraction-static 0.7 --sglang-attention-backend ascend
    --output-dir "$OUTPUT_DIR" --save "$OUTPUT_DIR/checkpoints" --save-interval 50
)

relax_train "${MODEL_ARGS[@]}" "${RUN_ARGS[@]}" "$@"
