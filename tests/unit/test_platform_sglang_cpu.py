"""The CPU platform's SGLang pieces: the sgl_kernel stand-in, its torch ops, the torchvision placeholder."""

import subprocess
import sys
import textwrap
import types

import pytest
import torch

from relax.platform.sgl_kernel_cpu_ops import assign_req_to_token_pool_cpu


def test_assign_req_to_token_pool_writes_each_requests_slots_into_its_row():
    req_to_token = torch.zeros(4, 8, dtype=torch.int32)
    # request in row 2 gets positions 1..3, request in row 0 gets positions 5..6
    out_cache_loc = torch.tensor([11, 12, 13, 21, 22], dtype=torch.int64)
    assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), req_to_token, torch.tensor([1, 5]), torch.tensor([4, 7]), out_cache_loc, 8
    )
    expected = torch.zeros(4, 8, dtype=torch.int32)
    expected[2, 1:4] = torch.tensor([11, 12, 13])
    expected[0, 5:7] = torch.tensor([21, 22])
    assert torch.equal(req_to_token, expected)
    with pytest.raises(ValueError, match="pool_len 9"):
        assign_req_to_token_pool_cpu(torch.tensor([0]), req_to_token, torch.tensor([0]), torch.tensor([1]),
                                     out_cache_loc, 9)


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120
    )


def test_stand_ins_serve_registered_ops_and_name_the_missing_ones():
    result = _run(
        """
        import os, subprocess, sys
        import torch
        from relax.platform import get_platform
        from relax.platform.sgl_kernel_cpu_ops import register_cpu_op

        register_cpu_op("relax_test_double_cpu", lambda x: x * 2, schema="(Tensor x) -> Tensor")
        register_cpu_op("relax_test_conv_cpu", lambda x: x, submodule="mamba")
        get_platform("cpu").prepare_sglang()
        get_platform("cpu").prepare_sglang()  # idempotent
        assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
        assert os.environ["PYTHONPATH"].count("cpu_stand_ins") == 1

        import sgl_kernel
        from sgl_kernel import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu
        from sgl_kernel.mamba import relax_test_conv_cpu
        assert sgl_kernel.mamba.relax_test_conv_cpu is relax_test_conv_cpu
        assert not hasattr(sgl_kernel, "__all__")  # dunders are not ops
        assert torch.equal(torch.ops.sgl_kernel.relax_test_double_cpu(torch.ones(2)), torch.full((2,), 2.0))
        try:
            copy_all_layer_kv_cache_cpu(torch.ones(1))
        except NotImplementedError as error:
            assert "sgl_kernel.copy_all_layer_kv_cache_cpu is not available" in str(error), error
        else:
            raise AssertionError("a missing op must raise when called")
        try:
            from sgl_kernel.scalar_type import scalar_types  # SGLang falls back on ImportError
        except ImportError:
            pass
        else:
            raise AssertionError("unknown sgl_kernel submodules must not import")

        import torchvision.transforms.functional as F
        from torchvision.transforms import InterpolationMode
        assert InterpolationMode.BILINEAR is InterpolationMode.BILINEAR
        assert InterpolationMode.BILINEAR is not InterpolationMode.BICUBIC
        try:
            F.resize(None, 4)
        except NotImplementedError as error:
            assert "torchvision.transforms.functional.resize" in str(error), error
        else:
            raise AssertionError("the torchvision placeholder must not be usable")

        # Spawned children (SGLang's scheduler) find the same stand-ins through the environment.
        child = subprocess.run([sys.executable, "-c", "import sgl_kernel; print(sgl_kernel.__version__)"],
                               capture_output=True, text=True, check=True)
        assert "relax" in child.stdout, child.stdout
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_prepare_sglang_refuses_once_sglang_is_imported(monkeypatch):
    from relax.platform import get_platform

    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.setitem(sys.modules, "sglang", types.ModuleType("sglang"))  # imported without the switch
    with pytest.raises(RuntimeError, match="sglang was imported before the CPU platform was prepared"):
        get_platform("cpu").prepare_sglang()
