"""relax: colocated RL post-training (Megatron-core actor + in-process SGLang engine on shared devices).

Versions live in relax/pins.py only. The CPU stack installs sglang without its dependencies (they pin a
CUDA torch and CUDA-only kernels), which pip's extras cannot express: use scripts/setup.sh for it.
"""

import runpy
from pathlib import Path

from setuptools import find_packages, setup

pins = runpy.run_path(str(Path(__file__).parent / "relax" / "pins.py"))

setup(
    name="relax",
    version="0.1.0",
    description="Colocated RL post-training for LLMs: Megatron-core training and SGLang rollout on the same devices",
    python_requires=">=3.11",
    packages=find_packages(include=["relax", "relax.*"]),
    # The CPU stand-in modules (sgl_kernel, torchvision) are put on PYTHONPATH as files, not imported.
    package_data={"relax": ["platform/cpu_stand_ins/*/*.py"]},
    install_requires=[],
    extras_require={
        "cpu": pins["CPU_STACK"],
        "cuda": pins["CUDA_STACK"],
        "test": pins["TEST_TOOLS"],
    },
    entry_points={"console_scripts": ["relax = relax.cli:main"]},
)
