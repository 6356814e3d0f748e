# shellcheck shell=bash
# The Qwen3.5 hybrid layer stack, shared by scripts/models/qwen3.5-*.sh as QWEN35_HYBRID_ARGS: every 4th
# layer full (gated) attention with q/k RMSNorm, heads of 256 and RoPE on a quarter of each head (base
# 1e7); the other layers Gated DeltaNet (16 key heads, 32 value heads of 128, conv kernel 4); RMSNorms
# that scale by (1 + weight); vocabulary 248320, 262144 positions.
# shellcheck disable=SC2034  # read by the file that sources this one
QWEN35_HYBRID_ARGS=(
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
