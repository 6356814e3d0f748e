"""CPU test sessions start on the CPU platform, prepared before any test imports SGLang or Megatron:
SGLang fixes its device at its first import, so test module order must not matter. (tests/gpu has no
such conftest: its tests pick the GPU platform themselves.)"""

import os

import pytest

os.environ.setdefault("RELAX_DEVICE", "cpu")  # workers the tests start inherit it

from relax.platform import get_platform  # noqa: E402

get_platform("cpu").prepare_sglang()
get_platform("cpu").prepare_megatron()


@pytest.fixture
def pretend_wandb_installed(monkeypatch):
    """pretend_wandb_installed(installed): importlib finds wandb (a spec with no loader) or not, whatever is
    installed; the parse-time rule that refuses --use-wandb without it asks importlib.util.find_spec."""
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def pretend(installed: bool) -> None:
        def find_spec(name, *args):
            if name == "wandb":
                return importlib.util.spec_from_loader("wandb", loader=None) if installed else None
            return real_find_spec(name, *args)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    return pretend
