# shellcheck shell=bash
# Qwen3.5-9B (dense, hybrid): Megatron architecture flags, sourced by scripts/run-*.sh as MODEL_ARGS.
# 32 layers, every 4th full (gated) attention with 16 query / 4 KV heads of 256 and RoPE on a quarter of
# each head (base 1e7); the other 24 are Gated DeltaNet layers (16 key heads, 32 value heads of 128,
# conv kernel 4). Hidden 4096, FFN 12288, vocabulary 248320, embeddings tied. Taken from published
# descriptions of its config.json; relax stops on any flag that disagrees with --hf-checkpoint's config.json.
# shellcheck disable=SC2034  # read by the script that sources this file
MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 12288
    --num-attention-heads 16
    --group-query-attention
    --num-query-groups 4
    --kv-channels 256
    --qk-layernorm
    --attention-output-gate
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --layernorm-zero-centered-gamma
    --swiglu
    --disable-bias-linear
    --position-embedding-type rope
    --rotary-percent 0.25
    --rotary-base 10000000
    --vocab-size 248320
    --max-position-embeddings 262144
    --experimental-attention-variant gated_delta_net
    --linear-attention-freq 4
    --linear-conv-kernel-dim 4
    --linear-key-head-dim 128
    --linear-value-head-dim 128
    --linear-num-key-heads 16
    --linear-num-value-heads 32
)
