"""Process groups that can be destroyed while the actor sleeps and rebuilt when it wakes.

Communicators hold device memory (NCCL/HCCL buffers) that the colocated engine wants while the actor
sleeps. Destroying them is easy; the hard part is that Megatron's DDP, optimizer and layers keep
references to the group objects. So while the actor builds itself, every `torch.distributed.new_group`
call is recorded and answered with a `ReloadableGroup`: a ProcessGroup whose calls go to a real group
underneath. Sleep destroys the real groups; wake calls new_group again with the very same arguments
(ranks, timeout, backend, pg_options, description), in the same order on every rank, and points each
ReloadableGroup at its new real group. Every reference held anywhere stays valid.

torch.distributed's module functions (get_rank(group), get_backend(group), ...) look groups up in its
private registry (distributed_c10d._world); a ReloadableGroup is registered there under the entries of
its current real group. That registry is torch-internal: the e2e tests exercise it on the pinned torch.
"""

import datetime
import inspect
from contextlib import contextmanager

import torch.distributed as dist
from torch.distributed import distributed_c10d

# distributed_c10d._world's per-group tables (GroupMember.WORLD is never among the groups handled here).
_REGISTRY_TABLES = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag")


class ReloadableGroup(dist.ProcessGroup):
    """A process group whose real group can be replaced; everything else is the real group's."""

    def __init__(self, real: dist.ProcessGroup):
        super().__init__(real.rank(), real.size())
        object.__setattr__(self, "_real", real)

    def __getattribute__(self, name):
        if name in ("_real", "_set_real") or name.startswith("__"):
            return object.__getattribute__(self, name)
        real = object.__getattribute__(self, "_real")
        if real is None:
            raise RuntimeError(
                f"process group used while destroyed ({name}): the actor is asleep, call wake() first"
            )
        return getattr(real, name)

    def _set_real(self, real: dist.ProcessGroup | None) -> None:
        world = distributed_c10d._world
        for table in _REGISTRY_TABLES:
            getattr(world, table).pop(self, None)
            if real is not None:
                getattr(world, table)[self] = getattr(world, table)[real]
        object.__setattr__(self, "_real", real)


class ReloadableGroups:
    """The groups created inside `recording()`, destroyed and rebuilt together."""

    def __init__(self, timeout: datetime.timedelta):
        # For the groups made without a timeout (megatron-core 0.16 makes its expert data-parallel gloo group
        # so), which torch would give its backend's default (gloo: 30 minutes) instead of the actor's.
        self.timeout = timeout
        self._calls: list[tuple[dict, ReloadableGroup | None]] = []
        self.destroyed = False

    @contextmanager
    def recording(self):
        """Answer torch.distributed.new_group with ReloadableGroups and remember each call's arguments."""
        create = dist.new_group

        def new_group(*args, **kwargs):
            kwargs = dict(inspect.signature(create).bind(*args, **kwargs).arguments)
            if kwargs.get("timeout") is None:
                kwargs["timeout"] = self.timeout
            group = create(**kwargs)
            reloadable = None if group is dist.GroupMember.NON_GROUP_MEMBER else ReloadableGroup(group)
            if reloadable is not None:
                reloadable._set_real(group)
            self._calls.append((kwargs, reloadable))
            return group if reloadable is None else reloadable

        dist.new_group = new_group
        try:
            yield self
        finally:
            dist.new_group = create

    @property
    def groups(self) -> list[ReloadableGroup]:
        """The groups this rank belongs to."""
        return [group for _, group in self._calls if group is not None]

    def destroy(self) -> None:
        if self.destroyed:
            raise RuntimeError("process groups are already destroyed")
        for group in reversed(self.groups):
            real = object.__getattribute__(group, "_real")
            group._set_real(None)
            dist.destroy_process_group(real)
        self.destroyed = True

    def rebuild(self) -> None:
        """new_group again with the recorded arguments, in the recorded order (every rank calls it for
        every group, members or not, as new_group requires)."""
        if not self.destroyed:
            raise RuntimeError("process groups are not destroyed")
        for kwargs, group in self._calls:
            real = dist.new_group(**kwargs)
            if group is not None:
                group._set_real(real)
        self.destroyed = False
