"""The static readers behind tests/npu: top-level names of a module, SGLang's unguarded kernel imports, and the
modules a patch series adds."""

import ast
import subprocess
import textwrap
from pathlib import Path

import pytest

import sgl_kernel_npu_api
from sglang_npu_imports import unguarded_kernel_imports, unresolved


def test_top_level_names_include_module_level_blocks_not_function_bodies():
    source = textwrap.dedent(
        """
        import os, torch.nn as nn
        from x import (a, b as c)
        d, (e, f) = 1, (2, 3)
        g: int = 4
        if os.name:
            def h(): import inner
        else:
            class I: pass
        try:
            from y import j
        except ImportError:
            j = None
        with open("f") as k:
            pass
        """
    )
    names, stars = sgl_kernel_npu_api.top_level_names(ast.parse(source).body)
    assert names == {"os", "nn", "a", "c", "d", "e", "f", "g", "h", "I", "j", "k"}
    assert stars == []


def _write(root: Path, relative: str, source: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))


def test_unguarded_imports_are_module_level_ones_that_nothing_catches(tmp_path):
    _write(
        tmp_path,
        "sglang/m.py",
        """
        from sgl_kernel_npu.a import f
        if _is_npu:
            from sgl_kernel_npu.b import g, h
        class C:
            import sgl_kernel_npu.c
        try:
            from sgl_kernel_npu.guarded import x
        except (ImportError, RuntimeError):
            pass
        try:
            from sgl_kernel_npu.unguarded import y
        except RuntimeError:
            pass
        def later():
            from sgl_kernel_npu.lazy import z
        if TYPE_CHECKING:
            from sgl_kernel_npu.typing_only import T
        """,
    )
    found = {(i.module, i.names) for i in unguarded_kernel_imports(tmp_path / "sglang")}
    assert found == {
        ("sgl_kernel_npu.a", ("f",)),
        ("sgl_kernel_npu.b", ("g", "h")),
        ("sgl_kernel_npu.c", ()),
        ("sgl_kernel_npu.unguarded", ("y",)),
    }
    api = {
        "sgl_kernel_npu.a": {"package": False, "names": ["f"]},
        "sgl_kernel_npu.b": {"package": True, "names": ["g"]},
        "sgl_kernel_npu.b.h": {"package": False, "names": []},  # a submodule satisfies `from b import h`
        "sgl_kernel_npu.c": {"package": False, "names": []},
    }
    assert unresolved(unguarded_kernel_imports(tmp_path / "sglang"), api) == [
        "sglang/m.py:12: no module sgl_kernel_npu.unguarded"
    ]


def _git(repo: Path, *args: str) -> str:
    identity = ["-c", "user.name=t", "-c", "user.email=t@t.invalid", "-c", "commit.gpgsign=false"]
    return subprocess.run(["git", *identity, "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def kernel_tree(tmp_path):
    repo = tmp_path / "sgl-kernel-npu"
    _write(repo, "python/sgl_kernel_npu/sgl_kernel_npu/fla/utils.py", "def prepare(): pass\n")
    _git(repo.parent, "init", "-q", str(repo))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "upstream")
    return repo


def _series(repo: Path, out: Path) -> Path:
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "relax change")
    _git(repo, "format-patch", "-q", "-1", "-o", str(out))
    return out


def test_series_api_reads_the_modules_a_series_adds(kernel_tree, tmp_path):
    fused = "import torch\n\n\ndef fused(x):\n    return x\n"
    _write(kernel_tree, "python/sgl_kernel_npu/sgl_kernel_npu/activation/fused.py", fused)
    _write(kernel_tree, "README.md", "not a module\n")
    modules = sgl_kernel_npu_api.series_api(_series(kernel_tree, tmp_path / "series"))
    assert modules == {"sgl_kernel_npu.activation.fused": {"package": False, "names": ["fused", "torch"]}}


def test_series_api_refuses_a_series_that_changes_an_upstream_module(kernel_tree, tmp_path):
    _write(kernel_tree, "python/sgl_kernel_npu/sgl_kernel_npu/fla/utils.py", "def prepare(): pass\ndef more(): pass\n")
    with pytest.raises(ValueError, match=r"changes python/sgl_kernel_npu/sgl_kernel_npu/fla/utils\.py.*only add"):
        sgl_kernel_npu_api.series_api(_series(kernel_tree, tmp_path / "series"))


def test_read_api_names_every_module_of_a_checkout(kernel_tree):
    api = sgl_kernel_npu_api.read_api(kernel_tree / sgl_kernel_npu_api.PACKAGE_DIR)
    # fla has no __init__.py: a namespace package, importable, binding nothing.
    assert api == {
        "sgl_kernel_npu.fla": {"package": True, "names": []},
        "sgl_kernel_npu.fla.utils": {"package": False, "names": ["prepare"]},
    }
