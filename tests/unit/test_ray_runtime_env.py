"""relax.ray.runtime_env: which variables workers get, and in which order they win."""

import pytest

from relax.ray.runtime_env import forwarded_env, job_env_vars, parse_env_specs, worker_env_vars


class FakePlatform:
    """Stands in for a relax.platform record: only the worker-environment calls."""

    def __init__(self, defaults):
        self.defaults = defaults
        self.checked = []

    def worker_env(self, memory_saver_on=False):
        return dict(self.defaults, SAVER=str(memory_saver_on))

    def check_worker_env(self, env, memory_saver_on=False):
        self.checked.append(dict(env))


def test_forwards_worker_prefixes_and_names_but_not_visible_devices_or_others():
    environ = {
        "SGLANG_X": "1", "HCCL_CONNECT_TIMEOUT": "1200", "ASCEND_LAUNCH_BLOCKING": "1", "MINDSPEED_Y": "y",
        "NCCL_DEBUG": "INFO", "CUDA_HOME": "/usr/local/cuda", "TORCH_NCCL_Z": "z", "PYTORCH_NPU_ALLOC_CONF": "a",
        "RELAX_DEVICE": "npu", "TASK_QUEUE_ENABLE": "2", "CPU_AFFINITY_CONF": "1",
        "CUDA_VISIBLE_DEVICES": "0,1", "ASCEND_RT_VISIBLE_DEVICES": "0", "HOME": "/root", "PATH": "/bin",
        "RAY_ADDRESS": "head:6379", "MY_SGLANG_X": "no",
    }
    forwarded = forwarded_env(environ)
    assert sorted(forwarded) == sorted(
        ["SGLANG_X", "HCCL_CONNECT_TIMEOUT", "ASCEND_LAUNCH_BLOCKING", "MINDSPEED_Y", "NCCL_DEBUG", "CUDA_HOME",
         "TORCH_NCCL_Z", "PYTORCH_NPU_ALLOC_CONF", "RELAX_DEVICE", "TASK_QUEUE_ENABLE", "CPU_AFFINITY_CONF"]
    )
    assert forwarded["HCCL_CONNECT_TIMEOUT"] == "1200"


def test_env_specs_take_values_from_the_shell_or_the_command_line():
    assert parse_env_specs(["FOO", "BAR=1=2", "EMPTY="], {"FOO": "shell"}) == {"FOO": "shell", "BAR": "1=2", "EMPTY": ""}


@pytest.mark.parametrize(
    "spec, message",
    [("MISSING", "--env MISSING: MISSING is not set in this shell; export it first or write --env MISSING=VALUE"),
     ("1BAD=x", "'1BAD' is not a variable name"), ("=x", "'' is not a variable name")],
)
def test_bad_env_specs_name_the_input_and_the_fix(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_env_specs([spec], {})


def test_platform_defaults_lose_to_the_shell_which_loses_to_named_variables():
    platform = FakePlatform({"HCCL_BUFFSIZE": "default", "TASK_QUEUE_ENABLE": "2", "ONLY_DEFAULT": "d"})
    environ = {"HCCL_BUFFSIZE": "shell", "TASK_QUEUE_ENABLE": "shell", "CUDA_VISIBLE_DEVICES": "3"}
    env = worker_env_vars(platform, environ, named={"TASK_QUEUE_ENABLE": "named", "CUDA_VISIBLE_DEVICES": "3"},
                          memory_saver_on=True)
    assert env == {"HCCL_BUFFSIZE": "shell", "TASK_QUEUE_ENABLE": "named", "ONLY_DEFAULT": "d", "SAVER": "True",
                   "CUDA_VISIBLE_DEVICES": "3"}
    assert platform.checked == [env]  # the platform sees the final environment
    # The job level carries the user's variables only: no platform defaults.
    assert job_env_vars(environ, {"X": "1"}) == {"HCCL_BUFFSIZE": "shell", "TASK_QUEUE_ENABLE": "shell", "X": "1"}


def test_the_npu_record_refuses_expandable_segments_beside_the_memory_saver():
    from relax.platform import platform_facts

    npu = platform_facts("npu")
    env = worker_env_vars(npu, {}, memory_saver_on=True)
    assert "expandable_segments" not in env.get("PYTORCH_NPU_ALLOC_CONF", "")
    with pytest.raises(ValueError, match="PYTORCH_NPU_ALLOC_CONF"):
        worker_env_vars(npu, {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}, memory_saver_on=True)

