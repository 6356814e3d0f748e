"""An sgl_kernel_npu stand-in built from an API manifest (tests/npu/data/sgl_kernel_npu_api.json's "modules").

install(modules) puts a finder first on sys.meta_path that serves exactly the manifest's modules: each binds the
names the manifest lists, every one a callable that raises StandInError when called. A module or name the manifest
does not list fails to import as it would with the real package, so SGLang's import path sees the pinned API and
nothing more.
"""

import importlib.abc
import importlib.machinery
import sys

PACKAGE = "sgl_kernel_npu"


class StandInError(RuntimeError):
    """Raised when an sgl_kernel_npu stand-in is called: it has the name, not the kernel."""


def _stand_in(module: str, name: str):
    def call(*args, **kwargs):
        raise StandInError(f"{module}.{name} is a stand-in built from the sgl-kernel-npu API manifest: no kernel")

    call.__name__ = name
    call.__qualname__ = name
    call.__module__ = module
    return call


class _ManifestFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, modules: dict[str, dict]):
        self.modules = modules

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] != PACKAGE:
            return None
        if fullname not in self.modules:
            # The real package would not have it either; stop here instead of finding an installed copy.
            raise ModuleNotFoundError(f"No module named {fullname!r} (not in the sgl-kernel-npu API manifest)",
                                      name=fullname)
        entry = self.modules[fullname]
        return importlib.machinery.ModuleSpec(fullname, self, is_package=entry["package"])

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        entry = self.modules[module.__name__]
        if entry["package"]:
            module.__path__ = []
        for name in entry["names"]:
            setattr(module, name, _stand_in(module.__name__, name))


def install(modules: dict[str, dict]) -> None:
    for name in [m for m in sys.modules if m.split(".")[0] == PACKAGE]:
        del sys.modules[name]
    sys.meta_path.insert(0, _ManifestFinder(modules))
