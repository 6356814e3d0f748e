"""relax.platform: selection of the platform and the facts each record holds (no accelerator needed)."""

import subprocess
import sys
import textwrap

import pytest
import torch

from relax.platform import DEVICE_ENV, get_platform, resolve_platform_name
from relax.platform.cpu import CpuDeviceModule


def _probes(npu: bool, cuda: bool) -> dict:
    return dict(npu_available=lambda: npu, cuda_available=lambda: cuda)


@pytest.mark.parametrize(
    "npu, cuda, expected",
    [(True, True, "npu"), (True, False, "npu"), (False, True, "cuda"), (False, False, "cpu")],
)
def test_auto_prefers_npu_then_cuda_then_cpu(npu, cuda, expected):
    assert resolve_platform_name("auto", environ={}, **_probes(npu, cuda)) == expected


def test_relax_device_overrides_auto_but_not_an_explicit_name():
    environ = {DEVICE_ENV: "CPU"}
    assert resolve_platform_name("auto", environ=environ, **_probes(True, True)) == "cpu"
    assert resolve_platform_name("cuda", environ=environ, **_probes(False, False)) == "cuda"
    assert resolve_platform_name("auto", environ={DEVICE_ENV: "auto"}, **_probes(False, True)) == "cuda"


@pytest.mark.parametrize(
    "name, environ, message",
    [("gpu", {}, "unknown device 'gpu'"), ("auto", {DEVICE_ENV: "tpu"}, "unknown RELAX_DEVICE='tpu'")],
)
def test_unknown_device_names_fail_with_the_choices(name, environ, message):
    with pytest.raises(ValueError, match=message) as error:
        resolve_platform_name(name, environ=environ, **_probes(False, False))
    assert "auto, cpu, cuda, npu" in str(error.value)


def test_explicit_cuda_without_a_gpu_fails_clearly():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="torch sees no CUDA device.*--device cpu"):
        get_platform("cuda")


def test_cpu_record():
    platform = get_platform("cpu")
    assert platform is get_platform("cpu")
    assert (platform.device_type, platform.dist_backend) == ("cpu", "gloo")
    assert platform.visible_devices_env is None and platform.ray_resource is None
    assert not platform.has_memory_saver
    assert (platform.same_node_transport, platform.sharing_strategy) == ("shared_memory", "file_system")
    assert platform.destroy_process_group_delay_s == 0
    assert platform.device_count() == 1 and platform.current_device() == torch.device("cpu")
    assert platform.worker_env() == {}
    with pytest.raises(ValueError, match="no memory saver"):
        platform.worker_env(memory_saver_on=True)
    with pytest.raises(TypeError):
        platform.sglang_server_defaults["device"] = "cuda"


def test_cpu_device_module_has_one_device():
    CpuDeviceModule.set_device(0)
    CpuDeviceModule.set_device("cpu")
    with pytest.raises(ValueError, match="device 1 does not exist on the CPU platform"):
        CpuDeviceModule.set_device(1)
    with pytest.raises(ValueError, match="does not exist"):
        CpuDeviceModule.set_device("cuda:0")


def test_megatron_redirections_stay_inside_megatron_core():
    # In a child: prepare_megatron patches torch.Tensor methods for the whole process.
    script = textwrap.dedent(
        """
        import torch
        from relax.platform import get_platform
        platform = get_platform("cpu")
        platform.prepare_megatron()
        platform.prepare_megatron()  # idempotent
        from megatron.core.transformer import utils
        from megatron.core.tensor_parallel import random

        mask = utils.get_default_causal_mask(4)  # a device="cuda" literal upstream
        assert mask.device.type == "cpu" and mask.dtype == torch.bool, mask
        assert utils.torch.cuda.current_device() == torch.device("cpu")
        assert utils.torch.Tensor is torch.Tensor and utils.torch.zeros is not torch.zeros
        # Outside megatron.core torch behaves as always.
        assert torch.ones(1).type() == "torch.FloatTensor"
        try:
            torch.ones(1).cuda()
        except (AssertionError, RuntimeError):
            pass
        else:
            raise AssertionError("Tensor.cuda() outside megatron.core must stay torch's own")
        # The RNG tracker forks the CPU generator.
        random.initialize_rng_tracker()
        tracker = random.get_cuda_rng_tracker()
        tracker.add("model-parallel-rng", 7)
        torch.manual_seed(0)
        outside = torch.get_rng_state()
        with tracker.fork("model-parallel-rng"):
            forked = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), outside)
        torch.manual_seed(7)
        assert torch.equal(forked, torch.rand(3))
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert "CPU RNG state changed" not in result.stderr
