"""The model classes SGLang's registry takes from this package (SGLang reads each module's EntryClass)."""

import importlib

from relax.rollout.sglang_models import SGLANG_MODULES

EntryClass = [
    getattr(importlib.import_module(f"sglang.srt.models.{module}"), architecture)
    for architecture, module in SGLANG_MODULES.items()
]
