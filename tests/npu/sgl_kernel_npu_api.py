"""The Python API of an sgl-kernel-npu tree, read statically: module paths and the names each binds at top level.

    python tests/npu/sgl_kernel_npu_api.py CHECKOUT --ref REF > tests/npu/data/sgl_kernel_npu_api.json

CHECKOUT is a git checkout of sgl-project/sgl-kernel-npu at REF, the pin of patches/manifest.toml, without relax's
series. The package lives at python/sgl_kernel_npu/sgl_kernel_npu there; every .py file under it is parsed with
`ast` (nothing is imported: the package needs torch_npu and CANN). A name counts as bound at top level when any
statement of the module body binds it, also inside module-level if/try/with blocks: such blocks run at import.

relax's series (patches/sgl-kernel-npu) adds modules to that tree; series_api() reads them from the patch files,
so the manifest need not change when the series does. The series must only add files to the package: a patch that
changes one of its existing files is refused (its result cannot be read without the upstream file).

The manifest and the series are data for tests/npu: the static check of SGLang's imports and the stand-in package
of the dynamic check are built from them.
"""

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = "sgl_kernel_npu"
PACKAGE_DIR = Path("python/sgl_kernel_npu/sgl_kernel_npu")  # inside an sgl-kernel-npu checkout


def _target_names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for element in target.elts for name in _target_names(element)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return []  # attribute or subscript targets bind no module name


def top_level_names(body: list[ast.stmt]) -> tuple[set[str], list[str]]:
    """The names a module body binds, and the modules it star-imports (`from X import *`, relative as written)."""
    names: set[str] = set()
    star_imports: list[str] = []
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                names.update(_target_names(target))
        elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
            names.update(_target_names(stmt.target))
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if alias.name == "*":
                    star_imports.append("." * stmt.level + (stmt.module or ""))
                else:
                    names.add(alias.asname or alias.name)
        elif isinstance(stmt, (ast.For, ast.AsyncFor)):
            names.update(_target_names(stmt.target))
        # Module-level blocks run at import: what they bind is part of the module.
        blocks: list[list[ast.stmt]] = []
        if isinstance(stmt, (ast.If, ast.For, ast.AsyncFor, ast.While)):
            blocks = [stmt.body, stmt.orelse]
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            blocks = [stmt.body]
            for item in stmt.items:
                if item.optional_vars is not None:
                    names.update(_target_names(item.optional_vars))
        elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            blocks = [stmt.body, stmt.orelse, stmt.finalbody] + [handler.body for handler in stmt.handlers]
        for block in blocks:
            block_names, block_stars = top_level_names(block)
            names |= block_names
            star_imports += block_stars
    return names, star_imports


def _module_entry(source: str, filename: str, is_package: bool) -> dict:
    names, star_imports = top_level_names(ast.parse(source, filename=filename).body)
    entry = {"package": is_package, "names": sorted(names)}
    if star_imports:
        entry["star_imports"] = star_imports
    return entry


def module_name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGE, *parts])


def read_api(package_dir: Path) -> dict[str, dict]:
    """{module: {"package": bool, "names": [...], "star_imports": [...]}} for every .py file under package_dir."""
    modules: dict[str, dict] = {}
    for path in sorted(package_dir.rglob("*.py")):
        entry = _module_entry(path.read_text(encoding="utf-8"), str(path), path.name == "__init__.py")
        modules[module_name(path.relative_to(package_dir))] = entry
    # A directory without __init__.py is a namespace package: importable, binding nothing of its own.
    for directory in sorted(p for p in package_dir.rglob("*") if p.is_dir() and any(p.rglob("*.py"))):
        name = module_name(directory.relative_to(package_dir) / "__init__.py")
        modules.setdefault(name, {"package": True, "names": []})
    return dict(sorted(modules.items()))


def series_api(patch_dir: Path) -> dict[str, dict]:
    """The modules relax's sgl-kernel-npu series adds to the package, read from its patch files (git format-patch)."""
    modules: dict[str, dict] = {}
    for patch in sorted(patch_dir.glob("*.patch")):
        # One section per file: "diff --git a/X b/X", headers, then hunks.
        for section in re.split(r"^(?=diff --git )", patch.read_text(encoding="utf-8"), flags=re.M)[1:]:
            path = Path(re.match(r"diff --git a/\S+ b/(\S+)", section).group(1))
            if path.suffix != ".py" or PACKAGE_DIR not in path.parents:
                continue
            if not re.search(r"^new file mode ", section, flags=re.M):
                raise ValueError(
                    f"{patch.name} changes {path}, a module of the pinned sgl-kernel-npu: the series may only add "
                    "modules (tests/npu reads their API from the patch); put the change in a new module"
                )
            hunk = section[section.index("\n@@ ") + 1 :]
            source = "".join(line[1:] + "\n" for line in hunk.splitlines() if line.startswith("+"))
            relative = path.relative_to(PACKAGE_DIR)
            modules[module_name(relative)] = _module_entry(source, f"{patch.name}:{path}", path.name == "__init__.py")
    return modules


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a git checkout of sgl-project/sgl-kernel-npu")
    parser.add_argument("--ref", required=True, help="the upstream tag the checkout was made from")
    args = parser.parse_args(argv)
    package_dir = args.checkout / PACKAGE_DIR
    if not package_dir.is_dir():
        parser.error(f"{args.checkout} has no {PACKAGE_DIR}: give a checkout of sgl-project/sgl-kernel-npu")

    def commit(rev: str) -> str:
        return subprocess.run(
            ["git", "-C", str(args.checkout), "rev-parse", f"{rev}^{{commit}}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    upstream_commit = commit(args.ref)
    if commit("HEAD") != upstream_commit:
        parser.error(f"{args.checkout} is not at {args.ref}: check out the tag itself, without relax's series")
    manifest = {
        "repository": "https://github.com/sgl-project/sgl-kernel-npu",
        "ref": args.ref,
        "commit": upstream_commit,
        "generated_by": "tests/npu/sgl_kernel_npu_api.py",
        "modules": read_api(package_dir),
    }
    json.dump(manifest, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
