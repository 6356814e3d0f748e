"""Write patches/sgl-kernel-npu from relax's kernels for it: `python -m relax.tools.sgl_kernel_npu_patches CHECKOUT`.

The series carries relax/kernels/sgl_kernel_npu/*.py byte for byte into sgl-kernel-npu's Python package as
python/sgl_kernel_npu/sgl_kernel_npu/relax/ (one source: relax's tests and its CUDA decode kernel import the same
files), plus the two modules SGLang v0.5.23 imports on an NPU and the pinned sgl-kernel-npu lacks, each a re-export
of relax's kernels under the module path and names SGLang calls. CHECKOUT is a git repository of
sgl-project/sgl-kernel-npu (a clone or a bare mirror) holding the pinned ref (patches/manifest.toml); it is cloned
into a scratch directory, never changed. Author and dates are fixed, so the same sources give the same patches.
Run it after changing a kernel; tests/unit/test_sgl_kernel_npu_patches.py fails while a patch and its source differ.
"""

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from relax.tools.patches import PATCHES_DIR, PatchError, _git, load_manifest

UPSTREAM = "sgl-kernel-npu"
SOURCE_DIR = Path(__file__).resolve().parents[1] / "kernels" / "sgl_kernel_npu"
PACKAGE_DIR = "python/sgl_kernel_npu/sgl_kernel_npu"  # the Python package in sgl-kernel-npu's tree
TARGET_DIR = f"{PACKAGE_DIR}/relax"  # where relax's modules go
IDENTITY = {
    "GIT_AUTHOR_NAME": "relax maintainers",
    "GIT_AUTHOR_EMAIL": "maintainers@users.noreply.a-seed-666d4781.example",
    "GIT_AUTHOR_DATE": "2026-12-04T18:00:00+0000",
    "GIT_COMMITTER_NAME": "relax maintainers",
    "GIT_COMMITTER_EMAIL": "maintainers@users.noreply.a-seed-666d4781.example",
    "GIT_COMMITTER_DATE": "2026-12-04T18:00:00+0000",
}


def _reexport(doc: str, module: str, names: list[str]) -> str:
    """A hook module that re-exports `names` of relax's `module` (sgl_kernel_npu.relax.<module>)."""
    quoted = ", ".join(f'"{name}"' for name in names)
    return f'"""{doc}"""\n\nfrom sgl_kernel_npu.relax.{module} import {", ".join(names)}\n\n__all__ = [{quoted}]\n'


@dataclass(frozen=True)
class SeriesPatch:
    message: str  # subject line, blank line, body
    modules: tuple[str, ...]  # relax/kernels/sgl_kernel_npu/<module>.py files it adds under TARGET_DIR
    hooks: tuple[tuple[str, str], ...] = ()  # (path under PACKAGE_DIR, text) of the small files it adds beside them


SERIES = (
    SeriesPatch(
        message="""Add relax's sigmoid-gate kernels as activation.fused_sigmoid_mul

SGLang v0.5.23 imports sgl_kernel_npu.activation.fused_sigmoid_mul on an
NPU: fused_sigmoid_mul(x, gate) at module level in its Qwen3.5 model (the
attention output gate) and fused_sigmoid_mul_broadcast(x, gate) in the
shared expert of Qwen2-MoE-style blocks (Qwen3.5-MoE). This tree does not
have the module, so the import fails, SGLang's model registry drops every
Qwen3.5 architecture, and the Ascend GDN backend cannot import.

Add relax's Triton kernels for x * sigmoid(gate) (float32 inside, the
result in x's dtype) under sgl_kernel_npu/relax/, with launch.py, the 1-D
grid of one program per vector core that every relax kernel here uses,
and the module SGLang imports, re-exporting both functions.
""",
        modules=("__init__", "launch", "sigmoid_mul"),
        hooks=(("activation/fused_sigmoid_mul.py", _reexport(
            "x * sigmoid(gate) under the module and names SGLang's Ascend models import: relax's kernels\n"
            "(sgl_kernel_npu/relax/sigmoid_mul.py).", "sigmoid_mul",
            ["fused_sigmoid_mul", "fused_sigmoid_mul_broadcast"])),),
    ),
    SeriesPatch(
        message="""Add relax's fused sigmoid-gating GDN decode update for SGLang's decode path

SGLang v0.5.23's Ascend GDN backend imports
fused_sigmoid_gating_delta_rule_update_decode_npu from
sgl_kernel_npu.fla.fused_sigmoid_gating_recurrent_decode_optimized at
module level and calls it for every decode batch of a Qwen3.5 / Qwen3-Next
GDN layer. This tree does not have the module.

Add relax's Triton kernel for it: the gating (decay from A_log, a and
dt_bias through softplus; beta = sigmoid(b)), the q/k l2norm and the delta
rule over the slot-indexed state pool [slots, HV, V, K] in one launch,
each program taking a sequence x value head x 32-row state tile and
keeping the tile on chip through the sequence's tokens; padding slots
(negative) are left alone. It takes the keywords of both SGLang calls and
refuses speculative target verification with NotImplementedError.
""",
        modules=("gdn_decode",),
        hooks=(("fla/fused_sigmoid_gating_recurrent_decode_optimized.py", _reexport(
            "The fused sigmoid-gating recurrent update SGLang's Ascend GDN backend imports for decode batches:\n"
            "relax's kernel (sgl_kernel_npu/relax/gdn_decode.py).", "gdn_decode",
            ["fused_sigmoid_gating_delta_rule_update_decode_npu"])),),
    ),
    SeriesPatch(
        message="""Add relax's fused MoE routing front: softmax or sigmoid scores, top-k, renormalised

SGLang's Ascend top-k for MoE layers with plain (ungrouped, unbiased)
routing runs torch_npu's gating top-k and then a separate L1
normalisation of the k weights. relax's kernel does the scores (softmax
over the experts, as Qwen3-MoE and Qwen3.5-MoE route, or a sigmoid per
expert), the top-k choice and the renormalisation in one launch, one
program per vector core looping over token rows.

SGLang calls it when SGLANG_RELAX_FUSED_MOE_TOPK=1 (relax's sglang
patch); nothing here changes what runs without that switch.
""",
        modules=("moe_routing",),
    ),
)


def write_series(checkout: Path, out_dir: Path = PATCHES_DIR / UPSTREAM) -> list[Path]:
    """Commit SERIES on a scratch clone of `checkout` at the pinned ref and write it with git format-patch."""
    ref = load_manifest()[UPSTREAM].ref
    with tempfile.TemporaryDirectory(prefix="relax-sgl-kernel-npu-") as scratch:
        repo = Path(scratch)
        _git(repo, "clone", "--quiet", "--shared", "--no-checkout", str(checkout.resolve()), ".")
        if _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False).returncode:
            raise PatchError(f"{checkout} has no {ref} (patches/manifest.toml's ref for {UPSTREAM}): fetch it there")
        _git(repo, "checkout", "--quiet", "--detach", ref)
        env = dict(os.environ, **IDENTITY)
        for patch in SERIES:
            files = {f"{TARGET_DIR}/{m}.py": (SOURCE_DIR / f"{m}.py").read_text() for m in patch.modules}
            files.update({f"{PACKAGE_DIR}/{path}": text for path, text in patch.hooks})
            for path, text in files.items():
                target = repo / path
                if target.exists():
                    raise PatchError(f"{UPSTREAM} {ref} already has {path}: the series only adds files")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
                _git(repo, "add", path)
            _git(repo, "-c", "commit.gpgsign=false", "commit", "--quiet", "--no-verify", "-m", patch.message, env=env)
        for old in out_dir.glob("*.patch"):
            old.unlink()
        out_dir.mkdir(parents=True, exist_ok=True)
        _git(repo, "format-patch", "--quiet", "--zero-commit", "--no-signature", "--full-index",
             "-o", str(out_dir.resolve()), f"{ref}..HEAD")
    return sorted(out_dir.glob("*.patch"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relax.tools.sgl_kernel_npu_patches",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path,
                        help="a git repository of sgl-project/sgl-kernel-npu holding the pinned ref")
    args = parser.parse_args(argv)
    try:
        for patch in write_series(args.checkout):
            print(patch.relative_to(PATCHES_DIR.parent))
    except PatchError as error:
        print(f"sgl_kernel_npu_patches: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
