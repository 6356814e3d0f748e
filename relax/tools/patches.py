"""The vendored patch sets under patches/: `relax patches check` and `relax patches apply`.

patches/manifest.toml pins each upstream (repository, tag or commit, path layout, PyPI release);
patches/<upstream>/NNNN-*.patch is its series, made by `git format-patch` and applied in order by `git am`
(docker/Dockerfile.npu does exactly that on a clone of the pinned ref).

check   For an upstream on PyPI, download its wheel of the pinned version (cached under
        ~/.cache/relax/pypi, or $RELAX_CACHE_DIR/pypi), rebuild its files as a scratch git repository
        with the upstream repository's path layout (sglang -> python/sglang/...), and `git am` the series.
        Any patch that does not apply fails the check, naming the patch, the file and the hunk.
        For an upstream not on PyPI, check that every patch is well formed (mail headers, a message,
        diff headers, real-looking index lines, hunk line counts) and say that it was not applied here.
        `--checkout NAME=PATH` names a git repository of an upstream (a clone or a bare mirror holding the
        pinned ref): the series is then applied with `git am` to a scratch clone of it at the ref, whether
        or not the upstream is on PyPI; PATH itself is not changed.
apply   Patch an installed copy in place (site-packages layout), patch by patch; patches already
        applied are skipped, so running it twice is harmless.
status  Say, per patch, whether an installed copy carries it (`relax doctor` uses the same function).

This module needs only git and the standard library: it runs before torch is installed.
"""

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
PATCHES_DIR = REPO_ROOT / "patches"
MANIFEST = PATCHES_DIR / "manifest.toml"
CACHE_ENV = "RELAX_CACHE_DIR"

# The identity `git am` records as committer in scratch repositories; authors come from the patches.
_GIT_IDENTITY = [
    "-c",
    "user.name=relax patches",
    "-c",
    "user.email=patches@relax.invalid",
    "-c",
    "commit.gpgsign=false",
]


class PatchError(Exception):
    """A patch set that is malformed or does not apply; the message names the patch, file and hunk."""


@dataclass(frozen=True)
class Upstream:
    name: str  # also the directory of its series under patches/
    repository: str
    ref: str  # tag or commit the series applies to
    path_prefix: str  # where the package's files sit in the upstream repository ("" = root)
    pypi: Optional[str] = None  # PyPI distribution with a wheel of `version` (None: not on PyPI)
    version: Optional[str] = None
    package: Optional[str] = None  # import name of the installed copy `apply` patches ("megatron.core")
    patches_dir: Path = PATCHES_DIR

    @property
    def series(self) -> list[Path]:
        return sorted((self.patches_dir / self.name).glob("*.patch"))

    @property
    def strip(self) -> int:
        """-p for `git apply` on a site-packages copy: a/ plus the path prefix's components."""
        return 1 + len([part for part in self.path_prefix.split("/") if part])


_FIELDS = {"repository", "ref", "path_prefix", "pypi", "version", "package"}
_REQUIRED = {"repository", "ref", "path_prefix"}


def load_manifest(path: Path = MANIFEST) -> dict[str, Upstream]:
    """The upstreams of patches/manifest.toml by name, validated."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    entries = data.get("upstream")
    if not isinstance(entries, dict) or not entries:
        raise PatchError(f"{path}: no [upstream.<name>] tables")
    upstreams = {}
    for name, fields in entries.items():
        unknown = set(fields) - _FIELDS
        missing = _REQUIRED - set(fields)
        if unknown or missing:
            raise PatchError(
                f"{path}: [upstream.{name}] has unknown keys {sorted(unknown)} / lacks {sorted(missing)}; "
                f"allowed keys: {sorted(_FIELDS)}"
            )
        if bool(fields.get("pypi")) != bool(fields.get("version")):
            raise PatchError(f"{path}: [upstream.{name}] needs both pypi and version, or neither")
        upstreams[name] = Upstream(name=name, patches_dir=path.parent, **fields)
    return upstreams


def select(upstreams: dict[str, Upstream], names: list[str]) -> list[Upstream]:
    unknown = [name for name in names if name not in upstreams]
    if unknown:
        raise PatchError(f"unknown upstream(s) {unknown}: choose from {sorted(upstreams)} (patches/manifest.toml)")
    return [upstreams[name] for name in names] if names else list(upstreams.values())


# --------------------------------------------------------------------------------------------------
# Reading patches: enough of the git format-patch format to check it and to name hunks.


@dataclass(frozen=True)
class Hunk:
    path: str  # the file it changes, as the patch names it (b/ side, prefix stripped)
    number: int  # 1-based among that file's hunks
    header: str  # the @@ line


_MBOX_FROM = re.compile(r"^From [0-9a-f]{40} Mon Sep 17 00:00:00 2001$")
_INDEX = re.compile(r"^index ([0-9a-f]{7,40})\.\.([0-9a-f]{7,40})( [0-7]{6})?$")
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_hunks(text: str, source: str = "patch") -> list[Hunk]:
    """The hunks of a patch, checking the diff's structure as it goes.

    Raises PatchError naming `source`, the file and the hunk for: a hunk whose body does not hold the
    line counts its header announces, an index line that is not two distinct git object ids (or
    claims a zero id for a file that is neither new nor deleted), a diff with no index line.
    """
    lines = text.split("\n")
    hunks: list[Hunk] = []
    path = None
    file_state: dict = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            _finish_file(file_state, source)
            match = re.match(r"^diff --git a/(\S+) b/(\S+)$", line)
            if not match:
                raise PatchError(f"{source}: malformed diff header {line!r}")
            path = match.group(2)
            file_state = {"path": path, "index": False, "new": False, "deleted": False, "hunks": 0, "binary": False}
        elif path is not None and line.startswith("new file mode"):
            file_state["new"] = True
        elif path is not None and line.startswith("deleted file mode"):
            file_state["deleted"] = True
        elif path is not None and line.startswith("index "):
            match = _INDEX.match(line)
            if not match:
                raise PatchError(f"{source}: {path}: malformed index line {line!r}")
            old, new = match.group(1), match.group(2)
            if len(old) != len(new) or old == new:
                raise PatchError(f"{source}: {path}: index line {line!r} is not two distinct object ids")
            if (set(old) == {"0"}) != file_state["new"] or (set(new) == {"0"}) != file_state["deleted"]:
                raise PatchError(f"{source}: {path}: index line {line!r} does not match the file's mode lines")
            file_state["index"] = True
        elif path is not None and line.startswith("Binary files"):
            file_state["binary"] = True
        elif path is not None and line.startswith("@@"):
            match = _HUNK.match(line)
            if not match:
                raise PatchError(f"{source}: {path}: malformed hunk header {line!r}")
            file_state["hunks"] += 1
            hunk = Hunk(path=path, number=file_state["hunks"], header=line)
            old_count = int(match.group(2) if match.group(2) is not None else 1)
            new_count = int(match.group(4) if match.group(4) is not None else 1)
            old_seen = new_seen = 0
            i += 1
            while old_seen < old_count or new_seen < new_count:
                if i >= len(lines):
                    raise PatchError(f"{source}: {_name(hunk)}: the patch ends inside the hunk")
                body = lines[i]
                if body.startswith(" ") or body == "":  # context ("" where an editor stripped the space)
                    old_seen, new_seen = old_seen + 1, new_seen + 1
                elif body.startswith("-"):
                    old_seen += 1
                elif body.startswith("+"):
                    new_seen += 1
                elif not body.startswith("\\"):  # "\ No newline at end of file" counts for neither side
                    break
                i += 1
            if (old_seen, new_seen) != (old_count, new_count):
                raise PatchError(
                    f"{source}: {_name(hunk)}: its lines do not match the header's counts "
                    f"(header -{old_count} +{new_count}, body -{old_seen} +{new_seen})"
                )
            hunks.append(hunk)
            continue
        i += 1
    _finish_file(file_state, source)
    return hunks


def _finish_file(state: dict, source: str) -> None:
    if not state:
        return
    if not state["index"]:
        raise PatchError(f"{source}: {state['path']}: diff without an index line (not made by git)")
    if not state["hunks"] and not state["binary"] and not (state["new"] or state["deleted"]):
        raise PatchError(f"{source}: {state['path']}: diff without hunks")


def _name(hunk: Hunk) -> str:
    return f"{hunk.path}: hunk #{hunk.number} ({hunk.header.split(' @@')[0]} @@)"


def check_well_formed(patch: Path) -> list[Hunk]:
    """Check one `git format-patch` file without its upstream; return its hunks."""
    text = patch.read_text()
    source = _rel(patch)
    lines = text.split("\n")
    if not _MBOX_FROM.match(lines[0]):
        raise PatchError(f"{source}: does not start with git format-patch's 'From <commit> Mon Sep 17 ...' line")
    header_end = lines.index("") if "" in lines else len(lines)
    headers = lines[1:header_end]
    for required in ("From: ", "Date: ", "Subject: "):
        if not any(h.startswith(required) for h in headers):
            raise PatchError(f"{source}: no {required.strip()} header")
    if "\ndiff --git " not in text:
        raise PatchError(f"{source}: contains no diff")
    message = text[text.index("\n\n") : text.index("\n---\n")] if "\n---\n" in text else ""
    if not message.strip():
        raise PatchError(f"{source}: its message is empty: say what the patch changes and why")
    hunks = parse_hunks(text[text.index("\ndiff --git ") + 1 :], source)
    if not hunks and "Binary files" not in text and "new file mode" not in text and "deleted file mode" not in text:
        raise PatchError(f"{source}: no hunks")
    return hunks


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------------------------------
# Upstream sources rebuilt from PyPI


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "relax")


def fetch_wheel(upstream: Upstream) -> Path:
    """The PyPI wheel of the pinned version, downloaded once with pip into the cache."""
    dest = cache_dir() / "pypi"
    pattern = f"{re.sub(r'[-_.]+', '_', upstream.pypi)}-{upstream.version}-*.whl"
    found = sorted(dest.glob(pattern))
    if not found:
        dest.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--dest",
            str(dest),
            f"{upstream.pypi}=={upstream.version}",
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        found = sorted(dest.glob(pattern))
        if result.returncode != 0 or not found:
            raise PatchError(
                f"{upstream.name}: could not download {upstream.pypi}=={upstream.version} from PyPI "
                f"({' '.join(command)}):\n{result.stderr.strip()}"
            )
    return found[0]


def build_scratch_repo(upstream: Upstream, wheel: Path, root: Path) -> Path:
    """A git repository at `root` holding the wheel's package files under the upstream's path layout.

    Compiled extensions and the .dist-info directory are left out: they are not upstream source.
    """
    prefix = Path(root, upstream.path_prefix)
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            top = member.filename.split("/", 1)[0]
            if member.is_dir() or top.endswith((".dist-info", ".data")) or member.filename.endswith((".so", ".pyd")):
                continue
            target = prefix / member.filename
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
    _git(root, "init", "--quiet")
    _git(root, "add", "--all")
    _git(
        root, *_GIT_IDENTITY, "commit", "--quiet", "--no-verify", "-m", f"{upstream.name} {upstream.version} from PyPI"
    )
    return root


def _git(cwd: Path, *args: str, check: bool = True, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    result = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env)
    if check and result.returncode != 0:
        raise PatchError(f"git {' '.join(args)} failed in {cwd}:\n{result.stdout}{result.stderr}")
    return result


def clone_checkout(upstream: Upstream, checkout: Path, root: Path) -> Path:
    """A scratch clone at `root` of the git repository `checkout`, at the upstream's pinned ref."""
    if not checkout.exists():
        raise PatchError(f"{upstream.name}: --checkout {checkout} does not exist")
    _git(root, "clone", "--quiet", "--shared", "--no-checkout", str(checkout.resolve()), ".")
    if _git(root, "rev-parse", "--verify", "--quiet", f"{upstream.ref}^{{commit}}", check=False).returncode:
        raise PatchError(
            f"{upstream.name}: {checkout} has no {upstream.ref} (the ref patches/manifest.toml pins): fetch it there "
            f"(git -C {checkout} fetch {upstream.repository} tag {upstream.ref})"
        )
    _git(root, "checkout", "--quiet", "--detach", upstream.ref)
    return root


def apply_series_with_git_am(upstream: Upstream, repo: Path, target: str) -> None:
    """`git am` the whole series in order to `repo` (`target` names it in errors); on a failure, raise naming
    the patch, file and hunk(s)."""
    for patch in upstream.series:
        result = _git(repo, *_GIT_IDENTITY, "am", "--quiet", str(patch), check=False)
        if result.returncode != 0:
            details = _rejected_hunks(repo, patch)
            _git(repo, "am", "--abort", check=False)
            raise PatchError(
                f"{upstream.name}: {_rel(patch)} does not apply to {target}:\n"
                + "\n".join(f"  {line}" for line in details or [result.stderr.strip() or result.stdout.strip()])
            )


def _rejected_hunks(repo: Path, patch: Path) -> list[str]:
    """Which hunks of `patch` fail on the repository's current tree, as 'file: hunk #n (@@ ... @@): why'."""
    hunks = parse_hunks(patch.read_text(), _rel(patch))
    # A real apply with --reject (on the scratch tree, which is thrown away) reports every hunk: --check
    # would stop at the first failure.
    result = _git(repo, "apply", "--verbose", "--reject", str(patch), check=False)
    messages = []
    missing = re.findall(r"error: (\S+): (does not exist in index|No such file or directory)", result.stderr)
    for path, _ in missing:
        messages.append(f"{path}: the file does not exist upstream")
    # With --reject git reports, per file, "Hunk #n applied cleanly." or "Rejected hunk #n.".
    current = None
    for line in (result.stdout + result.stderr).splitlines():
        match = re.match(r"^(?:Checking patch|Applying patch) (\S+)", line)
        if match:
            current = match.group(1)
        match = re.match(r"^Rejected hunk #(\d+)\.", line)
        if match and current:
            number = int(match.group(1))
            hunk = next((h for h in hunks if h.path == current and h.number == number), None)
            messages.append(f"{_name(hunk) if hunk else f'{current}: hunk #{number}'}: does not apply")
    if not messages:
        # a failure git reports only by position ("patch failed: FILE:LINE"): find the hunk by its line
        match = re.search(r"error: patch failed: (\S+):(\d+)", result.stderr)
        if match:
            path, line = match.group(1), int(match.group(2))
            hunk = next((h for h in hunks if h.path == path and _HUNK.match(h.header).group(1) == str(line)), None)
            messages.append(f"{_name(hunk) if hunk else f'{path}: the hunk at line {line}'}: does not apply")
    return messages


# --------------------------------------------------------------------------------------------------
# Commands


def check(upstreams: list[Upstream], out=None, checkouts: Optional[dict[str, Path]] = None) -> list[str]:
    """Check every named upstream's series, applying it to the git repository `checkouts` names for the upstream
    (at its pinned ref), else to its PyPI wheel's files, else for form only; return the failures (empty when all
    is well)."""
    out = out or sys.stdout
    checkouts = checkouts or {}
    failures = []
    for upstream in upstreams:
        series = upstream.series
        try:
            for patch in series:
                check_well_formed(patch)
            if not series:
                print(f"{upstream.name}: no patches", file=out)
                continue
            if upstream.name in checkouts:
                checkout = checkouts[upstream.name]
                with tempfile.TemporaryDirectory(prefix=f"relax-patches-{upstream.name}-") as scratch:
                    repo = clone_checkout(upstream, checkout, Path(scratch))
                    commit = _git(repo, "rev-parse", "--short=12", "HEAD").stdout.strip()
                    apply_series_with_git_am(upstream, repo, f"{upstream.ref} of {checkout}")
                print(
                    f"{upstream.name} {upstream.ref}: {len(series)} patch(es) apply with git am "
                    f"(checkout {checkout} at {commit})",
                    file=out,
                )
                continue
            if not upstream.pypi:
                print(
                    f"{upstream.name} {upstream.ref}: {len(series)} patch(es) well formed; NOT applied here "
                    f"({upstream.name} is not on PyPI: the Docker build applies them with git am "
                    f"to {upstream.repository}; --checkout {upstream.name}=PATH applies them to a clone)",
                    file=out,
                )
                continue
            wheel = fetch_wheel(upstream)
            with tempfile.TemporaryDirectory(prefix=f"relax-patches-{upstream.name}-") as scratch:
                repo = build_scratch_repo(upstream, wheel, Path(scratch))
                apply_series_with_git_am(upstream, repo, f"{upstream.pypi} {upstream.version}")
            print(
                f"{upstream.name} {upstream.version}: {len(series)} patch(es) apply with git am ({wheel.name})",
                file=out,
            )
        except PatchError as error:
            failures.append(str(error))
            print(f"FAILED {error}", file=out)
    return failures


def installed_root(upstream: Upstream) -> Path:
    """The directory holding the installed package's top-level directory (site-packages, usually)."""
    if not upstream.package:
        raise PatchError(
            f"{upstream.name} has no installed-package layout in the manifest: apply its series with git am "
            f"in a checkout of {upstream.repository} at {upstream.ref} (see docker/Dockerfile.npu)"
        )
    spec = importlib.util.find_spec(upstream.package)
    if spec is None or not spec.origin:
        raise PatchError(f"{upstream.name}: {upstream.package} is not installed in {sys.executable}")
    return Path(spec.origin).parents[len(upstream.package.split("."))]


def _git_apply(root: Path, upstream: Upstream, patch: Path, *flags: str) -> subprocess.CompletedProcess:
    # GIT_CEILING_DIRECTORIES keeps git from treating an enclosing repository (a venv inside a checkout)
    # as the tree to patch: paths are then taken relative to `root`.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.resolve().parent))
    return _git(root, "apply", f"-p{upstream.strip}", *flags, str(patch.resolve()), check=False, env=env)


def patch_states(upstream: Upstream, root: Path) -> dict[str, str]:
    """Per patch file name: 'applied', 'not applied' or 'conflicts' for the copy under `root`.

    Judged patch by patch against the current files, so it assumes the series' patches touch
    different lines (true of relax's sets; a test applies them one by one).
    """
    states = {}
    for patch in upstream.series:
        if _git_apply(root, upstream, patch, "--check", "--reverse").returncode == 0:
            states[patch.name] = "applied"
        elif _git_apply(root, upstream, patch, "--check").returncode == 0:
            states[patch.name] = "not applied"
        else:
            states[patch.name] = "conflicts"
    return states


def apply(upstream: Upstream, root: Path, out=None) -> None:
    """Apply the series in place to the copy under `root`, skipping patches it already carries."""
    out = out or sys.stdout
    for patch in upstream.series:
        if _git_apply(root, upstream, patch, "--check", "--reverse").returncode == 0:
            print(f"{upstream.name}: {patch.name} already applied", file=out)
            continue
        result = _git_apply(root, upstream, patch)
        if result.returncode != 0:
            raise PatchError(
                f"{upstream.name}: {_rel(patch)} does not apply to the copy under {root}:\n{result.stderr.strip()}"
            )
        print(f"{upstream.name}: applied {patch.name}", file=out)


def parse_checkouts(values: list[str], upstreams: dict[str, Upstream]) -> dict[str, Path]:
    """--checkout NAME=PATH values by upstream name, each NAME one of the manifest's."""
    checkouts = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not path:
            raise PatchError(f"--checkout {value!r}: give NAME=PATH, e.g. --checkout sgl-kernel-npu=../sgl-kernel-npu")
        select(upstreams, [name])
        checkouts[name] = Path(path)
    return checkouts


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="relax patches", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("check", "apply every set to its pinned upstream in a scratch git repository (git am)"),
        ("apply", "patch the installed copies in place (site-packages layout)"),
        ("status", "say which patches the installed copies carry"),
    ):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("upstreams", nargs="*", help="names from patches/manifest.toml (default: all)")
        if name == "check":
            sub.add_argument(
                "--checkout", action="append", default=[], metavar="NAME=PATH",
                help="apply NAME's set to a clone of the git repository PATH at the pinned ref (repeatable)",
            )
        if name in ("apply", "status"):
            sub.add_argument(
                "--target", type=Path, help="directory holding the package (default: where it is installed)"
            )
        sub.add_argument("--manifest", type=Path, default=MANIFEST, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        upstreams = load_manifest(args.manifest)
        if args.command == "check":
            failures = check(select(upstreams, args.upstreams), checkouts=parse_checkouts(args.checkout, upstreams))
            return 1 if failures else 0
        chosen = select(upstreams, args.upstreams) if args.upstreams else [u for u in upstreams.values() if u.package]
        for upstream in chosen:
            root = args.target or installed_root(upstream)
            if args.command == "apply":
                apply(upstream, root)
            else:
                for patch, state in patch_states(upstream, root).items():
                    print(f"{upstream.name}: {patch}: {state}")
        return 0
    except PatchError as error:
        print(f"relax patches: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
