"""What every test tier shares: the tier markers and the lanes.

Tiers, marked from the directory a test lives in (pytest.ini declares them): unit (relax's own logic, no
process started), npu (Ascend start-up code on the CPU under stand-ins), e2e (the real stack: Ray, SGLang's
engine, megatron-core), gpu (tests/gpu, through the device tool only; not in CI). `-m unit` runs one tier.

Lanes: pytest.ini runs the suite in pytest-xdist workers (`--dist loadgroup`). An e2e test that uses a module
fixture (an engine, a process group, a cluster) is in its module's group, so the fixture starts once, in one lane;
so is one that uses the session's saved tiny run (built once for all lanes: tests/e2e/conftest.py), so that the
module's other tests do not hold the second lane idle on the run's lock while the first lane runs it; any other test
goes to whichever lane is free. Each lane gets its own Ray temporary directory, so a local cluster one lane starts
(ray.init() with no address) never finds another lane's through /tmp/ray."""

import os
from pathlib import Path

import pytest

# In the order the lanes take them: the e2e tests (seconds to minutes each) first, the unit tests (milliseconds each)
# last, where they fill in while the last long tests end.
TIERS = ("e2e", "npu", "unit", "gpu")
# The e2e modules whose tests take longest, longest first (CPU-seconds in one process, 2026-12-07: about 30 to 450 each;
# most of them start an engine or the whole tiny job); the lanes take them before the other e2e modules. A long test
# taken last would run on alone while the other lane stands idle. (pytest.ini turns off pytest-xdist's own order, the
# groups with the most tests first.) The long tier's modules (pytest.ini) are in the list for `-m long`.
LONGEST_FIRST = (
    "test_train_megatron.py", "test_loop_faults.py", "test_loop_resume.py", "test_loop_debug.py",
    "test_ray_cluster.py", "test_patches_sglang.py", "test_loop_async.py", "test_multinode_sync.py",
    "test_loop_two_engines.py", "test_qwen35_sglang.py", "test_submit_tiny_run.py", "test_run_scripts.py", "test_loop.py",
    "test_loop_signals.py", "test_weight_sync_cpu.py", "test_qwen35_loop.py",
    "test_loop_tools.py", "test_loop_custom_generate.py", "test_qwen35_vl_sglang.py", "test_qwen35_megatron.py",
    "test_npu_startup.py", "test_engine.py",
)

_lane = os.environ.get("PYTEST_XDIST_WORKER")
if _lane:
    # Short: Ray puts unix sockets under it, whose paths are limited to 107 bytes.
    os.environ["RAY_TMPDIR"] = f"/tmp/relax-{os.getpid()}-{_lane}"
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)


# Session fixtures that one lane builds while any other lane that needs them waits (tests/e2e/conftest.py).
BUILT_BY_ONE_LANE = ("saved_tiny_run",)


def _runs_in_its_modules_lane(item) -> bool:
    # pytest names a test's fixture definitions only in this attribute (the last definition of a name is used).
    fixtures = item._fixtureinfo.name2fixturedefs
    if any(name in fixtures for name in BUILT_BY_ONE_LANE):
        return True
    return any(overrides[-1].scope in ("class", "module") for overrides in fixtures.values())


def _lane_order(path: Path) -> tuple[int, int]:
    """Where the tests of `path` (relative to tests/) come in the order the lanes take them."""
    tier = TIERS.index(path.parts[0]) if path.parts[0] in TIERS else len(TIERS)
    return tier, LONGEST_FIRST.index(path.name) if path.name in LONGEST_FIRST else len(LONGEST_FIRST)


# A wrapper, so the marks and the order are there before pytest-xdist's own hook reads the xdist_group marks.
@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    tests_dir = Path(__file__).parent
    items.sort(key=lambda item: _lane_order(Path(item.fspath).relative_to(tests_dir)))  # stable: modules stay whole
    grouped = set()  # the e2e modules whose tests share a lane: a module fixture or the saved run of one of them
    for item in items:
        tier = Path(item.fspath).relative_to(tests_dir).parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "e2e" and _runs_in_its_modules_lane(item):
            grouped.add(item.fspath)
    for item in items:
        if item.fspath in grouped:
            item.add_marker(pytest.mark.xdist_group(Path(item.fspath).name))
    collected = yield
    if hasattr(config, "workerinput") and config.getvalue("loadgroup"):  # a lane: pytest-xdist has named the groups
        ungrouped = [item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
        if ungrouped:
            raise pytest.UsageError(
                f"pytest-xdist did not put {ungrouped[0]} in its lane group: each lane would start its module "
                "fixtures again; install the pytest relax/pins.py TEST_TOOLS names (bash scripts/setup.sh)"
            )
    return collected
