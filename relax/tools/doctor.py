"""`relax doctor`: a preflight table for this machine, and the fix for each thing that would stop a run.

It reports the platform and its device count; the versions of the device toolkit (CANN, or the NVIDIA
driver), torch / torch_npu, sglang, megatron-core and MindSpeed against relax/pins.py; whether the installed
sglang and megatron-core carry relax's patch sets (patches/); environment settings that conflict with a
colocated run (the platform's own rule from relax.platform, e.g. expandable segments beside a memory saver;
HCCL port settings shared by the several processes on one device; visible-device variables); and the
resources of a running Ray cluster.

What each platform needs (its pinned versions, toolkit, whether the patch sets are required) is its record's
(relax.platform). Gathering facts (gather_facts) is separate from judging them: every check is a plain function of
the record and plain values, tested with a fake environment. The exit status is 1 when any row is a blocker.
"""

import argparse
import importlib.metadata
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from relax import pins
from relax.kernels.gdn_training import KERNEL_PACKAGES
from relax.tools import patches
from relax.platform import DEVICE_CHOICES, PLATFORMS, Platform, platform_facts, resolve_platform_name

OK, INFO, WARN, BLOCKER = "ok", "info", "warn", "BLOCKER"

# A colocated run puts two processes on every device: the training actor and the SGLang engine.
PROCESSES_PER_DEVICE = 2

# What every platform runs on; each platform adds its own (Platform.pinned_versions).
COMMON_VERSIONS = {
    "sglang": pins.SGLANG,
    "megatron-core": pins.MEGATRON_CORE,
    "ray": pins.RAY,
    "transformers": pins.TRANSFORMERS,
}
# How to install what is not on PyPI under its own name.
INSTALL_HINTS = {
    "mindspeed": f"pip install -e a checkout of https://github.com/Ascend/MindSpeed at {pins.MINDSPEED[:12]} "
    "(branch core_r0.16.0), as docker/Dockerfile.npu does",
}
# A different version of these is a blocker: relax's flags, model mappings and patches are made for the pin.
EXACT = {"sglang", "megatron-core"}
VISIBLE_DEVICE_VARIABLES = tuple(p.visible_devices_env for p in PLATFORMS.values() if p.visible_devices_env)
HCCL_PORT_RANGE_VARIABLES = ("HCCL_HOST_SOCKET_PORT_RANGE", "HCCL_NPU_SOCKET_PORT_RANGE")


@dataclass(frozen=True)
class Row:
    check: str
    status: str  # ok | info | warn | BLOCKER
    found: str
    expected: str = ""
    fix: str = ""


@dataclass
class Facts:
    """Everything the checks judge, gathered once (or written by hand in tests)."""

    platform: Optional[Platform]  # the asked-for platform's record; None when the name is not a platform
    platform_error: str = ""  # why this machine cannot compute on the platform ("" when it can)
    device_count: int = 0
    gdn_kernel_error: str = ""  # why the GDN training kernel does not import here ("" when it does)
    versions: dict = field(default_factory=dict)  # distribution -> version, None when not installed
    toolkit_version: Optional[str] = None
    patch_states: dict = field(default_factory=dict)  # upstream -> {patch: state} or an error string
    environ: Mapping[str, str] = field(default_factory=dict)
    # What the platform's own rule (relax.platform: check_worker_env) says of this environment, if wrong
    worker_env_problem: str = ""
    ray_resources: Optional[dict] = None  # None: no cluster looked at
    ray_note: str = ""


# --------------------------------------------------------------------------------------------------
# Checks: plain functions of plain values.


def check_platform(facts: Facts) -> list[Row]:
    platform = facts.platform
    if platform is None:
        names = ", ".join(PLATFORMS)
        return [Row("platform", BLOCKER, facts.platform_error, names, f"pass --device {', '.join(DEVICE_CHOICES)}")]
    if facts.platform_error:
        return [Row("platform", BLOCKER, f"{platform.name}: unusable here", ">= 1 device", facts.platform_error)]
    status = OK if facts.device_count > 0 else BLOCKER
    found = f"{platform.name}, {facts.device_count} device(s), {platform.dist_backend}"
    return [
        Row(
            "platform",
            status,
            found,
            ">= 1 device",
            ""
            if status == OK
            else f"no {platform.name} device is visible: check the driver and "
            f"{platform.visible_devices_env or 'the visible-device variable'}",
        )
    ]


def check_training_kernels(attention_kernel: str, gdn_training_kernel: str, gdn_kernel_error: str) -> list[Row]:
    found = f"attention {attention_kernel}, GDN {gdn_training_kernel}"
    if gdn_kernel_error:
        _, package = KERNEL_PACKAGES.get(gdn_training_kernel, (None, "it"))
        return [
            Row(
                "training kernels",
                WARN,
                found,
                "the GDN kernel imports",
                f"Qwen3.5 / Qwen3-Next training needs it ({gdn_kernel_error}): install {package}, or pass "
                "--gdn-training-kernel reference",
            )
        ]
    return [Row("training kernels", OK, found, "", "")]


def _public(version: str) -> str:
    return version.split("+", 1)[0]


def check_versions(platform: Platform, versions: Mapping[str, Optional[str]]) -> list[Row]:
    expected = {**platform.pinned_versions, **COMMON_VERSIONS}
    rows = []
    for name, want in expected.items():
        have = versions.get(name)
        if have is None:
            rows.append(
                Row(name, BLOCKER, "not installed", want, INSTALL_HINTS.get(name, f"pip install {name}=={want}"))
            )
        elif _public(have) == want:
            rows.append(Row(name, OK, have, want))
        else:
            status = BLOCKER if name in EXACT else WARN
            rows.append(Row(name, status, have, want, f"pip install {name}=={want} (relax/pins.py)"))
    return rows


def check_toolkit(platform: Platform, version: Optional[str]) -> list[Row]:
    name, want = platform.toolkit, platform.toolkit_pin
    if name is None:
        return [Row("device toolkit", INFO, f"none needed on {platform.name}")]
    if version is None:
        return [
            Row(
                name,
                BLOCKER,
                "not found",
                want or "installed",
                f"install {name} (the image in docker/ has it) and load its environment",
            )
        ]
    if want and not version.startswith(want):
        return [Row(name, WARN, version, want, f"relax is pinned and tested against {name} {want}")]
    return [Row(name, OK, version, want or "")]


def check_patches(platform: Platform, states: Mapping[str, object]) -> list[Row]:
    required = platform.patches_required
    rows = []
    for upstream, per_patch in states.items():
        if isinstance(per_patch, str):  # could not be judged (not installed, no git)
            rows.append(Row(f"patches {upstream}", BLOCKER if required else INFO, per_patch))
            continue
        counts = {state: sum(1 for s in per_patch.values() if s == state) for state in set(per_patch.values())}
        found = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no patches"
        missing = [p for p, s in per_patch.items() if s != "applied"]
        conflicts = [p for p, s in per_patch.items() if s == "conflicts"]
        if not missing:
            rows.append(Row(f"patches {upstream}", OK, found, "all applied"))
        elif conflicts:
            rows.append(
                Row(
                    f"patches {upstream}",
                    BLOCKER if required else WARN,
                    found,
                    "all applied",
                    f"the installed {upstream} differs from the pinned release where {conflicts[0]} applies: "
                    f"reinstall the pinned version, then `relax patches apply {upstream}`",
                )
            )
        else:
            rows.append(
                Row(
                    f"patches {upstream}",
                    BLOCKER if required else INFO,
                    found,
                    "all applied",
                    f"relax patches apply {upstream}"
                    if required
                    else f"not needed on {platform.name} (relax.platform redirects what they fix)",
                )
            )
    return rows


def check_worker_env(problem: str, memory_saver: bool) -> list[Row]:
    """The platform's own verdict on this environment (e.g. expandable segments beside a memory saver)."""
    if problem:
        return [Row("worker environment", BLOCKER, "conflicts", "", problem)]
    saver = "memory saver on" if memory_saver else "no memory saver"
    return [Row("worker environment", OK, f"no conflict ({saver})")]


def _port_range(value: str) -> Optional[tuple[int, int]]:
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", value)
    if not match:
        return None
    low, high = int(match.group(1)), int(match.group(2))
    return (low, high) if 0 < low <= high <= 65535 else None


def check_hccl_ports(environ: Mapping[str, str], dist_backend: str) -> list[Row]:
    rows = []
    for variable in HCCL_PORT_RANGE_VARIABLES:
        value = environ.get(variable)
        if value is None or value.strip().lower() == "auto":
            continue
        ports = _port_range(value)
        if ports is None:
            rows.append(
                Row(
                    variable, BLOCKER, value, "auto, or LOW-HIGH", f"set {variable}=auto or a range such as 60000-60099"
                )
            )
        elif ports[1] - ports[0] + 1 < PROCESSES_PER_DEVICE:
            rows.append(
                Row(
                    variable,
                    BLOCKER,
                    value,
                    f">= {PROCESSES_PER_DEVICE} ports",
                    f"{PROCESSES_PER_DEVICE} processes share each NPU (training actor and SGLang engine) and "
                    f"every one inherits this range: widen it, or set {variable}=auto",
                )
            )
        else:
            rows.append(
                Row(
                    variable,
                    WARN,
                    value,
                    "auto",
                    f"every process inherits the same range; {PROCESSES_PER_DEVICE} of them share each NPU. "
                    f"Leave room for all of them, or set {variable}=auto",
                )
            )
    base = environ.get("HCCL_IF_BASE_PORT")
    if base is not None:
        rows.append(
            Row(
                "HCCL_IF_BASE_PORT",
                WARN,
                base,
                "unset",
                f"one base port for every process: the {PROCESSES_PER_DEVICE} processes on an NPU derive the "
                "same ports from it. Unset it unless each process gets its own",
            )
        )
    if rows and dist_backend != "hccl":
        rows = [Row(r.check, INFO, r.found, "", "HCCL is not used on this platform") for r in rows]
    return rows


def check_visible_devices(environ: Mapping[str, str], visible_devices_env: Optional[str], platform: str) -> list[Row]:
    rows = []
    for variable in VISIBLE_DEVICE_VARIABLES:
        value = environ.get(variable)
        if value is None:
            continue
        if variable != visible_devices_env:
            rows.append(
                Row(
                    variable,
                    WARN if visible_devices_env else INFO,
                    value,
                    "unset",
                    f"ignored on {platform}"
                    + (f": select devices with {visible_devices_env}" if visible_devices_env else ""),
                )
            )
            continue
        ids = [part.strip() for part in value.split(",")]
        if not value.strip():
            rows.append(
                Row(variable, BLOCKER, "(empty)", "device ids", f"an empty {variable} hides every device: unset it")
            )
        elif not all(part.isdigit() for part in ids) or len(set(ids)) != len(ids):
            rows.append(
                Row(
                    variable,
                    BLOCKER,
                    value,
                    "distinct device ids, e.g. 0,1,2,3",
                    f"set {variable} to comma-separated distinct ids",
                )
            )
        else:
            rows.append(Row(variable, OK, value, "", "Ray sets it per worker; relax keeps it as the job's device set"))
    return rows


def check_ray(resources: Optional[dict], note: str, ray_resource: Optional[str], device_count: int) -> list[Row]:
    if resources is None:
        return [
            Row(
                "ray cluster",
                INFO,
                note or "not looked at",
                "",
                "relax train starts a local Ray instance when none runs",
            )
        ]
    counted = [k for k in ("CPU", "GPU", "NPU", ray_resource) if k and k in resources]
    summary = ", ".join(
        [f"{k}={resources[k]:g}" for k in dict.fromkeys(counted)]
        + [f"memory={resources.get('memory', 0) / 2**30:.0f} GiB"]
    )
    if ray_resource and resources.get(ray_resource, 0) < 1:
        return [
            Row(
                "ray cluster",
                BLOCKER,
                summary,
                f"{ray_resource} >= 1",
                f"the cluster offers no {ray_resource}: start Ray on the device nodes "
                f"(ray start ... --resources '{{\"{ray_resource}\": {device_count}}}' for NPUs)",
            )
        ]
    return [Row("ray cluster", OK, summary)]


def run_checks(facts: Facts) -> list[Row]:
    rows = check_platform(facts)
    platform = facts.platform
    if platform is None:
        return rows
    # The other checks still run on a platform this machine lacks: they say what else is missing.
    rows += check_toolkit(platform, facts.toolkit_version)
    rows += check_training_kernels(platform.attention_kernel, platform.gdn_training_kernel, facts.gdn_kernel_error)
    rows += check_versions(platform, facts.versions)
    rows += check_patches(platform, facts.patch_states)
    rows += check_worker_env(facts.worker_env_problem, platform.has_memory_saver)
    rows += check_hccl_ports(facts.environ, platform.dist_backend)
    rows += check_visible_devices(facts.environ, platform.visible_devices_env, platform.name)
    rows += check_ray(facts.ray_resources, facts.ray_note, platform.ray_resource, facts.device_count)
    return rows


# --------------------------------------------------------------------------------------------------
# Gathering facts from this machine.

DISTRIBUTIONS = sorted({name for p in PLATFORMS.values() for name in p.pinned_versions} | set(COMMON_VERSIONS))


def installed_versions(names=DISTRIBUTIONS) -> dict:
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def gdn_kernel_import_error(name: str) -> str:
    from relax.kernels.gdn_training import gdn_training_kernel

    try:
        gdn_training_kernel(name)
    except ImportError as error:
        return str(error)
    return ""


def installed_patch_states() -> dict:
    states = {}
    for upstream in patches.load_manifest().values():
        if not upstream.package:
            continue
        try:
            states[upstream.name] = patches.patch_states(upstream, patches.installed_root(upstream))
        except patches.PatchError as error:
            states[upstream.name] = str(error)
    return states


def ray_cluster_resources(environ: Mapping[str, str]) -> tuple[Optional[dict], str]:
    """Resources of the running cluster (RAY_ADDRESS, or the one `ray start` on this node recorded)."""
    address = environ.get("RAY_ADDRESS")
    # `ray start` records the head's address here (under RAY_TMPDIR when set)
    recorded = Path(environ.get("RAY_TMPDIR") or "/tmp", "ray", "ray_current_cluster")
    if not address and not recorded.exists():
        return None, "no cluster running (no RAY_ADDRESS, no local `ray start`)"
    import ray

    try:
        ray.init(address=address or "auto", logging_level="ERROR", log_to_driver=False)
        return dict(ray.cluster_resources()), ""
    except Exception as error:  # noqa: BLE001  (any failure to connect is reported, not raised)
        return None, f"could not connect: {type(error).__name__}: {error}"
    finally:
        if ray.is_initialized():
            ray.shutdown()


def gather_facts(device: str = "auto", look_at_ray: bool = True, environ: Optional[Mapping[str, str]] = None) -> Facts:
    environ = dict(os.environ if environ is None else environ)
    try:
        record = platform_facts(resolve_platform_name(device, environ))
    except ValueError as error:
        return Facts(platform=None, platform_error=str(error), environ=environ)
    reason = record.unavailable_reason()
    try:
        record.check_worker_env(environ, memory_saver_on=record.has_memory_saver)
        worker_env_problem = ""
    except ValueError as error:
        worker_env_problem = str(error)
    facts = Facts(
        platform=record,
        platform_error=reason or "",
        device_count=0 if reason else record.device_count(),
        gdn_kernel_error=gdn_kernel_import_error(record.gdn_training_kernel),
        versions=installed_versions(),
        toolkit_version=record.toolkit_version(environ),
        patch_states=installed_patch_states(),
        environ=environ,
        worker_env_problem=worker_env_problem,
    )
    if look_at_ray:
        facts.ray_resources, facts.ray_note = ray_cluster_resources(environ)
    else:
        facts.ray_note = "skipped (--no-ray)"
    return facts


# --------------------------------------------------------------------------------------------------


def format_table(rows: list[Row]) -> str:
    header = ("CHECK", "STATUS", "FOUND", "EXPECTED")
    table = [header] + [(r.check, r.status, r.found, r.expected) for r in rows]
    widths = [min(max(len(line[i]) for line in table), 48) for i in range(3)]
    lines = [
        "  ".join(cell.ljust(widths[i]) if i < 3 else cell for i, cell in enumerate(line)).rstrip() for line in table
    ]
    fixes = [r for r in rows if r.fix and r.status != OK]
    if fixes:
        lines.append("")
        for r in fixes:
            lines.append(f"{r.status} {r.check}: {r.fix}")
    blockers = sum(r.status == BLOCKER for r in rows)
    lines.append("")
    lines.append(f"{blockers} blocker(s), {sum(r.status == WARN for r in rows)} warning(s)")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="relax doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        default="auto",
        choices=DEVICE_CHOICES,
        help="platform to check (auto: RELAX_DEVICE, else what this machine has)",
    )
    parser.add_argument("--no-ray", action="store_true", help="do not connect to a running Ray cluster")
    args = parser.parse_args(argv)
    rows = run_checks(gather_facts(args.device, look_at_ray=not args.no_ray))
    print(format_table(rows))
    return 1 if any(r.status == BLOCKER for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
