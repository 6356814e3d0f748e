"""relax's placeholder for torchvision on the CPU platform: importable, unusable.

SGLang 0.5.23 imports torchvision while importing its engine (sglang/srt/configs -> nano_nemotron_vl ->
multimodal/internvl_utils.py), but PyPI's torchvision does not import beside the CPU build of torch
("operator torchvision::nms does not exist"). Once torchvision is importable, transformers 5.19 also
imports names from it at module level (image_utils.py: torchvision.io, torchvision.transforms...).
Text-only models never use any of it, so every submodule and name here is a placeholder: importing
and naming work, calling or instantiating fails naming what was reached for. Vision models are not
supported on the CPU platform. Only relax's CPU platform puts this directory on the path (prepare_sglang).
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+relax.cpu.placeholder"


class Placeholder:
    """A name from torchvision: naming it works, using it raises. Each dotted name is one object."""

    _children: dict

    def __init__(self, qualified_name: str):
        self._qualified_name = qualified_name
        self._children = {}

    def __getattr__(self, name: str) -> "Placeholder":
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in self._children:
            self._children[name] = Placeholder(f"{self._qualified_name}.{name}")
        return self._children[name]

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._qualified_name}: relax's CPU platform replaces torchvision with a placeholder (PyPI's "
            "torchvision does not import beside the CPU torch); vision models are not supported on the CPU platform"
        )

    def __repr__(self) -> str:
        return f"<relax placeholder {self._qualified_name}>"


def _placeholder_attribute(module_name: str):
    names = {}

    def __getattr__(name: str) -> Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return names.setdefault(name, Placeholder(f"{module_name}.{name}"))

    return __getattr__


class _PlaceholderSubmodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every torchvision.* submodule (torchvision.io, torchvision.transforms.v2.functional, ...)."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        module.__getattr__ = _placeholder_attribute(module.__name__)


__path__ = []
__getattr__ = _placeholder_attribute(__name__)
sys.meta_path.append(_PlaceholderSubmodules())
