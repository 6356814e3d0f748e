"""Every scripts/run-*.sh in dry-run mode (RELAX_DRY_RUN=1): its flags parse and pass relax's checks, so a
script with a bad flag fails CI. Also shellcheck over the scripts and the model flag files they source."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_SCRIPTS = sorted((REPO / "scripts").glob("run-*.sh"))


def _dry_run(script: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        RELAX_DRY_RUN="1",
        RELAX_PYTHON=sys.executable,
        EXP_DIR=str(tmp_path / "exp"),
        OUTPUT_DIR=str(tmp_path / "out"),
    )
    env.pop("RELAX_DEVICE", None)
    return subprocess.run(
        ["bash", str(script), *extra], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """Each script run once in dry-run mode (each run costs seconds of Megatron/SGLang config building)."""
    return {script.name: _dry_run(script, tmp_path_factory.mktemp(script.stem)) for script in RUN_SCRIPTS}


def test_there_are_npu_run_scripts():
    names = {p.name for p in RUN_SCRIPTS}
    assert {"run-qwen3-4B-npu.sh", "run-qwen3.5-9B-npu.sh", "run-qwen3.5-35B-A3B-npu.sh"} <= names


@pytest.mark.parametrize("name", [p.name for p in RUN_SCRIPTS])
def test_run_script_passes_relax_train_dry_run(dry_runs, name):
    done = dry_runs[name]
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "== megatron.model" in done.stdout  # the resolved settings were printed


def test_npu_scripts_ask_for_the_npu_and_their_model_flags_reach_megatron(dry_runs):
    out = dry_runs["run-qwen3.5-35B-A3B-npu.sh"].stdout
    for setting in (
        "device = 'npu'",
        "num_nodes = 2",
        "experimental_attention_variant = 'gated_delta_net'",
        "num_moe_experts = 256",
        "attention_backend = 'ascend'",
    ):
        assert setting in out, setting


def test_a_bad_flag_fails_the_dry_run_with_a_suggestion(tmp_path):
    done = _dry_run(REPO / "scripts" / "run-qwen3-4B-npu.sh", tmp_path, "--mamba-scheduler-strategy", "no_buffer")
    assert done.returncode != 0
    assert "unknown flag --mamba-scheduler-strategy: did you mean --sglang-" in done.stderr


def test_shellcheck_passes_on_the_scripts():
    shellcheck = Path(sys.executable).parent / "shellcheck"
    files = sorted((REPO / "scripts").glob("*.sh")) + sorted((REPO / "scripts" / "models").glob("*.sh"))
    done = subprocess.run([str(shellcheck), "-x", *map(str, files)], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
