"""Torch functions with the exact call semantics of the sgl_kernel CPU ops SGLang 0.5.23's GDN models call.

Each function takes the arguments in the order SGLang passes them to `torch.ops.sgl_kernel.<name>_cpu` (read in
sglang/srt/models/qwen3_5.py, qwen3_next.py, layers/attention/linear/gdn_backend.py, kernels/gdn_triton.py,
kernels/ops/attention/fla/layernorm_gated.py and sgl_kernel/mamba.py) and is built from gdn_reference.
Registering them as torch ops is the platform layer's job, not this module's.

Pools use SGLang's layouts: recurrent state [num_slots, Hv, V, K], conv state [num_slots, conv_dim, W-1].
The C++ ops' `is_vnni` flag (weights pre-packed by causal_conv1d_weight_pack) is refused: these take plain
[conv_dim, W] weights.
"""

import torch

from relax.kernels import gdn_reference as ref


def fused_sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> None:
    """x *= sigmoid(gate), in place. x: [N, H*D]; gate: [N, H*D] or a strided [N, H, D] view."""
    x.copy_(ref.sigmoid_mul(x, gate.reshape(x.shape)))


def fused_qk_gemma_rmsnorm(q, k, q_weight, k_weight, eps: float, head_dim: int):
    """Per-head Gemma RMSNorm of q and k. Returns (q_out [N*Hq, head_dim], k_out [N*Hk, head_dim])."""
    return (ref.gemma_rms_norm(q.reshape(-1, head_dim), q_weight, eps),
            ref.gemma_rms_norm(k.reshape(-1, head_dim), k_weight, eps))


def fused_qk_gemma_rmsnorm_with_gate(q_gate, k, q_weight, k_weight, eps: float, head_dim: int, num_heads: int):
    """q_gate [N, num_heads * 2 * head_dim] holds per head [q | gate]. Returns (q_out, k_out, gate_out) with
    q_out, gate_out [N*num_heads, head_dim] and k_out [N*Hk, head_dim]; q and k Gemma-RMS-normed."""
    q, gate = q_gate.reshape(q_gate.shape[0], num_heads, 2 * head_dim).split([head_dim, head_dim], dim=-1)
    q_out, k_out = fused_qk_gemma_rmsnorm(q, k, q_weight, k_weight, eps, head_dim)
    return q_out, k_out, gate.reshape(-1, head_dim).contiguous()


def fused_qkvzba_split_reshape_cat_contiguous(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    """Qwen3.5's [q|k|v|z], [b|a] -> (mixed_qkv [N, 2*Hk*K+Hv*V], z [N, Hv, V], b [N, Hv], a [N, Hv])."""
    return ref.split_qkvzba(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v, "contiguous")


def fused_qkvzba_split_reshape_cat(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    """Qwen3-Next's per-key-head interleaved layout; same outputs as the contiguous variant."""
    return ref.split_qkvzba(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v, "interleaved")


def fused_rmsnorm_gated(x, weight, z, eps: float):
    """RMSNorm(x) * weight * silu(z) over the last dim (norm before gate, no groups)."""
    return ref.gated_rms_norm(x, z, weight, eps)


def fused_gdn_gating(A_log, a, b, dt_bias):
    """a, b [N, Hv] -> (g, beta), each float32 [1, N, Hv] as SGLang's Triton fused_gdn_gating returns them."""
    g, beta = ref.gdn_gating(A_log, a, b, dt_bias)
    return g.unsqueeze(0), beta.unsqueeze(0)


def _refuse_vnni(is_vnni: bool):
    if is_vnni:
        raise ValueError("is_vnni=True: these reference ops take the plain [conv_dim, W] conv weight, not a "
                         "causal_conv1d_weight_pack'ed one; call them with is_vnni=False")


def causal_conv1d_fwd(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                      silu_activation: bool, pad_slot_id: int, is_vnni: bool):
    """Prefill conv over packed sequences. x: [conv_dim, total_tokens]; sequence i spans
    query_start_loc[i]:query_start_loc[i+1], starts from conv_states[cache_indices[i]] when has_initial_state[i]
    (else zeros), and leaves its last W-1 inputs there. Sequences whose slot is pad_slot_id are skipped (zero
    output). Returns the output [conv_dim, total_tokens]. Sequences of one length are convolved as one batch."""
    _refuse_vnni(is_vnni)
    out = torch.zeros_like(x)
    activation = "silu" if silu_activation else None
    bounds, slots = query_start_loc.tolist(), cache_indices.tolist()
    by_length: dict[int, list[int]] = {}
    for i, slot in enumerate(slots[:len(bounds) - 1]):
        if slot != pad_slot_id:
            by_length.setdefault(bounds[i + 1] - bounds[i], []).append(i)
    for length, members in by_length.items():
        spans = [slice(bounds[i], bounds[i] + length) for i in members]
        member_slots = torch.tensor([slots[i] for i in members])
        starts = has_initial_state[members].reshape(-1, 1, 1)
        initial = torch.where(starts, conv_states[member_slots], torch.zeros((), dtype=conv_states.dtype))
        y, final = ref.causal_conv1d(torch.stack([x[:, span] for span in spans]), weight, bias,
                                     initial_states=initial, return_final_states=True, activation=activation)
        for span, y_i in zip(spans, y):
            out[:, span] = y_i
        conv_states[member_slots] = final.to(conv_states.dtype)
    return out


def causal_conv1d_update(x, conv_states, weight, bias, silu_activation: bool, cache_seqlens, conv_state_indices,
                         pad_slot_id: int, is_vnni: bool):
    """Decode conv step. x: [N, conv_dim]; conv_states [num_slots, conv_dim, W-1] updated in place for the rows'
    slots; rows whose slot is pad_slot_id are skipped. Returns [N, conv_dim]."""
    _refuse_vnni(is_vnni)
    if cache_seqlens is not None:
        raise ValueError("cache_seqlens (a circular conv buffer) is not supported: pass None")
    if x.dim() != 2:
        raise ValueError(f"x must be [N, conv_dim] (one decode token per row), got shape {tuple(x.shape)}")
    slots = conv_state_indices.masked_fill(conv_state_indices == pad_slot_id, -1)
    return ref.causal_conv1d_update(x, conv_states, weight, bias, "silu" if silu_activation else None, slots)


def chunk_gated_delta_rule(query, key, value, g, beta, initial_state, output_final_state: bool, cu_seqlens,
                           head_first: bool, use_qk_l2norm_in_kernel: bool, initial_state_indices):
    """Prefill over packed sequences ([1, T, H, D] inputs, cu_seqlens [N+1]). Sequence i starts from the pool
    slot initial_state[initial_state_indices[i]] ([num_slots, Hv, V, K]) and its final state is written back
    there. Returns (o [1, T, Hv, V], the pool)."""
    if head_first:
        raise ValueError("head_first=True is not supported: pass [1, T, H, D] inputs (SGLang passes False)")
    slots = initial_state_indices.long()
    o, final = ref.chunk_gated_delta_rule(query, key, value, g, beta,
                                          initial_state=ref.state_from_pool_layout(initial_state[slots]),
                                          output_final_state=True, cu_seqlens=cu_seqlens,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    initial_state[slots] = ref.state_to_pool_layout(final).to(initial_state.dtype)
    return o, initial_state if output_final_state else None


def fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                           initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel: bool,
                                           softplus_beta: float = 1.0, softplus_threshold: float = 20.0):
    """Decode / short-extend recurrent update with the gating fused in. q, k [1, T, H, K]; v [1, T, Hv, V];
    a, b [T, Hv]; sequences packed by cu_seqlens; states read from and written back to
    initial_state_source[initial_state_indices] ([num_slots, Hv, V, K]); negative slots are skipped.
    Returns o [1, T, Hv, V]."""
    g, beta = ref.gdn_gating(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)
    o = torch.zeros_like(v)
    bounds, slots = cu_seqlens.tolist(), initial_state_indices.tolist()
    live = [i for i, slot in enumerate(slots[:len(bounds) - 1]) if slot >= 0]
    if not live:
        return o
    tokens = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in live])
    live_bounds = torch.tensor([0] + [bounds[i + 1] - bounds[i] for i in live]).cumsum(0)
    live_slots = torch.tensor([slots[i] for i in live])
    out, final = ref.recurrent_gated_delta_rule(
        q[:, tokens], k[:, tokens], v[:, tokens], g[None, tokens], beta[None, tokens],
        initial_state=ref.state_from_pool_layout(initial_state_source[live_slots]), output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=live_bounds)
    o[:, tokens] = out
    initial_state_source[live_slots] = ref.state_to_pool_layout(final).to(initial_state_source.dtype)
    return o
