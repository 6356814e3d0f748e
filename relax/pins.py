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
MEGATRON_CORE = "0.16.1"  # the last release for Python 3.11; MindSpeed core_r0.16.0 pairs with it
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

# The CPU stack: what scripts/setup.sh installs (plus sglang==SGLANG with --no-deps).
CPU_STACK = [
    f"torch=={TORCH_CPU}",
    "triton",  # the CPU torch build does not pull it; sglang imports it and relax's kernels run under TRITON_INTERPRET
    f"megatron-core=={MEGATRON_CORE}",
    f"ray[default]=={RAY}",
    f"transformers=={TRANSFORMERS}",
    "datasets",
    "pyarrow",
    "tensorboard",
    "matplotlib",
    "math-verify==0.9.0",
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
    "tensorboard",
    "math-verify==0.9.0",
]

TEST_TOOLS = ["pytest", "pytest-timeout"]


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
