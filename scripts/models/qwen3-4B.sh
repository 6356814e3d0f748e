# shellcheck shell=bash
# Qwen3-4B (dense): Megatron architecture flags, sourced by scripts/run-*.sh as MODEL_ARGS.
# Values from the model's config.json: 36 layers, hidden 2560, FFN 9728, 32 query / 8 KV heads of 128,
# QK RMSNorm, RoPE base 1e6, vocabulary 151936, input and output embeddings tied.
# shellcheck disable=SC2034  # read by the script that sources this file
MODEL_ARGS=(
    --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728
    --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128 --qk-layernorm
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
    --position-embedding-type rope --rotary-base 1000000
    --vocab-size 151936 --max-position-embeddings 40960
)
