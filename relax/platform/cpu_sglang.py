"""SGLang 0.5.23 on the CPU: its CPU engine switch and stand-ins for what PyPI cannot give a CPU.

Needed before sglang is imported, in this process and in the scheduler/detokenizer processes SGLang
spawns (they inherit the environment, so everything here goes through os.environ):

1. SGLANG_USE_CPU_ENGINE=1: SGLang 0.5.23 treats the device as CPU only when this is set before import
   (sglang/srt/platforms/__init__.py, utils/common.py); without it the model build reaches
   `from vllm._custom_ops import rotary_embedding` and fails.
2. relax/platform/cpu_stand_ins first on PYTHONPATH (and sys.path), which holds
   - `sgl_kernel`: PyPI's sgl-kernel is CUDA-only (no CPU ops, no sdist), and with the CPU engine switch
     SGLang imports CPU ops from it at module level. Measured for tiny Qwen2/Qwen3 generation: the engine
     imports assign_req_to_token_pool_cpu (mem_cache/allocation.py; called on its speculative-decoding
     allocation path), copy_all_layer_kv_cache_cpu and six speculative-decoding ops
     (assign_draft_cache_locs_contiguous_cpu, assign_extend_cache_locs_cpu, build_tree_kernel_efficient_cpu,
     fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu, verify_tree_greedy_cpu), and calls none of them.
     relax/platform/sgl_kernel_cpu_ops.py implements ops in torch; any other op raises when called.
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
