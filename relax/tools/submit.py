"""`relax submit`: run an entrypoint as a Ray job, with the workers' environment taken from this shell.

    relax submit [--address URL] [--env NAME | --env NAME=VALUE ...] [--working-dir DIR] [--max-restarts N]
                 -- <entrypoint ...>

The job's runtime_env carries the variables relax.ray.runtime_env takes from this shell (every variable
with a prefix workers read, and the --env ones), so a variable exported here reaches the job's driver and
every actor it creates, even on a cluster started long before; the driver adds its platform's worker
defaults to the actors it places (relax.ray.placement). The
command waits for the job, streams its logs, and exits 0 when the job succeeded, the driver's exit code
(or 1) when it failed, 1 when it was stopped, 130 when interrupted here (the job is stopped too).

--max-restarts N hands `--max-restarts N` to the job's `relax train` (the entrypoint's last words, as
`relax train ...` or a scripts/run-*.sh preset passes them on): the job's driver itself restarts the run from its
newest checkpoint after a worker fails (relax.run.loop.run_with_restarts). Ray resubmitting a failed job
instead would also survive the driver's death, but needs this command to outlive the job and a new job to find
the old one's checkpoints; restarting inside the job needs neither.
"""

import argparse
import asyncio
import os
import shlex
import sys
import time
from pathlib import Path

from relax.ray.runtime_env import WORKER_ENV_NAMES, WORKER_ENV_PREFIXES, job_env_vars, parse_env_specs

USAGE = "relax submit [options] -- <entrypoint ...>"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relax submit",
        usage=USAGE,
        description="Submit a Ray job whose driver and actors get this shell's worker environment.",
        epilog=(
            "Forwarded from this shell: variables starting with "
            + " ".join(WORKER_ENV_PREFIXES)
            + " and "
            + " ".join(WORKER_ENV_NAMES)
            + " (never *_VISIBLE_DEVICES unless named with --env). The entrypoint's words are quoted for "
            "the shell: for shell syntax write `-- bash -c '...'`."
        ),
    )
    parser.add_argument(
        "--address",
        help="the cluster's dashboard (Jobs API) address, e.g. http://HEAD:8265 "
        "(default: RAY_API_SERVER_ADDRESS, then RAY_ADDRESS, then a cluster started on this machine)",
    )
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME[=VALUE]",
        help="also forward NAME (from this shell) or set NAME=VALUE; repeatable",
    )
    parser.add_argument("--working-dir", help="directory uploaded to the cluster and used as the driver's cwd")
    parser.add_argument("--submission-id", help="the job's id (default: chosen by Ray)")
    parser.add_argument("--no-wait", action="store_true", help="return once the job is submitted")
    parser.add_argument(
        "--max-restarts", type=int, metavar="N",
        help="append `--max-restarts N` to the entrypoint, a `relax train` run (or a scripts/run-*.sh preset): the "
        "job resumes from its newest checkpoint in --save after a training rank or an engine fails, at most N times",
    )
    return parser


def with_max_restarts(entrypoint: list[str], max_restarts: int) -> list[str]:
    """The entrypoint with `--max-restarts N` appended for its `relax train`; ValueError naming the fix when it
    is not recognisably one, or already has the flag."""
    if max_restarts < 1:
        raise ValueError(f"--max-restarts must be a positive integer, got {max_restarts}")
    runs_train = any(
        (Path(word).name in ("relax", "relax.cli") and following == "train")
        or (Path(word).name.startswith("run-") and word.endswith(".sh"))
        for word, following in zip(entrypoint, [*entrypoint[1:], ""])
    )
    if not runs_train:
        raise ValueError(
            f"--max-restarts: the entrypoint ({shlex.join(entrypoint)}) is neither `relax train ...` nor a "
            "scripts/run-*.sh preset; put --max-restarts N on its own relax train command instead"
        )
    if any(word == "--max-restarts" or word.startswith("--max-restarts=") for word in entrypoint):
        raise ValueError("--max-restarts is given both here and in the entrypoint; give it once")
    return [*entrypoint, "--max-restarts", str(max_restarts)]


def split_entrypoint(argv: list[str]) -> tuple[list[str], list[str]]:
    """(options, entrypoint words): everything after the first `--` is the entrypoint."""
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def job_runtime_env(env_specs: list[str], working_dir: str | None, environ=os.environ) -> dict:
    runtime_env = {"env_vars": job_env_vars(environ, parse_env_specs(env_specs, environ))}
    if working_dir is not None:
        if not os.path.isdir(working_dir):
            raise ValueError(f"--working-dir {working_dir!r} is not a directory")
        runtime_env["working_dir"] = os.path.abspath(working_dir)
    return runtime_env


def exit_code_for(status: str, driver_exit_code: int | None) -> int:
    """0 for SUCCEEDED; a failed job's driver exit code (1 when unknown); 1 for STOPPED."""
    if status == "SUCCEEDED":
        return 0
    if status == "FAILED" and driver_exit_code and 0 < driver_exit_code < 256:
        return driver_exit_code
    return 1


async def _stream_logs(client, job_id: str) -> None:
    async for chunk in client.tail_job_logs(job_id):
        sys.stdout.write(chunk)
        sys.stdout.flush()


def _wait(client, job_id: str) -> int:
    from ray.job_submission import JobStatus

    try:
        asyncio.run(_stream_logs(client, job_id))
    except RuntimeError as error:  # the log stream broke; the job may still be running
        print(f"relax submit: log stream of job {job_id} ended early ({error}); waiting for the job", file=sys.stderr)
    while not (info := client.get_job_info(job_id)).status.is_terminal():
        time.sleep(1)
    code = exit_code_for(str(info.status.value), info.driver_exit_code)
    detail = f": {info.message}" if info.message and info.status != JobStatus.SUCCEEDED else ""
    print(f"relax submit: job {job_id} {info.status.value} (exit {code}){detail}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    options, entrypoint = split_entrypoint(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args = parser.parse_args(options)
    if not entrypoint:
        parser.error("no entrypoint: put the command to run after `--`, e.g. relax submit -- python train.py")
    try:
        runtime_env = job_runtime_env(args.env, args.working_dir)
        if args.max_restarts is not None:
            entrypoint = with_max_restarts(entrypoint, args.max_restarts)
    except ValueError as error:
        parser.error(str(error))

    from ray.job_submission import JobSubmissionClient

    if args.address:
        # Ray's client takes RAY_API_SERVER_ADDRESS or RAY_ADDRESS over its own argument; --address wins here.
        for name in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
            os.environ.pop(name, None)
    try:
        client = JobSubmissionClient(args.address)
    except ConnectionError as error:
        print(f"relax submit: cannot reach the Ray cluster's Jobs API ({error}); pass --address http://HEAD:8265",
              file=sys.stderr)
        return 2
    job_id = client.submit_job(
        entrypoint=shlex.join(entrypoint), runtime_env=runtime_env, submission_id=args.submission_id
    )
    names = " ".join(sorted(runtime_env["env_vars"])) or "(none)"
    print(f"relax submit: job {job_id} submitted; worker environment: {names}", file=sys.stderr)
    if args.no_wait:
        return 0
    try:
        return _wait(client, job_id)
    except KeyboardInterrupt:
        client.stop_job(job_id)
        print(f"relax submit: interrupted; job {job_id} stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
