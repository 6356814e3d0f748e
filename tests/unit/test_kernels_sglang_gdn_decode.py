"""relax.kernels.sglang_gdn_decode's layout glue and launch choice (the engine-level check of the switch is
tests/e2e/test_patches_sglang.py): SGLang's conv state pools in both layouts it allocates, CUDA/CPU
[slots, conv_dim, W-1] and Ascend's window-major [slots, W-1, conv_dim], reach the fused kernel as views and give
the reference's result, pools updated in place. Interpreted checks run in a subprocess (TRITON_INTERPRET must be
set before the kernels are decorated)."""

import os
import subprocess
import sys

import pytest
import torch

from relax.kernels import gdn_reference as ref


def check_window_major_conv_pool():
    from test_kernels_triton import decode_case

    from relax.kernels.gdn_triton import gdn_decode
    from relax.kernels.sglang_gdn_decode import conv_pool_as_channels_by_taps, launch_for_device

    case = decode_case("contiguous")
    expected_case = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    conv_dim, width = case["conv_weight"].shape
    window_major = case.pop("conv_state_pool").transpose(1, 2).contiguous()  # as Ascend's pool holds it
    view = conv_pool_as_channels_by_taps(window_major, conv_dim, width)
    assert view.data_ptr() == window_major.data_ptr()  # a view: the kernel writes the engine's own pool
    launch = launch_for_device(torch.device("cpu"))
    out = gdn_decode(**case, conv_state_pool=view, launch=launch)
    expected = ref.gdn_decode(**expected_case)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(window_major, expected_case["conv_state_pool"].transpose(1, 2))
    torch.testing.assert_close(case["state_pool"], expected_case["state_pool"], atol=1e-5, rtol=1e-5)


def test_window_major_conv_pool_matches_reference_interpreted():
    unit_dir = os.path.dirname(__file__)
    code = (f"import sys; sys.path.insert(0, {unit_dir!r}); "
            "import test_kernels_sglang_gdn_decode as t; t.check_window_major_conv_pool()")
    result = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]


def test_conv_pool_layouts_recognised_and_others_refused():
    from relax.kernels.sglang_gdn_decode import conv_pool_as_channels_by_taps

    pool = torch.zeros(5, 24, 3)
    assert conv_pool_as_channels_by_taps(pool, 24, 4) is pool
    assert conv_pool_as_channels_by_taps(pool.transpose(1, 2).contiguous(), 24, 4).shape == (5, 24, 3)
    assert conv_pool_as_channels_by_taps(torch.zeros(5, 24, 5), 24, 4) is None  # a spec-decoding window
    assert conv_pool_as_channels_by_taps(torch.zeros(5, 24), 24, 4) is None


def test_cpu_without_the_interpreter_is_a_clear_error():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("this process runs Triton interpreted")
    from relax.kernels.sglang_gdn_decode import launch_for_device

    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        launch_for_device(torch.device("cpu"))
