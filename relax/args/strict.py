"""An argparse parser that refuses what it does not know and says what was probably meant.

No abbreviations (`--lr-decay` never means `--lr-decay-style`), and an unknown flag is an error that
names the closest known flags. Flags that belong to SGLang but were given without the `--sglang-`
prefix are pointed at their prefixed spelling; flags relax sets itself are pointed at the relax flag.
A flag with a second spelling (an alias) takes one of them: given both, argparse would keep the last silently.
"""

import argparse
import difflib
import sys


class StrictArgumentParser(argparse.ArgumentParser):
    def __init__(
        self,
        *args,
        redirects: dict[str, str] | None = None,
        aliases: dict[str, str] | None = None,
        refused_values: dict[str, str] | None = None,
        **kwargs,
    ):
        """redirects: unknown flag -> the sentence to say instead of a guess (e.g. flags relax manages).
        aliases: flag -> its second spelling (an option string of the same argument), refused together.
        refused_values: "--flag value" -> the sentence to say instead of listing the flag's choices."""
        # The full usage line would list every flag (about a thousand); help and errors show a short one.
        kwargs.setdefault("usage", "%(prog)s [flag ...]   (see `%(prog)s --help`)")
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self.redirects = dict(redirects or {})
        self.aliases = dict(aliases or {})
        self.refused_values = dict(refused_values or {})

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        refused = [self.refused_values[given] for given in _flag_values(args) if given in self.refused_values]
        if refused:
            self.error("\n".join(refused))
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self.unknown_message(extras))
        both = [(flag, alias) for flag, alias in self.aliases.items() if _given(flag, args) and _given(alias, args)]
        if both:
            self.error("\n".join(f"{alias} is another spelling of {flag}: give one of them" for flag, alias in both))
        return namespace

    def known_flags(self) -> list[str]:
        return [option for action in self._actions for option in action.option_strings]

    def unknown_message(self, extras: list[str]) -> str:
        flags = [token.split("=", 1)[0] for token in extras if token.startswith("-")]
        if not flags:
            return f"unexpected value(s) {' '.join(extras)!r}: every value follows the flag it belongs to"
        return "\n".join(self.explain_unknown(flag) for flag in flags)

    def explain_unknown(self, flag: str) -> str:
        if flag in self.redirects:
            return f"unknown flag {flag}: {self.redirects[flag]}"
        # Compare without the --sglang- prefix on either side, so that an SGLang flag given without the
        # prefix is answered with its prefixed spelling, and a misspelt one with or without it is matched
        # on the part that is SGLang's.
        by_bare_spelling = {}
        for option in self.known_flags():
            by_bare_spelling.setdefault(_without_namespace(option), option)
        bare = _without_namespace(flag)
        guesses = [by_bare_spelling[bare]] if bare in by_bare_spelling else []
        for close in difflib.get_close_matches(bare, list(by_bare_spelling), n=3, cutoff=0.7):
            if by_bare_spelling[close] not in guesses:
                guesses.append(by_bare_spelling[close])
        if not guesses:
            return f"unknown flag {flag} (`relax train --help` lists every flag)"
        return f"unknown flag {flag}: did you mean {' or '.join(guesses)}?"


def _given(option: str, args: list[str]) -> bool:
    return any(token == option or token.startswith(option + "=") for token in args)


def _flag_values(args: list[str]) -> list[str]:
    """Each flag with the token after it, and each --flag=value, spelled "--flag value"."""
    pairs = [token.replace("=", " ", 1) for token in args if token.startswith("--") and "=" in token]
    return pairs + [f"{token} {value}" for token, value in zip(args, args[1:]) if token.startswith("--")]


def _without_namespace(option: str) -> str:
    for prefix, bare in (("--no-sglang-", "--no-"), ("--sglang-", "--")):
        if option.startswith(prefix):
            return bare + option[len(prefix) :]
    return option


class RefusedFlag(argparse.Action):
    """A flag relax knows but does not take: using it is an error that says why and what to do instead."""

    def __init__(self, option_strings, dest, reason, **kwargs):
        self.reason = reason
        super().__init__(option_strings, dest, nargs="?", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} {self.reason}")
