# shellcheck shell=bash
# Qwen3.5-35B-A3B (MoE, hybrid): Megatron architecture flags, sourced by scripts/run-*.sh as MODEL_ARGS.
# 40 layers (30 Gated DeltaNet, 10 full attention with 16 query / 2 KV heads), hidden 2048, separate
# input and output embeddings; the layer stack in qwen3.5-hybrid.sh. Every layer's MLP is MoE: 256
# experts of 512, top-8 softmax routing, one gated shared expert of 512. relax stops on any flag that
# disagrees with --hf-checkpoint's config.json. How experts are run (dispatcher, parallelism) is the run
# script's choice.
# shellcheck source=scripts/models/qwen3.5-hybrid.sh
source scripts/models/qwen3.5-hybrid.sh
# shellcheck disable=SC2034  # read by the script that sources this file
MODEL_ARGS=(
    "${QWEN35_HYBRID_ARGS[@]}"
    --num-layers 40 --hidden-size 2048 --untie-embeddings-and-output-weights
    --num-attention-heads 16 --group-query-attention --num-query-groups 2
    --num-experts 256 --moe-ffn-hidden-size 512 --moe-router-topk 8 --moe-router-score-function softmax
    --moe-shared-expert-intermediate-size 512 --moe-shared-expert-gate
)
