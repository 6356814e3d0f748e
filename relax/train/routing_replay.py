"""Routing replay (R3, --use-rollout-routing-replay): the actor's MoE routers send every token to the experts the
rollout engine's routers chose for it, instead of choosing again.

The engine and the actor compute router logits with different kernels and precisions; where two experts' scores
are close they pick different experts, and the token's logprob under the actor then differs from the engine's by
more than rounding. Replayed, each token meets the same experts in both; the router's probabilities are still the
actor's own (its scores gathered at the replayed experts), so the router weights keep their gradient.

megatron-core 0.16.1 gives each router a RouterReplay when TransformerConfig.moe_enable_routing_replay is set
(megatron/core/transformer/moe/router_replay.py): under the REPLAY_FORWARD action its top-k returns the target
indices it holds, [tokens the router sees, top-k]. relax sets those targets per micro-batch, before its forward,
from the micro-batch's packed routed experts (relax.train.batch), for each router by its global layer number, so
a pipeline stage takes its own layers' experts; under context parallelism, those of the rank's own tokens. The
targets serve the backward of the same micro-batch as well: the schedules without pipelining run each micro-batch's
backward before the next forward, and a backward that recomputes the router across pipeline stages is refused at
parse time (relax.args.checks).
"""


class RoutingReplay:
    """The routers of one model, replaying what they are given. Use replay(micro_batch) before each forward and
    clear() after the schedule."""

    def __init__(self, model, sequence_parallel: bool):
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        # (0-based global layer index, its RouterReplay) for every MoE layer of this pipeline stage
        self.routers = [
            (module.layer_number - 1, module.router_replay)
            for module in model.modules()
            if isinstance(module, TopKRouter)
        ]
        if not self.routers or any(replay is None for _, replay in self.routers):
            raise ValueError(
                "routing replay needs a MoE model whose routers were built with moe_enable_routing_replay "
                "(relax sets it with --use-rollout-routing-replay)"
            )
        for _, replay in self.routers:
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        # With sequence parallelism each tensor-parallel rank's routers see its slice of the row's tokens.
        self.token_slice = (
            (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
            if sequence_parallel
            else (0, 1)
        )

    def replay(self, micro_batch) -> None:
        """Make every router of this stage take the micro-batch's routed experts in the next forward."""
        experts = micro_batch.routed_experts
        if experts is None:
            raise ValueError(
                "routing replay is on but the batch carries no routed experts: the rollout engine must return them "
                "(--use-rollout-routing-replay turns on SGLang's enable_return_routed_experts)"
            )
        if micro_batch.row_split is not None:  # context parallelism: this rank's part of the row
            experts = experts[micro_batch.row_split.token_index]
        rank, size = self.token_slice
        tokens = experts.shape[0] // size
        experts = experts[rank * tokens : (rank + 1) * tokens].long()  # indices for megatron's gather
        for layer, replay in self.routers:
            replay.clear_indices()  # its backward list would otherwise keep every micro-batch's targets
            replay.set_target_indices(experts[:, layer].contiguous())

    def clear(self) -> None:
        """Drop the targets (they hold the last micro-batch's experts)."""
        for _, replay in self.routers:
            replay.clear_indices()

