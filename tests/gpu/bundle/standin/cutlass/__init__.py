"""Import-only stand-in for `cutlass` (NVIDIA's CuTe DSL, nvidia-cutlass-dsl) on the lent GPU machine. Verification only.

SGLang 0.5.23 builds every dense Qwen3 MLP through layers/dual_gemm.py, which imports a CuTe DSL kernel module
(kernels/ops/gemm/cutedsl_dual_gemm.py) that imports cutlass at module level; it only uses that kernel on SM100
(can_use_dual_gemm), so on Hopper the module just has to import. The real package's wheel (about 92 MB) does not
fit a device call. Every `cutlass.*` module and attribute here is a placeholder that can be called, subscripted,
used as a decorator or a base class; a function decorated with one raises NotImplementedError when called.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+relax.gpu.verification"


class Placeholder:
    def __init__(self, name: str = "cutlass"):
        self._name = name

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return Placeholder(f"{self._name}.{attribute}")

    def __getitem__(self, key):
        return self

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # used as a decorator: the kernel cannot run
            return _unrunnable(f"{self._name}({getattr(args[0], '__qualname__', args[0])})")
        return Placeholder(f"{self._name}(...)")

    def __mro_entries__(self, bases):
        return (object,)  # `class K(cutlass.Something):` gets a plain base


def _unrunnable(what: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"{what}: CuTe DSL kernels cannot run with relax's cutlass import stand-in")

    return kernel


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return Placeholder(f"{self.__name__}.{attribute}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every `cutlass.<...>` submodule as a placeholder module."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _PlaceholderModule  # `cutlass.Float32` and friends
