#!/usr/bin/env bash
# GRPO on Qwen3.5-35B-A3B (hybrid MoE; math, rule-based reward) on two Atlas A3 nodes of 16 NPUs: 32 NPUs,
# each shared by the Megatron actor (TP 8 x PP 2 x DP 2; experts over EP 16) and one of 4 SGLang engines
# of 8 NPUs (colocated: the two release their memory in turn).
# Start Ray on both nodes, put EXP_DIR on storage both see, then submit from the head (docs/npu.md):
#   EXP_DIR=/shared/relax-exp scripts/submit.sh --address http://HEAD:8265 -- \
#       bash scripts/run-qwen35-35B-A3B-16xnpu-colocate.sh
#   RELAX_DRY_RUN=1 bash scripts/run-qwen35-35B-A3B-16xnpu-colocate.sh   # check the flags, print the settings, stop
# Paths and switches: scripts/common.sh. Extra arguments are appended to relax train's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/common.sh
source scripts/models/qwen3.5-35B-A3B.sh
preset_defaults Qwen3.5-35B-A3B
npu_environment  # SGLANG_*, ASCEND_USE_FIA, TASK_QUEUE_ENABLE, CPU_AFFINITY_CONF, HCCL and stream settings
# MB of buffer per HCCL communicator: the alltoall of 16 expert ranks moves more than the 200 MB default
export HCCL_BUFFSIZE="${HCCL_BUFFSIZE:-400}"
# Between nodes HCCL and Gloo pick a network interface themselves; when a node has several, name the one
# the nodes reach each other on: HCCL_SOCKET_IFNAME=<nic> GLOO_SOCKET_IFNAME=<nic> (machine-specific).

RUN_ARGS=(
    --device npu
    --num-nodes "${NUM_NODES:-2}" --num-devices-per-node "${NUM_DEVICES_PER_NODE:-16}" --colocate
    # truncated importance sampling: corrects each token's gradient for the engine's sampling mismatch
    --use-tis
    --rollout-batch-size 64 --micro-batch-size 1
    --use-dynamic-batch-size --max-tokens-per-device 16384
    --tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 2
    # experts: EP 16 x PP 2 covers the 32 NPUs, each expert whole on its NPU (no expert TP)
    --expert-model-parallel-size 16 --expert-tensor-parallel-size 1
    --moe-token-dispatcher-type alltoall
    --moe-router-dtype fp32 --moe-aux-loss-coeff 0
    # overlap DP gradient reduce-scatter and parameter all-gather with backward and forward compute
    --overlap-grad-reduce --overlap-param-gather
    # MindSpeed's fused NPU kernels in megatron-core's own modules (relax's attention, GDN and norms have their own)
    --use-fused-swiglu --bias-activation-fusion --use-fused-rotary-pos-emb
    # experts as one grouped matmul per projection; MindSpeed's fused token permute for the alltoall dispatcher
    --moe-grouped-gemm --use-fused-moe-token-permute-and-unpermute
    --rollout-num-devices-per-engine 8
    # a prefill may wait up to 30 scheduler passes to be batched with others
    --sglang-prefill-delayer-max-delay-passes 30
    --sglang-mem-fraction-static 0.85 --sglang-attention-backend ascend
    # decode graphs for up to the 128 requests each engine gets (64 prompts x 8 / 4 engines); GDN state in bf16
    --sglang-cuda-graph-bs-decode 4 8 16 24 32 40 48 64 128 --sglang-mamba-ssm-dtype bfloat16
)

relax_train "${MODEL_ARGS[@]}" "${PRESET_ARGS[@]}" "${RUN_ARGS[@]}" "$@"
