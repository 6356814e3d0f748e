"""Weights reach engines by both routes of relax.sync.broadcast: from the training rank on the engine's own
device, and by SGLang's distributed update from a rank on another node.

On the two-raylet cluster (two_node_cluster, tests/e2e/conftest.py) the placement spreads two CPU
"devices" over the two nodes: training rank 0 and engine 0 on one node, rank 1 and engine 1 on the other.
The actor has two pipeline stages, so each rank holds half the layers. One training step at a high learning
rate changes the actor's weights, and the loop's own weight-sync phase pushes them: each rank gives its
stage's layers to the engine on its own device (a payload gathered in a one-rank group) and broadcasts them
to the engine on the other node through a gloo group made with SGLang's init_weights_update_group. The two
engines' greedy tokens and logprobs for fixed prompts then agree, and differ from before the step.
"""

import pytest
import ray

from generations import assert_same_generations, largest_logprob_change
from relax.args import parse_train_args
from relax.ray.faults import FaultPlan
from relax.run.colocation import Colocation
from relax.run.loop import train
from relax.platform import get_platform
from relax.ray.placement import create_engine_actors, create_node_placement, create_training_actors
from relax.rollout.data import Prompt
from relax.rollout.engine import SamplingConfig
from relax.rollout.groups import Sample
from relax.rollout.synthetic import write_task
from relax.rollout.worker import EngineWorker
from relax.sync.broadcast import BROADCAST, SAME_DEVICE
from relax.tools.tiny_model import build_tiny_model
from relax.train.worker import TrainWorker

pytestmark = pytest.mark.long  # pytest.ini: not in CI's run

PROMPTS = [[5, 6, 7], [1, 33, 31, 17, 30, 54, 15]]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def greedy_outputs(engines) -> list[list[tuple[list[int], list[float]]]]:
    """Per engine: (tokens, logprobs) of the greedy completion of each prompt."""
    outputs = ray.get([engine.generate.remote(PROMPTS, GREEDY) for engine in engines.actors])
    return [[(c.token_ids, c.logprobs) for (c,) in groups] for groups in outputs]


def one_group(prompt_ids, responses, rewards) -> list[Sample]:
    prompt = Prompt(row=1, token_ids=list(prompt_ids), text="")
    return [Sample(prompt, list(tokens), [0.0] * len(tokens), "length", reward=reward)
            for tokens, reward in zip(responses, rewards)]


def test_engine_on_the_other_node_takes_the_update_by_broadcast(two_node_cluster, tmp_path):
    model = build_tiny_model(tmp_path / "model", "qwen3", seed=0)
    data = write_task("copy_digit", 4, tmp_path / "prompts.jsonl")
    config = parse_train_args([
        "--device", "cpu", "--hf-checkpoint", str(model), "--prompt-data", str(data), "--reward-fn", "copy_digit",
        "--num-nodes", "2", "--num-devices-per-node", "1", "--rollout-num-devices-per-engine", "1",
        "--pipeline-model-parallel-size", "2",
        "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--global-batch-size", "2",
        "--micro-batch-size", "1", "--lr", "1e-2", "--weight-decay", "0.0",
        "--sglang-max-total-tokens", "2048",
    ])
    settings = config.run
    platform = get_platform("cpu")
    placement = create_node_placement(platform, settings.num_nodes, settings.num_devices_per_node)
    trainers = engines = None
    try:
        trainers = create_training_actors(
            TrainWorker, placement,
            args=(
                settings.hf_checkpoint, config.megatron.values, config.actor, platform.name,
                settings.update_weight_buffer_size, {},
            ),
        )
        ray.get(trainers.call("sleep"))
        data_parallel_ranks = ray.get(trainers.call("data_parallel_rank"))
        engines = create_engine_actors(
            EngineWorker, placement, devices_per_engine=1,
            args=(config.sglang, settings.hf_checkpoint, platform.name, 1, False),
        )
        nodes = placement.node_ids()
        assert len(nodes) == 2 and set(nodes) == set(two_node_cluster.node_names)
        assert [bundle.node_id for bundle in trainers.bundles] == nodes  # rank (and stage) i on nodes[i]
        assert [bundle.node_id for bundle in engines.bundles] == nodes  # engine i beside rank i

        before = greedy_outputs(engines)
        assert_same_generations(before[0], before[1])  # both loaded the same checkpoint

        colocation = Colocation(trainers, engines, 1, config.run, FaultPlan())
        for step in range(2):  # the second push reuses the groups made by the first
            samples = one_group(PROMPTS[step], [before[0][step][0][:4], before[0][step][0][4:]], rewards=[1.0, 0.0])
            colocation.to_actor()
            train(trainers, data_parallel_ranks, samples, config.algorithm, config.run.train_timeout)
            reports = colocation.to_engines()
            assert reports[0]["routes"] == [SAME_DEVICE, BROADCAST] and reports[0]["bytes"] > 0
            assert reports[1]["routes"] == [BROADCAST, SAME_DEVICE] and reports[1]["bytes"] > 0

            after = greedy_outputs(engines)
            assert largest_logprob_change(before[0], after[0]) > 1e-3, "the training step changed nothing"
            assert_same_generations(after[1], after[0])  # half of each engine's weights by broadcast
            before = after
        ray.get(trainers.call("close_weight_sync"))
    finally:
        for group in (engines, trainers):
            if group is not None:
                group.kill()
        placement.remove()
