"""SGLang's flags as `--sglang-<flag>`, taken at run time from the installed SGLang, and back to a ServerArgs.

Every action of `ServerArgs.add_cli_args` is re-registered with each option string prefixed
(`--foo` -> `--sglang-foo`, `--no-foo` -> `--no-sglang-foo`) and its dest prefixed with `sglang_`;
type, nargs, choices, default, help and the action class itself are SGLang's. The ServerArgs is then
built by SGLang's own `from_cli_args` from a Namespace with the unprefixed dests, exactly as
`sglang.srt.server_args.prepare_server_args` does.
"""

import argparse
import copy
import functools

import msgspec
import yaml

from relax.args.strict import RefusedFlag
from relax.args.unsupported import MANAGED_BY_RELAX, refused_sglang_field

PREFIX = "sglang"


def prepare_import(requested_device: str) -> None:
    """Run the platform's step that must come before the first `import sglang` in this process.

    Parsing imports SGLang's ServerArgs, and SGLang decides its device at import (is_cpu() is cached; the
    CPU engine needs SGLANG_USE_CPU_ENGINE=1 first: relax.platform.cpu_sglang). The requested platform is
    prepared when this machine has it; otherwise (a dry run of a GPU/NPU script on a CPU machine) this
    machine's own platform is, since that is where this process would run SGLang.
    """
    from relax.platform import get_platform

    for name in (requested_device, "auto"):
        try:
            platform = get_platform(name)
        except RuntimeError:  # that device is not on this machine
            continue
        platform.prepare_sglang()
        return


def prefixed(option: str) -> str:
    if option.startswith("--no-"):
        return f"--no-{PREFIX}-{option[5:]}"
    return f"--{PREFIX}-{option[2:]}"


@functools.cache
def sglang_parser() -> argparse.ArgumentParser:
    """SGLang's own parser, as prepare_server_args builds it (without -h)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve", add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser


def sglang_actions() -> list[argparse.Action]:
    """Every flag of ServerArgs.add_cli_args except --config (relax's --sglang-config replaces it)."""
    return [a for a in sglang_parser()._actions if "--config" not in a.option_strings]


def add_sglang_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "SGLang engine (every flag of the installed sglang.srt.server_args.ServerArgs, prefixed with --sglang-)"
    )
    group.add_argument(
        "--sglang-config",
        metavar="YAML",
        help="SGLang's --config: a YAML file whose keys are SGLang flags (without the prefix); flags given "
        "on the command line override it.",
    )
    for action in sglang_actions():
        options = [prefixed(o) for o in action.option_strings]
        why = refusal(action.dest)
        if why is not None:
            group.add_argument(
                *options, action=RefusedFlag, dest=f"{PREFIX}_{action.dest}", reason=why, help=f"Refused: it {why}."
            )
            continue
        # A copy of SGLang's own action object keeps its class, type, nargs, choices, default, required and
        # help; only the spellings and the dest change. argparse has no public way to add an existing action.
        clone = copy.copy(action)
        clone.option_strings = options
        clone.dest = f"{PREFIX}_{action.dest}"
        if clone.metavar is None and clone.choices is None:  # show SGLang's name, not the prefixed dest
            clone.metavar = action.dest.upper()
        if getattr(clone, "new_flag", None):  # deprecation warnings name the replacement flag
            clone.new_flag = prefixed(clone.new_flag)
        group._add_action(clone)


def refusal(field: str) -> str | None:
    """Why --sglang-<field> is refused, as its error says it after the flag; None where relax takes the field."""
    if field in MANAGED_BY_RELAX:
        return f"is set by relax: {MANAGED_BY_RELAX[field]}"
    refused = refused_sglang_field(field)
    return None if refused is None else f"is not supported: {refused.reason}; {refused.instead}"


def redirects() -> dict[str, str]:
    """Unprefixed spellings of the managed flags -> what to use instead (for unknown-flag messages)."""
    return {
        o: MANAGED_BY_RELAX[a.dest] for a in sglang_actions() if a.dest in MANAGED_BY_RELAX for o in a.option_strings
    }


def expand_sglang_config(argv: list[str], error) -> list[str]:
    """Put the flags of `--sglang-config FILE` in front of argv, so the command line overrides the file.

    SGLang does this for --config in prepare_server_args: its ConfigArgumentMerger turns the YAML into
    `--key value` tokens placed before the other arguments. relax uses that same merger on SGLang's parser
    and then prefixes the flag tokens, so the file means exactly what it means to SGLang.
    """
    positions = [i for i, a in enumerate(argv) if a == "--sglang-config" or a.startswith("--sglang-config=")]
    if not positions:
        return argv
    if len(positions) > 1:
        error("--sglang-config given more than once")
    i = positions[0]
    path = argv[i].partition("=")[2] if "=" in argv[i] else (argv[i + 1] if i + 1 < len(argv) else "")
    if not path:
        error("--sglang-config needs a YAML file")
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    keys = _config_keys(path, error)
    try:
        tokens = ConfigArgumentMerger(sglang_parser()).merge_config_with_args(["--config", path])
    except ValueError as exc:
        error(f"--sglang-config {path}: {exc}")
    flag_tokens = {f"--{key}" for key in keys}
    return [prefixed(t) if t in flag_tokens else t for t in tokens] + argv


def _config_keys(path: str, error) -> list[str]:
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        error(f"--sglang-config {path}: {exc}")
    if not isinstance(data, dict):
        error(f"--sglang-config {path}: the file must hold a mapping of SGLang flags to values")
    by_option = {o: a for a in sglang_actions() for o in a.option_strings}
    for key in data:
        action = by_option.get(f"--{key}")
        if action is None:
            import difflib

            guess = difflib.get_close_matches(f"--{key}", list(by_option), n=1, cutoff=0.75)
            hint = f": did you mean {guess[0][2:]!r}?" if guess else " (keys are SGLang flags without the leading --)"
            error(f"--sglang-config {path}: unknown SGLang flag {key!r}{hint}")
        why = refusal(action.dest)
        if why is not None:
            error(f"--sglang-config {path}: {key!r} {why}")
    return list(data)


def _given(action: argparse.Action, argv: list[str]) -> bool:
    """Whether one of the action's --sglang-* spellings is in argv (relax's parser takes no abbreviations)."""
    flags = [prefixed(option) for option in action.option_strings]
    return any(token == flag or token.startswith(flag + "=") for token in argv for flag in flags)


def build_server_args(namespace: argparse.Namespace, argv: list[str], managed: dict, defaults: dict):
    """A real ServerArgs from the `sglang_*` dests, the managed fields relax fills (`managed`), and relax's
    defaults for this platform (`defaults`, relax.rollout.engine_fields.server_defaults) under every field whose
    flag is not in argv: the ServerArgs the engine runs with, so --dry-run shows it."""
    from sglang.srt.server_args import ServerArgs

    values = {}
    for action in sglang_actions():
        if refusal(action.dest) is not None:  # relax's own value goes in below, or SGLang's default stays
            values[action.dest] = action.default
        elif action.dest in defaults and not _given(action, argv):
            values[action.dest] = defaults[action.dest]
        else:
            values[action.dest] = getattr(namespace, f"{PREFIX}_{action.dest}")
    unknown = set(managed) - set(MANAGED_BY_RELAX)
    assert not unknown, f"not a relax-managed ServerArgs field: {unknown}"
    values.update(managed)
    # prepare_server_args records whether the flag was given (a model override reads it); so does relax.
    radix_eviction_policy = next(a for a in sglang_actions() if a.dest == "radix_eviction_policy")
    values["_radix_eviction_policy_explicitly_set"] = _given(radix_eviction_policy, argv)
    return ServerArgs.from_cli_args(argparse.Namespace(**values))


def server_args_fields(server_args) -> dict:
    return {f.name: getattr(server_args, f.name) for f in msgspec.structs.fields(type(server_args))}
