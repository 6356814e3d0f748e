"""SGLang 0.5.23 on the CPU: its CPU engine switch and stand-ins for what PyPI cannot give a CPU.

Needed before sglang is imported, in this process and in the scheduler/detokenizer processes SGLang
spawns (they inherit the environment, so everything here goes through os.environ):

1. SGLANG_USE_CPU_ENGINE=1: SGLang 0.5.23 treats the device as CPU only when this is set before import
   (sglang/srt/platforms/__init__.py, utils/common.py); without it the model build reaches
   `from vllm._custom_ops import rotary_embedding` and fails.
2. relax/platform/cpu_stand_ins first on PYTHONPATH (and sys.path), which holds
   - `sgl_kernel`: PyPI's sgl-kernel is CUDA-only, and the CPU path imports its CPU ops at module level
     (mem_cache/allocation.py: assign_req_to_token_pool_cpu, called for every batch). The ops are
     implemented in torch in relax/platform/sgl_kernel_cpu_ops.py; unimplemented ones raise when called.
   - `torchvision`: a placeholder, because PyPI's torchvision does not import beside the CPU torch and
     SGLang's engine import reaches it through its multimodal configs.

Engine flags that make the engine run on a CPU live in relax.platform.cpu.SGLANG_SERVER_DEFAULTS.
"""

import os
import sys
from pathlib import Path

STAND_INS_DIR = str(Path(__file__).with_name("cpu_stand_ins"))
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"


def prepare_sglang() -> None:
    if os.environ.get(CPU_ENGINE_ENV) != "1" and "sglang" in sys.modules:
        raise RuntimeError(
            "sglang was imported before the CPU platform was prepared: call "
            "relax.platform.get_platform().prepare_sglang() before the first `import sglang`"
        )
    os.environ[CPU_ENGINE_ENV] = "1"
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if STAND_INS_DIR not in python_path:
        os.environ["PYTHONPATH"] = os.pathsep.join([STAND_INS_DIR, *python_path])
    if STAND_INS_DIR not in sys.path:
        sys.path.insert(0, STAND_INS_DIR)
