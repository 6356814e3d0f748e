"""The chunked GDN's backward (autograd through relax.kernels.gdn_reference.chunk_gated_delta_rule, what Megatron's
GatedDeltaNet trains with on the CPU and with --train-gdn-kernel reference) against autograd through the token-by-token
definition in float64, over the gate ranges models produce: g = -exp(A_log) * softplus(a + dt_bias) with A from
a trained model's slow decays up to per-token gates of -1e4 (HF and megatron initialise A in (0, 16) and (1, 16))."""

import pytest
import torch

from relax.kernels import gdn_reference as ref
from relax.kernels.gdn_training import L2NORM_BUCKET_TOKENS, bucketed_l2norm

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


def test_the_mindspeed_kernel_is_mindspeeds_functions_called_with_fla_arguments(monkeypatch):
    """MindSpeed is absent here: stand-in modules at its paths give functions with the signature of MindSpeed
    core_r0.16.0's chunk_gated_delta_rule and l2norm (which refuse float32 q/k/v) and answer with the reference,
    so the check is which functions "mindspeed" names and that relax's GDN call binds to that signature."""
    import inspect
    import sys
    import types

    from relax.kernels.gdn_training import gdn_training_kernel

    calls, normed_lengths = [], []

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64, head_first=False):
        if q.dtype == torch.float32:
            raise ValueError("does not support float32")
        calls.append(inspect.signature(chunk_gated_delta_rule).bind(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens).arguments)
        return ref.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                          output_final_state=output_final_state, cu_seqlens=cu_seqlens)

    def l2norm(x, eps=1e-6, output_dtype=None):
        normed_lengths.append(x.shape[1])
        return ref.l2norm(x)

    for name, attrs in {
        "mindspeed": {}, "mindspeed.core": {}, "mindspeed.core.ssm": {}, "mindspeed.ops": {}, "mindspeed.ops.triton": {},
        "mindspeed.core.ssm.chunk_gated_delta_rule": {"chunk_gated_delta_rule": chunk_gated_delta_rule},
        "mindspeed.ops.triton.l2norm": {"l2norm": l2norm},
    }.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))
    rule, norm = gdn_training_kernel("mindspeed")
    assert rule == chunk_gated_delta_rule  # and norm is MindSpeed's l2norm on bucketed lengths (below)

    # the call of relax's GDN forward (relax/train/model/gdn_spec.py): bf16 q/k/v/beta, float32 g, packed rows
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, 2, 8, generator=generator).bfloat16() for _ in range(3))
    g = -torch.rand(1, 12, 2, generator=generator)
    beta = torch.rand(1, 12, 2, generator=generator).bfloat16()
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)
    out, final = rule(norm(q), norm(k), v, g=g, beta=beta, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, cu_seqlens=cu_seqlens)
    assert out.shape == v.shape and final is None
    assert calls[-1]["cu_seqlens"] is cu_seqlens and calls[-1]["g"] is g
    assert normed_lengths == [L2NORM_BUCKET_TOKENS, L2NORM_BUCKET_TOKENS]


@pytest.mark.parametrize("tokens", [5, 1024, 1500])
def test_bucketed_l2norm_equals_l2norm_and_pads_to_the_bucket(tokens):
    lengths = []

    def l2norm(x):
        lengths.append(x.shape[1])
        return ref.l2norm(x)

    x = torch.randn(1, tokens, 2, 8, generator=torch.Generator().manual_seed(tokens), requires_grad=True)
    got, expected = bucketed_l2norm(l2norm)(x), ref.l2norm(x)
    torch.testing.assert_close(got, expected)
    assert lengths == [-(-tokens // L2NORM_BUCKET_TOKENS) * L2NORM_BUCKET_TOKENS]
    grad = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(expected, x, grad)[0])
