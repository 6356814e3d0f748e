"""relax.kernels.gdn_sglang_ops: the sgl_kernel CPU op semantics, checked against HF modules and the references."""

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

from relax.kernels import gdn_reference as ref
from relax.kernels import gdn_sglang_ops as ops

TOL = dict(atol=2e-5, rtol=2e-5)


def test_fused_sigmoid_mul_is_in_place_and_reads_a_strided_gate():
    x = torch.randn(3, 4 * 8)
    q_gate = torch.randn(3, 4, 16)
    gate = q_gate[..., 8:]  # strided [N, H, D] view, as Qwen3.5's attention hands it over
    expected = x * gate.reshape(3, -1).sigmoid()
    ops.fused_sigmoid_mul(x, gate)
    torch.testing.assert_close(x, expected)


def test_fused_qk_gemma_rmsnorm_matches_hf_qwen3_5_rmsnorm():
    q_norm, k_norm = Qwen3_5RMSNorm(16), Qwen3_5RMSNorm(16)
    q_norm.weight.data, k_norm.weight.data = torch.randn(16), torch.randn(16)
    q, k = torch.randn(3, 4 * 16), torch.randn(3, 2 * 16)
    q_out, k_out = ops.fused_qk_gemma_rmsnorm(q, k, q_norm.weight, k_norm.weight, 1e-6, 16)
    torch.testing.assert_close(q_out, q_norm(q.reshape(-1, 16)).detach())
    torch.testing.assert_close(k_out, k_norm(k.reshape(-1, 16)).detach())

    q_gate = torch.randn(3, 4 * 2 * 16)  # per head [q | gate]
    q_out, k_out, gate_out = ops.fused_qk_gemma_rmsnorm_with_gate(q_gate, k, q_norm.weight, k_norm.weight, 1e-6,
                                                                  16, 4)
    per_head = q_gate.reshape(3, 4, 32)
    torch.testing.assert_close(q_out, q_norm(per_head[..., :16].reshape(-1, 16)).detach())
    torch.testing.assert_close(gate_out, per_head[..., 16:].reshape(-1, 16))
    torch.testing.assert_close(k_out, k_norm(k.reshape(-1, 16)).detach())


def test_fused_gdn_gating_shapes_and_values():
    A_log, dt_bias, a, b = torch.randn(4), torch.randn(4), torch.randn(5, 4), torch.randn(5, 4)
    g, beta = ops.fused_gdn_gating(A_log, a, b, dt_bias)
    assert g.shape == beta.shape == (1, 5, 4) and g.dtype == beta.dtype == torch.float32
    torch.testing.assert_close(g[0], ref.gdn_gating(A_log, a, b, dt_bias)[0])


def test_causal_conv1d_fwd_packed_sequences_with_and_without_initial_state():
    dim, width = 6, 4
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    x = torch.randn(dim, 10)
    query_start_loc = torch.tensor([0, 2, 7, 10])
    cache_indices = torch.tensor([3, 0, -1])  # the third sequence is padding
    has_initial_state = torch.tensor([True, False, True])
    pool = torch.randn(4, dim, width - 1)
    before = pool.clone()
    out = ops.causal_conv1d_fwd(x, weight, bias, pool, query_start_loc, cache_indices, has_initial_state, True, -1,
                                False)
    y0, s0 = ref.causal_conv1d(x[None, :, 0:2], weight, bias, before[3:4], True, "silu")
    y1, s1 = ref.causal_conv1d(x[None, :, 2:7], weight, bias, None, True, "silu")
    torch.testing.assert_close(out[:, 0:2], y0[0])
    torch.testing.assert_close(out[:, 2:7], y1[0])
    assert torch.equal(out[:, 7:], torch.zeros(dim, 3))
    torch.testing.assert_close(pool[3], s0[0])
    torch.testing.assert_close(pool[0], s1[0])
    assert torch.equal(pool[1:3], before[1:3])
    with pytest.raises(ValueError, match="is_vnni"):
        ops.causal_conv1d_fwd(x, weight, bias, pool, query_start_loc, cache_indices, has_initial_state, True, -1,
                              True)


def test_causal_conv1d_fwd_equal_length_sequences_batched_with_their_own_states():
    dim, width = 6, 4
    weight = torch.randn(dim, width)
    x = torch.randn(dim, 9)
    query_start_loc = torch.tensor([0, 3, 6, 9])  # three sequences of 3 tokens: one call
    cache_indices, has_initial_state = torch.tensor([2, 0, 1]), torch.tensor([True, False, True])
    pool = torch.randn(3, dim, width - 1)
    before = pool.clone()
    out = ops.causal_conv1d_fwd(x, weight, None, pool, query_start_loc, cache_indices, has_initial_state, False, -1,
                                False)
    for start, slot, has_initial in ((0, 2, True), (3, 0, False), (6, 1, True)):
        initial = before[slot:slot + 1] if has_initial else None
        y, final = ref.causal_conv1d(x[None, :, start:start + 3], weight, None, initial, True, None)
        torch.testing.assert_close(out[:, start:start + 3], y[0])
        torch.testing.assert_close(pool[slot], final[0])


def test_causal_conv1d_update_skips_pad_slot_rows():
    dim, width = 6, 3
    weight = torch.randn(dim, width)
    pool = torch.randn(4, dim, width - 1)
    expected_pool = pool.clone()
    x = torch.randn(2, dim)
    out = ops.causal_conv1d_update(x, pool, weight, None, True, None, torch.tensor([2, -1]), -1, False)
    expected = ref.causal_conv1d_update(x[:1], expected_pool, weight, None, "silu", torch.tensor([2]))
    torch.testing.assert_close(out[:1], expected)
    assert torch.equal(out[1], torch.zeros(dim)) and torch.equal(pool, expected_pool)


def gdn_inputs(length, heads=2, v_heads=4, dk=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, length, heads, dk, generator=gen)
    k = torch.randn(1, length, heads, dk, generator=gen)
    v = torch.randn(1, length, v_heads, dv, generator=gen)
    a, b = torch.randn(length, v_heads, generator=gen), torch.randn(length, v_heads, generator=gen)
    return q, k, v, a, b


def test_chunk_gated_delta_rule_reads_and_writes_pool_slots():
    q, k, v, a, b = gdn_inputs(9)
    A_log, dt_bias = torch.randn(4), torch.randn(4)
    g, beta = ops.fused_gdn_gating(A_log, a, b, dt_bias)
    pool = torch.randn(5, 4, 6, 8) * 0.1
    initial = pool.clone()
    cu = torch.tensor([0, 4, 9])
    slots = torch.tensor([4, 1])
    o, returned = ops.chunk_gated_delta_rule(q, k, v, g, beta, pool, True, cu, False, True, slots)
    assert returned is pool
    for n, (start, end) in enumerate([(0, 4), (4, 9)]):
        o_n, s_n = ref.recurrent_gated_delta_rule(
            q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end], beta[:, start:end],
            initial_state=ref.state_from_pool_layout(initial[slots[n]][None]), output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[:, start:end], o_n, **TOL)
        torch.testing.assert_close(pool[slots[n]], ref.state_to_pool_layout(s_n[0]), **TOL)
    assert torch.equal(pool[[0, 2, 3]], initial[[0, 2, 3]])


def test_fused_sigmoid_gating_delta_rule_update_is_the_pooled_decode_step():
    q, k, v, a, b = gdn_inputs(3, seed=1)
    A_log, dt_bias = torch.randn(4), torch.randn(4)
    pool = torch.randn(6, 4, 6, 8) * 0.1
    expected_pool = pool.clone()
    slots = torch.tensor([5, -1, 2])
    o = ops.fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, pool, slots, torch.arange(4),
                                                   True)
    g, beta = ref.gdn_gating(A_log, a, b, dt_bias)
    expected = ref.gated_delta_rule_decode(q[0], k[0], v[0], g, beta, expected_pool, slots)
    torch.testing.assert_close(o[0], expected, **TOL)
    torch.testing.assert_close(pool, expected_pool, **TOL)
