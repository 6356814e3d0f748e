"""The NPU platform's MindSpeed preparation on a CPU run, for tests: relax's NPU start-up path executed here.

MindSpeedOnCpu is the CPU platform (gloo, the host as device, megatron-core's CUDA calls redirected) whose
prepare_megatron also runs relax.platform.npu.prepare_mindspeed, the NPU platform's own function: torch_npu, MindSpeed's
adaptor with Ray's argv hidden, repatch with the feature arguments and the Megatron-LM arguments MindSpeed reads. It
takes the NPU platform's MindSpeed switches and context-parallel attention (MindSpeed's ring attention, computing with
the stand-in npu_fusion_attention and its gradient). relax's product code has no branch for it: a process that calls
use_mindspeed_on_cpu() gets it from relax.platform.get_platform("cpu").

Which MindSpeed: the contract double in tests/npu/mindspeed_double, or, with RELAX_MINDSPEED_CHECKOUT set to a
checkout of the pinned commit (relax.pins.MINDSPEED), the real package with stand-ins for the compiled Ascend
parts it imports (ascend_stand_ins.py). torch_npu is tests/npu/stand_ins' with the double, the generated one of
ascend_stand_ins with the real package (MindSpeed reaches dozens of torch_npu names at import); both compute the ops
of torch_npu_ops.py. Neither registers an "npu" device here: the ranks compute on the CPU, and the training step's
torch.compile fails once torch takes "npu" for its accelerator (stand_ins/torch_npu's stand_in_one_npu says why)."""

import os
import sys
from pathlib import Path

import torch

from relax.platform import PLATFORMS
from relax.platform.cpu import CpuPlatform
from relax.platform.cpu_megatron import _scoped_type as scoped_type
from relax.platform.npu import NpuPlatform, prepare_mindspeed
from relax.train.worker import TrainWorker

HERE = Path(__file__).resolve().parent
CHECKOUT_ENV = "RELAX_MINDSPEED_CHECKOUT"


class MindSpeedOnCpu(CpuPlatform):
    megatron_features = NpuPlatform.megatron_features
    context_parallel_attention = NpuPlatform.context_parallel_attention

    def prepare_megatron(self, feature_args=None) -> None:
        # The CPU redirects first: they adjust megatron-core's modules as MindSpeed's patching imports them.
        super().prepare_megatron()
        prepare_mindspeed(dict(feature_args or {}))
        # MindSpeed wraps Tensor.type and Parameter.type globally (its NPU type names reported as CUDA ones,
        # core/megatron_basic/requirements_basic.py type_wrapper), above the CPU platform's Tensor.type, which
        # answers CUDA names only to megatron-core's callers: that answer goes on top again, as torch_npu's sits
        # below on an NPU.
        for tensor_class in (torch.Tensor, torch.nn.Parameter):
            tensor_class.type = scoped_type(tensor_class.type)


def mindspeed_in_use() -> str:
    """"real MindSpeed at <checkout>" or "the MindSpeed double"."""
    checkout = os.environ.get(CHECKOUT_ENV)
    return f"real MindSpeed at {checkout}" if checkout else "the MindSpeed double"


def use_mindspeed_on_cpu() -> None:
    """In this process: MindSpeed importable (the double, or the checkout of RELAX_MINDSPEED_CHECKOUT with its
    stand-ins) and get_platform("cpu") returning MindSpeedOnCpu. Before megatron is imported."""
    checkout = os.environ.get(CHECKOUT_ENV)
    if checkout:
        if not (Path(checkout) / "mindspeed" / "megatron_adaptor.py").is_file():
            raise FileNotFoundError(
                f"{CHECKOUT_ENV}={checkout!r} is not a MindSpeed checkout (no mindspeed/megatron_adaptor.py): "
                "point it at a checkout of Ascend/MindSpeed at relax.pins.MINDSPEED"
            )
        from ascend_stand_ins import install_ascend_stand_ins, install_mindspeed_op_stand_ins

        install_ascend_stand_ins()
        sys.path.insert(0, checkout)
        install_mindspeed_op_stand_ins()
    else:
        sys.path[:0] = [str(HERE / "mindspeed_double"), str(HERE / "stand_ins")]
    PLATFORMS["cpu"] = MindSpeedOnCpu()


class MindSpeedOnCpuTrainWorker(TrainWorker):
    """relax's TrainWorker in a process that uses MindSpeed on the CPU (its Ray actor class for the tests)."""

    def __init__(self, *args, **kwargs):
        use_mindspeed_on_cpu()
        super().__init__(*args, **kwargs)
