"""CPU test sessions start on the CPU platform, prepared before any test imports SGLang or Megatron:
SGLang fixes its device at its first import, so test module order must not matter. (tests/gpu has no
such conftest: its tests pick the GPU platform themselves.)

Shared fixtures: tiny_qwen3, a tiny Qwen3 checkpoint for the session; tool_chat_tokenizer; pretend_wandb_installed."""

import os

import pytest

os.environ.setdefault("RELAX_DEVICE", "cpu")  # workers the tests start inherit it

from relax.platform import get_platform  # noqa: E402

get_platform("cpu").prepare_sglang()
get_platform("cpu").prepare_megatron()

from relax.tools.tiny_model import build_tiny_model, build_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A tiny Qwen3 HF checkpoint (relax.tools.tiny_model), built once: the tests that take it only read it."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tool_chat_tokenizer(tmp_path_factory):
    """The tiny model's tokenizer with its Qwen3-format tool chat template (relax.tools.tiny_model), built once."""
    return build_tokenizer(tmp_path_factory.mktemp("tool_chat"), tool_chat=True)


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
