"""One SGLang engine as a Ray actor, on the bundle relax.ray.placement gave it: relax.rollout.engine.RolloutEngine
itself, its methods called through Ray by the driver and the training ranks.

The engine's first device is the actor's logical device index (RELAX_LOCAL_DEVICE), SGLang's base_gpu_id.
SGLang's scheduler and detokenizer ask the kernel to SIGKILL them when their parent dies (PR_SET_PDEATHSIG,
sglang.srt.utils.kill_itself_when_parent_died), so they end with this actor's process, even a SIGKILLed
one: relax needs no watchdog of its own for them. Their own death is reported by the driver's liveness
watch (relax.ray.watch), which polls the processes watched_child_pids names.

The actor is a threaded one with two concurrency groups: the hand-overs (memory, weights) run one at a time in
Ray's default group, in the order they are called, as before; the rollout's groups (generate_group) and the abort
run in GENERATION, each waiting in its own thread on the engine's event loop (RolloutEngine runs it in a thread of
its own). The abort must not wait behind the generations it ends, so GENERATION has a thread for every group a
rollout may have in flight, on whichever engine they all went to, and one more (engine_actor_class); more calls than
threads wait in Ray's queue, which only an evaluation's (all its prompts submitted at once, never aborted) meets.
Not an async actor: Ray runs an async actor's __init__ on its event loop thread, where SGLang's Engine would take
Ray's running loop as its own, and off the main thread, where no SIGQUIT handler can be installed (SGLang's children
SIGQUIT the process when they fail).

With tools (--tools: a ToolRollout), a group's samples are multi-turn (relax.rollout.multi_turn): each sample's turns
run as one coroutine on the engine's event loop, all n of the group at once, so a sample's requests stay on this
engine (its prefix cache holds the conversation so far) and a sample waiting on a tool holds no generation slot (the
tool runs in a thread; the engine batches the other samples' turns meanwhile). An abort ends the turns in flight
and keeps the groups it finds from starting another; with partial rollout a later step's group continues each
sample where it stopped (relax.rollout.multi_turn).

With a custom generate function (--custom-generate-function-path: relax.rollout.custom_generate), a rollout group's
samples are the function's, n calls on the engine's event loop at once (each gives a sample, or several: its fan-out
joins the group), for the same reasons: the requests it sends through relax.rollout.custom_generate.generate go to this
engine, and an abort answers those it sends after it as aborted. The evaluation's groups are the function's too, and it
is told so; with partial rollout a later step's call continues each sample the function returned ABORTED
(relax.rollout.custom_generate). The actor then also serves SGLang's /generate over HTTP in front of its engine
(relax.rollout.generate_server, on the engine's loop; its address is the function's args.sglang_router_ip and
sglang_router_port), for functions written for slime, and OpenAI's chat completions of the agent sessions the function
opens (relax.rollout.agent_session). An HTTP request to /generate carries nothing of the group it belongs to, so after
an abort every such request is answered aborted until each group that ran at the abort has returned: the rollout starts
no group before the aborted ones are back (relax.rollout.rollout.collect_groups), so those requests are all the aborted
groups'. (A session's chat completions go to the engine as its group's requests: aborted after an abort that came once
the group started.)
"""

import asyncio
import functools
from collections import Counter
from dataclasses import asdict

import ray

from relax.ports import free_port
from relax.ray.placement import local_device_index
from relax.rollout.agent_session import ChatSessions
from relax.rollout.custom_generate import SlimeArgs, generate_samples, load_custom_generate_fn
from relax.rollout.data import Prompt
from relax.rollout.engine import Completion, RolloutEngine, SamplingConfig, request_params, sglang_generate
from relax.rollout.generate_server import HOST, EngineUnavailable, GenerateRequest, GenerateServer, aborted_output
from relax.rollout.multi_turn import MultiTurnResponse, ToolRollout, generate_multi_turn
from relax.rollout.partial import ResponseSoFar
from relax.rollout.rollout import offset_seed
from relax.rollout.tool_calls import ToolUse

GENERATION = "generation"  # the concurrency group of the rollout's calls
# GENERATION's threads at least: generate_group calls an engine actor runs at once (the evaluation's too; Ray queues
# the rest). Ray starts them all with the actor.
MIN_GENERATION_THREADS = 1024


class EngineWorker(RolloutEngine):
    # ray.remote's options for this class (relax.ray.placement.ActorGroup reads them; subclasses inherit them)
    RAY_OPTIONS = {"concurrency_groups": {GENERATION: MIN_GENERATION_THREADS}}

    def __init__(self, server_args, model_path: str, device: str, tp_size: int, enable_memory_saver: bool,
                 tool_rollout: ToolRollout | None = None, custom_generate: SlimeArgs | None = None):
        from relax.platform import get_platform

        super().__init__(
            server_args,
            model_path=model_path,
            platform=get_platform(device),
            tp_size=tp_size,
            base_gpu_id=local_device_index(),
            enable_memory_saver=enable_memory_saver,
        )
        self.tool_rollout = tool_rollout
        self.aborts = 0  # abort_requests calls so far: a multi-turn group started before the last one ends
        self.custom_groups = Counter()  # custom generate groups running, by the aborts there were at their start
        # The custom generate function and its `args`, or None; with it, the /generate endpoint its args name
        self.custom_generate, self.generate_server = None, None
        if custom_generate is not None:
            port = free_port(HOST)
            self.chat_sessions = ChatSessions(model_path, custom_generate.settings["apply_chat_template_kwargs"] or {},
                                              f"http://{HOST}:{port}")
            self.generate_server = GenerateServer(functools.partial(answer_http_request, self), port,
                                                  self.chat_sessions.complete)
            self._run(self.generate_server.start())
            args = custom_generate.as_namespace(HOST, self.generate_server.port)
            self.custom_generate = (load_custom_generate_fn(custom_generate.spec), args)
        if tool_rollout is not None:
            from transformers import AutoTokenizer

            from relax.rollout.tools import load_tools
            from relax.rollout.turns import ChatTurns

            self.chat_turns = ChatTurns(AutoTokenizer.from_pretrained(model_path), tool_rollout.chat_template_kwargs)
            self.tools = load_tools(list(tool_rollout.tools), "--tools")

    def watched_child_pids(self) -> list[int]:
        """The engine's scheduler and detokenizer processes, for the driver's liveness watch
        (relax.ray.watch): a SIGKILLed scheduler ends nothing else, and the engine would notice only at
        its next call."""
        return self.child_pids

    @ray.method(concurrency_group=GENERATION)
    def generate_group(
        self, prompt: list[int], sampling: SamplingConfig, prefixes: list[ResponseSoFar] | None = None,
        source: Prompt | None = None, evaluation: bool = False,
    ) -> list[Completion]:
        """sampling.n completions of one prompt, or the continuations of its responses begun earlier `prefixes`
        (partial rollout: each completion holds what its response generated since): RolloutEngine.generate, beside
        the actor's other groups. With tools, multi-turn samples (generate_multi_turn_group). With a custom generate
        function and the prompt's data row `source`, the function's samples (generate_custom_group; `evaluation`: the
        group is an evaluation's; the checks refuse tools with it)."""
        if source is not None and self.custom_generate is not None:
            return self.generate_custom_group(source, sampling, evaluation, prefixes)
        if self.tool_rollout is None:
            continued = None if prefixes is None else [[response.token_ids for response in prefixes]]
            return self.generate([prompt], sampling, continued)[0]
        return self.generate_multi_turn_group(prompt, sampling, prefixes)

    def generate_multi_turn_group(self, prompt: list[int], sampling: SamplingConfig,
                                  prefixes: list[ResponseSoFar] | None = None) -> list[Completion]:
        """sampling.n multi-turn samples of one prompt, or the continuations of its responses `prefixes`, their turns
        run at once on the engine's loop: sample j's requests seeded sampling.seed + j, as the single-turn requests
        of a group are."""
        request = _request_unless_aborted(self)
        begun = [None] * sampling.n if prefixes is None else [_multi_turn_so_far(response) for response in prefixes]

        def engine_for(so_far: MultiTurnResponse | None):
            """The requests of a sample: those of a response begun earlier go before new ones, as single-turn
            continuations do (RolloutEngine.generate)."""
            priority = self.continued_priority() if so_far is not None and so_far.token_ids else None

            async def generate(input_ids: list[int], turn_sampling: SamplingConfig) -> Completion:
                return await request(input_ids, request_params([input_ids], turn_sampling)[0], priority)

            return generate

        async def each_sample():
            return await asyncio.gather(*(
                generate_multi_turn(engine_for(so_far), prompt, offset_seed(sampling, j), self.chat_turns,
                                    self.tools, self.tool_rollout.max_turns, so_far)
                for j, so_far in enumerate(begun)
            ))

        kept = [0 if so_far is None else len(so_far.token_ids) for so_far in begun]
        return [_completion_of(response, self.chat_turns.tokenizer, start)
                for response, start in zip(self._run(each_sample()), kept)]

    def generate_custom_group(self, source: Prompt, sampling: SamplingConfig, evaluation: bool,
                              prefixes: list[ResponseSoFar] | None = None) -> list[Completion]:
        """The samples of sampling.n calls of the custom generate function for one prompt, or of one call per
        response of it begun earlier `prefixes` (partial rollout: a response with tokens is the call's sample to
        continue, one without a new sample), run at once on the engine's loop: call j gets the sampling params of
        request j of the group (seeded sampling.seed + j) and gives one completion, or one per sample of its fan-out.
        A new group's completions come call by call; a continued group's first one per call, in the order of
        `prefixes` (each continues its own response: the rollout matches them so), then the other samples of the
        calls that fanned out. The requests of a continued sample go before new ones, as single-turn continuations
        do (RolloutEngine.generate)."""
        aborts, fn, args = self.aborts, *self.custom_generate
        request = _request_unless_aborted(self)
        begun = [None] * sampling.n if prefixes is None else [p if p.token_ids else None for p in prefixes]

        async def each_sample():
            params = request_params([source.token_ids] * len(begun), sampling)
            self.custom_groups[aborts] += 1  # on the engine's loop, as the HTTP requests' check
            try:
                with self.chat_sessions.serving():  # the agent sessions the group's samples open
                    calls = await asyncio.gather(*(
                        generate_samples(
                            fn, args, source, sample_params,
                            functools.partial(request, priority=None if so_far is None else self.continued_priority()),
                            evaluation, so_far, keep_aborted=args.partial_rollout and not evaluation,
                        )
                        for sample_params, so_far in zip(params, begun)
                    ))
            finally:
                self.custom_groups[aborts] -= 1
            if prefixes is None:
                return [completion for call in calls for completion in call]
            return [call[0] for call in calls] + [completion for call in calls for completion in call[1:]]

        return self._run(each_sample())

    @ray.method(concurrency_group=GENERATION)
    def abort_requests(self):
        """RolloutEngine.abort_requests, in the group of the generations it ends; a multi-turn sample between turns
        then ends before its next one."""
        self.aborts += 1
        super().abort_requests()

    def shutdown(self):
        """The /generate endpoint stops before the engine (RolloutEngine.shutdown): its requests in flight end."""
        engine = self._engine
        if self.generate_server is not None and engine is not None:
            asyncio.run_coroutine_threadsafe(self.generate_server.stop(), engine.loop).result()
        super().shutdown()


def engine_actor_class(worker_class: type[EngineWorker], groups_in_flight: int) -> ray.actor.ActorClass:
    """`worker_class` (EngineWorker or a subclass) as the Ray actor class of a rollout with at most `groups_in_flight`
    groups in flight over all the engines: GENERATION has a thread for each (one engine may get them all, the others
    restarting) and one for the abort. (Ray's .options() cannot set concurrency groups.)"""
    threads = max(MIN_GENERATION_THREADS, groups_in_flight + 1)
    return ray.remote(concurrency_groups={GENERATION: threads})(worker_class)


def _request_unless_aborted(worker: EngineWorker):
    """The requests of a group starting now on `worker`'s engine: (input ids, SGLang's sampling params, its priority)
    -> awaitable Completion, aborted at once after an abort_requests that came once the group started (its sample was
    between requests: a tool or the function's own work ran, so no request of it was in the engine to abort)."""
    engine, aborts = worker._live(), worker.aborts

    async def request(input_ids: list[int], params: dict, priority: int | None = None) -> Completion:
        if worker.aborts != aborts:
            return Completion.aborted()
        return await worker.generate_request(engine, input_ids, params, priority)

    return request


async def answer_http_request(worker: EngineWorker, request: GenerateRequest) -> dict:
    """SGLang's output for a request to `worker`'s /generate endpoint, on its engine's loop; aborted while an abort
    ends the groups that ran at it (the module's docstring says why). Not a method: Ray makes a class with an
    `async def` method an async actor (the module's docstring says why EngineWorker must not be one)."""
    engine = worker._engine  # not _live(): on the loop, its shutdown of a dead engine would wait on this loop
    if engine is None:
        raise EngineUnavailable(worker._end_reason)
    if any(count and started != worker.aborts for started, count in worker.custom_groups.items()):
        prompt = request.prompt
        prompt_ids = engine.tokenizer_manager.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return aborted_output(len(prompt_ids), request.return_logprob)
    return await sglang_generate(engine, request.prompt, request.sampling_params, request.return_logprob)


def _multi_turn_so_far(response: ResponseSoFar) -> MultiTurnResponse:
    """A response begun in an earlier step as generate_multi_turn continues it: its ids, mask and logprobs, and the
    counts of its turns (none for a response without ToolUse: its tokens, if any, are its first turn's)."""
    use = response.tool_use or ToolUse()
    loss_mask = [1] * len(response.token_ids) if response.loss_mask is None else response.loss_mask
    return MultiTurnResponse(**asdict(use), token_ids=list(response.token_ids), loss_mask=list(loss_mask),
                             logprobs=list(response.logprobs))


def _completion_of(response: MultiTurnResponse, tokenizer, start: int = 0) -> Completion:
    """A multi-turn response as the rollout takes a completion: its ids from `start` (those before it a continued
    response had already: ResponseSoFar.extended adds these after them), their text decoded (what the reward
    function reads), tool turns included, and the counts of all its turns."""
    token_ids = response.token_ids[start:]
    return Completion(
        token_ids=token_ids, logprobs=response.logprobs[start:], finish_reason=response.finish_reason,
        text=tokenizer.decode(token_ids, skip_special_tokens=True), routed_experts=response.routed_experts,
        error=response.error, loss_mask=response.loss_mask[start:], tool_use=response.counts(),
    )
