"""Triton kernels of relax.kernels.gdn_triton against their torch references, on CPU via TRITON_INTERPRET=1.

Each check runs in its own interpreter subprocess: TRITON_INTERPRET must be set before a kernel is decorated, and
setting it in the pytest process would turn every later-imported Triton kernel (SGLang's too) into interpreted ones.
"""

import os
import subprocess
import sys

import pytest
import torch

from relax.kernels import gdn_reference as ref


def decode_case(layout, num_rows=3, hk=2, hv=4, dk=16, dv=12, width=4, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    conv_dim = 2 * hk * dk + hv * dv
    return dict(
        mixed_qkvz=torch.randn(num_rows, conv_dim + hv * dv, generator=gen),
        mixed_ba=torch.randn(num_rows, 2 * hv, generator=gen),
        conv_state_pool=torch.randn(5, conv_dim, width - 1, generator=gen),
        conv_weight=torch.randn(conv_dim, width, generator=gen),
        conv_bias=torch.randn(conv_dim, generator=gen) if bias else None,
        state_pool=torch.randn(5, hv, dv, dk, generator=gen) * 0.1,
        slot_indices=torch.tensor([3, -1, 0, 4, 1][:num_rows]),
        A_log=torch.randn(hv, generator=gen), dt_bias=torch.randn(hv, generator=gen),
        norm_weight=torch.randn(dv, generator=gen), norm_eps=1e-6,
        num_k_heads=hk, head_k_dim=dk, head_v_dim=dv, layout=layout,
    )


def check_fused_decode(layout, bias, block_v, hv):
    from relax.kernels.gdn_triton import gdn_decode
    from relax.kernels.launch import TritonLaunch

    # 3 rows x 2 key heads on 4 programs, so programs loop over items; a key-head group in one program, and
    # spread over programs (one value head and every other value tile each).
    for num_programs, programs_per_group in ((4, 1), (4, 2 * (hv // 2))):
        case = decode_case(layout, hv=hv, bias=bias)
        expected_case = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        tickets = torch.zeros(8, dtype=torch.int32)
        out = gdn_decode(**case, launch=TritonLaunch(num_programs=num_programs), block_v=block_v,
                         programs_per_group=programs_per_group, tickets=tickets)
        expected = ref.gdn_decode(**expected_case)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(case["state_pool"], expected_case["state_pool"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(case["conv_state_pool"], expected_case["conv_state_pool"])
        assert torch.equal(tickets, torch.zeros(8, dtype=torch.int32)), "tickets must be left at zero"


def check_simple_ops():
    from relax.kernels import gdn_triton
    from relax.kernels.launch import TritonLaunch

    launch = TritonLaunch(num_programs=3)
    gen = torch.Generator().manual_seed(1)
    dim, width = 40, 4
    x = torch.randn(4, dim + 8, generator=gen)[:, :dim]  # strided rows, as a slice of a projection
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    pool = torch.randn(6, dim, width - 1, generator=gen)
    expected_pool = pool.clone()
    slots = torch.tensor([5, -1, 0, 2])
    y = gdn_triton.causal_conv1d_update(x, pool, weight, bias, "silu", slots, launch, block_channels=16)
    expected = ref.causal_conv1d_update(x, expected_pool, weight, bias, "silu", slots)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(pool, expected_pool)

    A_log, dt_bias = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    ab = torch.randn(5, 12, generator=gen) * 15  # crosses softplus's threshold
    g, beta = gdn_triton.gdn_gating(A_log, ab[:, 6:], ab[:, :6], dt_bias, launch)
    g_ref, beta_ref = ref.gdn_gating(A_log, ab[:, 6:], ab[:, :6], dt_bias)
    torch.testing.assert_close(g, g_ref)
    torch.testing.assert_close(beta, beta_ref)

    x, z, w = torch.randn(3, 4, 12, generator=gen), torch.randn(3, 4, 12, generator=gen), torch.randn(12)
    torch.testing.assert_close(gdn_triton.gated_rms_norm(x, z, w, 1e-6, launch), ref.gated_rms_norm(x, z, w, 1e-6))


def run_interpreted(check, *args, module=__name__):
    """Run `module`'s function `check`(*args) in a subprocess with TRITON_INTERPRET=1 (a test module beside this
    one, which may import tests/helpers.py); fail with its stderr."""
    here = os.path.dirname(__file__)
    code = (f"import sys; sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]; "
            f"import {module.rsplit('.', 1)[-1]} as t; t.{check}(*{args!r})")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]


# V = 12 is not a power of two: tiles of 4 and 8 leave masked tails; 6 value heads on 2 key heads is a ratio of 3.
@pytest.mark.parametrize("layout,bias,block_v,hv", [("contiguous", True, 4, 4), ("interleaved", False, 8, 6)])
def test_fused_decode_matches_reference_interpreted(layout, bias, block_v, hv):
    run_interpreted("check_fused_decode", layout, bias, block_v, hv)


def test_conv_update_gating_and_gated_norm_match_references_interpreted():
    run_interpreted("check_simple_ops")


def test_fused_decode_rejects_a_pool_in_hf_layout():
    from relax.kernels.gdn_triton import gdn_decode
    from relax.kernels.launch import TritonLaunch

    case = decode_case("contiguous")
    case["state_pool"] = ref.state_from_pool_layout(case["state_pool"])  # [slots, Hv, K, V]
    with pytest.raises(ValueError, match="pool layout"):
        gdn_decode(**case, launch=TritonLaunch(num_programs=1))


# decode_tiling, the launch policy: (rows) -> (block_v, programs_per_group, num_stages) with the CUDA platform's
# record of an H200 (132 SMs) at Qwen3.5-9B's shape; docs/benchmarks.md ("GDN decode (H200)") times each choice
# against the policy's other candidates.
H200_TILINGS = {1: (16, 16, 2), 2: (32, 8, 2), 4: (32, 4, 2), 8: (32, 2, 2), 16: (32, 1, 2), 32: (32, 1, 2),
                64: (32, 1, 2), 128: (32, 1, 2), 256: (32, 1, 2)}


@pytest.mark.parametrize("rows", sorted(H200_TILINGS))
def test_decode_tiling_on_an_h200_splits_small_batches_only(rows):
    from relax.kernels.gdn_triton import decode_tiling
    from relax.kernels.launch import triton_launch

    launch = triton_launch("nvidia", 132)
    tiling = decode_tiling(rows, 16, 32, 128, launch)
    assert (tiling.block_v, tiling.programs_per_group, tiling.launch.options["num_stages"]) == H200_TILINGS[rows]
    assert tiling.launch.num_programs == launch.num_programs and tiling.launch.options["num_warps"] == 4


@pytest.mark.parametrize("hk,hv,dv", [(16, 32, 128), (2, 4, 12), (4, 4, 64), (8, 24, 256), (1, 1, 8)])
def test_decode_tiling_choices_are_valid_kernel_arguments(hk, hv, dv):
    from relax.kernels.gdn_triton import decode_tiling
    from relax.kernels.launch import TritonLaunch, triton_launch

    small = TritonLaunch(num_programs=4, decode_block_v=8, decode_split_items=8, decode_split_min_block_v=4)
    for launch in (triton_launch("nvidia", 132), triton_launch("nvidia", 8), small):
        previous_parts = None
        for rows in range(1, 300):
            tiling = decode_tiling(rows, hk, hv, dv, launch)
            parts, block_v = tiling.programs_per_group, tiling.block_v
            assert block_v & (block_v - 1) == 0
            if parts == 1:
                assert block_v == launch.decode_block_v and tiling.launch == launch
                continue
            splits = parts // (hv // hk)
            assert parts % (hv // hk) == 0 and splits <= -(-dv // block_v), "more parts than value tiles"
            assert launch.decode_split_min_block_v <= block_v <= launch.decode_block_v
            assert rows * hk <= rows * hk * parts <= launch.decode_split_items, "tickets buffer too small"
            assert previous_parts is None or parts <= previous_parts, "more rows must not split more"
            assert tiling.launch.options == {**launch.options, **launch.decode_split_options}
            previous_parts = parts


def test_decode_tiling_never_splits_with_the_default_record():
    """The Ascend tuning keeps TritonLaunch's defaults: 64-row tiles, one program per key head's group."""
    from relax.kernels.gdn_triton import decode_tiling
    from relax.kernels.launch import TritonLaunch, triton_launch

    launch = triton_launch("ascend", 48)
    assert launch == TritonLaunch(num_programs=48)
    for rows in (1, 2, 64):
        tiling = decode_tiling(rows, 16, 32, 128, launch)
        assert (tiling.block_v, tiling.programs_per_group, tiling.launch) == (64, 1, launch)


def test_split_tiling_rejects_a_split_that_is_not_a_power_of_two():
    from relax.kernels.gdn_triton import split_tiling
    from relax.kernels.launch import triton_launch

    with pytest.raises(ValueError, match="power of two"):
        split_tiling(3, 16, 32, 128, triton_launch("nvidia", 132))
