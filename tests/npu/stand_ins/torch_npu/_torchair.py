"""Stand-in of torchair, the torch.compile backend for NPUs that ships inside torch_npu (torch_npu/dynamo) and is
importable as the top-level `torchair` once torch_npu is imported. SGLang asks it for a compile backend while
importing (utils/common.py get_compiler_backend, for its @torch.compile decorators); a stand-in backend compiles
nothing: calling a function compiled with it raises StandInError."""

import sys
import types

from torch_npu import StandInError


class CompilerConfig:
    """The fields SGLang sets: mode and debug.run_eagerly."""

    def __init__(self):
        self.mode = "max-autotune"
        self.debug = types.SimpleNamespace(run_eagerly=False)


def get_npu_backend(compiler_config=None):
    def backend(graph_module, example_inputs):
        raise StandInError("torchair's NPU compile backend is a CPU stand-in (tests/npu/stand_ins): no NPU to compile")

    return backend


def install() -> None:
    modules = {
        "torchair": dict(get_npu_backend=get_npu_backend),
        "torchair.configs": {},
        "torchair.configs.compiler_config": dict(CompilerConfig=CompilerConfig),
        "torchair.ge_concrete_graph": {},
        "torchair.ge_concrete_graph.ge_converter": {},
        "torchair.ge_concrete_graph.ge_converter.experimental": {},
        # Imported by SGLang for its side effect (HCCL all-reduce conversion); nothing to do on a CPU.
        "torchair.ge_concrete_graph.ge_converter.experimental.patch_for_hcom_allreduce": {},
    }
    for name, attributes in modules.items():
        module = types.ModuleType(name, __doc__)
        module.__path__ = []
        module.__dict__.update(attributes)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
