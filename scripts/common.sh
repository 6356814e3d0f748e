# shellcheck shell=bash
# Sourced by scripts/run-*.sh (the cluster presets): where a run's files live, the flags every preset
# shares, the Ascend environment, and the one way they start `relax train`.
#   EXP_DIR        experiment root (default: ~/relax-exp); on several nodes put it on storage every node sees
#   MODEL_DIR      the HF checkpoint (default: $EXP_DIR/models/<model>, e.g. $EXP_DIR/models/Qwen3.5-9B)
#   DATA_DIR       prompt data (default: $EXP_DIR/data); the presets read $DATA_DIR/dapo-math-17k.jsonl
#   OUTPUT_DIR     metrics, logs, TensorBoard events (default: $EXP_DIR/output/<script name without run->)
#   RELAX_PYTHON   the interpreter relax is installed in (default: python3)
#   RELAX_DRY_RUN  1: append --dry-run, so relax validates every flag, prints the resolved relax, SGLang
#                  and Megatron settings, and exits without touching a device (CI runs every run-*.sh so)

# preset_defaults MODEL: sets EXP_DIR, MODEL_DIR, DATA_DIR and OUTPUT_DIR (each kept when already set) and
# PRESET_ARGS, the flags every preset shares; a run script adds what differs (devices, parallelism, sizes).
preset_defaults() {
    local run
    run="$(basename "$0" .sh)"
    EXP_DIR="${EXP_DIR:-$HOME/relax-exp}"
    MODEL_DIR="${MODEL_DIR:-$EXP_DIR/models/$1}"
    DATA_DIR="${DATA_DIR:-$EXP_DIR/data}"
    OUTPUT_DIR="${OUTPUT_DIR:-$EXP_DIR/output/${run#run-}}"
    # shellcheck disable=SC2034  # read by the run script
    PRESET_ARGS=(
        --hf-checkpoint "$MODEL_DIR"
        # DAPO-Math-17k prompts (fields prompt and label) in the chat template, scored by the math reward
        --prompt-data "$DATA_DIR/dapo-math-17k.jsonl" --input-key prompt --label-key label
        --apply-chat-template --rollout-shuffle --reward-fn math
        # GRPO: 8 responses per prompt at temperature 1, up to 8k new tokens each
        --advantage-estimator grpo --num-steps 200
        --n-samples-per-prompt 8 --rollout-max-response-len 8192 --rollout-temperature 1.0
        # Megatron: bf16 with the distributed optimizer, every layer recomputed in the backward pass
        --bf16 --use-distributed-optimizer
        --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
        --lr 1e-6 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0
        --output-dir "$OUTPUT_DIR"
    )
}

# npu_environment: the Ascend variables of the NPU presets, exported unless already set (the shell wins).
# Workers get them through the job's environment (relax/ray/runtime_env.py). relax's NPU platform gives
# workers the same HCCL timeouts, TASK_QUEUE_ENABLE and CPU_AFFINITY_CONF by default (relax/platform/npu.py
# says why for each); they are exported here so a run's settings are in one place and visible.
npu_environment() {
    # SGLang keeps weights in plain ND layout instead of casting them to FRACTAL_NZ at load: each weight
    # push copies Megatron's ND tensors into them in place
    export SGLANG_NPU_DISABLE_ACL_FORMAT_WEIGHT="${SGLANG_NPU_DISABLE_ACL_FORMAT_WEIGHT:-1}"
    # relax's sglang patch: torch_npu may not move tensors into private layouts behind SGLang's back
    export SGLANG_NPU_ALLOW_INTERNAL_FORMAT="${SGLANG_NPU_ALLOW_INTERNAL_FORMAT:-0}"
    # relax's sglang patch: run torch_npu's prebuilt kernels, no online compilation per shape
    export SGLANG_NPU_JIT_COMPILE="${SGLANG_NPU_JIT_COMPILE:-0}"
    # SGLang's Ascend attention backend uses the fused-infer-attention (FIA) kernels, which also serve
    # Qwen3.5's 256-dim heads in mixed prefill/decode batches (without FIA only up to 128)
    export ASCEND_USE_FIA="${ASCEND_USE_FIA:-1}"
    # level-1 operator queue: the host enqueues kernels ahead of the device (the value Relax's Ascend scripts
    # ran the actor and SGLang engines with; MindSpeed-LLM's training-only examples use 2)
    export TASK_QUEUE_ENABLE="${TASK_QUEUE_ENABLE:-1}"
    # bind each process's threads to the CPU cores next to its NPU
    export CPU_AFFINITY_CONF="${CPU_AFFINITY_CONF:-1}"
    # seconds HCCL waits for every rank to join a communicator (ranks of colocated groups arrive minutes apart)
    export HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-1800}"
    # seconds a started collective waits for slow peers (a long rollout keeps peers away)
    export HCCL_EXEC_TIMEOUT="${HCCL_EXEC_TIMEOUT:-3600}"
    # collectives are expanded on the AI Vector cores instead of the host-scheduled path (lower latency)
    export HCCL_OP_EXPANSION_MODE="${HCCL_OP_EXPANSION_MODE:-AIV}"
    # torch_npu's HCCL collectives work on the tensors in place instead of copying them into HCCL's buffer
    export TORCH_HCCL_ZERO_COPY="${TORCH_HCCL_ZERO_COPY:-1}"
    # torch_npu's allocator reuses memory freed on another stream (SGLang's NPU path runs several streams)
    export MULTI_STREAM_MEMORY_REUSE="${MULTI_STREAM_MEMORY_REUSE:-1}"
    # torch_npu's stream pool per device (SGLang's Ascend guides use 32)
    export STREAMS_PER_DEVICE="${STREAMS_PER_DEVICE:-32}"
    # SGLang on NPU: overlap work on several streams; plan the next batch on its own stream
    export SGLANG_NPU_USE_MULTI_STREAM="${SGLANG_NPU_USE_MULTI_STREAM:-1}"
    export SGLANG_ENABLE_OVERLAP_PLAN_STREAM="${SGLANG_ENABLE_OVERLAP_PLAN_STREAM:-1}"
}

relax_train() {
    local python="${RELAX_PYTHON:-python3}"
    if [[ "${RELAX_DRY_RUN:-0}" == "1" ]]; then
        exec "$python" -m relax.cli train "$@" --dry-run
    fi
    exec "$python" -m relax.cli train "$@"
}
