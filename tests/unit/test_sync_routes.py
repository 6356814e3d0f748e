"""relax.sync.broadcast: which training rank sends which engine its weights, and how (plan_pushes); what one rank
does with them (WeightRoutes). The transfers themselves run in the e2e loop tests and
tests/e2e/test_multinode_sync.py; every preset's plan is checked from its dry run in tests/e2e/test_run_scripts.py."""

import pytest

from relax.platform import platform_facts
from relax.sync.broadcast import (
    BROADCAST, SAME_DEVICE, SAME_NODE, BroadcastGroup, Push, WeightRoutes, plan_broadcasts, plan_pushes,
)


def layout(num_nodes: int, devices_per_node: int, pipeline_stages: int) -> tuple[list[int], list[str]]:
    """Each training rank's pipeline stage and node: rank i on device i of the placement, stages outermost in
    Megatron's default rank order (tp-cp-ep-dp-pp)."""
    world = num_nodes * devices_per_node
    per_stage = world // pipeline_stages
    return [rank // per_stage for rank in range(world)], [f"node{rank // devices_per_node}" for rank in range(world)]


def test_qwen35_9b_on_8_npus_each_engine_rank_takes_its_weights_from_its_own_device():
    # TP 4 x DP 2, one stage; four engines of two NPUs.
    pushes = plan_pushes(*layout(1, 8, 1), devices_per_engine=2, handles_cross_devices=False)
    assert pushes == [Push(0, engine, SAME_DEVICE, (2 * engine, 2 * engine + 1)) for engine in range(4)]


def test_qwen35_35b_on_two_16_npu_nodes_each_stage_feeds_its_node_by_device_and_the_other_by_broadcast():
    # TP 8 x PP 2 x DP 2 over 32 NPUs: stage 0 on node 0, stage 1 on node 1; four engines of eight NPUs.
    pushes = plan_pushes(*layout(2, 16, 2), devices_per_engine=8, handles_cross_devices=False)
    assert pushes == [
        Push(0, 0, SAME_DEVICE, tuple(range(0, 8))), Push(0, 1, SAME_DEVICE, tuple(range(8, 16))),
        Push(0, 2, BROADCAST, (0,)), Push(0, 3, BROADCAST, (0,)),
        Push(1, 0, BROADCAST, (16,)), Push(1, 1, BROADCAST, (16,)),
        Push(1, 2, SAME_DEVICE, tuple(range(16, 24))), Push(1, 3, SAME_DEVICE, tuple(range(24, 32))),
    ]


def test_qwen3_4b_on_8_gpus_each_rank_feeds_the_engine_on_its_own_gpu():
    # DP 8; eight engines of one GPU: eight pushes at once, one per GPU, on CUDA as on NPUs.
    for handles_cross_devices in (True, False):
        pushes = plan_pushes(*layout(1, 8, 1), devices_per_engine=1, handles_cross_devices=handles_cross_devices)
        assert pushes == [Push(0, engine, SAME_DEVICE, (engine,)) for engine in range(8)]


def test_engines_on_devices_of_their_own_take_every_stage_by_broadcast_from_its_first_rank():
    # --no-colocate: PP 2 over four training GPUs, three engines elsewhere.
    stages, _ = layout(1, 4, 2)
    assert plan_broadcasts(stages, num_engines=3) == [
        Push(stage, engine, BROADCAST, (2 * stage,)) for stage in (0, 1) for engine in range(3)
    ]


def test_where_handles_cross_devices_an_engine_holding_another_stage_takes_handles_from_its_node():
    # PP 2 over four GPUs, one engine of four: stage 0 (GPUs 0-1) reaches the engine's GPUs 2-3 by handle.
    pushes = plan_pushes(*layout(1, 4, 2), devices_per_engine=4, handles_cross_devices=True)
    assert pushes == [Push(0, 0, SAME_NODE, (0,)), Push(1, 0, SAME_NODE, (2,))]


def test_where_handles_cross_devices_an_engine_holding_another_stage_on_another_node_takes_a_broadcast():
    # PP 2 over two nodes of two GPUs: each stage feeds the engine on its own GPUs and broadcasts to the other.
    pushes = plan_pushes(*layout(2, 2, 2), devices_per_engine=2, handles_cross_devices=True)
    assert pushes == [
        Push(0, 0, SAME_DEVICE, (0, 1)), Push(0, 1, BROADCAST, (0,)),
        Push(1, 0, BROADCAST, (2,)), Push(1, 1, SAME_DEVICE, (2, 3)),
    ]


def test_an_engine_across_pipeline_stages_is_refused_where_handles_stay_on_their_device():
    # Stages of two devices, engines of four: engine 0 holds stage 0's ranks 0-1 and stage 1's 2-3, so neither
    # stage feeds all its ranks device by device, and a broadcast from stage 0's sender would reach device 0 twice.
    with pytest.raises(ValueError, match="engine 0 shares a device with training rank 0.*divide the devices per"):
        plan_pushes(*layout(1, 4, 2), devices_per_engine=4, handles_cross_devices=False)


def test_a_rank_sends_on_the_routes_of_its_pushes():
    engines = ["engine0", "engine1", "engine2", "engine3"]  # stand-ins for Ray actor handles: routing compares them
    pushes = plan_pushes(*layout(2, 4, 2), devices_per_engine=2, handles_cross_devices=False)
    groups = {(push.stage, push.engine): f"group{push.engine}" for push in pushes if push.route == SAME_DEVICE}
    cpu = platform_facts("cpu")
    sender = WeightRoutes(engines, pushes, rank=4, engine_tp_size=2, platform=cpu, group_name="g4", groups=groups)
    assert sender.routes == [BROADCAST, BROADCAST, SAME_DEVICE, None]
    assert sender.broadcast.engines == ["engine0", "engine1"] and sender.broadcast.world_size == 5
    assert (sender.same_device, sender.device_group) == (Push(1, 2, SAME_DEVICE, (4, 5)), "group2")
    member = WeightRoutes(engines, pushes, rank=7, engine_tp_size=2, platform=cpu, group_name="g7", groups=groups)
    assert member.routes == [None, None, None, SAME_DEVICE] and member.broadcast is None and member.sends
    # An engine restarted in place: the routes send to the new actor; a broadcast group that held it is rebuilt.
    member.follow(["engine0", "engine1", "engine2", "new3"])
    assert member.engines == ["engine0", "engine1", "engine2", "new3"]
    sender.follow(["engine0", "new1", "engine2", "engine3"])
    assert sender.broadcast.engines == ["engine0", "new1"] and sender.engines[1] == "new1"
    with pytest.raises(ValueError, match="2 engines, but the weight routes were planned for 4"):
        member.follow(engines[:2])


def test_bad_routing_input_is_refused():
    with pytest.raises(ValueError, match="4 training ranks' stages but 3 nodes"):
        plan_pushes([0, 0, 0, 0], ["a", "a", "a"], devices_per_engine=1, handles_cross_devices=False)
    with pytest.raises(ValueError, match="rollout_num_devices_per_engine=3 must divide the 4 placed devices"):
        plan_pushes(*layout(1, 4, 1), devices_per_engine=3, handles_cross_devices=False)
    with pytest.raises(RuntimeError, match="broadcast group 'g' is not open"):
        BroadcastGroup(["engine0"], 1, platform_facts("cpu"), "g").start_send(bucket=None)
