"""relax.kernels.gdn_reference against its own naive definitions and HF transformers' GDN implementations."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from relax.kernels import gdn_reference as ref

TOL = dict(atol=2e-5, rtol=2e-5)


def make_inputs(batch, length, heads, v_heads, dk, dv, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, dk, generator=gen)
    k = torch.randn(batch, length, heads, dk, generator=gen)
    v = torch.randn(batch, length, v_heads, dv, generator=gen)
    g = -F.softplus(torch.randn(batch, length, v_heads, generator=gen))  # log decay, <= 0
    beta = torch.rand(batch, length, v_heads, generator=gen)
    h0 = torch.randn(batch, v_heads, dk, dv, generator=gen) * 0.1
    tensors = [q, k, v, g, beta, h0]
    for t in tensors:
        t.requires_grad_(requires_grad)
    return tensors


@pytest.mark.parametrize("length,chunk_size", [(1, 16), (37, 16), (64, 64)])
def test_chunk_equals_naive_recurrent(length, chunk_size):
    q, k, v, g, beta, h0 = make_inputs(2, length, 2, 4, 8, 6)
    o_c, s_c = ref.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True, chunk_size=chunk_size)
    o_r, s_r = ref.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o_c, o_r, **TOL)
    torch.testing.assert_close(s_c, s_r, **TOL)


def test_chunk_and_recurrent_match_hf_torch_implementations():
    q, k, v, g, beta, h0 = make_inputs(2, 45, 2, 4, 16, 8, seed=1)
    q_rep, k_rep = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)  # HF repeats before its call
    hf_o, hf_s = hf.torch_chunk_gated_delta_rule(q_rep, k_rep, v, g, beta, chunk_size=16, initial_state=h0,
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = ref.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, chunk_size=16)
    torch.testing.assert_close(o, hf_o, **TOL)
    torch.testing.assert_close(s, hf_s, **TOL)
    hf_o, hf_s = hf.torch_recurrent_gated_delta_rule(q_rep, k_rep, v, g, beta, initial_state=h0,
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = ref.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, hf_o, **TOL)
    torch.testing.assert_close(s, hf_s, **TOL)


def test_varlen_cu_seqlens_equals_separate_sequences():
    q, k, v, g, beta, h0 = make_inputs(1, 30, 2, 2, 8, 8, seed=2)
    h0 = torch.cat([h0, h0 * 2])
    cu = torch.tensor([0, 11, 30])
    o, s = ref.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                      chunk_size=8)
    for n, (start, end) in enumerate([(0, 11), (11, 30)]):
        part = [t[:, start:end] for t in (q, k, v, g, beta)]
        o_n, s_n = ref.recurrent_gated_delta_rule(*part, initial_state=h0[n:n + 1], output_final_state=True)
        torch.testing.assert_close(o[:, start:end], o_n, **TOL)
        torch.testing.assert_close(s[n:n + 1], s_n, **TOL)
    with pytest.raises(ValueError, match="batch dim must be 1"):
        ref.chunk_gated_delta_rule(q.expand(2, -1, -1, -1), k, v, g, beta, cu_seqlens=cu)


def test_chunk_backward_matches_recurrent_backward():
    inputs = make_inputs(1, 20, 1, 2, 4, 4, seed=3, requires_grad=True)
    weights = torch.randn(1, 20, 2, 4)
    grads = []
    for fn in (ref.chunk_gated_delta_rule, ref.recurrent_gated_delta_rule):
        extra = {"chunk_size": 8} if fn is ref.chunk_gated_delta_rule else {}
        o, s = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True, use_qk_l2norm_in_kernel=True,
                  **extra)
        loss = (o * weights).sum() + s.pow(2).sum()
        grads.append(torch.autograd.grad(loss, inputs))
    for chunk_grad, recurrent_grad in zip(*grads):
        torch.testing.assert_close(chunk_grad, recurrent_grad, atol=1e-4, rtol=1e-4)


def test_l2norm_gating_and_gated_norm_match_hf():
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(ref.l2norm(x), hf.l2norm(x, dim=-1, eps=1e-6))
    A_log, dt_bias = torch.randn(4), torch.randn(4)
    a = torch.randn(6, 4) * 15  # crosses softplus's threshold of 20 for some entries
    b = torch.randn(6, 4)
    g, beta = ref.gdn_gating(A_log, a, b, dt_bias)
    torch.testing.assert_close(g, -A_log.exp() * F.softplus(a + dt_bias))
    torch.testing.assert_close(beta, b.sigmoid())
    norm = hf.Qwen3NextRMSNormGated(16, eps=1e-6)
    norm.weight.data = torch.randn(16)
    z = torch.randn(3, 5, 16)
    torch.testing.assert_close(ref.gated_rms_norm(x, z, norm.weight.data, 1e-6), norm(x, z).detach())


def test_causal_conv1d_matches_hf_and_carries_state():
    x = torch.randn(2, 12, 9)
    weight, bias = torch.randn(12, 4), torch.randn(12)
    y = ref.causal_conv1d(x, weight, bias, activation="silu")
    torch.testing.assert_close(y, hf.causal_conv1d_fn(x, weight, bias, activation="silu"))
    y1, state = ref.causal_conv1d(x[..., :2], weight, bias, activation="silu", return_final_states=True)
    y2 = ref.causal_conv1d(x[..., 2:], weight, bias, initial_states=state, activation="silu")
    torch.testing.assert_close(torch.cat([y1, y2], -1), y)


def test_causal_conv1d_update_over_slot_pool_matches_hf():
    dim, width = 12, 4
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    hf_state = torch.randn(3, dim, width)
    pool = torch.zeros(5, dim, width - 1)
    slots = torch.tensor([4, -1, 1, 0])  # row 1 is padding
    live = torch.tensor([0, 2, 3])
    pool[slots[live]] = ref.conv_state_from_hf(hf_state)
    untouched = pool[2].clone()
    x = torch.randn(4, dim)
    y = ref.causal_conv1d_update(x, pool, weight, bias, "silu", slots)
    hf_y = hf.causal_conv1d_update(x[live].unsqueeze(-1), hf_state, weight, bias, "silu").squeeze(-1)
    torch.testing.assert_close(y[live], hf_y)
    torch.testing.assert_close(pool[slots[live]], ref.conv_state_from_hf(hf_state))
    assert torch.equal(y[1], torch.zeros(dim)) and torch.equal(pool[2], untouched)


def tiny_next_config(**overrides):
    from transformers import Qwen3NextConfig

    fields = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1,
                  layer_types=["linear_attention"], rms_norm_eps=1e-6)
    fields.update(overrides)
    return Qwen3NextConfig(**fields)


def test_split_qkvzba_interleaved_matches_hf_qwen3_next():
    layer = hf.Qwen3NextGatedDeltaNet(tiny_next_config(), layer_idx=0)
    qkvz, ba = torch.randn(2, 3, layer.in_proj_qkvz.out_features), torch.randn(2, 3, 8)
    q, k, v, z, b, a = layer.fix_query_key_value_ordering(qkvz, ba)
    mixed_qkv, z2, b2, a2 = ref.split_qkvzba(qkvz, ba, 2, 4, 8, 6, "interleaved")
    expected = torch.cat([t.reshape(2, 3, -1) for t in (q, k, v)], -1)
    for got, want in [(mixed_qkv, expected), (z2, z), (b2, b), (a2, a)]:
        assert torch.equal(got, want)


def test_split_qkvzba_contiguous_is_qwen3_5_separate_projections():
    q, k, v, z = torch.randn(3, 16), torch.randn(3, 16), torch.randn(3, 24), torch.randn(3, 24)
    b, a = torch.randn(3, 4), torch.randn(3, 4)
    mixed_qkv, z2, b2, a2 = ref.split_qkvzba(torch.cat([q, k, v, z], -1), torch.cat([b, a], -1), 2, 4, 8, 6,
                                             "contiguous")
    assert torch.equal(mixed_qkv, torch.cat([q, k, v], -1)) and torch.equal(z2, z.reshape(3, 4, 6))
    assert torch.equal(b2, b) and torch.equal(a2, a)
    with pytest.raises(ValueError, match="layout"):
        ref.split_qkvzba(torch.cat([q, k, v, z], -1), torch.cat([b, a], -1), 2, 4, 8, 6, "packed")


def test_gdn_decode_matches_hf_qwen3_next_decode_path():
    """One decode step of HF's Qwen3NextGatedDeltaNet, assembled from its own functions, vs gdn_decode."""
    torch.manual_seed(4)
    layer = hf.Qwen3NextGatedDeltaNet(tiny_next_config(), layer_idx=0)
    layer.norm.weight.data = torch.randn(6)
    n, hk, hv, dk, dv = 3, 2, 4, 8, 6
    qkvz, ba = torch.randn(n, layer.in_proj_qkvz.out_features), torch.randn(n, 2 * hv)
    hf_conv = torch.randn(n, layer.conv_dim, 4)
    hf_state = torch.randn(n, hv, dk, dv) * 0.1
    slots = torch.tensor([2, 0, 5])
    conv_pool, state_pool = torch.zeros(6, layer.conv_dim, 3), torch.zeros(6, hv, dv, dk)
    conv_pool[slots], state_pool[slots] = ref.conv_state_from_hf(hf_conv), ref.state_to_pool_layout(hf_state)

    q, k, v, z, b, a = layer.fix_query_key_value_ordering(qkvz[:, None], ba[:, None])
    mixed = torch.cat([t.reshape(n, 1, -1) for t in (q, k, v)], -1).transpose(1, 2)
    weight = layer.conv1d.weight.squeeze(1).detach()
    mixed = hf.causal_conv1d_update(mixed, hf_conv, weight, None, "silu").transpose(1, 2)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], -1)
    g = -layer.A_log.exp() * F.softplus(a + layer.dt_bias)
    o, new_state = hf.torch_recurrent_gated_delta_rule(
        q.reshape(n, 1, hk, dk).repeat_interleave(2, 2), k.reshape(n, 1, hk, dk).repeat_interleave(2, 2),
        v.reshape(n, 1, hv, dv), g, b.sigmoid(), initial_state=hf_state, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    expected = layer.norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(n, hv, dv).detach()

    with torch.no_grad():
        out = ref.gdn_decode(qkvz, ba, conv_pool, weight, None, state_pool, slots, layer.A_log, layer.dt_bias,
                             layer.norm.weight, 1e-6, hk, dk, dv, "interleaved")
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(state_pool[slots], ref.state_to_pool_layout(new_state.detach()), **TOL)
    torch.testing.assert_close(conv_pool[slots], ref.conv_state_from_hf(hf_conv))


def test_equal_length_sequences_run_together_yet_stay_separate():
    # lengths 5, 4, 5, 6: the two of length 5 share one call (heads stacked); each keeps its own state
    q, k, v, g, beta, h0 = make_inputs(1, 20, 2, 4, 8, 8, seed=3)
    h0 = torch.cat([h0 * (n + 1) for n in range(4)])
    cu = torch.tensor([0, 5, 9, 14, 20])
    for forward in (ref.chunk_gated_delta_rule, ref.recurrent_gated_delta_rule):
        o, s = forward(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        for n, (start, end) in enumerate(zip(cu.tolist()[:-1], cu.tolist()[1:])):
            part = [t[:, start:end] for t in (q, k, v, g, beta)]
            o_n, s_n = ref.recurrent_gated_delta_rule(*part, initial_state=h0[n:n + 1], output_final_state=True)
            torch.testing.assert_close(o[:, start:end], o_n, **TOL)
            torch.testing.assert_close(s[n:n + 1], s_n, **TOL)
