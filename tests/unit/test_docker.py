"""docker/Dockerfile.npu and docker/Dockerfile: lint (hadolint, shellcheck) and structure.

Structure: every upstream of patches/manifest.toml is cloned at its pinned ref and patched with its
series before it is installed, every version default equals relax/pins.py, and the SoC name is given once.
"""

import re
import runpy
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from relax.tools import patches

REPO = Path(__file__).resolve().parents[2]
PINS = runpy.run_path(str(REPO / "relax" / "pins.py"))
NPU = REPO / "docker" / "Dockerfile.npu"
CUDA = REPO / "docker" / "Dockerfile"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str
    line: int


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions in order, with continuation lines joined and comments (and parser directives) dropped."""
    instructions, pending, start = [], "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are skipped by Docker too
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        text = pending + stripped
        pending = ""
        keyword, _, arguments = text.partition(" ")
        instructions.append(Instruction(keyword.upper(), arguments.strip(), start))
    assert not pending, f"{path}: ends inside a continued instruction"
    return instructions


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for instruction in instructions:
        if instruction.keyword == "ARG" and "=" in instruction.arguments:
            name, _, value = instruction.arguments.partition("=")
            defaults[name] = value.strip('"')
    return defaults


def run_lines(instructions: list[Instruction]) -> str:
    return "\n".join(i.arguments for i in instructions if i.keyword == "RUN")


def _tool(name: str) -> str:
    found = shutil.which(name) or (Path(sys.executable).parent / name)
    if not Path(found).exists():
        pytest.fail(f"{name} is not installed: `pip install {' '.join(PINS['DOCKER_LINT_TOOLS'])}` (relax/pins.py)")
    return str(found)


@pytest.mark.parametrize("dockerfile", [NPU, CUDA], ids=["npu", "cuda"])
def test_hadolint_passes(dockerfile):
    done = subprocess.run([_tool("hadolint"), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_shellcheck_passes_on_the_image_scripts():
    scripts = sorted((REPO / "docker").glob("*.sh"))
    assert scripts
    done = subprocess.run([_tool("shellcheck"), *map(str, scripts)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_parser_reads_continuations_and_skips_comments(tmp_path):
    path = tmp_path / "Dockerfile"
    path.write_text("# c\nARG A=1\nRUN echo a \\\n    # inner comment\n    && echo b\nFROM x\n")
    assert parse_dockerfile(path) == [
        Instruction("ARG", "A=1", 2),
        Instruction("RUN", "echo a && echo b", 3),
        Instruction("FROM", "x", 6),
    ]


@pytest.fixture(scope="module")
def npu():
    return parse_dockerfile(NPU)


@pytest.fixture(scope="module")
def manifest():
    return patches.load_manifest()


def test_npu_base_image_is_the_pinned_cann_a3_python311_image(npu):
    defaults = arg_defaults(npu)
    assert npu[0] == Instruction("ARG", f"CANN_IMAGE={PINS['CANN_NPU_IMAGE']}", npu[0].line)
    assert [i.arguments for i in npu if i.keyword == "FROM"] == ["${CANN_IMAGE}"]
    assert re.fullmatch(r"quay\.io/ascend/cann:9\.0\.0-a3-ubuntu\d+\.\d+-py3\.11", defaults["CANN_IMAGE"])


def test_npu_version_defaults_equal_the_pins(npu, manifest):
    expected = {
        "SOC_VERSION_FOR_SGL_BUILD": PINS["SOC_VERSION_NPU"],
        "TORCH_VERSION": PINS["TORCH_NPU_TORCH"],
        "TORCHVISION_VERSION": PINS["TORCHVISION_NPU"],
        "TORCH_NPU_VERSION": PINS["TORCH_NPU"],
        "TRITON_ASCEND_VERSION": PINS["TRITON_ASCEND"],
        "FLA_VERSION": PINS["FLASH_LINEAR_ATTENTION"],
        "SGLANG_REF": manifest["sglang"].ref,
        "SGL_KERNEL_NPU_REF": manifest["sgl-kernel-npu"].ref,
        "MEGATRON_LM_REF": manifest["megatron-core"].ref,
        "MINDSPEED_REF": manifest["mindspeed"].ref,
        "FASTOKENS_VERSION": PINS["FASTOKENS"],
        "RAY_VERSION": PINS["RAY"],
        "MEGATRON_BRIDGE_VERSION": PINS["MEGATRON_BRIDGE"],
    }
    defaults = arg_defaults(npu)
    assert {name: defaults.get(name) for name in expected} == expected
    # and each is used: a default nobody reads would let a pin drift silently
    text = run_lines(npu)
    for name in expected:
        assert "${" + name + "}" in text, f"ARG {name} is never used"


def _command_index(text: str, pattern: str) -> int:
    match = re.search(pattern, text)
    assert match, f"no command matching {pattern!r} in docker/Dockerfile.npu"
    return match.start()


def test_npu_clones_each_upstream_at_its_ref_and_patches_it_before_installing(npu, manifest):
    text = run_lines(npu)
    refs = {
        "sglang": "SGLANG_REF",
        "sgl-kernel-npu": "SGL_KERNEL_NPU_REF",
        "megatron-core": "MEGATRON_LM_REF",
        "mindspeed": "MINDSPEED_REF",
    }
    assert set(refs) == set(manifest), "a manifest upstream the image does not build"
    for name, upstream in manifest.items():
        steps = [i.arguments for i in npu if i.keyword == "RUN" and f"git-am-series {name} " in i.arguments]
        assert len(steps) == 1, f"{name}: patched in {len(steps)} RUN steps"
        step = steps[0]
        fetch = step.index(upstream.repository)
        assert "${" + refs[name] + "}" in step[: step.index(f"git-am-series {name} ")], f"{name}: not at its ref"
        assert fetch < step.index(f"git-am-series {name} "), f"{name}: patched before it is fetched"
    # installed after patching (an install of the unpatched tree would ship without relax's fixes)
    assert _command_index(text, r"git-am-series sglang ") < _command_index(text, r"pip install -e \"/opt/sglang/python")
    assert _command_index(text, r"git-am-series megatron-core ") < _command_index(
        text, r"pip install --no-deps -e /opt/Megatron-LM"
    )
    assert _command_index(text, r"git-am-series mindspeed ") < _command_index(text, r"pip install -e /opt/MindSpeed")
    assert _command_index(text, r"git-am-series sgl-kernel-npu ") < _command_index(text, r"build\.sh -a kernels")
    copies = [i.arguments for i in npu if i.keyword == "COPY"]
    assert "patches /opt/relax/patches" in copies
    assert "docker/git-am-series.sh /usr/local/bin/git-am-series" in copies


def test_npu_builds_sgl_kernel_npu_for_the_one_soc_argument(npu):
    text = run_lines(npu)
    for target in ('kernels "${SOC_VERSION_FOR_SGL_BUILD}"', "memory-saver", 'deepep "${SOC_VERSION_FOR_SGL_BUILD}"'):
        assert f"bash build.sh -a {target}" in text
    # no SoC name spelled out anywhere else: one ARG decides the build
    body = "\n".join(i.arguments for i in npu if not (i.keyword == "ARG" and i.arguments.startswith("SOC_VERSION")))
    assert not re.search(r"ascend910|ascend950", body, re.I), "a SoC name outside SOC_VERSION_FOR_SGL_BUILD"


def test_npu_install_order(npu):
    text = run_lines(npu)
    order = [
        r"pip install \"torch==\$\{TORCH_VERSION\}\"",
        r"\"torch-npu==\$\{TORCH_NPU_VERSION\}\"",
        r"\"flash-linear-attention==\$\{FLA_VERSION\}\"",
        r"\"triton-ascend==\$\{TRITON_ASCEND_VERSION\}\"",
        r"git clone .*sgl-project/sglang",
        r"sgl-project/sgl-kernel-npu",
        r"NVIDIA/Megatron-LM",
        r"Ascend/MindSpeed",
        r"\"fastokens==",
        r"\"ray\[default\]==",
        r"pip install --no-deps -e /opt/relax",
    ]
    positions = [_command_index(text, pattern) for pattern in order]
    assert "python3 /opt/relax/relax/pins.py npu-image-extras > /tmp/relax-extras.txt" in text
    assert positions == sorted(positions), "install steps out of order"
    assert [i.keyword for i in npu][-2:] == ["ENTRYPOINT", "CMD"]


def test_cuda_image_installs_the_pinned_stack_and_applies_every_installable_set(manifest):
    cuda = parse_dockerfile(CUDA)
    defaults = arg_defaults(cuda)
    assert defaults["BASE_IMAGE"] == PINS["CUDA_BASE_IMAGE"]
    assert re.fullmatch(r"python:3\.11-\S+", defaults["BASE_IMAGE"])
    text = run_lines(cuda)
    assert "python3 relax/pins.py cuda-stack > /tmp/cuda-stack.txt" in text
    assert "pip install --requirement /tmp/cuda-stack.txt" in text
    installable = {name for name, upstream in manifest.items() if upstream.package}
    applied = re.search(r"relax patches apply ([\w\- ]+?) +&&", text)
    assert applied and set(applied.group(1).split()) == installable, text
    assert text.index("relax patches apply") > text.index("pip install --no-deps -e /opt/relax")
