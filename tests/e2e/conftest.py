"""CPU test sessions start on the CPU platform, prepared before any test imports SGLang or Megatron:
SGLang fixes its device at its first import, so test module order must not matter. (tests/gpu has no
such conftest: its tests pick the GPU platform themselves.)"""

import os

os.environ.setdefault("RELAX_DEVICE", "cpu")  # workers the tests start inherit it

from relax.platform import get_platform  # noqa: E402

get_platform("cpu").prepare_sglang()
get_platform("cpu").prepare_megatron()
