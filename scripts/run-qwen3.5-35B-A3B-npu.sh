#!/usr/bin/env bash
# GRPO on Qwen3.5-35B-A3B (hybrid MoE; math, rule-based reward) on two Atlas A3 nodes: 32 NPUs, each
# shared by the Megatron actor (TP 2 x DP 16, experts over EP 8) and one of 8 SGLang engines of 4 NPUs.
# Start Ray on both nodes first, then submit from the head (docs/npu.md, "Several nodes"):
#   scripts/submit.sh --address http://HEAD:8265 -- bash scripts/run-qwen3.5-35B-A3B-npu.sh
#   RELAX_DRY_RUN=1 bash scripts/run-qwen3.5-35B-A3B-npu.sh   # check the flags, print the settings, stop
# Extra arguments are appended to relax train's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/common.sh
source scripts/models/qwen3.5-35B-A3B.sh

MODEL_DIR="${MODEL_DIR:-/models/Qwen3.5-35B-A3B}"
DATA="${DATA:-/data/dapo-math-17k.jsonl}"
OUTPUT_DIR="${OUTPUT_DIR:-runs/qwen3.5-35B-A3B-npu}"
NUM_NODES="${NUM_NODES:-2}"
NUM_DEVICES_PER_NODE="${NUM_DEVICES_PER_NODE:-16}"

RUN_ARGS=(
    --device npu
    --hf-checkpoint "$MODEL_DIR"
    --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
    --reward-fn math
    --advantage-estimator grpo
    --num-steps 200
    --rollout-batch-size 64 --n-samples-per-prompt 8
    --rollout-max-response-len 8192 --rollout-temperature 1.0
    --global-batch-size 512 --micro-batch-size 1
    --use-dynamic-batch-size --max-tokens-per-device 16384
    --num-nodes "$NUM_NODES" --num-devices-per-node "$NUM_DEVICES_PER_NODE" --colocate
    --rollout-num-devices-per-engine 4
    --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 8
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --bf16 --use-distributed-optimizer
    --lr 1e-6 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0
    --sglang-mem-fraction-static 0.7 --sglang-attention-backend ascend
    --output-dir "$OUTPUT_DIR" --save "$OUTPUT_DIR/checkpoints" --save-interval 50
)

relax_train "${MODEL_ARGS[@]}" "${RUN_ARGS[@]}" "$@"
