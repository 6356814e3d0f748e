"""benchmarks/weight_sync.py's failed_checks: each broken check of a switch is reported on its own line."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import weight_sync  # noqa: E402


def result(**checks):
    good = {"groups_usable_asleep": False, "groups_usable_awake": True, "timeouts": [["0:07:00"], ["0:07:00"]],
            "weights_compared": 3, "weights_mismatched": []}
    return {"checks": {**good, **checks}, "metrics": [{"update_successful": True}]}


def test_all_held():
    assert weight_sync.failed_checks([result(), result()], 7) == []


def test_each_failure_is_named():
    failed = weight_sync.failed_checks(
        [result(weights_mismatched=["lm_head.weight"]), result(timeouts=[["0:07:00"], ["0:30:00"]])], 7)
    assert len(failed) == 2
    assert failed[0].startswith("rank 0:") and "lm_head.weight" in failed[0]
    assert failed[1].startswith("rank 1:") and "0:30:00" in failed[1]
    skipped = {"checks": result()["checks"], "metrics": [{"update_successful": False}]}
    asleep = result(groups_usable_asleep=True)
    assert [line.split(":")[0] for line in weight_sync.failed_checks([skipped, asleep], 7)] == ["rank 0", "rank 1"]
