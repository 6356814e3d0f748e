"""SGLang's in-process Engine, as relax drives it: start, batched sampling, weight updates, memory
release/resume, and a shutdown that leaves no process behind.

Configuration comes in three layers, later ones winning: the platform's ServerArgs defaults
(relax.platform), the user's `--sglang-*` flags (a ServerArgs or a dict of fields), and the fields relax
manages itself (model path, tp size, base device id, ports, memory saver), which the user may not set
to anything else.

Four things differ from calling sglang.Engine directly:
- The engine's event loop runs in a thread of its own, so that calls from several threads run at once (a Ray
  actor's concurrent generations, relax.rollout.worker); abort_requests ends every pending generation.
- A request SGLang refuses (it raises for that request alone: a prompt too long for the context, a sampling
  setting it rejects) is a failed Completion carrying the error; the call's other requests complete. SGLang
  raises for a whole batch call, so each request is its own call, all of them submitted at once.
- Every call waits on the engine while watching its scheduler and detokenizer processes; if one has
  died, the call raises EngineDeadError within about a second and the engine's processes are cleaned up,
  instead of hanging (a SIGKILLed scheduler never answers) or killing the caller (SGLang's own SIGQUIT
  handler kills the whole process tree, including the process that hosts the engine).
- Weight updates are checked against the checkpoint the engine loaded: SGLang loads a bucket with an
  unknown name as a success that changed nothing (it only logs "Parameter ... not found in
  params_dict"), so relax refuses unknown names, wrong shapes, duplicates and incomplete updates itself,
  naming the tensor. The expected names and shapes are read once from the checkpoint's safetensors
  headers (relax.hf_checkpoint; no tensor data): the HF names and shapes the engine's loader accepted at
  start are exactly the ones a later update must use. A complete update is one of every tensor the actor trains: the
  checkpoint's tensors but the frozen vision tower and MTP head (relax/hf_checkpoint/layout.py).
"""

import asyncio
import base64
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Iterable, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch

from relax.hf_checkpoint import read_hf_checkpoint, trained_names
from relax.ports import free_port
from relax.rollout.engine_fields import AdmissionBudget, server_defaults
from relax.rollout.tool_calls import ToolUse
from relax.sync import bucket as weight_bucket

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # what release/resume_memory_occupation accept
LIVENESS_POLL_S = 0.5
LOOP_STOP_TIMEOUT_S = 30.0
# A request that continues a response (partial rollout) goes before new requests: SGLang's priority scheduling,
# which relax turns on with --partial-rollout, takes higher values first; a request without a priority gets the
# lowest. So a continued group is not queued behind the step's new ones and aborted again, growing older.
CONTINUED_RESPONSE_PRIORITY = 1
PRIORITY_SCHEDULE_POLICIES = ("fcfs", "lof")  # the policies SGLang's priority scheduling works with
# Routed expert ids in memory (Completion.routed_experts): they fit, at half the memory of SGLang's int32.
ROUTED_EXPERTS_DTYPE = torch.int16
# The package of model classes SGLang's registry imports in each scheduler instead of all of SGLang's model modules
# (relax.rollout.sglang_models, about 2 CPU-seconds less each engine start); a value the user set is kept.
MODEL_PACKAGE_ENV, RELAX_MODEL_PACKAGE = "SGLANG_EXTERNAL_MODEL_PACKAGE", "relax.rollout.sglang_models"


class EngineDeadError(RuntimeError):
    """The engine's scheduler or detokenizer process is gone; the engine cannot be used any more."""


class WeightUpdateError(RuntimeError):
    """A weight update was refused (before sending) or failed in the engine."""


@dataclass(frozen=True)
class SamplingConfig:
    n: int = 1  # samples per prompt
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's EOS
    stop: tuple[str, ...] = ()  # stop strings
    ignore_eos: bool = False  # SGLang then also ignores stop_token_ids: only max_new_tokens ends a response
    # Request i of a generate call samples with SGLang's sampling_seed seed + i (None: the engine's own random
    # stream). SGLang 0.5.23 honours it only with enable_deterministic_inference (--sglang-enable-deterministic-
    # inference); then a request's tokens depend on its seed and logits alone, not on what ran before.
    seed: int | None = None
    # --rollout-clip-response-to-context: the model's context length (relax.args.settings.ContextLength); each
    # request's max_new_tokens is clipped to what its prompt leaves of it, which SGLang refuses to exceed. None: not
    # clipped (relax.run.inputs then refused any prompt whose max_new_tokens would not fit).
    clip_to_context: int | None = None

    def __post_init__(self):
        problems = []
        if self.n < 1:
            problems.append(f"n={self.n} (must be >= 1)")
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} (must be >= 0)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} (must be in (0, 1])")
        if self.top_k != -1 and self.top_k < 1:
            problems.append(f"top_k={self.top_k} (must be -1 or >= 1)")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens={self.max_new_tokens} (must be >= 1)")
        if problems:
            raise ValueError("invalid sampling settings: " + ", ".join(problems))

    def max_new_tokens_for(self, prompt_length: int) -> int:
        """The response budget of a request whose prompt has `prompt_length` tokens."""
        if self.clip_to_context is None:
            return self.max_new_tokens
        return min(self.max_new_tokens, self.clip_to_context - prompt_length)

    def sglang_params(self) -> dict:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": list(self.stop_token_ids) or None,
            "stop": list(self.stop) or None,
            "ignore_eos": self.ignore_eos,
        }


@dataclass
class Completion:
    token_ids: list[int]  # the response, including the EOS / stop token when it stopped on one
    # Log-probability of each response token under the engine's weights at the sampling temperature:
    # SGLang's log_softmax(logits / temperature), before top-k/top-p truncation (raw logits when greedy).
    logprobs: list[float]
    finish_reason: str  # "stop", "length", "abort", or "error" (refused: see error)
    text: str  # the response decoded without special tokens
    # With routed experts on (--use-rollout-routing-replay): the experts each layer's router chose for every token
    # of prompt + response but the last, which the engine never ran forward, int16 [tokens - 1, layers, top-k].
    routed_experts: torch.Tensor | None = None
    # Why the engine refused this request (SGLang raised for it alone; the engine lives on), or None. A refused
    # request has no tokens: token_ids, logprobs and text are empty and finish_reason is "error".
    error: str | None = None
    # A multi-turn sample's (--tools: relax.rollout.worker), None otherwise: per response token 1 where the engine
    # sampled it, 0 where relax appended it (tool output, the template's turn ids; logprob 0.0), and what its turns
    # did (relax.rollout.tool_calls.ToolUse).
    loss_mask: list[int] | None = None
    tool_use: ToolUse | None = None
    # The reward a custom generate function set (relax.rollout.custom_generate): the reward function is not called
    reward: float | None = None
    # A custom generate function's sample that starts from other prompt ids than its data row's (it rewrote the
    # prompt; an agent's own system prompt and tools): those ids, which the sample trains on. None: the row's.
    prompt_ids: list[int] | None = None
    # A custom generate function's ABORTED sample kept for a later step (partial rollout): its metadata, given back
    # with it. `restarted`: the call's response so far is dropped, and a later step calls it anew from the prompt.
    metadata: dict | None = None
    restarted: bool = False

    @classmethod
    def refused(cls, error: str) -> "Completion":
        return cls(token_ids=[], logprobs=[], finish_reason="error", text="", error=error)

    @classmethod
    def aborted(cls, restarted: bool = False) -> "Completion":
        """A request aborted before it reached an engine (or a custom generate function's call whose ABORTED sample
        is not kept: `restarted` where it dropped a response begun earlier)."""
        return cls(token_ids=[], logprobs=[], finish_reason="abort", text="", restarted=restarted)


def request_params(
    requests: list[list[int]], sampling: SamplingConfig, prefix_lengths: list[int] | None = None
) -> list[dict]:
    """SGLang's sampling params of each request of a generate call: request i seeded sampling.seed + i (when
    given), its max_new_tokens what its prompt leaves of the context under sampling.clip_to_context. A request
    that continues a response (`prefix_lengths[i]` tokens of it at the end of requests[i]: partial rollout) gets
    what the response's budget has left."""
    params = sampling.sglang_params()
    prefix_lengths = prefix_lengths or [0] * len(requests)
    return [
        {
            **params,
            "max_new_tokens": sampling.max_new_tokens_for(len(request) - prefix) - prefix,
            **({} if sampling.seed is None else {"sampling_seed": sampling.seed + i}),
        }
        for i, (request, prefix) in enumerate(zip(requests, prefix_lengths, strict=True))
    ]


def _chosen_fields(server_args, platform) -> dict:
    """The fields to start from: a dict over relax's defaults for the platform, or a ServerArgs as it is
    (relax.args.build_server_args has applied those defaults to the fields the user did not give): its
    fields that differ from SGLang's defaults."""
    if isinstance(server_args, Mapping):
        return {**server_defaults(platform), **server_args}
    import msgspec
    from sglang.srt.server_args import ServerArgs

    reference = ServerArgs(model_path=server_args.model_path)
    return {
        f.name: getattr(server_args, f.name)
        for f in msgspec.structs.fields(ServerArgs)
        if getattr(server_args, f.name) != getattr(reference, f.name)
    }


def _log_child_failure(signum=None, frame=None):
    # SGLang's children SIGQUIT the hosting process when they fail, and SGLang's handler then kills the
    # whole process tree (the host included). relax's engines notice their own dead processes instead
    # and raise EngineDeadError in the caller, so the signal only needs to be logged.
    print("relax: an SGLang engine process reported a failure (SIGQUIT); its engine raises at its next call",
          file=sys.stderr, flush=True)


class RolloutEngine:
    """One SGLang Engine in this process. Use as a context manager or call shutdown()."""

    def __init__(
        self,
        server_args,  # sglang ServerArgs (relax.args' config.sglang) or a dict of ServerArgs fields
        *,
        model_path: str,
        platform,  # a relax.platform record
        tp_size: int = 1,
        base_gpu_id: int = 0,
        enable_memory_saver: bool = False,
        port: int | None = None,
        nccl_port: int | None = None,
    ):
        platform.prepare_sglang()  # before anything imports sglang
        os.environ.setdefault(MODEL_PACKAGE_ENV, RELAX_MODEL_PACKAGE)  # read as SGLang's registry is first imported
        if enable_memory_saver and not platform.has_memory_saver:
            raise ValueError(
                f"the memory saver was asked for, but platform {platform.name!r} has none; turn it off on this device"
            )
        managed = {
            "model_path": model_path,
            "device": platform.name,
            "tp_size": tp_size,
            "base_gpu_id": base_gpu_id,
            "enable_memory_saver": enable_memory_saver,
            "port": port or free_port(),
            "nccl_port": nccl_port or free_port(),
            "custom_sigquit_handler": _log_child_failure,
        }
        chosen = _chosen_fields(server_args, platform)
        for name, value in chosen.items():
            if name in managed and value != managed[name]:
                raise ValueError(
                    f"SGLang field {name}={value!r} is managed by relax (relax sets {managed[name]!r}); "
                    "set it through relax's own argument, not through --sglang-*"
                )
        fields = {**chosen, **managed}

        from sglang.srt.server_args import ServerArgs

        self.platform = platform
        self.model_path = model_path
        self.tp_size = tp_size
        checkpoint = read_hf_checkpoint(model_path)
        self._expected_shapes = checkpoint.tensor_shapes
        self._trained_names = trained_names(self._expected_shapes)
        self._update_session: set[str] | None = None
        # The engine's own event loop, run forever in a thread of its own once started: calls from several threads
        # (the actor's concurrent generations) share it, each waiting on its own future. SGLang's Engine takes the
        # thread's current loop; its module sets uvloop's policy when first imported, which drops the current loop,
        # so the fresh loop is set after that import.
        from sglang.srt.entrypoints.engine import Engine

        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._platform_hold = ExitStack()  # until the engine's processes are gone (shutdown)
        self._platform_hold.enter_context(platform.sglang_engine_processes())
        try:
            self._engine = Engine(server_args=ServerArgs(**fields))
        except BaseException:
            self._platform_hold.close()
            raise
        if self._engine.loop is not loop:
            raise RuntimeError("SGLang's Engine did not take the event loop relax made for it")
        self._end_reason = f"the engine for {model_path} was shut down"  # what a call after the end raises
        self._shutdown_lock = threading.Lock()
        self.server_args = self._engine.server_args
        # SGLang returns routed experts as flat bytes; each token's row is [layers, top-k] of the language model.
        self._routed_experts_row = (
            (checkpoint.text_config["num_hidden_layers"], checkpoint.text_config["num_experts_per_tok"])
            if self.server_args.enable_return_routed_experts
            else None
        )
        self._child_pids = list(self._engine.get_all_child_pids())
        # The tokenizer manager installs SGLang's kill-everything SIGQUIT handler when it starts its
        # receive loop; start that now (inside the engine's loop: outside one it would make a new loop)
        # and put relax's handler in its place (see _log_child_failure).
        async def start_receive_loop():
            self._engine.tokenizer_manager.auto_create_handle_loop()

        loop.run_until_complete(start_receive_loop())
        if threading.current_thread() is threading.main_thread():
            loop.add_signal_handler(signal.SIGQUIT, _log_child_failure)
        asyncio.set_event_loop(None)  # the loop is the engine's alone: this thread's other asyncio code makes its own
        self._loop_thread = threading.Thread(target=loop.run_forever, name="relax-engine-loop", daemon=True)
        self._loop_thread.start()

    # --- lifecycle -----------------------------------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False

    @property
    def child_pids(self) -> list[int]:
        """The scheduler and detokenizer processes of this engine."""
        return list(self._child_pids)

    def _dead_children(self) -> list[str]:
        dead = []
        for pid in self._child_pids:
            try:
                status = psutil.Process(pid).status()
            except psutil.NoSuchProcess:
                status = "gone"
            if status in ("gone", psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                dead.append(f"pid {pid} ({status})")
        return dead

    def _live(self):
        """The SGLang Engine, after checking that its processes still run."""
        if self._engine is None:
            raise EngineDeadError(self._end_reason)
        dead = self._dead_children()
        if dead:
            self._end_reason = (
                f"SGLang engine for {self.model_path} died: its process {', '.join(dead)} is no longer running "
                "(the engine's log above says why; exit -9 is often the OOM killer). The engine was shut down."
            )
            self.shutdown()
            raise EngineDeadError(self._end_reason)
        return self._engine

    def shutdown(self):
        """Stop this engine's processes (and theirs) and its event loop's thread, and reap them. Idempotent; any
        thread but the loop's may call it, while other threads' calls wait on the engine (they raise
        EngineDeadError).

        Not Engine.shutdown(): that kills every child process of the hosting process, which would also
        take down other engines (or anything else) this process started.
        """
        with self._shutdown_lock:
            if self._engine is None:
                return
            engine, self._engine = self._engine, None
            import atexit

            atexit.unregister(engine.shutdown)
            tokenizer_manager = engine.tokenizer_manager
            if tokenizer_manager._subprocess_watchdog is not None:
                tokenizer_manager._subprocess_watchdog.stop()  # it would SIGQUIT us for the kills below
            self._stop_loop(engine.loop)
            processes = []
            for pid in self._child_pids:
                try:
                    process = psutil.Process(pid)
                    processes += [process, *process.children(recursive=True)]
                except psutil.NoSuchProcess:
                    pass
            for process in processes:
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
            _, alive = psutil.wait_procs(processes, timeout=30)  # waits on (and so reaps) our own children
            if alive:
                raise RuntimeError(f"SGLang engine processes did not exit after SIGKILL: {[p.pid for p in alive]}")
            self._platform_hold.close()
            for path in engine_files(engine):
                path.unlink(missing_ok=True)

    def _stop_loop(self, loop) -> None:
        """Cancel every task of the engine's loop (the calls waiting on one then end) and stop its thread."""

        async def cancel_the_others():
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_the_others(), loop).result(timeout=LOOP_STOP_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        self._loop_thread.join(timeout=LOOP_STOP_TIMEOUT_S)
        if self._loop_thread.is_alive():
            raise RuntimeError(f"the event loop of the engine for {self.model_path} did not stop")
        loop.close()

    # --- calls into the engine -----------------------------------------------------------------------

    def _run(self, coroutine):
        """Run a coroutine of the engine (got through self._live()) on the engine's loop and wait for it here,
        watching the engine's processes meanwhile. Any number of threads may wait at once."""

        async def watched():
            task = asyncio.ensure_future(coroutine)
            while True:
                done, _ = await asyncio.wait({task}, timeout=LIVENESS_POLL_S)
                if done:
                    return task.result()
                if self._dead_children():
                    task.cancel()
                    return None  # _live() below raises

        try:
            result = asyncio.run_coroutine_threadsafe(watched(), self._live().loop).result()
        except BaseException:  # a cancellation too: another thread shut the engine down
            self._live()  # a dead engine explains the failure better than its symptom
            raise
        self._live()
        return result

    def abort_requests(self):
        """SGLang's abort of every request this engine holds (queued or running): each pending generate returns
        soon, its aborted requests with finish_reason "abort". A request aborted while it ran keeps what it had
        generated: SGLang 0.5.23 finishes it through its normal output path (the scheduler sets to_finish and runs
        one more decode step), so its Completion holds the tokens and logprobs sampled so far; one aborted while
        queued has none."""
        engine = self._live()

        async def abort_all():
            engine.tokenizer_manager.abort_request(abort_all=True)

        self._run(abort_all())

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, prefixes: list[list[list[int]]] | None = None
    ) -> list[list[Completion]]:
        """sampling.n completions for each token-id prompt, all submitted at once, one request each: the
        scheduler takes requests as they arrive and batches them continuously. A request SGLang refuses (it
        raises for that request alone while the engine lives: an over-long prompt, bad sampling settings)
        comes back as a failed Completion carrying the error, not as an exception; a dead engine raises
        EngineDeadError (_run). Returns one list of completions per prompt, in prompt order.

        `prefixes` (partial rollout): for each prompt, the responses begun earlier to continue, one request each
        in place of sampling.n new ones: request j of prompt p samples after prompts[p] + prefixes[p][j], within
        what the response's budget has left, and its Completion holds the new tokens only."""
        if not prompts:
            return []
        if prefixes is None:
            prefixes = [[[]] * sampling.n for _ in prompts]
        requests = [list(prompt) + list(prefix) for prompt, group in zip(prompts, prefixes) for prefix in group]
        params = request_params(requests, sampling, [len(prefix) for group in prefixes for prefix in group])
        engine = self._live()

        priorities = [self.continued_priority() if prefix else None for group in prefixes for prefix in group]

        async def each_request():  # gather wraps the coroutines in tasks of the running (the engine's) loop
            return await asyncio.gather(
                *(self.generate_request(engine, request, request_params, priority)
                  for request, request_params, priority in zip(requests, params, priorities)),
                return_exceptions=True,
            )

        completions = self._run(each_request())  # raises EngineDeadError if the engine died meanwhile
        for completion in completions:
            if isinstance(completion, BaseException):  # a cancellation: not the request's own failure
                raise completion
        answers = iter(completions)
        return [list(itertools.islice(answers, len(group))) for group in prefixes]

    def continued_priority(self) -> int | None:
        """SGLang's priority of a request that continues a response: CONTINUED_RESPONSE_PRIORITY, or None where the
        engine has no priority scheduling (it aborts a request that has a priority)."""
        return CONTINUED_RESPONSE_PRIORITY if self.server_args.enable_priority_scheduling else None

    def generate_request(self, engine, request: list[int], params: dict, priority: int | None = None
                         ) -> Awaitable[Completion]:
        """One request of token ids with SGLang's sampling `params` (request_params'), to await on the engine's loop
        (in a coroutine that _run runs; `engine`: self._live()'s). A request SGLang refuses is a failed Completion;
        a cancellation raises. A plain method returning the coroutine: Ray makes a class with an `async def` method
        an async actor (relax.rollout.worker says why EngineWorker must not be one). `priority`: SGLang's, for a
        request that continues a response (CONTINUED_RESPONSE_PRIORITY); None for the rest."""
        return _generate_request(engine, request, params, self._routed_experts_row, priority)

    def admission_budget(self) -> AdmissionBudget:
        """What the scheduler admits new requests against (AdmissionBudget), from its own state: the resolved
        server args and the KV cache's size in tokens; the two SGLang environment settings as its processes,
        this process's children, read them."""
        from sglang.srt.environ import envs
        from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

        state = self._run(self._live().tokenizer_manager.get_internal_state())[0]
        return AdmissionBudget(
            kv_cache_tokens=state["memory_usage"]["token_capacity"],
            conservativeness=state["schedule_conservativeness"],
            init_ratio=envs.SGLANG_INIT_NEW_TOKEN_RATIO.get(),
            reserve_clip=CLIP_MAX_NEW_TOKENS,
            max_running_requests=state["effective_max_running_requests_per_dp"],
        )

    def flush_cache(self):
        result = self._run(self._live().tokenizer_manager.flush_cache())
        if not result.success:
            raise RuntimeError(f"SGLang flush_cache failed: {result.message}")

    @contextmanager
    def profiled(self, output_dir: str):
        """SGLang's torch profiler (GPU kernels through CUPTI) around the block. The scheduler writes one Chrome trace
        into output_dir after the block ends, not before this returns."""
        from sglang.srt.managers.io_struct import ProfileReq

        engine = self._live()
        self._run(engine.tokenizer_manager.start_profile(
            ProfileReq(output_dir=output_dir, activities=["GPU"], with_stack=False, record_shapes=False)
        ))
        try:
            yield
        finally:
            self._run(engine.tokenizer_manager.stop_profile())

    # --- weight updates ------------------------------------------------------------------------------

    def begin_weight_update(self):
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        if self._update_session is not None:
            raise WeightUpdateError("a weight update is already open; end it with end_weight_update()")
        self._check_result("begin_weight_update", self._run(
            self._live().tokenizer_manager.begin_weight_update(BeginWeightUpdateReqInput(), None)
        ))
        self._update_session = set()

    def _check_bucket(self, specs: list[tuple[str, tuple[int, ...]]]) -> None:
        """Refuse a bucket (before anything is sent) unless every (name, shape) is a checkpoint tensor
        with its shape, sent once in this update."""
        if self._update_session is None:
            raise WeightUpdateError("weight buckets need begin_weight_update() first")
        in_bucket = set()
        for name, shape in specs:
            expected = self._expected_shapes.get(name)
            if expected is None:
                raise WeightUpdateError(
                    f"refusing weight bucket: tensor {name!r} is not a tensor of the engine's checkpoint "
                    f"{self.model_path} (SGLang would ignore it and report success); send HF names"
                )
            if tuple(shape) != expected:
                raise WeightUpdateError(
                    f"refusing weight bucket: tensor {name!r} has shape {tuple(shape)}, the engine's "
                    f"checkpoint has {expected} (a partial or unsharded-wrong tensor?)"
                )
            if name in self._update_session or name in in_bucket:
                raise WeightUpdateError(f"refusing weight bucket: tensor {name!r} was already sent in this update")
            in_bucket.add(name)

    def _send_bucket(self, names: list[str], payloads: list[bytes]):
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        if len(payloads) != self.tp_size:
            raise WeightUpdateError(f"a bucket needs one payload per TP rank ({self.tp_size}), got {len(payloads)}")
        request = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads, load_format=weight_bucket.LOAD_FORMAT, flush_cache=False
        )
        result = self._run(self._live().tokenizer_manager.update_weights_from_tensor(request, None))
        self._check_result("update_weights_from_tensor", result)
        self._update_session.update(names)

    def update_weights_from_tensor(self, named_tensors: list):
        """Send one bucket of (HF name, full tensor) pairs inside begin/end_weight_update, packed in this
        process. Every name and shape is checked against the checkpoint before anything is sent."""
        named_tensors = list(named_tensors)
        self._check_bucket([(name, tuple(tensor.shape)) for name, tensor in named_tensors])
        bucket, payloads = weight_bucket.serialize_bucket(named_tensors, self.platform, tp_size=self.tp_size)
        self._send_bucket([name for name, _ in named_tensors], payloads)
        del bucket  # the engine has copied the data: the shared buffer may go now

    def update_weights_from_serialized_bucket(self, specs: list[tuple[str, tuple[int, ...]]], payloads: list[bytes]):
        """Send one bucket packed by another process (the training actor) with
        relax.sync.bucket.serialize_bucket: `specs` is bucket_specs(bucket), `payloads` its payloads (on a
        device they hold IPC handles, not the data; on CPU the bytes themselves). The sender keeps the bucket alive until this returns. Checked like update_weights_from_tensor."""
        self._check_bucket(specs)
        self._send_bucket([name for name, _ in specs], payloads)

    # Engines on another node than the sender receive buckets by broadcast (relax.sync.broadcast).

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str):
        """Join a sender's broadcast group through SGLang's distributed weight update: the sender is group
        rank 0, this engine's TP ranks take rank_offset .. rank_offset + tp_size - 1. Returns once every
        member has joined."""
        from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

        request = InitWeightsUpdateGroupReqInput(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend,
        )
        result = self._run(self._live().tokenizer_manager.init_weights_update_group(request, None))
        self._check_result("init_weights_update_group", result)

    def update_weights_from_distributed(self, specs: list[tuple[str, tuple[int, ...]]], dtypes: list[str],
                                        group_name: str):
        """Receive one bucket that the sender of `group_name` broadcasts, packed by
        relax.sync.bucket.flatten_bucket and described by its bucket_specs and bucket_dtypes. Checked like
        update_weights_from_tensor before joining the broadcast: a refused bucket raises here, and so in the
        sender, which waits for this call."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        if len(dtypes) != len(specs):
            raise WeightUpdateError(f"a bucket of {len(specs)} tensors came with {len(dtypes)} dtypes")
        self._check_bucket(specs)
        request = UpdateWeightsFromDistributedReqInput(
            names=[name for name, _ in specs],
            dtypes=list(dtypes),
            shapes=[list(shape) for _, shape in specs],
            group_name=group_name,
            flush_cache=False,  # end_weight_update flushes once
            load_format=weight_bucket.LOAD_FORMAT,
        )
        result = self._run(self._live().tokenizer_manager.update_weights_from_distributed(request, None))
        self._check_result("update_weights_from_distributed", result)
        self._update_session.update(request.names)

    def destroy_weights_update_group(self, group_name: str):
        from sglang.srt.managers.io_struct import DestroyWeightsUpdateGroupReqInput

        request = DestroyWeightsUpdateGroupReqInput(group_name=group_name)
        result = self._run(self._live().tokenizer_manager.destroy_weights_update_group(request, None))
        self._check_result("destroy_weights_update_group", result)

    def end_weight_update(self, expect_complete: bool = True):
        """Close the update and flush the prefix cache (it holds KV computed with the old weights).
        With expect_complete, every checkpoint tensor the actor trains must have been sent; otherwise the
        engine would run on a mix of old and new weights, and this raises naming what is missing."""
        if self._update_session is None:
            raise WeightUpdateError("end_weight_update without begin_weight_update()")
        sent, self._update_session = self._update_session, None
        self._end_engine_update()
        self.flush_cache()
        missing = sorted(self._trained_names - sent)
        if expect_complete and missing:
            raise WeightUpdateError(
                f"incomplete weight update: {len(missing)} of {len(self._trained_names)} checkpoint tensors that "
                f"the actor trains were not sent, e.g. {missing[:5]}; the engine now mixes old and new weights"
            )

    def _end_engine_update(self):
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        result = self._run(self._live().tokenizer_manager.end_weight_update(EndWeightUpdateReqInput(), None))
        self._check_result("end_weight_update", result)

    def update_weights(self, named_tensors: Iterable, bucket_bytes: int = 512 << 20):
        """A whole update: begin, buckets of at most bucket_bytes, end."""
        self.begin_weight_update()
        try:
            for bucket in weight_bucket.split_into_buckets(named_tensors, bucket_bytes):
                self.update_weights_from_tensor(bucket)
        except BaseException:
            self._update_session = None
            self._end_engine_update()  # leave the engine's update session closed
            raise
        self.end_weight_update()

    def update_weights_from_disk(self, model_path: str):
        """Reload all weights from an HF checkpoint directory (the fallback path), then flush the cache."""
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        result = self._run(
            self._live().tokenizer_manager.update_weights_from_disk(
                UpdateWeightFromDiskReqInput(model_path=model_path), None
            )
        )
        self._check_result("update_weights_from_disk", result[:2])
        self.flush_cache()

    @staticmethod
    def _check_result(call: str, result):
        success, message = (result.success, result.message) if hasattr(result, "success") else result
        if not success:
            raise WeightUpdateError(f"SGLang {call} failed: {message}")

    # --- memory ---------------------------------------------------------------------------------------

    def wait_until_idle(self, timeout_s: float = 60.0):
        """Return once the scheduler is fully idle. A finished generate leaves its last batch in the
        scheduler until its next pass; flush_cache succeeds only when nothing is left, so it is the probe."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.flush_cache()
                return
            except EngineDeadError:
                raise
            except RuntimeError:  # flush_cache's "not idle yet"
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the SGLang engine did not become idle within {timeout_s:g} s") from None
                time.sleep(0.05)

    def release_memory_occupation(self, tags: Iterable[str] = MEMORY_TAGS):
        """Hand the tagged device memory back (a no-op on platforms without a memory saver). Waits for the
        scheduler to be idle first: SGLang 0.5.23 asserts it is, and its scheduler dies otherwise."""
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        self.wait_until_idle()
        self._run(self._live().tokenizer_manager.release_memory_occupation(
            ReleaseMemoryOccupationReqInput(tags=_checked_tags(tags)), None
        ))

    def resume_memory_occupation(self, tags: Iterable[str] = MEMORY_TAGS):
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        self._run(self._live().tokenizer_manager.resume_memory_occupation(
            ResumeMemoryOccupationReqInput(tags=_checked_tags(tags)), None
        ))


def engine_files(engine) -> list[Path]:
    """Files an engine leaves behind when its processes are killed (nothing else unlinks them): its ZMQ
    IPC socket files and its load-snapshot segment in /dev/shm."""
    from sglang.srt.managers.load_snapshot import shm_path_for

    port_args = engine.port_args
    sockets = [
        value.removeprefix("ipc://")
        for name, value in vars(port_args).items()
        if name.endswith("_ipc_name") and isinstance(value, str) and value.startswith("ipc://")
    ]
    return [Path(path) for path in [*sockets, shm_path_for(port_args.instance_id)]]


def _checked_tags(tags) -> list[str]:
    tags = list(tags)
    unknown = [tag for tag in tags if tag not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; choose from {list(MEMORY_TAGS)}")
    return tags


def sglang_generate(engine, prompt: list[int] | str, params: dict, return_logprob: bool = True,
                    return_routed_experts: bool = False, priority: int | None = None) -> Awaitable[dict]:
    """One request to the SGLang `engine` (RolloutEngine._live()'s), to await on its loop: the prompt's token ids or
    its text (the engine tokenizes it), SGLang's sampling `params`, SGLang's `priority` (None: the lowest). Its
    answer is SGLang's output, as SGLang's HTTP /generate returns it; SGLang raises for a request it refuses.
    relax's requests (_generate_request) and those of the /generate endpoint (relax.rollout.generate_server) both go
    through here."""
    return engine.async_generate(
        **({"prompt": prompt} if isinstance(prompt, str) else {"input_ids": prompt}),
        sampling_params=params,
        return_logprob=return_logprob,
        return_routed_experts=return_routed_experts,  # of prompt and response
        priority=priority,
    )


async def _generate_request(engine, request: list[int], params: dict, routed_experts_row: tuple[int, int] | None,
                            priority: int | None = None) -> Completion:
    try:
        output = await sglang_generate(
            engine, request, params, return_routed_experts=routed_experts_row is not None, priority=priority
        )
    except Exception as error:
        return Completion.refused(f"{type(error).__name__}: {error}")
    return _completion(output, request, routed_experts_row)


def _completion(output: dict, prompt: list[int], routed_experts_row: tuple[int, int] | None) -> Completion:
    meta = output["meta_info"]
    finish = meta.get("finish_reason") or {}
    token_logprobs = meta["output_token_logprobs"]
    token_ids = [token_id for _, token_id, _ in token_logprobs]
    return Completion(
        token_ids=token_ids,
        logprobs=[logprob for logprob, _, _ in token_logprobs],
        finish_reason=finish.get("type", "abort"),
        text=output.get("text", ""),
        routed_experts=(
            None
            if routed_experts_row is None
            else decode_routed_experts(meta["routed_experts"], len(prompt) + len(token_ids), routed_experts_row)
        ),
    )


def decode_routed_experts(encoded: str, num_tokens: int, row: tuple[int, int]) -> torch.Tensor:
    """SGLang's routed experts of one sequence of `num_tokens` tokens (base64 of int32 [num_tokens - 1, *row], the
    last token never ran forward) as ROUTED_EXPERTS_DTYPE [num_tokens - 1, layers, top-k]."""
    values = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    expected = (num_tokens - 1) * row[0] * row[1]
    if values.size != expected:
        raise RuntimeError(
            f"SGLang returned {values.size} routed-expert ids for a sequence of {num_tokens} tokens; expected "
            f"{expected} (every token but the last x {row[0]} layers x top-{row[1]})"
        )
    if values.size and values.max() > torch.iinfo(ROUTED_EXPERTS_DTYPE).max:
        raise RuntimeError(f"routed expert id {values.max()} does not fit {ROUTED_EXPERTS_DTYPE}")
    return torch.tensor(values, dtype=ROUTED_EXPERTS_DTYPE).reshape(num_tokens - 1, *row)
