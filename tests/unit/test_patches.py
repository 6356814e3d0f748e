"""relax/tools/patches.py and patches/: the manifest, the series' form, and in-place apply on copies.

Applying each series to its pinned upstream (which downloads from PyPI) is tests/e2e/test_patches_check.py.
"""

import importlib.util
import io
import re
import runpy
import shutil
import subprocess
from pathlib import Path

import pytest

from relax.tools import patches

REPO = Path(__file__).resolve().parents[2]
PINS = runpy.run_path(str(REPO / "relax" / "pins.py"))


def _site_packages() -> Path:
    """Where the venv's packages are, found without importing them."""
    return Path(importlib.util.find_spec("megatron.core").origin).parents[2]


@pytest.fixture(scope="module")
def upstreams():
    return patches.load_manifest()


def test_manifest_lists_every_series_directory(upstreams):
    directories = {p.name for p in (REPO / "patches").iterdir() if p.is_dir()}
    assert directories <= set(upstreams), f"patch directories without a manifest entry: {directories - set(upstreams)}"
    assert {"sglang", "megatron-core", "sgl-kernel-npu", "mindspeed"} <= set(upstreams)


def test_manifest_versions_and_refs_agree_with_pins(upstreams):
    assert upstreams["sglang"].version == PINS["SGLANG"]
    assert upstreams["sglang"].ref == f"v{PINS['SGLANG']}"
    assert upstreams["megatron-core"].version == PINS["MEGATRON_CORE"]
    assert upstreams["megatron-core"].ref == PINS["MEGATRON_LM"] == f"core_v{PINS['MEGATRON_CORE']}"
    assert upstreams["sgl-kernel-npu"].ref == PINS["SGL_KERNEL_NPU"]
    assert upstreams["mindspeed"].ref == PINS["MINDSPEED"]
    # setup.py's extras come from the same pins
    assert f"sglang=={PINS['SGLANG']}" in PINS["CUDA_STACK"]
    assert f"megatron-core=={PINS['MEGATRON_CORE']}" in PINS["CPU_STACK"] + PINS["CUDA_STACK"]
    assert '"relax" / "pins.py"' in (REPO / "setup.py").read_text()


def test_first_real_sets_exist(upstreams):
    assert len(upstreams["sglang"].series) >= 3
    assert len(upstreams["megatron-core"].series) >= 3


def test_every_patch_is_well_formed_with_a_message(upstreams):
    for upstream in upstreams.values():
        for patch in upstream.series:
            hunks = patches.check_well_formed(patch)
            assert hunks, patch
            prefix = upstream.path_prefix + "/" if upstream.path_prefix else ""
            assert all(h.path.startswith(prefix) for h in hunks), f"{patch}: paths outside {prefix!r}"


def _real_patch_text() -> str:
    return patches.load_manifest()["sglang"].series[0].read_text()


def _write(tmp_path, text) -> Path:
    path = tmp_path / "0001-x.patch"
    path.write_text(text)
    return path


def test_hunk_line_counts_are_checked(tmp_path):
    text = _real_patch_text().replace("@@ -376,7 +377,10 @@", "@@ -376,8 +377,10 @@")
    with pytest.raises(patches.PatchError, match=r"weight_updater\.py: hunk #2 .*do not match the header"):
        patches.check_well_formed(_write(tmp_path, text))


@pytest.mark.parametrize(
    "bad_index",
    ["index 0000000..1111111 100644", "index abcdef1..abcdef1 100644", "index zzzzzzz..1234567 100644"],
)
def test_fake_index_lines_are_rejected(tmp_path, bad_index):
    lines = _real_patch_text().split("\n")
    first = next(i for i, line in enumerate(lines) if line.startswith("index "))
    lines[first] = bad_index
    with pytest.raises(patches.PatchError, match="index line"):
        patches.check_well_formed(_write(tmp_path, "\n".join(lines)))


def test_a_patch_without_index_line_or_message_is_rejected(tmp_path):
    text = _real_patch_text()
    no_index = "\n".join(line for line in text.split("\n") if not line.startswith("index "))
    with pytest.raises(patches.PatchError, match="without an index line"):
        patches.check_well_formed(_write(tmp_path, no_index))
    head, rest = text.split("\n\n", 1)
    no_message = head + "\n\n" + rest[rest.index("---\n") :]
    with pytest.raises(patches.PatchError, match="message is empty"):
        patches.check_well_formed(_write(tmp_path, no_message))


def test_manifest_errors_name_the_key(tmp_path):
    bad = tmp_path / "manifest.toml"
    bad.write_text('[upstream.x]\nrepository = "r"\nref = "t"\npath_prefix = ""\ntag = "oops"\n')
    with pytest.raises(patches.PatchError, match=r"\[upstream.x\] has unknown keys \['tag'\]"):
        patches.load_manifest(bad)


def test_unknown_upstream_is_an_error(capsys):
    assert patches.main(["check", "no-such-upstream"]) == 1
    assert "unknown upstream(s) ['no-such-upstream']" in capsys.readouterr().err


def _copy_touched_files(upstream, tmp_path) -> Path:
    """A site-packages-like tree holding only the installed files the series touches."""
    site = _site_packages()
    root = tmp_path / "site"
    for patch in upstream.series:
        for hunk in patches.parse_hunks(patch.read_text()):
            relative = Path(*Path(hunk.path).parts[upstream.strip - 1 :])
            if (site / relative).exists() and not (root / relative).exists():
                (root / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(site / relative, root / relative)
    return root


@pytest.mark.parametrize("name", ["sglang", "megatron-core"])
def test_apply_in_place_then_status_and_idempotence(upstreams, tmp_path, capsys, name):
    upstream = upstreams[name]
    root = _copy_touched_files(upstream, tmp_path)
    assert set(patches.patch_states(upstream, root).values()) == {"not applied"}

    patches.apply(upstream, root)
    assert set(patches.patch_states(upstream, root).values()) == {"applied"}
    patches.apply(upstream, root)  # a second run skips what is there
    assert capsys.readouterr().out.count("already applied") == len(upstream.series)


def test_status_reports_a_conflicting_copy(upstreams, tmp_path):
    upstream = upstreams["megatron-core"]
    root = _copy_touched_files(upstream, tmp_path)
    target = root / "megatron/core/transformer/utils.py"
    target.write_text(target.read_text().replace('device="cuda"', 'device="xpu"'))
    states = patches.patch_states(upstream, root)
    assert states[upstream.series[0].name] == "conflicts"
    with pytest.raises(patches.PatchError, match="does not apply to the copy"):
        patches.apply(upstream, root)


def test_git_am_series_script_applies_in_order_and_skips_an_empty_set(tmp_path):
    upstream_repo = tmp_path / "upstream"
    upstream_repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    (upstream_repo / "a.txt").write_text("one\n")
    subprocess.run([*git, "init", "-q"], cwd=upstream_repo, check=True)
    subprocess.run([*git, "add", "a.txt"], cwd=upstream_repo, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=upstream_repo, check=True)
    for word in ("two", "three"):
        (upstream_repo / "a.txt").write_text((upstream_repo / "a.txt").read_text() + word + "\n")
        subprocess.run(
            [*git, "commit", "-qam", f"add {word}\n\nbecause a test needs it"], cwd=upstream_repo, check=True
        )
    series_dir = tmp_path / "patches" / "demo"
    subprocess.run(["git", "format-patch", "-q", "-o", str(series_dir), "HEAD~2"], cwd=upstream_repo, check=True)
    subprocess.run(["git", "reset", "-q", "--hard", "HEAD~2"], cwd=upstream_repo, check=True)
    (tmp_path / "patches" / "empty").mkdir()

    script = REPO / "docker" / "git-am-series.sh"
    done = subprocess.run(["bash", script, "demo", upstream_repo, tmp_path / "patches"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (upstream_repo / "a.txt").read_text() == "one\ntwo\nthree\n"
    empty = subprocess.run(
        ["bash", script, "empty", upstream_repo, tmp_path / "patches"], capture_output=True, text=True
    )
    assert empty.returncode == 0 and "no patches for empty" in empty.stdout


def test_check_of_an_upstream_not_on_pypi_checks_form_and_says_it_did_not_apply(tmp_path):
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(
        '[upstream.npu-thing]\nrepository = "https://example.invalid/npu-thing"\nref = "v1"\npath_prefix = "python"\n'
    )
    (tmp_path / "npu-thing").mkdir()
    shutil.copy(patches.load_manifest()["sglang"].series[0], tmp_path / "npu-thing" / "0001-a.patch")
    upstream = patches.load_manifest(manifest)["npu-thing"]
    out = io.StringIO()
    assert patches.check([upstream], out=out) == []
    assert "npu-thing v1: 1 patch(es) well formed; NOT applied here" in out.getvalue()

    broken = tmp_path / "npu-thing" / "0002-b.patch"
    broken.write_text(_real_patch_text().replace("@@ -376,7 +377,10 @@", "@@ -376,7 +377,11 @@"))
    failures = patches.check([upstream], out=io.StringIO())
    assert (
        len(failures) == 1
        and "0002-b.patch: python/sglang/srt/managers/scheduler_components/weight_updater.py: hunk #2" in failures[0]
    )


def _upstream_with_a_tagged_base(tmp_path) -> tuple[Path, Path]:
    """A git repository holding tag v1 (a.txt = "one"), and a series of one patch on it under tmp/patches/demo."""
    repo = tmp_path / "upstream"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    (repo / "a.txt").write_text("one\n")
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "a.txt"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=repo, check=True)
    subprocess.run([*git, "tag", "v1"], cwd=repo, check=True)
    (repo / "a.txt").write_text("one\ntwo\n")
    subprocess.run([*git, "commit", "-qam", "add two\n\nbecause a test needs it"], cwd=repo, check=True)
    subprocess.run(["git", "format-patch", "-q", "-o", str(tmp_path / "patches" / "demo"), "v1"], cwd=repo,
                   check=True)
    (tmp_path / "patches" / "manifest.toml").write_text(
        '[upstream.demo]\nrepository = "https://example.invalid/demo"\nref = "v1"\npath_prefix = ""\n')
    return repo, tmp_path / "patches" / "manifest.toml"


def test_check_applies_a_set_to_a_named_checkout_at_the_pinned_ref(tmp_path):
    repo, manifest = _upstream_with_a_tagged_base(tmp_path)  # the checkout's HEAD already carries the patch
    upstream = patches.load_manifest(manifest)["demo"]
    out = io.StringIO()
    assert patches.check([upstream], out=out, checkouts={"demo": repo}) == []
    assert re.match(r"demo v1: 1 patch\(es\) apply with git am \(checkout .*upstream at [0-9a-f]{12}\)",
                    out.getvalue()), out.getvalue()
    assert (repo / "a.txt").read_text() == "one\ntwo\n", "the checkout itself is not changed"

    patch = upstream.series[0]
    patch.write_text(patch.read_text().replace("+two", "+two\n+three").replace("@@ -1 +1,2 @@", "@@ -1 +1,3 @@")
                     .replace(" one\n", " zero\n"))
    failures = patches.check([upstream], out=io.StringIO(), checkouts={"demo": repo})
    assert len(failures) == 1 and "does not apply to v1 of" in failures[0] and "a.txt" in failures[0], failures

    subprocess.run(["git", "tag", "-d", "v1"], cwd=repo, check=True, capture_output=True)
    failures = patches.check([upstream], out=io.StringIO(), checkouts={"demo": repo})
    assert len(failures) == 1 and "has no v1" in failures[0] and "fetch" in failures[0], failures


def test_checkout_flag_names_a_manifest_upstream(capsys):
    assert patches.main(["check", "--checkout", "no-such=/tmp"]) == 1
    assert "unknown upstream(s) ['no-such']" in capsys.readouterr().err
    assert patches.main(["check", "--checkout", "sgl-kernel-npu"]) == 1
    assert "give NAME=PATH" in capsys.readouterr().err
