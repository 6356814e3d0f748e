#!/usr/bin/env bash
# GRPO on Qwen3.5-9B (hybrid Gated DeltaNet / gated attention; math, rule-based reward) on one node of 8
# Ascend NPUs, each shared by the Megatron actor (TP 4 x DP 2) and one of 4 SGLang engines of 2 NPUs
# (colocated: the two release their memory in turn).
#   bash scripts/run-qwen35-9B-8xnpu-colocate.sh                    # reads $EXP_DIR/models/Qwen3.5-9B
#   RELAX_DRY_RUN=1 bash scripts/run-qwen35-9B-8xnpu-colocate.sh    # check the flags, print the settings, stop
# Paths and switches: scripts/common.sh. Extra arguments are appended to relax train's. docs/npu.md: the
# image, the cluster, each variable.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/common.sh
source scripts/models/qwen3.5-9B.sh
preset_defaults Qwen3.5-9B
npu_environment

RUN_ARGS=(
    --device npu
    --num-nodes "${NUM_NODES:-1}" --num-devices-per-node "${NUM_DEVICES_PER_NODE:-8}" --colocate
    # truncated importance sampling: corrects each token's gradient for the engine's sampling mismatch
    --use-tis
    --rollout-batch-size 32 --micro-batch-size 1
    # pack each micro-batch up to 16k tokens instead of a fixed number of samples
    --use-dynamic-batch-size --max-tokens-per-device 16384
    --tensor-model-parallel-size 4 --sequence-parallel
    # engines of 2 NPUs: 9 GB of weights per NPU leaves most of the memory for the KV cache
    # MindSpeed's fused NPU kernels in megatron-core's own modules (relax's attention, GDN and norms have their own)
    --use-fused-swiglu --bias-activation-fusion --use-fused-rotary-pos-emb
    --rollout-num-devices-per-engine 2
    # a prefill may wait up to 30 scheduler passes to be batched with others
    --sglang-prefill-delayer-max-delay-passes 30
    --sglang-mem-fraction-static 0.7 --sglang-attention-backend ascend
    # decode graphs for up to the 64 requests each engine gets (32 prompts x 8 / 4 engines); GDN state in bf16
    --sglang-cuda-graph-bs-decode 2 8 16 24 32 64 --sglang-mamba-ssm-dtype bfloat16
    # Keep the GDN layers' recurrent state of cached prefixes in extra buffers, so that the n responses
    # of a prompt reuse its prefill. The issue asked for --sglang-mamba-scheduler-strategy; SGLang 0.5.23
    # names the flag --mamba-radix-cache-strategy.
    --sglang-mamba-radix-cache-strategy extra_buffer
    # tokenize with the fastokens library (installed in docker/Dockerfile.npu) instead of HF tokenizers
    --sglang-tokenizer-backend fastokens
)

relax_train "${MODEL_ARGS[@]}" "${PRESET_ARGS[@]}" "${RUN_ARGS[@]}" "$@"
