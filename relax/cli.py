"""The `relax` console script: train, submit, doctor, patches.

Each subcommand imports only what it needs, so `relax patches check` works without torch on the path.
"""

import sys

USAGE = """usage: relax {train,submit,doctor,patches} ...

  train    run the colocated RL loop (`relax train --help` lists every flag; --dry-run validates and prints)
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
    if command == "patches":
        from relax.patches import main as patches_main

        return patches_main(rest)
    if command == "doctor":
        from relax.doctor import main as doctor_main

        return doctor_main(rest)
    if command == "submit":
        from relax.submit import main as submit_main

        return submit_main(rest)
    print(f"relax: unknown command {command!r}\n\n{USAGE}", file=sys.stderr, end="")
    return 2


def _train(argv: list[str]) -> int:
    from relax.args import format_config, parse_train_args

    config = parse_train_args(argv)
    if config.relax.dry_run:
        print(format_config(config))
        return 0
    from relax.loop import run

    output_dir = run(config)
    print(f"relax train: done; metrics, TensorBoard events and the reward curve are in {output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
