"""The device memory one training rank is expected to allocate at its peak: what `relax train --dry-run` prints and
what --device-memory-gib is checked against before a run starts.

    estimate = estimate_actor_memory(transformer, vocab_size, untied, tokens, layout, bytes_of)
    print("\n".join(estimate.lines()))

Counted from the architecture (megatron-core's TransformerConfig) and the layout, per rank:
- parameters, their gradient buffer (fp32 with --accumulate-allreduce-grads-in-fp32, else the parameters' dtype)
  and the optimizer's state (Adam: two fp32 moments, plus an fp32 main copy of bf16/fp16 parameters; SGD: one
  momentum), sharded over data parallel with --use-distributed-optimizer. Tensor parallelism splits the
  projections and the vocabulary, expert parallelism the experts, pipeline stages the layers.
- activations of one micro-batch (`tokens` per device) kept for the backward: per layer and token, what the
  norms keep, the projections' inputs and outputs and the attention / gated-delta output (flash attention:
  no [s, s] scores); full recompute keeps only each layer's input (and one recomputed group of layers at a time);
  selective recompute drops its modules' internals; under context parallelism the attention keeps the keys and
  values it gathered from every CP rank (relax's all-gather), or its own only (MindSpeed's ring attention on the NPU,
  which passes the others' around the ring again in the backward). With pipeline parallelism the first stage holds as many
  micro-batches in flight as there are stages, which amounts to every layer's activations for one micro-batch.
- the logits: the output layer's logits, their transposed copy and their gradient in the activations' dtype (the
  logprob and entropy never materialise them in fp32; relax/train/logprobs.py). With --fused-output-logprobs, one
  piece of them instead, and the output layer's input gradient, added up over the pieces in fp32.
- the working set of one GDN layer's chunked rule in its backward (Qwen3.5's linear attention): float32 chunk terms,
  per-chunk states and their gradients for every token of the micro-batch at once, beyond the activations kept. It
  and the logits are never live together (the output layer's backward ends before the layers' begins), so the
  larger of the two counts.

It is an estimate of allocated memory, checked against measurements in docs/training.md; the caching allocator
reserves 5-20% more than it allocates.
"""

from dataclasses import dataclass

GIB = 2**30
# Rows of relax.train.logprobs' float32 temporaries live at once when the platform computes the logprobs over
# pieces of positions (CHUNK_BYTES each): the forward's and the backward's.
LOGPROB_PIECES_LIVE = 3
# What a layer's RMSNorm keeps for the backward, in hidden-size vectors per token: its input, the normalised
# value (for the weight's gradient) and its output (the next projection's input).
NORM_KEEPS = 3
# Tokens per chunk of the chunked gated delta rule: relax.kernels.gdn_chunk_triton.CHUNK, not imported, since that
# module imports Triton and the dry run reads this one.
GDN_CHUNK = 64
# relax's chunked rule (the CUDA default) holds about this many times the float32 working set of its forward
# (_gdn_rule_forward_floats) in its backward: the terms recomputed, their gradients and autograd's saved
# intermediates. Measured: 8.97 GiB beyond the inputs for one layer's forward + backward on 16,384 tokens x 32 value
# heads, K = V = 128, on an H100 (benchmarks/gdn_chunk_rule.py, docs/benchmarks.md): 2.24 x 4 x 2,048 floats per token
# and value head. The torch reference took 4.15 GiB on that batch (11 sequences; it works one length at a time).
GDN_BACKWARD_COPIES = 2.24


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    data: int = 1  # data-parallel replicas (world / (tensor x pipeline x context))
    # Under context parallelism, whether each rank keeps the whole row's keys and values (the platform's
    # context_parallel_attention: relax's all-gather) or its own only (MindSpeed's ring attention).
    keys_gathered: bool = True
    sequence_parallel: bool = False
    distributed_optimizer: bool = False


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int  # bytes
    gradients: int
    optimizer: int
    activations: int
    logits: int
    parameter_count: int  # on this rank
    tokens: int  # of the micro-batch counted
    fused_output: bool = False  # `logits` counts a piece of them (--fused-output-logprobs)
    gdn_backward: int = 0  # one GDN layer's backward working set: live only after the logits' backward

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.activations
                + max(self.logits, self.gdn_backward))

    def lines(self) -> list[str]:
        def gib(value: int) -> str:
            return f"{value / GIB:.2f} GiB" if value >= GIB / 10 else f"{value / 2**20:.1f} MiB"

        return [
            f"training memory per device (estimate of the peak allocated, {self.parameter_count:,} parameters "
            f"on this rank): {gib(self.total)}",
            f"  parameters {gib(self.parameters)}, gradients {gib(self.gradients)}, optimizer {gib(self.optimizer)}, "
            f"activations of a micro-batch of {self.tokens:,} tokens {gib(self.activations)}, "
            f"{'fused output layer (a piece of the logits)' if self.fused_output else 'logits'} {gib(self.logits)}"
            + (f", one GDN layer's backward {gib(self.gdn_backward)} (the larger of it and the logits counts)"
               if self.gdn_backward else ""),
        ]


def layer_kinds(tc) -> list[str]:
    """Each layer's token mixer: "attention" or "gated_delta_net" (Qwen3.5's linear attention)."""
    pattern = tc.linear_attention_freq if tc.experimental_attention_variant == "gated_delta_net" else None
    if pattern is None:
        return ["attention"] * tc.num_layers
    if isinstance(pattern, int):  # every pattern-th layer is full attention, as megatron-core reads it
        return ["attention" if (i + 1) % pattern == 0 else "gated_delta_net" for i in range(tc.num_layers)]
    return ["gated_delta_net" if linear else "attention" for linear in pattern]


def moe_layers(tc) -> list[bool]:
    if not tc.num_moe_experts:
        return [False] * tc.num_layers
    freq = tc.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(tc.num_layers)]
    return [bool(f) for f in freq]


def _attention_widths(tc) -> tuple[int, int, int, int]:
    """(q, k + v, output) widths of a softmax attention layer's projections (Qwen3.5's output gate doubles q) and
    its head size."""
    head_dim = tc.kv_channels or tc.hidden_size // tc.num_attention_heads
    out = tc.num_attention_heads * head_dim
    q = out * (2 if getattr(tc, "attention_output_gate", False) else 1)
    return q, 2 * (tc.num_query_groups or tc.num_attention_heads) * head_dim, out, head_dim


def _gdn_widths(tc) -> tuple[int, int, int]:
    """(q + k, v, heads) widths of a gated delta net layer."""
    qk = 2 * tc.linear_num_key_heads * tc.linear_key_head_dim
    return qk, tc.linear_num_value_heads * tc.linear_value_head_dim, tc.linear_num_value_heads


def _gdn_rule_forward_floats(tc, cp: int) -> int:
    """Float32 values per token and value head the chunked rule's forward works on: q, k and v; the chunk's
    decays, its triangular system and the attention inside it (GDN_CHUNK each); the two right-hand sides and their
    solutions; the decayed q and k; the corrected values; the per-chunk state and its gradient (K x V per chunk).
    Under context parallelism the values are widened by a key head (relax.train.context_parallel)."""
    k, v = tc.linear_key_head_dim, tc.linear_value_head_dim + (tc.linear_key_head_dim if cp > 1 else 0)
    return 2 * k + v + 4 * GDN_CHUNK + 2 * (k + v) + 2 * k + v + 2 * k * v // GDN_CHUNK


def mixer_parameters(tc, kind: str) -> int:
    h = tc.hidden_size
    if kind == "attention":
        q, kv, out, head_dim = _attention_widths(tc)
        norms = 2 * head_dim if tc.qk_layernorm else 0
        bias = q + kv if tc.add_qkv_bias else 0
        return h * (q + kv) + bias + out * h + norms + h  # + the layer's input norm
    qk, v, heads = _gdn_widths(tc)
    in_proj = h * (qk + 2 * v + 2 * heads)  # q, k, v, the output gate z; b and a per head
    conv = (qk + v) * tc.linear_conv_kernel_dim
    return in_proj + conv + 2 * heads + tc.linear_value_head_dim + v * h + h  # A, dt bias, the gated norm, out, norm


def mlp_parameters(tc, moe: bool) -> tuple[int, int]:
    """(dense, expert) parameters of one layer's MLP with its norm."""
    h, gated = tc.hidden_size, 3 if tc.gated_linear_unit else 2
    if not moe:
        return gated * h * tc.ffn_hidden_size + h, 0
    shared = tc.moe_shared_expert_intermediate_size or 0
    dense = h * tc.num_moe_experts + gated * h * shared + (h if tc.moe_shared_expert_gate else 0) + h
    return dense, tc.num_moe_experts * gated * h * tc.moe_ffn_hidden_size


def parameter_count(tc, vocab_size: int, untied: bool) -> tuple[int, int, int]:
    """(embedding and output layer, layers' dense, layers' expert) parameters of the whole model."""
    dense = experts = 0
    for kind, moe in zip(layer_kinds(tc), moe_layers(tc)):
        mlp_dense, mlp_experts = mlp_parameters(tc, moe)
        dense += mixer_parameters(tc, kind) + mlp_dense
        experts += mlp_experts
    vocabulary = vocab_size * tc.hidden_size * (2 if untied else 1) + tc.hidden_size  # + the final norm
    return vocabulary, dense, experts


def _mixer_activation_elements(tc, kind: str, tp: int, sp_div: int, cp: int, keys_gathered: bool) -> float:
    h = tc.hidden_size
    if kind == "attention":
        q, kv, out, _ = _attention_widths(tc)
        # the norm, q/k/v (as rotated; under context parallelism with keys_gathered the keys and values gathered from
        # every CP rank), the attention's output (the output projection's input)
        return NORM_KEEPS * h / sp_div + (q + kv * (cp if keys_gathered else 1) + out) / tp
    qk, v, heads = _gdn_widths(tc)
    # the norm, q/k/v/z/b/a, the convolution's output, the rule's output and its gated norm; under context parallelism
    # the rule runs on values widened by a key head's width per value head (relax.train.context_parallel)
    widened = heads * tc.linear_key_head_dim if cp > 1 else 0
    return NORM_KEEPS * h / sp_div + (qk + 2 * v + 2 * heads + qk + v + widened + 2 * v) / tp


def _mlp_activation_elements(tc, moe: bool, tp: int, etp: int, sp_div: int, modules: set) -> float:
    h, gated = tc.hidden_size, 3 if tc.gated_linear_unit else 2  # fc1's output (gate and up) and the activation
    inputs = NORM_KEEPS * h / sp_div
    if not moe:
        return inputs + (0 if "mlp" in modules else gated * tc.ffn_hidden_size / tp)
    k, routed = tc.moe_router_topk, 0.0
    if "moe" not in modules:
        per_copy = h + gated * tc.moe_ffn_hidden_size / etp  # each token's copy sent to an expert, its fc1 and act
        if "moe_act" in modules:
            per_copy -= tc.moe_ffn_hidden_size / etp
        routed = k * per_copy + 2 * tc.num_moe_experts  # + the router's float32 scores
    shared = tc.moe_shared_expert_intermediate_size or 0
    shared_part = 0 if "shared_experts" in modules else gated * shared / tp
    return inputs + routed + shared_part


def estimate_actor_memory(
    tc, vocab_size: int, untied: bool, tokens: int, layout: Layout, param_bytes: int, grad_bytes: int,
    optimizer: str, logprob_pieces_bytes: int = 0, fused_output_piece_bytes: int = 0,
) -> MemoryEstimate:
    """`tc`: megatron-core's TransformerConfig; `tokens`: one micro-batch's tokens on this device; `param_bytes`:
    2 for bf16/fp16, 4 for fp32; `grad_bytes`: the gradient buffer's; `optimizer`: "adam" or "sgd";
    `logprob_pieces_bytes`: the float32 temporaries of one piece at most where the platform computes logprobs by
    pieces of positions (0 where fused kernels do); `fused_output_piece_bytes`: with the output projection fused with
    the logprobs (relax.train.logprobs.output_logprobs_and_entropy), the bytes of one piece of the logits (0: the
    logits are whole)."""
    tp, pp, ep = layout.tensor, layout.pipeline, layout.expert
    etp = tc.expert_tensor_parallel_size or tp
    vocabulary, dense, experts = parameter_count(tc, vocab_size, untied)
    # The worst pipeline stage: its share of the layers and the larger of the embedding and the output layer.
    vocabulary_on_stage = vocabulary if pp == 1 else vocabulary / (2 if untied else 1)
    on_rank = int(vocabulary_on_stage / tp + dense / (tp * pp) + experts / (etp * ep * pp))
    master = 4 if param_bytes < 4 else 0
    state_bytes = master + (8 if optimizer == "adam" else 4)
    optimizer_shards = layout.data * layout.context if layout.distributed_optimizer else 1

    activation_bytes = param_bytes  # the layers compute in the parameters' dtype
    sp_div = tp if layout.sequence_parallel else 1
    modules = set(tc.recompute_modules or ()) if tc.recompute_granularity == "selective" else set()
    per_layer = [
        _mixer_activation_elements(tc, kind, tp, sp_div, layout.context, layout.keys_gathered)
        + _mlp_activation_elements(tc, moe, tp, etp, sp_div, modules)
        for kind, moe in zip(layer_kinds(tc), moe_layers(tc))
    ]
    if tc.recompute_granularity == "full":
        group = tc.recompute_num_layers or 1
        kept = tc.hidden_size / sp_div  # each recomputed layer's input
        if tc.recompute_method == "block":  # the first `group` layers of each stage recompute, the rest keep all
            per_stage = tc.num_layers // pp
            elements = sum(kept if i % per_stage < group else per_layer[i] for i in range(tc.num_layers))
        else:  # uniform: every layer's input kept, one group of layers live while it is recomputed
            elements = kept * tc.num_layers + max(per_layer) * group
    else:
        elements = sum(per_layer)
    activations = int(elements * tokens * activation_bytes)
    pieces = LOGPROB_PIECES_LIVE * min(logprob_pieces_bytes, 4 * tokens * vocab_size // tp)
    logits_bytes = tokens * vocab_size / tp * activation_bytes
    if fused_output_piece_bytes:
        # one piece of logits at a time; the backward's gradient of the hidden states in fp32, and each piece's part
        logits = int(min(fused_output_piece_bytes, logits_bytes) + tokens * tc.hidden_size * (4 + activation_bytes)
                     + pieces)
    else:
        logits = int(3 * logits_bytes + pieces)
    gdn_backward = 0
    if "gated_delta_net" in layer_kinds(tc):
        gdn_heads = tc.linear_num_value_heads / tp
        gdn_backward = int(GDN_BACKWARD_COPIES * 4 * _gdn_rule_forward_floats(tc, layout.context) * tokens * gdn_heads)
    return MemoryEstimate(
        parameters=on_rank * param_bytes,
        gradients=on_rank * grad_bytes,
        optimizer=on_rank * state_bytes // optimizer_shards,
        activations=activations,
        logits=logits,
        parameter_count=on_rank,
        tokens=tokens,
        fused_output=bool(fused_output_piece_bytes),
        gdn_backward=gdn_backward,
    )
