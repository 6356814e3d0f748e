# shellcheck shell=bash
# Qwen3.5-35B-A3B (MoE, hybrid): Megatron architecture flags, sourced by scripts/run-*.sh as MODEL_ARGS.
# 40 layers, every 4th full (gated) attention with 16 query / 2 KV heads of 256 and RoPE on a quarter of
# each head (base 1e7); the other 30 are Gated DeltaNet layers (16 key heads, 32 value heads of 128,
# conv kernel 4). Hidden 2048; every layer is MoE: 256 experts of 512, top-8 softmax routing, one gated
# shared expert of 512. Vocabulary 248320. relax stops on any flag that disagrees with --hf-checkpoint's
# config.json.
# shellcheck disable=SC2034  # read by the script that sources this file
MODEL_ARGS=(
    --num-layers 40
    --hidden-size 2048
    --num-attention-heads 16
    --group-query-attention
    --num-query-groups 2
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
    --untie-embeddings-and-output-weights
    --experimental-attention-variant gated_delta_net
    --linear-attention-freq 4
    --linear-conv-kernel-dim 4
    --linear-key-head-dim 128
    --linear-value-head-dim 128
    --linear-num-key-heads 16
    --linear-num-value-heads 32
    --num-experts 256
    --moe-ffn-hidden-size 512
    --moe-shared-expert-intermediate-size 512
    --moe-shared-expert-gate
    --moe-router-topk 8
    --moe-router-score-function softmax
    --moe-router-dtype fp32
    --moe-token-dispatcher-type alltoall
    --moe-grouped-gemm
    --moe-aux-loss-coeff 0
)
