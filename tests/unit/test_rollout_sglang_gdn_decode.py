"""relax.rollout.sglang_gdn_decode's layout glue and launch choice (the engine-level check of the switch is
tests/e2e/test_patches_sglang.py): SGLang's conv state pools in both layouts it allocates, CUDA/CPU
[slots, conv_dim, W-1] and Ascend's window-major [slots, W-1, conv_dim], reach the fused kernel as views and give
the reference's result, pools updated in place, with the tiling gdn_triton.decode_tiling picks (split at small
batches, not at larger ones). Interpreted checks run in a subprocess (TRITON_INTERPRET must be set before the
kernels are decorated)."""

import os
import subprocess
import sys

import pytest
import torch

from relax.kernels import gdn_reference as ref


def check_glue_decode_matches_reference():
    """fused_decode (the glue's kernel call) with the CPU's interpreter record: 1 and 3 rows split each key head's
    group (4 and 2 ways), 5 rows do not; the conv pool is Ascend's window-major one at every batch; two steps each, so the second
    reuses the persistent tickets the first left at zero."""
    from test_kernels_triton import decode_case

    from relax.kernels.gdn_triton import decode_tiling
    from relax.rollout.sglang_gdn_decode import (conv_pool_as_channels_by_taps, fused_decode, launch_for_device,
                                                 tickets_for_device)

    cpu = torch.device("cpu")
    for num_rows, programs_per_group in ((1, 4), (3, 2), (5, 1)):
        case = decode_case("contiguous", num_rows=num_rows)
        assert decode_tiling(num_rows, 2, 4, 12, launch_for_device(cpu)).programs_per_group == programs_per_group
        expected_case = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        conv_dim, width = case["conv_weight"].shape
        window_major = case["conv_state_pool"].transpose(1, 2).contiguous()  # as Ascend's pool holds it
        view = conv_pool_as_channels_by_taps(window_major, conv_dim, width)
        assert view.data_ptr() == window_major.data_ptr()  # a view: the kernel writes the engine's own pool
        for step in range(2):
            out = fused_decode(case["mixed_qkvz"], case["mixed_ba"], view, case["conv_weight"], case["conv_bias"],
                               case["state_pool"], case["slot_indices"], case["A_log"], case["dt_bias"],
                               case["norm_weight"], case["norm_eps"], 2, 16, 12)
            expected = ref.gdn_decode(**expected_case)
            message = f"{num_rows} rows, programs_per_group={programs_per_group}, step {step}"
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=message)
            torch.testing.assert_close(window_major, expected_case["conv_state_pool"].transpose(1, 2), msg=message)
            torch.testing.assert_close(case["state_pool"], expected_case["state_pool"], atol=1e-5, rtol=1e-5,
                                       msg=message)
            assert not tickets_for_device(cpu).any(), f"{message}: tickets must be left at zero"


def test_glue_decode_split_and_unsplit_match_reference_interpreted():
    unit_dir = os.path.dirname(__file__)
    code = (f"import sys; sys.path.insert(0, {unit_dir!r}); "
            "import test_rollout_sglang_gdn_decode as t; t.check_glue_decode_matches_reference()")
    result = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]


def test_conv_pool_layouts_recognised_and_others_refused():
    from relax.rollout.sglang_gdn_decode import conv_pool_as_channels_by_taps

    pool = torch.zeros(5, 24, 3)
    assert conv_pool_as_channels_by_taps(pool, 24, 4) is pool
    assert conv_pool_as_channels_by_taps(pool.transpose(1, 2).contiguous(), 24, 4).shape == (5, 24, 3)
    assert conv_pool_as_channels_by_taps(torch.zeros(5, 24, 5), 24, 4) is None  # a spec-decoding window
    assert conv_pool_as_channels_by_taps(torch.zeros(5, 24), 24, 4) is None


def test_cpu_without_the_interpreter_is_a_clear_error():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("this process runs Triton interpreted")
    from relax.rollout.sglang_gdn_decode import launch_for_device

    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        launch_for_device(torch.device("cpu"))
