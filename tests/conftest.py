"""Every CPU test session starts on the CPU platform, prepared before any test imports SGLang or Megatron.

SGLang decides at its first import whether it runs the CPU engine (relax.platform.cpu_sglang), so the
order in which test modules import it must not matter: prepare here, once, before collection.
"""

import os

os.environ.setdefault("RELAX_DEVICE", "cpu")

from relax.platform import get_platform  # noqa: E402  (after RELAX_DEVICE, which workers inherit)

_cpu = get_platform("cpu")
_cpu.prepare_sglang()
_cpu.prepare_megatron()
