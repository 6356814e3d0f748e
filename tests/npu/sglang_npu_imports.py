"""Where SGLang imports sgl_kernel_npu at import time, read statically from its installed source.

An import is unguarded when it runs while its module is imported and nothing catches its failure: it sits in the
module body, or in module-level `if`/`with`/`for`/`while` blocks or class bodies (an `if _is_npu:` block runs on
every NPU), and not in a `try` whose handlers catch ImportError (or a base of it), nor under `if TYPE_CHECKING:`.
Imports inside functions run later, at call time; lazy_kernel_imports lists those of chosen files.
"""

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "sgl_kernel_npu"
GUARDING_EXCEPTIONS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


@dataclass(frozen=True)
class KernelImport:
    file: str  # relative to the directory holding the sglang package
    line: int
    module: str  # e.g. sgl_kernel_npu.fla.utils
    names: tuple[str, ...]  # what `from module import ...` takes; () for `import module`


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in GUARDING_EXCEPTIONS for t in types)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(body: list[ast.stmt], file: str, out: list[KernelImport]) -> None:
    for stmt in body:
        if isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and (stmt.module or "").split(".")[0] == PACKAGE:
            out.append(KernelImport(file, stmt.lineno, stmt.module, tuple(a.name for a in stmt.names)))
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.name.split(".")[0] == PACKAGE:
                    out.append(KernelImport(file, stmt.lineno, alias.name, ()))
        elif isinstance(stmt, ast.If):
            if not _is_type_checking(stmt.test):  # that block never runs
                _walk(stmt.body, file, out)
            _walk(stmt.orelse, file, out)
        elif isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            _walk(stmt.body, file, out)
            _walk(stmt.orelse, file, out)
        elif isinstance(stmt, (ast.With, ast.AsyncWith, ast.ClassDef)):
            _walk(stmt.body, file, out)
        elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            if not any(_catches_import_error(h) for h in stmt.handlers):
                _walk(stmt.body, file, out)
            for handler in stmt.handlers:
                _walk(handler.body, file, out)
            _walk(stmt.orelse, file, out)
            _walk(stmt.finalbody, file, out)


def unguarded_kernel_imports(package_dir: Path) -> list[KernelImport]:
    """Every unguarded module-level sgl_kernel_npu import in the package at package_dir (e.g. .../sglang)."""
    found: list[KernelImport] = []
    for path in sorted(package_dir.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        if PACKAGE not in source:
            continue
        _walk(ast.parse(source, filename=str(path)).body, str(path.relative_to(package_dir.parent)), found)
    return found


def lazy_kernel_imports(package_dir: Path, files: list[str]) -> list[KernelImport]:
    """The sgl_kernel_npu imports inside functions of the given files (relative to package_dir's parent): they run
    when the function is first called, on the serving path."""
    found: list[KernelImport] = []
    for file in files:
        tree = ast.parse((package_dir.parent / file).read_text(encoding="utf-8"), filename=file)
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for stmt in ast.walk(function):
                    if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").split(".")[0] == PACKAGE:
                        found.append(KernelImport(file, stmt.lineno, stmt.module, tuple(a.name for a in stmt.names)))
    return sorted(set(found), key=lambda i: (i.file, i.line))


def unresolved(imports: list[KernelImport], modules: dict[str, dict]) -> list[str]:
    """The imports that the manifest's modules do not satisfy, one line each naming file, line and what is missing."""
    problems = []
    for imp in imports:
        if imp.module not in modules:
            problems.append(f"{imp.file}:{imp.line}: no module {imp.module}")
            continue
        bound = set(modules[imp.module]["names"])
        for name in imp.names:
            if name not in bound and f"{imp.module}.{name}" not in modules:
                problems.append(f"{imp.file}:{imp.line}: {imp.module} has no {name}")
    return problems
