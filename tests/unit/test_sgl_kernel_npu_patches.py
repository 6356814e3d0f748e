"""patches/sgl-kernel-npu is what relax/tools/sgl_kernel_npu_patches.py writes from relax/kernels/sgl_kernel_npu:
regenerated here on a stand-in repository holding the pinned tag (the series only adds files, so the patches do not
depend on the tree's other contents), they must equal the committed ones. Applying the committed series to a real
checkout of the pinned tag is `relax patches check --checkout sgl-kernel-npu=PATH` (docs/npu.md)."""

import subprocess
from pathlib import Path

from relax.tools import patches
from relax.tools import sgl_kernel_npu_patches as series

REPO = Path(__file__).resolve().parents[2]


def _message_and_diff(text: str) -> tuple[str, str]:
    """The mail headers and message, and the diffs; not the diffstat between them, whose layout is git's."""
    return text[:text.index("\n---\n")], text[text.index("\ndiff --git "):]


def test_committed_series_is_what_the_generator_writes_from_relax_sources(tmp_path):
    stand_in = tmp_path / "sgl-kernel-npu"
    (stand_in / series.PACKAGE_DIR).mkdir(parents=True)
    (stand_in / series.PACKAGE_DIR / "__init__.py").write_text("")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=stand_in, check=True)
    subprocess.run([*git, "add", "-A"], cwd=stand_in, check=True)
    subprocess.run([*git, "commit", "-qm", "stand-in"], cwd=stand_in, check=True)
    subprocess.run([*git, "tag", patches.load_manifest()[series.UPSTREAM].ref], cwd=stand_in, check=True)

    written = series.write_series(stand_in, out_dir=tmp_path / "out")
    committed = patches.load_manifest()[series.UPSTREAM].series
    assert [p.name for p in written] == [p.name for p in committed], "regenerate: python -m " \
        "relax.tools.sgl_kernel_npu_patches CHECKOUT"
    for new, old in zip(written, committed):
        assert _message_and_diff(new.read_text()) == _message_and_diff(old.read_text()), (
            f"{old.name} differs from what relax/tools/sgl_kernel_npu_patches.py writes from relax's sources: "
            "regenerate with python -m relax.tools.sgl_kernel_npu_patches CHECKOUT")


def test_every_kernel_module_is_carried_once():
    carried = [module for patch in series.SERIES for module in patch.modules]
    sources = sorted(p.stem for p in series.SOURCE_DIR.glob("*.py"))
    assert sorted(carried) == sources, "each relax/kernels/sgl_kernel_npu module goes into exactly one patch"
