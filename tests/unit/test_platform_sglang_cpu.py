"""The CPU platform's SGLang pieces: the sgl_kernel stand-in, its torch ops, the torchvision placeholder."""

import struct
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from relax.platform.cpu_sgl_kernel_registry import assign_req_to_token_pool_cpu, murmur_hash32_cpu


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


def _murmur3_32(data: bytes) -> int:
    """MurmurHash3 x86_32 with seed 0, written from its specification (bytes a multiple of 4 long)."""
    rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF  # noqa: E731
    h = 0
    for (k,) in struct.iter_unpack("<I", data):
        k = (rotl((k * 0xCC9E2D51) & 0xFFFFFFFF, 15) * 0x1B873593) & 0xFFFFFFFF
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_murmur_hash32_hashes_seed_position_and_column_like_sglangs_kernel():
    # SGLang's Triton kernel hashes the 16 bytes (seed as uint64, position, column as uint32) with seed 0.
    assert _murmur3_32(b"test") == 0xBA6BD213  # the reference itself, against a published value
    seeds = torch.tensor([0, 1, 2**40 + 7, 2**62 + 12345], dtype=torch.int64)
    positions = torch.tensor([0, 5, 17, 100000])
    hashed = murmur_hash32_cpu(seeds.to(torch.uint64), positions, torch.arange(300))
    assert hashed.dtype == torch.uint32 and hashed.shape == (4, 300)
    for row in range(4):
        for column in (0, 1, 299):
            expected = _murmur3_32(struct.pack("<QII", int(seeds[row]), int(positions[row]), column))
            assert int(hashed[row, column].to(torch.int64)) == expected


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
        from relax.platform.cpu_sgl_kernel_registry import register_cpu_op

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
