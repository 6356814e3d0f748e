"""Run a function on a module right after it is imported, and on it at once if it is already imported.

The CPU platform adjusts a few upstream modules this way (megatron.core's CUDA calls, SGLang's non-AMX
Triton fallbacks): the module's own finder and loader do the import, this only wraps the loader.
"""

import importlib.abc
import sys
import types
from typing import Callable


class PostImportHook(importlib.abc.MetaPathFinder):
    def __init__(self, wants: Callable[[str], bool], adjust: Callable[[types.ModuleType], None]):
        self.wants = wants  # module name -> whether to adjust it
        self.adjust = adjust

    def install(self) -> None:
        """Adjust matching modules from now on, and those already imported."""
        sys.meta_path.insert(0, self)
        for name, module in list(sys.modules.items()):
            if module is not None and self.wants(name):
                self.adjust(module)

    def find_spec(self, fullname, path, target=None):
        if not self.wants(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AdjustingLoader(spec.loader, self.adjust)
                return spec
        return None


class _AdjustingLoader(importlib.abc.Loader):
    def __init__(self, loader, adjust):
        self._loader = loader
        self._adjust = adjust

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._adjust(module)

    def __getattr__(self, name):  # get_source, is_package, ... of the wrapped loader
        return getattr(self._loader, name)
