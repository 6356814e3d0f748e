"""scripts/run-tiny-cpu.sh, the README's tiny colocated job (local Ray, SGLang engine actor, Megatron actor), run
by the e2e tests. Each run starts the whole stack, which costs far more than its few steps: tests share a run
where they can (tests/e2e/conftest.py, saved_tiny_run)."""

import functools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from processes import describe, leftover_processes, run_marker
from relax.run.metrics import read_metrics
from relax.tools.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
# The time of each phase, logged at every step of a run that trains.
PERF_KEYS = ("perf/step_time", "perf/rollout_time", "perf/train_wait_time", "perf/train_time", "perf/weight_sync_time")
# 8 prompt groups of 8 samples a step, for tests that count them (the script's own job trains on 16 prompts)
EIGHT_PROMPTS = ("--rollout-batch-size", "8", "--global-batch-size", "64")


def step_records(records: list[dict]) -> list[dict]:
    """The steps' rows of a record, without the row of the evaluation after the last step (the script evaluates
    a held-out set)."""
    return [r for r in records if "perf/step_time" in r]


# This process's builds of the tiny models, removed when it exits.
_BUILDS = tempfile.TemporaryDirectory(prefix="relax-tiny-models-")


@functools.cache
def _built_tiny_model(family: str) -> Path:
    """The tiny model of `family` as the script builds it (relax.tools.tiny_model, seed 0), built once per test
    process: a build in the script costs a process importing torch and transformers, about 5 CPU-seconds."""
    return build_tiny_model(Path(_BUILDS.name) / family, family)


def _tiny_family(args: tuple[str, ...], env: dict[str, str]) -> str:
    """The family the script runs: its --tiny-model among `args`, else its TINY_MODEL variable, else qwen3."""
    for i, arg in enumerate(args):
        if arg == "--tiny-model":
            return args[i + 1]
        if arg.startswith("--tiny-model="):
            return arg.partition("=")[2]
    return env.get("TINY_MODEL", "qwen3")


def tiny_job(exp_dir: Path, *args: str, env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command and environment of the tiny job with EXP_DIR=exp_dir, `args` passed on to `relax train` and
    `env` added to this process's environment. The model is this process's build, copied to where the script would
    build it (exp_dir / "model") and given as TINY_MODEL_DIR; the script's own build runs in test_run_scripts and
    test_submit_tiny_run."""
    model_dir = exp_dir / "model"
    run_env = {**os.environ, "EXP_DIR": str(exp_dir), "RELAX_PYTHON": str(ROOT / ".venv" / "bin" / "python"),
               "TINY_MODEL_DIR": str(model_dir), **(env or {})}
    shutil.copytree(_built_tiny_model(_tiny_family(args, run_env)), model_dir, dirs_exist_ok=True)
    return ["bash", str(ROOT / "scripts" / "run-tiny-cpu.sh"), *args], run_env


def run_tiny_job(exp_dir: Path, *args: str, env: dict[str, str] | None = None) -> list[dict]:
    """Run the tiny job (tiny_job); its metrics records. The test fails with the run's output when the run fails."""
    _run_tiny_script(exp_dir, args, env)
    return read_metrics(exp_dir / "output" / "metrics.jsonl")


def _run_tiny_script(exp_dir: Path, args, env: dict[str, str] | None) -> str:
    """The tiny job's console: what it wrote to stdout and stderr (on one terminal, both would show)."""
    command, run_env = tiny_job(exp_dir, *args, env=env)
    result = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout + result.stderr


@dataclass
class SavedTinyRun:
    exp_dir: Path  # EXP_DIR: the model, the data, output/ (the run's record), SAVES, HF_SAVES
    saves: Path  # --save: step_000001, step_000003
    hf_saves: Path  # --save-hf: the same steps as HF directories
    records: list[dict]  # output/metrics.jsonl
    tensorboard_events: set[str]  # the file names in output/tensorboard
    reward_curve_head: bytes  # the first bytes of output/reward_curve.png
    leftover: str  # the run's processes still alive once it ended, described; empty when none
    console: str  # what the run wrote to stdout and stderr


SAVING_RUN_STEPS = 4
# The saving run's files in its EXP_DIR besides the script's: its checkpoints, their HF directories, and what
# run_saving_tiny_job read of the run as it ended (its console, its processes still alive).
SAVES, HF_SAVES, CONSOLE_FILE, LEFTOVER_FILE = "checkpoints", "hf", "console.txt", "leftover.txt"
EVAL_INTERVAL = 2
EVAL_SETS = ("held_out", "ones")


def eval_set_paths(exp_dir: Path) -> dict[str, Path]:
    """EVAL_SETS' files: the script's held-out copy_digit set, and one of "copy 1:" prompts only, written here."""
    ones = exp_dir / "ones.jsonl"
    ones.write_text('{"prompt": "copy 1:", "label": "1"}\n' * 3)
    return dict(zip(EVAL_SETS, (exp_dir / "data" / "copy_digit_held_out.jsonl", ones)))


def eval_flags(exp_dir: Path) -> list[str]:
    """The saving run's evaluation: EVAL_SETS every EVAL_INTERVAL steps (the script's K samples per prompt)."""
    pairs = [str(part) for name, path in eval_set_paths(exp_dir).items() for part in (name, path)]
    return ["--eval-prompt-data", *pairs, "--eval-interval", str(EVAL_INTERVAL)]


def run_saving_tiny_job(exp_dir: Path) -> None:
    """The tiny job for 4 steps, saving after steps 1 and 3 (--save-interval 2) with an HF directory at each save
    (--save-hf), each request sampling with a seed from (--seed, step) that SGLang honours under deterministic
    inference, so that a run resumed from a checkpoint repeats its rollouts; evaluating two sets (eval_flags). Its
    console and the processes it left are written into exp_dir as it ends (CONSOLE_FILE, LEFTOVER_FILE): the whole
    run can then be read from exp_dir by any process (read_saved_tiny_run)."""
    marker = run_marker()
    console = _run_tiny_script(
        exp_dir, ["--num-steps", str(SAVING_RUN_STEPS), "--sglang-enable-deterministic-inference",
                  "--save", str(exp_dir / SAVES), "--save-interval", "2", "--save-hf", str(exp_dir / HF_SAVES),
                  *eval_flags(exp_dir)],
        env=marker,
    )
    leftover = leftover_processes(marker)
    (exp_dir / CONSOLE_FILE).write_text(console)
    (exp_dir / LEFTOVER_FILE).write_text(describe(leftover) if leftover else "")


def read_saved_tiny_run(exp_dir: Path) -> SavedTinyRun:
    """The run that run_saving_tiny_job left in exp_dir."""
    output = exp_dir / "output"
    return SavedTinyRun(
        exp_dir, exp_dir / SAVES, exp_dir / HF_SAVES, read_metrics(output / "metrics.jsonl"),
        tensorboard_events={path.name for path in (output / "tensorboard").iterdir()},
        reward_curve_head=(output / "reward_curve.png").read_bytes()[:4],
        leftover=(exp_dir / LEFTOVER_FILE).read_text(),
        console=(exp_dir / CONSOLE_FILE).read_text(),
    )


def not_relax_lines(console: str) -> list[str]:
    """The console lines that are not relax's own (blank lines are nobody's). relax's are: the reports of the inputs
    read ("prompt data: ...", "eval set NAME: ...", "rollout data: ...", "--load: ..."), the progress bar and relax's messages (starting "relax", e.g.
    "relax train: done; ..."), and the rows of the end-of-run summary (indented, after "relax run summary")."""
    others, in_summary = [], False
    for line in console.replace("\r", "\n").split("\n"):  # a progress bar redraws its line after a \r
        if not line.strip():
            continue
        if line.startswith("relax run summary"):
            in_summary = True
        elif not (in_summary and line.startswith("  ")):
            in_summary = False
            if not line.startswith(("relax", "prompt data: ", "eval set ", "rollout data: ", "--load: ")):
                others.append(line)
    return others
