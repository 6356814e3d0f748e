"""User functions that flags name: `module:function` or slime's dotted `module.path.function`."""

import importlib
from typing import Callable


def import_user_function(spec: str, flag: str) -> Callable:
    """The function `spec` names, imported; a spec that names none is an error saying why, for `flag`."""
    module_name, _, name = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"{flag} {spec!r}: name a function as module:function or module.path.function")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a user's module may fail to import in any way; say which and where
        raise ValueError(f"{flag} {spec}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{flag} {spec}: module {module_name!r} has no function {name!r}")
    return fn
