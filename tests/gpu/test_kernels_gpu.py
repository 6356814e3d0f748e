"""relax.kernels on a CUDA GPU: the fused decode kernel and relax's chunked training rule vs the torch reference, and
the torch chunked forward vs flash-linear-attention's own chunk kernel. Skipped where there is no GPU (or, for the
fla check, no fla)."""

import pytest
import torch

from relax.kernels import gdn_reference as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HK, HV, K, V, WIDTH = 16, 32, 128, 128, 4  # Qwen3.5-9B's linear-attention layers


def cuda_launch(num_stages=2, num_warps=4):
    from relax.kernels.launch import TritonLaunch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return TritonLaunch(num_programs=sms * 16, options=dict(num_warps=num_warps, num_stages=num_stages))


def decode_case(layout, dtype, rows=6, slots=9, heads_and_dims=(HK, HV, K, V)):
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_k_heads, num_v_heads, head_k_dim, head_v_dim = heads_and_dims
    conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim

    def randn(*shape, scale=1.0, dtype=dtype):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    return dict(
        mixed_qkvz=randn(rows, conv_dim + num_v_heads * head_v_dim), mixed_ba=randn(rows, 2 * num_v_heads),
        conv_state_pool=randn(slots, conv_dim, WIDTH - 1), conv_weight=randn(conv_dim, WIDTH, scale=0.5),
        conv_bias=randn(conv_dim),
        state_pool=randn(slots, num_v_heads, head_v_dim, head_k_dim, scale=0.05, dtype=torch.float32),
        slot_indices=torch.tensor([7, 0, -1, 3, 8, 2][:rows], device="cuda"),
        A_log=randn(num_v_heads, dtype=torch.float32), dt_bias=randn(num_v_heads, dtype=torch.float32),
        norm_weight=randn(head_v_dim, dtype=torch.float32), norm_eps=1e-6,
        num_k_heads=num_k_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim, layout=layout,
    )


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_fused_decode_matches_reference(layout, dtype, tol):
    from relax.kernels.gdn_triton import gdn_decode

    case = decode_case(layout, dtype)
    expected_case = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    out = gdn_decode(**case, launch=cuda_launch(), programs_per_group=4)
    expected = ref.gdn_decode(**expected_case)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(case["state_pool"], expected_case["state_pool"], atol=tol / 10, rtol=tol / 10)
    torch.testing.assert_close(case["conv_state_pool"], expected_case["conv_state_pool"])


@pytest.mark.parametrize("heads_and_dims", [(2, 4, 16, 16), (2, 4, 32, 32), (4, 8, 64, 64), (2, 2, 32, 64)])
@pytest.mark.parametrize("num_warps", [4, 8])
@pytest.mark.parametrize("block_v,programs_per_group", [(16, 1), (16, 2), (8, 4)])
def test_fused_decode_small_heads(heads_and_dims, num_warps, block_v, programs_per_group):
    """Head dims under 128 and 8 warps: conv windows smaller than the program, which Triton may replicate
    across warps (the in-place window shifts wait for every warp's read). Three steps on one ticket buffer."""
    from relax.kernels.gdn_triton import gdn_decode

    case = decode_case("contiguous", torch.float32, heads_and_dims=heads_and_dims)
    expected_case = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    tickets = torch.zeros(6 * case["num_k_heads"], dtype=torch.int32, device="cuda")
    for _ in range(3):
        out = gdn_decode(**case, launch=cuda_launch(num_warps=num_warps), block_v=block_v,
                         programs_per_group=programs_per_group, tickets=tickets)
        torch.testing.assert_close(out, ref.gdn_decode(**expected_case), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(case["state_pool"], expected_case["state_pool"], atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(case["conv_state_pool"], expected_case["conv_state_pool"])


@pytest.mark.parametrize("block_v,programs_per_group,num_stages",
                         [(64, 1, 1), (32, 1, 2), (64, 4, 2), (32, 8, 1), (16, 1, 2)])
def test_fused_decode_many_rows_and_steps(block_v, programs_per_group, num_stages):
    """256 rows x 16 key heads of concurrently finishing groups, three steps in a row on one ticket buffer:
    a race between a group's parts would show up as a mismatch here. num_stages=2 prefetches state tiles."""
    from relax.kernels.gdn_triton import gdn_decode

    case = decode_case("contiguous", torch.float32, rows=256, slots=300)
    case["slot_indices"] = torch.randperm(300, device="cuda")[:256]
    expected_case = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    tickets = torch.zeros(256 * HK, dtype=torch.int32, device="cuda")
    for _ in range(3):
        out = gdn_decode(**case, launch=cuda_launch(num_stages), block_v=block_v,
                         programs_per_group=programs_per_group, tickets=tickets)
        expected = ref.gdn_decode(**expected_case)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(case["state_pool"], expected_case["state_pool"], atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(case["conv_state_pool"], expected_case["conv_state_pool"])
    assert int(tickets.abs().sum()) == 0


@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16, 64])
def test_glue_decode_with_the_platform_tiling_matches_reference(rows):
    """What SGLang's glue runs: the CUDA platform's launch record through decode_tiling (on an H200 each group
    split 16, 8, 4, 2 ways at 1, 2, 4, 8 rows, unsplit from 16 up) with the device's persistent tickets, two
    steps in a row."""
    from relax.kernels.gdn_triton import decode_tiling
    from relax.rollout.sglang_gdn_decode import fused_decode, launch_for_device, tickets_for_device

    device = torch.device("cuda", torch.cuda.current_device())
    case = decode_case("contiguous", torch.float32, rows=rows, slots=rows + 3)
    case["slot_indices"] = torch.randperm(rows + 3, device="cuda")[:rows]
    if rows > 1:
        case["slot_indices"][rows // 2] = -1  # a padding row
    expected_case = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    tiling = decode_tiling(rows, HK, HV, V, launch_for_device(device))
    for step in range(2):
        out = fused_decode(case["mixed_qkvz"], case["mixed_ba"], case["conv_state_pool"], case["conv_weight"],
                           case["conv_bias"], case["state_pool"], case["slot_indices"], case["A_log"],
                           case["dt_bias"], case["norm_weight"], case["norm_eps"], HK, K, V)
        expected = ref.gdn_decode(**expected_case)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5, msg=f"{tiling.describe()}, step {step}")
    torch.testing.assert_close(case["state_pool"], expected_case["state_pool"], atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(case["conv_state_pool"], expected_case["conv_state_pool"])
    assert not tickets_for_device(device).any(), "tickets must be left at zero"


def test_chunk_reference_matches_fla_chunk_kernel():
    fla_gdr = pytest.importorskip("fla.ops.gated_delta_rule")
    gen = torch.Generator(device="cuda").manual_seed(1)
    batch, length, heads, v_heads, dim = 2, 200, 2, 4, 64
    q = torch.randn(batch, length, heads, dim, device="cuda", generator=gen)
    k = torch.randn(batch, length, heads, dim, device="cuda", generator=gen)
    v = torch.randn(batch, length, v_heads, dim, device="cuda", generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(batch, length, v_heads, device="cuda", generator=gen))
    beta = torch.rand(batch, length, v_heads, device="cuda", generator=gen)
    h0 = torch.randn(batch, v_heads, dim, dim, device="cuda", generator=gen) * 0.1
    o, s = ref.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
    fla_o, fla_s = fla_gdr.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    # fla's chunk kernel computes its matmuls in tf32 / bf16-accumulated blocks: looser than fp32.
    torch.testing.assert_close(o, fla_o, atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(s, fla_s, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("dtype_name,tolerance", [("float32", 2e-5), ("bfloat16", 2e-2)])
def test_relax_chunk_rule_matches_the_reference(dtype_name, tolerance):
    """relax's training kernel (relax.kernels.gdn_chunk_triton) against the torch reference at Qwen3.5's head sizes
    (K = V = 128, 4 value heads per key head pair), packed sequences of one token to several chunks with initial
    states: outputs, final states and every input's gradient."""
    from helpers import chunk_rule_case, chunk_rule_outputs_and_gradients

    from relax.kernels import gdn_chunk_triton
    from relax.platform import get_platform

    case = chunk_rule_case([1, 700, 64, 2000, 33], 2, 8, 128, 128, initial=True, gate_scale=1.0,
                           dtype_name=dtype_name, device="cuda")
    out, final, grads = chunk_rule_outputs_and_gradients(gdn_chunk_triton.chunk_gated_delta_rule, case, True,
                                                         launch=get_platform("cuda").triton_launch(0))
    expected_out, expected_final, expected_grads = chunk_rule_outputs_and_gradients(ref.chunk_gated_delta_rule, case,
                                                                                    True)
    torch.testing.assert_close(out, expected_out, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(final, expected_final, atol=tolerance, rtol=tolerance)
    for name, grad in grads.items():
        expected = expected_grads[name]
        error = (grad.float() - expected.float()).abs().max().item() / expected.float().abs().max().item()
        assert error < tolerance, (name, error)
