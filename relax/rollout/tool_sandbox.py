"""The inside of the Python tool's sandbox (relax.rollout.tools.PythonTool): run as a script, not imported.

    unshare --user --map-root-user --net --mount --pid --fork --kill-child --mount-proc \
        python -I -u tool_sandbox.py SCRATCH SCRATCH_BYTES MEMORY_BYTES CPU_SECONDS FILE_BYTES  < code

It starts as root of its own user, network, mount and PID namespaces (no network: only a loopback that is down),
then, before the code runs:
- SCRATCH becomes a tmpfs of SCRATCH_BYTES, the working directory and $HOME / $TMPDIR; it vanishes with the process;
- every other mount is made read-only, and /dev is replaced by a read-only tmpfs holding only null, zero, random
  and urandom (no accelerator device, no /dev/shm);
- memory (address space), CPU seconds, the size of a written file and core dumps are limited;
- every capability is dropped, from the bounding set too, and no_new_privs is set: the code cannot mount, remount
  read-write or gain capabilities by exec.
Then the code read from stdin runs as __main__. A step that fails stops the sandbox with exit status 3 and a line
naming the step: the code never runs with a sandbox half made.
"""

import ctypes
import os
import resource
import sys
import traceback

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
# A bind remount in a user namespace must keep the flags the outer namespace locked on the mount.
KEPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
              "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
DEVICES = ("null", "zero", "random", "urandom")
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38
LINUX_CAPABILITY_VERSION_3 = 0x20080522
SANDBOX_FAILED = 3

libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source, target: str, fstype, flags: int, data=None) -> None:
    _check(libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                      data and data.encode()), f"mount {target}")


def mount_points() -> list[tuple[str, list[str]]]:
    """(mount point, its options) of every mount this process sees, parents first."""
    points = []
    with open("/proc/self/mountinfo") as table:
        for line in table:
            fields = line.split()
            # mountinfo escapes a space, tab, newline and backslash in a path as octal (\040)
            point = fields[4].encode().decode("unicode_escape")
            points.append((point, fields[5].split(",")))
    return points


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def make_read_only(scratch: str) -> None:
    """Every mount but the scratch, /proc and /dev (replaced below) read-only."""
    for point, options in mount_points():
        if under(point, scratch) or under(point, "/proc") or under(point, "/dev"):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in options:
            flags |= KEPT_FLAGS.get(option, 0)
        mount(None, point, None, flags)


def replace_dev(scratch: str) -> None:
    """/dev as a read-only tmpfs with the four harmless devices, bound in through the scratch."""
    staging = os.path.join(scratch, ".dev")
    os.mkdir(staging)
    for name in DEVICES:
        open(os.path.join(staging, name), "w").close()
        mount(f"/dev/{name}", os.path.join(staging, name), None, MS_BIND)
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name in DEVICES:
        open(f"/dev/{name}", "w").close()
        mount(os.path.join(staging, name), f"/dev/{name}", None, MS_BIND)
        _check(libc.umount2(os.path.join(staging, name).encode(), MNT_DETACH), f"umount {staging}/{name}")
        os.remove(os.path.join(staging, name))
    os.rmdir(staging)
    mount(None, "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)


def drop_capabilities() -> None:
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # fails (EINVAL) past the kernel's last capability
        cap += 1

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    _check(libc.capset(ctypes.byref(Header(LINUX_CAPABILITY_VERSION_3, 0)), (Data * 2)()), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def enter(scratch: str, scratch_bytes: int, memory_bytes: int, cpu_seconds: int, file_bytes: int) -> None:
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host's mounts
    mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={scratch_bytes},mode=0700")
    make_read_only(scratch)
    replace_dev(scratch)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    drop_capabilities()
    os.chdir(scratch)
    os.environ.update(HOME=scratch, TMPDIR=scratch)


def main() -> None:
    scratch, *limits = sys.argv[1:]
    code = sys.stdin.read()
    try:
        enter(scratch, *(int(limit) for limit in limits))
    except OSError as error:
        print(f"relax tool sandbox: {error}", file=sys.stderr)
        sys.exit(SANDBOX_FAILED)
    sys.argv = ["<tool>"]
    try:
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as error:  # the traceback of the code alone, as Python would print it for a script
        frames = traceback.extract_tb(error.__traceback__)[1:]
        print("Traceback (most recent call last):", file=sys.stderr)
        print("".join(traceback.format_list(frames)), end="", file=sys.stderr)
        print("".join(traceback.format_exception_only(error)), end="", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
