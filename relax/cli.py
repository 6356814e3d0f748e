"""The `relax` console script: train, convert, submit, doctor, patches.

Each subcommand imports only what it needs, so `relax patches check` works without torch on the path.
"""

import sys
from pathlib import Path

USAGE = """usage: relax {train,convert,submit,doctor,patches} ...

  train    run the colocated RL loop (`relax train --help` lists every flag; --dry-run validates and prints)
  convert  an actor checkpoint (`relax train --save`) to an HF directory, on the CPU (`relax convert --help`)
  submit   submit a run to a Ray cluster with `ray job submit` and the workers' environment
  doctor   preflight checks of this machine's platform, versions, patches and environment
  patches  check, apply or report the vendored patch sets (patches/): check | apply | status
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        return _train(rest)
    if command == "convert":
        from relax.tools.convert import main as convert_main

        return convert_main(rest)
    if command == "patches":
        from relax.tools.patches import main as patches_main

        return patches_main(rest)
    if command == "doctor":
        from relax.tools.doctor import main as doctor_main

        return doctor_main(rest)
    if command == "submit":
        from relax.tools.submit import main as submit_main

        return submit_main(rest)
    print(f"relax: unknown command {command!r}\n\n{USAGE}", file=sys.stderr, end="")
    return 2


def _train(argv: list[str]) -> int:
    from relax.args import format_config, parse_train_args
    from relax.rollout.data import PromptDataError
    from relax.rollout.dump import RolloutDataError

    from relax.train.saved_steps import CheckpointError

    config = parse_train_args(argv)
    if config.run.dry_run:
        print(format_config(config))
        try:
            print(_dry_run_prompt_data(config.run, config.rollout, config.evaluation))
            start_step = 0
            if config.run.load is not None:
                checkpoint_report, start_step = _dry_run_checkpoint(config.run)
                print(checkpoint_report)
            if config.run.mode.replays_rollouts:
                print(_dry_run_rollout_data(config.rollout, start_step, config.run.num_steps))
        except (PromptDataError, CheckpointError, RolloutDataError) as error:
            print(f"relax train: {error}", file=sys.stderr)
            return 2
        return 0
    from relax.run.loop import run_with_restarts
    from relax.ray.placement import WorkerFailed
    from relax.rollout.worker import EngineWorker
    from relax.console import RunConsole, say
    from relax.run.state import RunStopped, StopOnSignal

    outputs = config.outputs
    console = RunConsole(
        outputs.output_dir, verbose=outputs.verbose, shown_actors=(EngineWorker.__name__,) if outputs.engine_logs else (),
        append=config.run.load is not None,  # a resumed run continues its record
    )
    # SIGINT / SIGTERM: the current step finishes, then a save (with --save) and the loop's cleanup (engines,
    # actors, the local Ray it started); a second signal abandons the step. Exit 128 + signal (130, 143).
    stop = StopOnSignal()
    with console:
        try:
            with stop:
                output_dir = run_with_restarts(config, stop)
        except (CheckpointError, PromptDataError, RolloutDataError) as error:  # bad input: the message names it
            say(f"relax train: {error}", error=True)
            return 2
        except WorkerFailed as failure:  # the worker's own traceback is in its log, which the message names
            say(f"relax train: {failure}", error=True)
            return 1
        except RunStopped as stopped:
            say(f"relax train: {stopped}", error=True)
            return 128 + stopped.signum
        except KeyboardInterrupt:
            if stop.signum is None:  # not one of ours: Python's own SIGINT handling from before the handlers
                raise
            say("relax train: stopped at once by a second signal, the step abandoned; nothing saved", error=True)
            return 128 + stop.signum
        say(f"relax train: done; metrics, TensorBoard events, the reward curve and the run's log are in {output_dir}")
    return 0


def _dry_run_prompt_data(run, rollout, evaluation) -> str:
    """Read the prompt data and the eval sets as the run would (every row checked and tokenized) and return their
    load reports. Data or a model that is not there yet (a preset dry-run on a machine without them) is reported as
    not checked. `run`, `rollout`, `evaluation`: relax.args.RunSettings, RolloutSettings, EvalSettings."""
    from relax.rollout.data import load_prompts
    from relax.rollout.evaluation import load_eval_sets

    lines, hf_checkpoint = [], run.hf_checkpoint
    if run.mode.replays_rollouts:
        lines.append("prompt data: not read (the run replays --load-rollout-data)")
    elif not run.mode.reads_prompts:
        lines.append(
            "prompt data: none (--eval-only evaluates --hf-checkpoint on the eval sets once; the training flags, "
            "--num-steps, batch sizes, optimizer and loss, are checked as for a run but unused)"
        )
    else:
        path = rollout.data.path if rollout.data else None
        read = lambda tokenizer: load_prompts(rollout.data, tokenizer)[1]  # noqa: E731
        lines.append(_dry_run_data("prompt data", "--prompt-data", path, hf_checkpoint, read))
    for name, data in evaluation.datasets.items():  # (each read is called at once, within its iteration)
        read = lambda tokenizer: load_eval_sets({name: data}, tokenizer)[1][0]  # noqa: E731
        flag = f"--eval-prompt-data {name}"
        lines.append(_dry_run_data(f"eval set {name}", flag, data.path, hf_checkpoint, read))
    return "\n".join(lines)


def _dry_run_data(what: str, flag: str, path: str | None, hf_checkpoint: str | None, read) -> str:
    """`read(tokenizer)`: the data's load report."""
    absent = [
        f"{given_flag} {'not given' if given is None else f'{given} does not exist'}"
        for given_flag, given in ((flag, path), ("--hf-checkpoint", hf_checkpoint))
        if given is None or not Path(given).exists()
    ]
    if absent:
        return f"{what}: not checked ({'; '.join(absent)})"
    from transformers import AutoTokenizer

    return f"{what}: {read(AutoTokenizer.from_pretrained(hf_checkpoint)).summary()}"


def _dry_run_checkpoint(run) -> tuple[str, int | None]:
    """Check the checkpoint --load names as the run would (complete, same seed and architecture, steps left);
    `run`: relax.args.RunSettings. Returns the report and the step the run resumes at. A directory that is not there
    yet is reported as not checked (resuming at an unknown step: None)."""
    absent = [
        f"{flag} {'not given' if path is None else f'{path} does not exist'}"
        for flag, path in (("--load", run.load), ("--hf-checkpoint", run.hf_checkpoint))
        if path is None or not Path(path).exists()
    ]
    if absent:
        return f"--load: not checked ({'; '.join(absent)})", None
    from relax.run.state import read_checkpoint

    checkpoint = read_checkpoint(run.load, run.hf_checkpoint, run.seed, run.num_steps)
    return f"--load: {checkpoint.directory}, the run resumes at step {checkpoint.next_step}", checkpoint.next_step


def _dry_run_rollout_data(rollout, start_step: int | None, num_steps: int) -> str:
    """Read every step's file --load-rollout-data names, from `start_step` on, whole and checked as the run reads
    it at that step (one file at a time); `rollout`: relax.args.RolloutSettings. Reading all of it costs what the
    run's own reads cost, and only that finds a malformed group or routed experts that do not match their samples
    before the run."""
    if start_step is None:
        return "rollout data: not checked (the run's first step is that of the --load checkpoint, not checked)"
    from relax.rollout.dump import check_rollout_data

    read = check_rollout_data(
        rollout.load_data, range(start_step, num_steps), rollout.batch_size, rollout.sampling.n,
        rollout.routing_replay, read_samples=True,
    )
    return f"rollout data: {read}"


if __name__ == "__main__":
    sys.exit(main())
