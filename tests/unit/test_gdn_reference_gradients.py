"""The chunked GDN's backward (autograd through relax.kernels.gdn_reference.chunk_gated_delta_rule, what Megatron's
GatedDeltaNet trains with on the CPU and with --train-gdn-kernel reference) against autograd through the token-by-token
definition in float64, over the gate ranges models produce: g = -exp(A_log) * softplus(a + dt_bias) with A from
a trained model's slow decays up to per-token gates of -1e4 (HF and megatron initialise A in (0, 16) and (1, 16))."""

import pytest
import torch

from relax.kernels import gdn_reference as ref

LENGTH, CHUNK = 100, 32  # three whole chunks and a partial one


def recurrent_float64(q, k, v, g, beta):
    """The gated delta rule token by token in float64: q, k [T, H, K] (l2-normalised here), v [T, H, V],
    g, beta [T, H]."""
    q, k = ref.l2norm(q.double()), ref.l2norm(k.double())
    q = q * q.shape[-1] ** -0.5
    state = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=torch.float64)
    outputs = []
    for t in range(q.shape[0]):
        state = state * g[t].double().exp()[:, None, None]
        delta = beta[t].double()[:, None] * (v[t].double() - torch.einsum("hkv,hk->hv", state, k[t]))
        state = state + k[t][:, :, None] * delta[:, None, :]
        outputs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(outputs)


@pytest.mark.parametrize("a_range, a_scale", [
    ((0.01, 0.1), 1.0),  # slow decays, g about -0.1
    ((1e-3, 16.0), 1.0),  # HF's initialisation, g down to about -50
    ((16.0, 100.0), 1.0),  # g down to about -300
    ((1e-4, 1e3), 5.0),  # per-token gates from -1e-4 to -1e4 in one head: chunk sums of -1e5
])
def test_chunk_backward_equals_float64_recurrent_backward(a_range, a_scale):
    generator = torch.Generator().manual_seed(1)
    heads, value_heads, dim = 1, 2, 16
    q, k = (torch.randn(1, LENGTH, heads, dim, generator=generator) for _ in range(2))
    v = torch.randn(1, LENGTH, value_heads, dim, generator=generator)
    A_log = torch.empty(value_heads).uniform_(*a_range, generator=generator).log()
    a = torch.randn(1, LENGTH, value_heads, generator=generator) * a_scale
    b = torch.randn(1, LENGTH, value_heads, generator=generator)
    dt_bias = torch.ones(value_heads)
    weights = torch.randn(1, LENGTH, value_heads, dim, generator=generator, dtype=torch.float64)

    def gradients(chunked: bool):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, A_log, a, b, dt_bias)]
        q_, k_, v_, A_log_, a_, b_, dt_bias_ = leaves
        g, beta = ref.gdn_gating(A_log_, a_, b_, dt_bias_)
        if chunked:
            o, _ = ref.chunk_gated_delta_rule(q_, k_, v_, g, beta, use_qk_l2norm_in_kernel=True, chunk_size=CHUNK)
        else:  # value heads read their key head, as the chunked form does
            repeat = value_heads // heads
            o = recurrent_float64(q_[0].repeat_interleave(repeat, 1), k_[0].repeat_interleave(repeat, 1), v_[0],
                                  g[0], beta[0])[None]
        return o.double(), torch.autograd.grad((o.double() * weights).sum(), leaves)

    out, grads = gradients(chunked=True)
    expected_out, expected_grads = gradients(chunked=False)
    torch.testing.assert_close(out, expected_out, atol=1e-5 * expected_out.abs().max().item(), rtol=0)
    for name, grad, expected in zip(("q", "k", "v", "A_log", "a", "b", "dt_bias"), grads, expected_grads):
        assert torch.isfinite(grad).all(), name
        error = (grad.double() - expected).abs().max().item() / expected.abs().max().item()
        assert error < 1e-5, (name, error)
