# shellcheck shell=bash
# Qwen3.5-9B (dense, hybrid): Megatron architecture flags, sourced by scripts/run-*.sh as MODEL_ARGS.
# 32 layers (24 Gated DeltaNet, 8 full attention with 16 query / 4 KV heads), hidden 4096, FFN 12288,
# embeddings tied; the layer stack in qwen3.5-hybrid.sh. Taken from published descriptions of its
# config.json; relax stops on any flag that disagrees with --hf-checkpoint's config.json.
# shellcheck source=scripts/models/qwen3.5-hybrid.sh
source scripts/models/qwen3.5-hybrid.sh
# shellcheck disable=SC2034  # read by the script that sources this file
MODEL_ARGS=(
    "${QWEN35_HYBRID_ARGS[@]}"
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 12288
    --num-attention-heads 16 --group-query-attention --num-query-groups 4
)
