"""Repository-level promises: the README's commands are the ones CI and users run, pins live in one place."""

import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in first_block.splitlines() if line.strip()]


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    main_job, tests = commands
    assert main_job.startswith("bash scripts/setup.sh && ")
    assert tests.startswith("bash scripts/setup.sh && ") and "pytest" in tests
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci_lines, ".ci/run must run exactly the README's test command"
    script = main_job.split("&& ", 1)[1].split()[1]
    assert (ROOT / script).is_file(), f"the main-job command runs {script}, which does not exist"


def test_pins_file_runs_standalone_and_names_every_stack_version():
    pins = runpy.run_path(str(ROOT / "relax" / "pins.py"))
    for name, version in [("sglang", pins["SGLANG"]), ("megatron-core", pins["MEGATRON_CORE"])]:
        out = subprocess.run(
            [sys.executable, str(ROOT / "relax" / "pins.py"), name], capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == version
    assert f"torch=={pins['TORCH_CPU']}" in pins["CPU_STACK"]
    assert f"sglang=={pins['SGLANG']}" in pins["CUDA_STACK"]
    bad = subprocess.run([sys.executable, str(ROOT / "relax" / "pins.py"), "nope"], capture_output=True, text=True)
    assert bad.returncode != 0 and "nope" in bad.stderr


def test_installed_stack_matches_the_pins():
    from importlib.metadata import version

    pins = runpy.run_path(str(ROOT / "relax" / "pins.py"))
    assert version("torch").split("+")[0] == pins["TORCH_CPU"]
    assert version("sglang") == pins["SGLANG"]
    assert version("megatron-core") == pins["MEGATRON_CORE"]
    assert version("ray") == pins["RAY"]
    assert version("transformers") == pins["TRANSFORMERS"]


def test_cli_help_and_unknown_command():
    from relax.cli import main

    assert main(["--help"]) == 0
    assert main(["frobnicate"]) == 2
    assert main([]) == 2
