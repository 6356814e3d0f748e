"""relax/tools/doctor.py: each check on fake facts, and the real command on this CPU machine."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from relax import pins
from relax.tools import doctor
from relax.tools.doctor import BLOCKER, INFO, OK, WARN, Facts
from relax.platform import platform_facts

REPO = Path(__file__).resolve().parents[2]


CPU, CUDA, NPU = platform_facts("cpu"), platform_facts("cuda"), platform_facts("npu")


def _versions(platform) -> dict:
    return {**platform.pinned_versions, **doctor.COMMON_VERSIONS}


def _npu_facts(**changes) -> Facts:
    facts = Facts(
        platform=NPU,
        device_count=16,
        versions=_versions(NPU),
        toolkit_version="9.0.0",
        patch_states={"sglang": {"0001-a.patch": "applied"}, "megatron-core": {"0001-b.patch": "applied"}},
        environ={},
        ray_resources={"CPU": 192.0, "NPU": 16.0, "memory": 1e12},
    )
    return replace(facts, **changes)


def _by_check(rows) -> dict:
    return {row.check: row for row in rows}


def test_a_healthy_npu_node_has_no_blocker():
    rows = doctor.run_checks(_npu_facts())
    assert [r for r in rows if r.status in (BLOCKER, WARN)] == []
    assert {
        "platform",
        "CANN",
        "torch",
        "torch-npu",
        "sglang",
        "megatron-core",
        "mindspeed",
        "triton-ascend",
        "patches sglang",
        "patches megatron-core",
        "ray cluster",
    } <= set(_by_check(rows))


def test_expandable_segments_beside_the_memory_saver_are_a_blocker_by_the_platforms_rule():
    environ = {"PYTORCH_NPU_ALLOC_CONF": "max_split_size_mb:256,expandable_segments:True"}
    facts = doctor.gather_facts("npu", look_at_ray=False, environ=environ)  # the NPU record, read on this CPU
    row = _by_check(doctor.run_checks(facts))["worker environment"]
    assert row.status == BLOCKER and "PYTORCH_NPU_ALLOC_CONF" in row.fix and "expandable" in row.fix
    # the CPU has no memory saver: nothing to conflict with
    cpu = doctor.gather_facts("cpu", look_at_ray=False, environ=environ)
    assert _by_check(doctor.run_checks(cpu))["worker environment"].status == OK


def test_a_platform_this_machine_lacks_is_a_blocker_and_the_other_checks_still_run():
    facts = doctor.gather_facts("npu", look_at_ray=False, environ={})
    rows = _by_check(doctor.run_checks(facts))
    assert rows["platform"].status == BLOCKER and "torch_npu" in rows["platform"].fix
    assert rows["torch-npu"].status == BLOCKER  # and it says what else is missing
    assert rows["CANN"].status == BLOCKER


@pytest.mark.parametrize(
    "value, status",
    [
        ("auto", None),
        ("60000-60099", WARN),
        ("60000-60000", BLOCKER),
        ("60000:60099", BLOCKER),
        ("70000-70010", BLOCKER),
    ],
)
def test_hccl_port_ranges_for_two_processes_per_device(value, status):
    rows = doctor.check_hccl_ports({"HCCL_HOST_SOCKET_PORT_RANGE": value}, "hccl")
    assert [r.status for r in rows] == ([status] if status else [])
    if status:
        assert "HCCL_HOST_SOCKET_PORT_RANGE" in rows[0].fix


def test_hccl_base_port_is_flagged_and_hccl_settings_are_only_info_off_npu():
    assert [r.status for r in doctor.check_hccl_ports({"HCCL_IF_BASE_PORT": "50000"}, "hccl")] == [WARN]
    assert [r.status for r in doctor.check_hccl_ports({"HCCL_HOST_SOCKET_PORT_RANGE": "1-1"}, "nccl")] == [INFO]


def test_visible_device_variables():
    check = doctor.check_visible_devices
    assert [r.status for r in check({"ASCEND_RT_VISIBLE_DEVICES": ""}, "ASCEND_RT_VISIBLE_DEVICES", "npu")] == [BLOCKER]
    assert [r.status for r in check({"ASCEND_RT_VISIBLE_DEVICES": "0,1,1"}, "ASCEND_RT_VISIBLE_DEVICES", "npu")] == [
        BLOCKER
    ]
    assert [r.status for r in check({"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"}, "ASCEND_RT_VISIBLE_DEVICES", "npu")] == [
        OK
    ]
    wrong = check({"CUDA_VISIBLE_DEVICES": "0"}, "ASCEND_RT_VISIBLE_DEVICES", "npu")
    assert [r.status for r in wrong] == [WARN] and "select devices with ASCEND_RT_VISIBLE_DEVICES" in wrong[0].fix
    assert [r.status for r in check({"CUDA_VISIBLE_DEVICES": "0"}, None, "cpu")] == [INFO]


def test_versions_against_the_pins():
    versions = _versions(NPU) | {
        "sglang": None,
        "megatron-core": "0.15.0",
        "transformers": "5.1.0",
        "torch": pins.TORCH_NPU_TORCH + "+cpu",
    }
    rows = _by_check(doctor.check_versions(NPU, versions))
    assert rows["sglang"].status == BLOCKER and rows["sglang"].found == "not installed"
    assert rows["megatron-core"].status == BLOCKER  # exact: flags, mappings and patches are made for the pin
    assert rows["transformers"].status == WARN
    assert rows["torch"].status == OK  # the local build tag does not matter
    assert "torch-npu" not in _by_check(doctor.check_versions(CPU, _versions(CPU)))


def test_patches_are_required_on_devices_and_optional_on_cpu():
    missing = {"sglang": {"0001-a.patch": "not applied", "0002-b.patch": "applied"}}
    row = doctor.check_patches(NPU, missing)[0]
    assert row.status == BLOCKER and row.fix == "relax patches apply sglang"
    assert doctor.check_patches(CPU, missing)[0].status == INFO
    conflict = {"megatron-core": {"0001-a.patch": "conflicts"}}
    assert doctor.check_patches(CUDA, conflict)[0].status == BLOCKER
    assert doctor.check_patches(NPU, {"sglang": "sglang is not installed"})[0].status == BLOCKER


def test_toolkit_and_ray_and_platform():
    cann = pins.CANN_NPU_IMAGE.split(":")[1].split("-")[0]
    assert doctor.check_toolkit(NPU, None)[0].status == BLOCKER
    assert doctor.check_toolkit(NPU, "8.5.0")[0].status == WARN
    assert doctor.check_toolkit(NPU, cann)[0].status == OK
    assert doctor.check_ray({"CPU": 64.0}, "", "NPU", 8)[0].status == BLOCKER
    healthy = doctor.check_ray({"CPU": 192.0, "NPU": 16.0, "memory": 2.0**40, "node:10.0.0.1": 1.0}, "", "NPU", 16)[0]
    assert (healthy.status, healthy.found) == (OK, "CPU=192, NPU=16, memory=1024 GiB")
    assert doctor.check_ray(None, "no cluster running", "NPU", 8)[0].status == INFO
    assert doctor.check_platform(Facts(platform=None, platform_error="unknown device 'tpu'"))[0].status == BLOCKER
    assert doctor.check_platform(_npu_facts(platform_error="no torch_npu"))[0].status == BLOCKER
    assert doctor.check_platform(_npu_facts(device_count=0))[0].status == BLOCKER


def test_training_kernels_row_names_a_gdn_kernel_that_does_not_import():
    from relax.tools.doctor import check_training_kernels

    (row,) = check_training_kernels("flash_varlen", "fla", "No module named 'fla'")
    assert row.status == WARN and "attention flash_varlen, GDN fla" in row.found
    assert "--gdn-training-kernel reference" in row.fix
    assert check_training_kernels("sdpa", "reference", "")[0].status == OK
    (npu_row,) = check_training_kernels("npu_fusion", "mindspeed", "No module named 'mindspeed'")
    assert "GDN mindspeed" in npu_row.found and "MindSpeed (github.com/Ascend/MindSpeed" in npu_row.fix
    assert "docker/Dockerfile.npu" in npu_row.fix and "--gdn-training-kernel reference" in npu_row.fix


def test_table_lists_each_fix_and_counts_blockers():
    rows = doctor.run_checks(
        _npu_facts(environ={"ASCEND_RT_VISIBLE_DEVICES": ""}, versions=_versions(NPU) | {"transformers": "5.0.0"})
    )
    table = doctor.format_table(rows)
    assert "BLOCKER ASCEND_RT_VISIBLE_DEVICES: an empty ASCEND_RT_VISIBLE_DEVICES hides every device: unset it" in table
    assert "warn transformers: pip install transformers==" in table
    assert table.endswith("1 blocker(s), 1 warning(s)")


def test_doctor_runs_on_this_cpu_machine_and_reports_it():
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "RELAX_DEVICE": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "relax.cli", "doctor", "--no-ray"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {
        line.split()[0] + (" " + line.split()[1] if line.startswith("patches") else ""): line
        for line in done.stdout.splitlines()
        if line.strip()
    }
    assert lines["platform"].split()[1:3] == ["ok", "cpu,"]
    for name in ("torch", "sglang", "megatron-core", "ray", "patches sglang", "patches megatron-core", "ray"):
        assert name in lines, done.stdout
    assert done.stdout.rstrip().endswith("0 blocker(s), 0 warning(s)")


def test_an_unusable_platform_is_a_blocker_with_exit_1(capsys):
    assert doctor.main(["--device", "npu", "--no-ray"]) == 1
    assert "BLOCKER platform: torch_npu does not import" in capsys.readouterr().out


def test_no_ray_cluster_is_reported_without_starting_one(tmp_path):
    resources, note = doctor.ray_cluster_resources({"RAY_TMPDIR": str(tmp_path)})
    assert resources is None and note.startswith("no cluster running")
    assert doctor.check_ray(resources, note, "NPU", 16)[0].status == INFO
