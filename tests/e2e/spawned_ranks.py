"""A pool of spawned processes on the CPU platform, started once per test module: `ranks.run(fn, *args)` calls the
module-level `fn(*args)` on every rank, in a gloo process group of that call's, and returns each rank's result. A
`prologue` (a module-level function) runs first in every rank, before the platform prepares Megatron.

Megatron's parallel state and every process group are destroyed after every call, so each call builds the layout it
needs.
"""

import datetime
import gc
import traceback

import torch
import torch.multiprocessing as mp

from relax.ports import free_port


def _next_task(conn):
    try:
        return conn.recv()
    except EOFError:  # the test process is gone
        return None


def _rank_main(rank: int, world_size: int, timeout_s: float, conn, prologue) -> None:
    torch.set_num_threads(1)
    if prologue is not None:
        prologue()
    from relax.platform import get_platform

    get_platform("cpu").prepare_megatron()
    from megatron.core import parallel_state

    while (task := _next_task(conn)) is not None:
        fn, args, port = task
        # A process group of its own for each task, all of them destroyed after it: megatron's destroy_model_parallel
        # only drops its groups, whose gloo threads (two per group) would pile up over a module's tests.
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
            _free_the_tasks_models()


def _free_the_tasks_models() -> None:
    """Collect what the task left: its models, and with them the process groups they reference, whose gloo threads
    (two per group) end with their last reference. A megatron-core DDP model is held in a cycle the garbage collector
    cannot see, through autograd's C++ nodes: the DDP keeps a hook on each parameter's gradient accumulator that
    refers back to it, and a tensor the model keeps from its last forward (an MoE token dispatcher's, say) holds
    the graph up to those accumulators. Emptying each DDP left over (the task has ended: nothing uses them) lets the
    model go, and the cycle with it (each task's models stayed alive otherwise: 560 threads per rank by the middle of
    test_train_megatron)."""
    from megatron.core.distributed import DistributedDataParallel

    for ddp in [o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)]:
        ddp.__dict__.clear()
    gc.collect()


class SpawnedRanks:
    def __init__(self, world_size: int, task_timeout_s: float, prologue=None):
        self.task_timeout_s = task_timeout_s
        context = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = context.Pipe()
            # Not daemonic: megatron's checkpoint writer starts a helper process of its own.
            proc = context.Process(
                target=_rank_main, args=(rank, world_size, task_timeout_s, child, prologue), daemon=False
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, fn, *args) -> list:
        port = free_port()  # the task's process group
        for conn in self.conns:
            conn.send((fn, args, port))
        results = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(self.task_timeout_s):
                self.close()
                raise TimeoutError(f"rank {rank} did not finish {fn.__name__} in {self.task_timeout_s} s")
            status, value = conn.recv()
            if status == "error":
                raise AssertionError(f"rank {rank} failed in {fn.__name__}:\n{value}")
            results.append(value)
        return results

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
                proc.join(10)
            if proc.is_alive():
                proc.kill()
