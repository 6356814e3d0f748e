"""The `relax` console script: train, convert, submit, doctor, patches.

Each subcommand imports only what it needs, so `relax patches check` works without torch on the path.
"""

import sys

USAGE = """usage: relax {train,convert,submit,doctor,patches} ...

  train    run the RL loop (`relax train --help` lists every flag; --dry-run validates and prints)
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
    from relax.run.inputs import InputError, read_inputs
    from relax.train.saved_steps import CheckpointError

    bad_input = (InputError, CheckpointError, PromptDataError, RolloutDataError)  # each message names the input
    config = parse_train_args(argv)
    if config.run.dry_run:
        from relax.args.memory import memory_report
        from relax.platform import platform_facts
        from relax.ray.placement import placement_plan

        run, mode = config.run, config.run.mode
        print(format_config(config))
        print("\n".join(placement_plan(
            run.num_nodes, run.num_devices_per_node, config.rollout.devices_per_engine, run.rollout_num_devices,
            mode.has_actor, mode.has_engines,
        )))
        if mode.has_actor:
            print("\n".join(memory_report(config.flags, config.megatron, platform_facts(config.flags.device))))
    try:  # before the run's console opens: it would start a new run.log in an --output-dir it refuses
        inputs = read_inputs(config, dry_run=config.run.dry_run)
    except bad_input as error:
        print(f"relax train: {error}", file=sys.stderr)
        return 2
    if config.run.dry_run:
        print("\n".join(inputs.report))
        return 0
    from relax.run import loop, loop_async
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
        for line in inputs.report:
            say(line)
        try:
            with stop:
                attempt = loop.run if config.run.colocate else loop_async.run
                output_dir = loop.run_with_restarts(config, inputs, stop, attempt)
        except bad_input as error:
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


if __name__ == "__main__":
    sys.exit(main())
