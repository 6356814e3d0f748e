"""relax.ray.envcheck: the verdict over its report (its run on a cluster is in tests/e2e/test_ray_cluster.py)."""

from relax.ray.envcheck import missing


def test_envcheck_names_each_process_that_missed_a_variable():
    seen = {"env": {"A": "1", "B": "2"}}
    report = {"driver": seen, "plain_actor": {"env": {"A": "1", "B": None}},
              "placed_ranks": [seen, {"env": {"A": None, "B": None}}]}
    assert missing(report) == ["plain_actor: B", "rank 1: A", "rank 1: B"]
