"""Torch implementations of the sgl_kernel CPU ops that SGLang 0.5.23's CPU engine calls.

PyPI's sgl-kernel wheel is CUDA-only (no CPU ops, no sdist), so on the CPU platform relax puts a stand-in
`sgl_kernel` package first on the path (relax/platform/cpu_stand_ins/sgl_kernel). The stand-in serves
the ops registered here and, for any other name SGLang imports, a function that raises
NotImplementedError naming the op when called: SGLang imports many ops at module level that its
CPU path never calls, so importing must succeed and only calling may fail.

Register more ops with `register_cpu_op` at the bottom of this module (this module is what the
stand-in imports in every process, including SGLang's spawned scheduler):
- `submodule="mamba"` serves `from sgl_kernel.mamba import name`;
- `schema="(Tensor x) -> Tensor"` also defines `torch.ops.sgl_kernel.<name>` (SGLang reads some ops,
  e.g. fused_sigmoid_mul_cpu in models/qwen3_5.py, from the torch op namespace).
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch


@dataclass(frozen=True)
class CpuOp:
    name: str
    function: Callable
    submodule: str  # "" for the top-level sgl_kernel module
    schema: Optional[str]  # torch op schema without the name, or None for a Python-only op


CPU_OPS: Dict[str, CpuOp] = {}


def register_cpu_op(name: str, function: Callable, submodule: str = "", schema: Optional[str] = None) -> None:
    if name in CPU_OPS:
        raise ValueError(f"sgl_kernel CPU op {name!r} is registered twice")
    CPU_OPS[name] = CpuOp(name, function, submodule, schema)


def missing_op(qualified_name: str) -> Callable:
    """What the stand-in serves for an op nobody implemented: fails when called, naming the op.
    Dunder names are never ops: they raise AttributeError, as on any module."""
    if qualified_name.rpartition(".")[2].startswith("__"):
        raise AttributeError(qualified_name)

    def not_implemented(*args, **kwargs):
        raise NotImplementedError(
            f"{qualified_name} is not available on relax's CPU platform: PyPI's sgl-kernel has no CPU ops "
            "and relax implements only the ones SGLang's CPU engine calls for the supported models. "
            "Implement it in torch and register it with relax.platform.sgl_kernel_cpu_ops.register_cpu_op."
        )

    not_implemented.__name__ = qualified_name.rpartition(".")[2]
    not_implemented.__qualname__ = qualified_name
    return not_implemented


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV-cache slots into its row of the request-to-token table.

    Request i owns req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]; its slots are the
    next end-start entries of out_cache_loc, which holds all requests' new slots back to back (the
    semantics of the Triton kernel assign_req_to_token_pool in sglang/srt/mem_cache/allocation.py).
    """
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"pool_len {pool_len} does not match req_to_token's row length {req_to_token.shape[1]}")
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[taken : taken + count].to(req_to_token.dtype)
        taken += count


register_cpu_op("assign_req_to_token_pool_cpu", assign_req_to_token_pool_cpu)
