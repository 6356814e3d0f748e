"""relax.platform: selection of the platform and the facts each record holds (no accelerator needed)."""

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from relax.platform import DEVICE_ENV, PLATFORMS, Platform, get_platform, platform_facts, resolve_platform_name
from relax.platform.cpu_device import CpuDeviceModule


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


def test_explicit_devices_this_machine_lacks_fail_clearly():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="device 'cuda' was asked for, but torch .*--device cpu"):
        get_platform("cuda")
    with pytest.raises(RuntimeError, match="device 'npu' was asked for, but torch_npu does not import"):
        get_platform("npu")


@pytest.mark.parametrize(
    "name, backend, visible, resource, saver, transport",
    [
        ("cpu", "gloo", None, None, None, "inline"),
        ("cuda", "nccl", "CUDA_VISIBLE_DEVICES", "GPU", "torch_memory_saver", "ipc"),
        ("npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", "NPU", "torch_memory_saver", "ipc"),
    ],
)
def test_facts_are_readable_without_the_device(name, backend, visible, resource, saver, transport):
    platform = platform_facts(name)
    assert (platform.name, platform.dist_backend, platform.visible_devices_env) == (name, backend, visible)
    assert (platform.ray_resource, platform.memory_saver, platform.same_node_transport) == (resource, saver, transport)
    assert platform.colocation_needs_release == (saver is not None)
    assert platform.sglang_server_defaults["device"] == name
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        platform_facts("gpu")


def test_a_platform_states_every_fact():
    with pytest.raises(TypeError, match="platform Half does not state dist_backend, visible_devices_env"):
        class Half(Platform):
            name = "half"


def test_every_platform_triton_target_has_launch_tuning():
    from relax.kernels.launch import TUNINGS

    assert {platform.triton_target for platform in PLATFORMS.values()} <= set(TUNINGS)


def test_cpu_runs_triton_only_interpreted():
    script = "from relax.platform import platform_facts; print(platform_facts('cpu').triton_compute_units(0))"
    for interpret, expected in (("1", "1"), ("0", "TRITON_INTERPRET=1")):
        env = {**os.environ, "TRITON_INTERPRET": interpret}
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
        assert expected in result.stdout + result.stderr


def test_npu_worker_env_keeps_expandable_segments_away_from_the_memory_saver():
    npu = platform_facts("npu")
    without_saver, with_saver = npu.worker_env(memory_saver_on=False), npu.worker_env(memory_saver_on=True)
    for env in (without_saver, with_saver):
        assert env["HCCL_HOST_SOCKET_PORT_RANGE"] == env["HCCL_NPU_SOCKET_PORT_RANGE"] == "auto"
        assert int(env["HCCL_CONNECT_TIMEOUT"]) >= 1800 and int(env["HCCL_EXEC_TIMEOUT"]) >= 1800
        assert env["TASK_QUEUE_ENABLE"] == "1" and env["CPU_AFFINITY_CONF"] == "1"
        assert all(isinstance(value, str) for value in env.values())
    assert without_saver["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_NPU_ALLOC_CONF" not in with_saver
    npu.check_worker_env(without_saver, memory_saver_on=False)
    npu.check_worker_env(with_saver, memory_saver_on=True)
    # The user's environment wins over the defaults, so the final one is checked again.
    user = {**with_saver, "PYTORCH_NPU_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:True"}
    with pytest.raises(ValueError, match="PYTORCH_NPU_ALLOC_CONF=.*drop expandable_segments"):
        npu.check_worker_env(user, memory_saver_on=True)
    npu.check_worker_env({**with_saver, "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False"}, True)


@pytest.mark.parametrize("memory_saver_on", [False, True])
def test_npu_worker_env_refuses_the_memory_savers_preload_hook_mode(memory_saver_on):
    npu = platform_facts("npu")
    env = npu.worker_env(memory_saver_on=memory_saver_on)
    with pytest.raises(ValueError, match="TMS_HOOK_MODE=preload: .*LD_PRELOAD.*unset TMS_HOOK_MODE"):
        npu.check_worker_env({**env, "TMS_HOOK_MODE": "preload"}, memory_saver_on)
    npu.check_worker_env({**env, "TMS_HOOK_MODE": "torch"}, memory_saver_on)


def test_cuda_worker_env_and_its_check():
    cuda = platform_facts("cuda")
    assert cuda.worker_env(memory_saver_on=True) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    with pytest.raises(ValueError, match="PYTORCH_CUDA_ALLOC_CONF.*torch_memory_saver"):
        cuda.check_worker_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, memory_saver_on=True)
    cuda.check_worker_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, memory_saver_on=False)


def test_cpu_memory_saver_does_nothing():
    saver = platform_facts("cpu").load_memory_saver()
    assert not saver.enabled
    with saver.region("weights"):
        kept = torch.ones(3)
    saver.pause("weights")
    saver.resume("weights")
    assert torch.equal(kept, torch.ones(3))


def test_cuda_memory_saver_is_torch_memory_saver_in_torch_hook_mode(monkeypatch):
    # A stand-in for torch_memory_saver (not installable without CUDA); the real one was run on an H200.
    singleton = types.SimpleNamespace(hook_mode="preload")
    monkeypatch.setitem(sys.modules, "torch_memory_saver", types.SimpleNamespace(torch_memory_saver=singleton))
    assert platform_facts("cuda").load_memory_saver() is singleton
    assert singleton.hook_mode == "torch"


@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_platforms_without_an_adaptation_layer_refuse_megatron_feature_args(name):
    with pytest.raises(ValueError, match="use_fused_rmsnorm.*remove them"):
        platform_facts(name).prepare_megatron({"use_fused_rmsnorm": True})


def test_cpu_record():
    platform = get_platform("cpu")
    assert platform is get_platform("cpu")
    assert (platform.device_type, platform.dist_backend) == ("cpu", "gloo")
    assert platform.visible_devices_env is None and platform.ray_resource is None
    assert not platform.has_memory_saver
    assert platform.same_node_transport == "inline"
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
        # megatron's @jit_fuser functions stay plain functions: no torch.compile (a C++ build per process).
        from megatron.core import jit
        from megatron.core.transformer.moe import router
        from megatron.core.transformer.torch_norm import L2Norm

        assert jit.jit_fuser is jit.noop_decorator
        assert type(L2Norm._norm) is type(router.TopKRouter._apply_expert_bias) is type(lambda: 0)
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert "CPU RNG state changed" not in result.stderr


def test_npu_preparation_order_with_stand_in_torch_npu_and_mindspeed(tmp_path):
    """relax's own NPU logic, run against stand-ins for torch_npu and MindSpeed (neither runs here):
    torch_npu first, MindSpeed's adaptor with Ray's argv hidden, feature args through repatch once."""
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text("import import_log\nimport_log.events.append('torch_npu')\n")
    (tmp_path / "mindspeed").mkdir()
    (tmp_path / "mindspeed" / "__init__.py").write_text("")
    (tmp_path / "mindspeed" / "megatron_adaptor.py").write_text(
        "import sys, import_log\n"
        "import_log.events.append(('adaptor', list(sys.argv)))\n"
        "def repatch(args):\n    import_log.events.append(('repatch', args))\n"
    )
    (tmp_path / "megatron").mkdir()  # a stand-in, to import "megatron" too early without the real one's cost
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (tmp_path / "import_log.py").write_text("events = []\n")
    script = textwrap.dedent(
        """
        import sys
        import import_log
        from relax.platform import platform_facts

        npu = platform_facts("npu")
        sys.argv = ["default_worker.py", "--node-ip-address=10.0.0.1"]
        npu.prepare_megatron({"use_fused_rmsnorm": True})
        npu.prepare_megatron({"use_fused_rmsnorm": True})  # idempotent
        assert sys.argv == ["default_worker.py", "--node-ip-address=10.0.0.1"], sys.argv
        assert import_log.events == [
            "torch_npu", ("adaptor", ["default_worker.py"]), ("repatch", {"position_embedding_type": "rope", "use_fused_rmsnorm": True})
        ], import_log.events
        npu.prepare_megatron({"use_fused_rmsnorm": False})  # new feature args are applied
        assert import_log.events[-1] == (
            "repatch", {"position_embedding_type": "rope", "use_fused_rmsnorm": False}
        ), import_log.events
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"

    late = "import megatron\nfrom relax.platform import platform_facts\nplatform_facts('npu').prepare_megatron()\n"
    result = subprocess.run([sys.executable, "-c", late], capture_output=True, text=True, timeout=60, env=env)
    assert "megatron was imported before MindSpeed patched it" in result.stderr


def test_npu_toolkit_version_is_read_from_the_cann_records(tmp_path):
    npu = platform_facts("npu")
    assert npu.toolkit_version({"ASCEND_TOOLKIT_HOME": str(tmp_path)}) is None
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "version.info").write_text("Version=9.0.0\nversion_dir=9.0.0\n")
    assert npu.toolkit_version({"ASCEND_TOOLKIT_HOME": str(tmp_path)}) == "9.0.0"
    (tmp_path / "aarch64-linux").mkdir()
    (tmp_path / "aarch64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=9.0.0.alpha1\n"
    )
    assert npu.toolkit_version({"ASCEND_HOME_PATH": str(tmp_path)}) == "9.0.0.alpha1"
