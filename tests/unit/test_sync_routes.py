"""relax.sync.broadcast: which engines a sending rank reaches by handle and which through its broadcast group.
(The transfers themselves run in tests/e2e/test_multinode_sync.py.)"""

import pytest

from relax.platform import get_platform
from relax.sync.broadcast import BROADCAST, SAME_NODE, BroadcastGroup, WeightRoutes


def test_engines_on_other_nodes_share_one_broadcast_group():
    engines = ["engine0", "engine1", "engine2"]  # stand-ins for Ray actor handles: routing only compares them
    routes = WeightRoutes(engines, ["node-a", "node-b", "node-c"], own_node="node-b", engine_tp_size=2,
                          platform=get_platform("cpu"), group_name="relax-weights-from-rank0")
    assert routes.routes == [BROADCAST, SAME_NODE, BROADCAST]
    assert routes.same_node == ["engine1"]
    assert routes.broadcast.engines == ["engine0", "engine2"]
    assert routes.broadcast.world_size == 5  # the sender, then two TP ranks per remote engine
    assert routes.broadcast.name == "relax-weights-from-rank0"
    assert routes.serves(engines) and not routes.serves(engines[:2])


def test_no_group_when_every_engine_is_on_the_sender_node():
    routes = WeightRoutes(["engine0", "engine1"], ["node-a", "node-a"], own_node="node-a", engine_tp_size=1,
                          platform=get_platform("cpu"), group_name="unused")
    assert routes.routes == [SAME_NODE, SAME_NODE] and routes.broadcast is None
    routes.close()  # nothing to destroy


def test_bad_routing_input_is_refused():
    with pytest.raises(ValueError, match="2 engines but 1 engine node ids"):
        WeightRoutes(["engine0", "engine1"], ["node-a"], own_node="node-a", engine_tp_size=1,
                     platform=get_platform("cpu"), group_name="g")
    with pytest.raises(RuntimeError, match="broadcast group 'g' is not open"):
        BroadcastGroup(["engine0"], 1, get_platform("cpu"), "g").start_send(bucket=None)
