"""The environment every relax worker process gets: one rule, used by `relax submit` for the job and by
the driver for each actor it places.

A Ray actor is a process forked by its node's raylet, which was started long before the run: a variable
exported in the shell that submits (or starts) a run reaches actors only through a runtime_env. The rule:

    job_env_vars:     every variable of the calling environment with a prefix workers read
                      (WORKER_ENV_PREFIXES, WORKER_ENV_NAMES), except the visible-devices variables
                      < the variables the user names (`--env NAME` takes its value from the calling
                      environment, `--env NAME=VALUE` sets it)
    worker_env_vars:  the platform's default worker environment < job_env_vars; checked by the platform

Later entries win. `relax submit` gives the job job_env_vars of the submitting shell; Ray hands a job's
env_vars to its driver and to every actor the driver creates. The driver then gives each actor it places
worker_env_vars of its own environment (which holds the job's variables): the platform defaults are
applied there and only there, because they depend on the run (the memory saver) and on the cluster's
platform, which the submitting machine may not have. Ray merges env_vars per variable, the actor's winning.
"""

import re
from collections.abc import Iterable, Mapping

# Prefixes of the variables SGLang, Megatron/MindSpeed, torch, the collective libraries and relax read.
WORKER_ENV_PREFIXES = (
    "RELAX_",
    "SGLANG_",
    "TORCH_",
    "PYTORCH_",
    "NCCL_",
    "CUDA_",
    "HCCL_",
    "ASCEND_",
    "MINDSPEED_",
    "GLOO_",
    "TRITON_",
)
# Whole names read by the same programs that share no prefix.
WORKER_ENV_NAMES = (
    "TASK_QUEUE_ENABLE",  # torch_npu: operator dispatch queue level
    "CPU_AFFINITY_CONF",  # torch_npu: bind threads to the cores next to the NPU
    "OMP_NUM_THREADS",
    "STREAMS_PER_DEVICE",  # torch_npu: streams in each device's pool
    "MULTI_STREAM_MEMORY_REUSE",  # torch_npu's allocator: reuse memory freed on other streams
    "P2P_HCCL_BUFFSIZE",  # torch_npu: MB of buffer of the separate point-to-point HCCL communicators
    "DEEPEP_HCCL_BUFFSIZE",  # SGLang on NPU: MB of HCCL buffer of its DeepEP group (else HCCL_BUFFSIZE)
    # the Ascend SGLang build of Relax's NPU scripts: Triton or Ascend C GDN attention (SGLang 0.5.23 reads none)
    "GDN_ATTN_BACKEND_TRITON",
    "TMS_HOOK_MODE",  # torch_memory_saver (sgl-kernel-npu's build): "torch" or "preload" hooks
)
# Never forwarded by prefix: Ray gives each actor its devices on its own node, and a login shell's
# CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES would point every worker at the same devices.
# Naming one with --env still forwards it.
_NOT_FORWARDED_SUFFIX = "_VISIBLE_DEVICES"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` that workers read, by prefix or name (visible-devices variables excluded)."""
    return {
        name: value
        for name, value in environ.items()
        if (name.startswith(WORKER_ENV_PREFIXES) or name in WORKER_ENV_NAMES)
        and not name.endswith(_NOT_FORWARDED_SUFFIX)
    }


def parse_env_specs(specs: Iterable[str], environ: Mapping[str, str]) -> dict[str, str]:
    """`NAME=VALUE` sets NAME; a bare `NAME` takes its value from `environ` and must be set there."""
    named = {}
    for spec in specs:
        name, has_value, value = spec.partition("=")
        if not _NAME.match(name):
            raise ValueError(f"--env {spec!r}: {name!r} is not a variable name; write NAME or NAME=VALUE")
        if not has_value:
            if name not in environ:
                raise ValueError(
                    f"--env {name}: {name} is not set in this shell; export it first or write --env {name}=VALUE"
                )
            value = environ[name]
        named[name] = value
    return named


def job_env_vars(environ: Mapping[str, str], named: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the user's environment gives every process of a job: forwarded variables < `named`."""
    return {**forwarded_env(environ), **(named or {})}


def worker_env_vars(
    platform,
    environ: Mapping[str, str],
    named: Mapping[str, str] | None = None,
    memory_saver_on: bool = False,
) -> dict[str, str]:
    """Environment of a device worker: platform defaults < job_env_vars(environ, named), checked by the
    platform (a ValueError names a variable that contradicts it, e.g. expandable segments with a memory saver)."""
    env = {name: str(value) for name, value in platform.worker_env(memory_saver_on).items()}
    env.update(job_env_vars(environ, named))
    platform.check_worker_env(env, memory_saver_on)
    return env
