"""relax submit: argument handling, the job's runtime_env and exit codes (no cluster needed)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax.cli import main as cli_main
from relax.tools.submit import exit_code_for, job_runtime_env, main, split_entrypoint, with_max_restarts

REPO = Path(__file__).resolve().parents[2]


def test_the_entrypoint_is_everything_after_the_first_double_dash():
    assert split_entrypoint(["--env", "A", "--", "python", "x.py", "--", "y"]) == (
        ["--env", "A"], ["python", "x.py", "--", "y"])
    assert split_entrypoint(["--env", "A"]) == (["--env", "A"], [])


@pytest.mark.parametrize(
    "status, driver_exit_code, expected",
    [("SUCCEEDED", 0, 0), ("FAILED", 3, 3), ("FAILED", None, 1), ("FAILED", -9, 1), ("STOPPED", None, 1)],
)
def test_exit_code_follows_the_job_status(status, driver_exit_code, expected):
    assert exit_code_for(status, driver_exit_code) == expected


def test_job_runtime_env_forwards_the_shell_and_named_variables(tmp_path):
    environ = {"RELAX_DEVICE": "cpu", "SGLANG_FOO": "1", "HOME": "/root", "MINE": "m"}
    runtime_env = job_runtime_env(["MINE", "X=2"], str(tmp_path), environ)
    assert runtime_env == {
        "env_vars": {"RELAX_DEVICE": "cpu", "SGLANG_FOO": "1", "MINE": "m", "X": "2"},
        "working_dir": str(tmp_path),
    }


def test_max_restarts_goes_to_the_entrypoints_relax_train():
    assert with_max_restarts(["relax", "train", "--save", "c"], 2) == ["relax", "train", "--save", "c",
                                                                         "--max-restarts", "2"]
    assert with_max_restarts(["bash", "scripts/run-qwen3-4B.sh", "--save", "c"], 1)[-2:] == ["--max-restarts", "1"]
    assert with_max_restarts(["python", "-m", "relax.cli", "train"], 1)[-2:] == ["--max-restarts", "1"]


@pytest.mark.parametrize(
    "argv, message",
    [([], "no entrypoint: put the command to run after `--`"),
     (["--env", "RELAX_TEST_SURELY_UNSET", "--", "true"], "--env RELAX_TEST_SURELY_UNSET: RELAX_TEST_SURELY_UNSET is not set"),
     (["--working-dir", "/no/such/dir", "--", "true"], "--working-dir '/no/such/dir' is not a directory"),
     (["--adress", "x", "--", "true"], "unrecognized arguments: --adress"),
     (["--max-restarts", "2", "--", "python", "train.py"],
      "--max-restarts: the entrypoint (python train.py) is neither `relax train ...` nor a scripts/run-*.sh preset"),
     (["--max-restarts", "2", "--", "relax", "train", "--max-restarts", "1"], "given both here and in the entrypoint"),
     (["--max-restarts", "0", "--", "relax", "train"], "--max-restarts must be a positive integer, got 0")],
)
def test_bad_arguments_fail_before_contacting_a_cluster(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("RELAX_TEST_SURELY_UNSET", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_relax_cli_and_submit_sh_reach_the_submit_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["submit", "--help"])
    assert exit_.value.code == 0
    assert "usage: relax submit [options] -- <entrypoint ...>" in capsys.readouterr().out
    result = subprocess.run(["bash", str(REPO / "scripts" / "submit.sh"), "--help"], capture_output=True, text=True,
                            env={**os.environ, "RELAX_PYTHON": sys.executable}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--working-dir" in result.stdout
