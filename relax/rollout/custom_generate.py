"""slime's custom generate function (--custom-generate-function-path): a user's async function that generates a sample
of a prompt (or several) in place of relax's own request, so a rollout written for slime (multi-turn, tools, agents)
runs in relax. slime names it `module.path.function`; relax takes that and `module:function`. It is called as

    async def generate(args, sample, sampling_params): ...                     # returns the sample (or a list)
    async def generate(args, sample, sampling_params, evaluation=False): ...  # told when it generates for an eval

--n-samples-per-prompt times per prompt of a rollout (--eval-n-samples-per-prompt of an evaluation), inside the engine
actor that the prompt's group went to (relax.rollout.worker); `evaluation` (True in an evaluation) is passed only to a
function that declares it. load_custom_generate_fn imports the function and checks that it can be called so, before a
run starts (--dry-run's check).

What the function gets:
    args             a namespace of slime's names for the settings such functions read (hf_checkpoint,
                     rollout_max_response_len, rollout_temperature, n_samples_per_prompt, ...: slime_args), and
                     sglang_router_ip and sglang_router_port: the SGLang-compatible /generate endpoint that the engine
                     actor serves in front of its own engine (relax.rollout.generate_server), where a function
                     written for slime posts its requests
    sample           a Sample with the prompt's text, label and metadata, its `tokens` the data row's prompt ids
                     (status PENDING); or, continuing an ABORTED sample (partial rollout, below), that sample
    sampling_params  SGLang's sampling parameters of the sample's request (max_new_tokens: the whole response's
                     budget; sampling_seed where the run seeds its requests: the rollout's and evaluation's are)

How it generates: a POST to args' /generate endpoint, or `await generate(input_ids, sampling_params)`, which sends
one request to the engine of the actor it runs in, or an agent's chat completions in an agent session
(relax.rollout.agent_session); any way one sample's turns share that engine's prefix cache, and a sample waiting on a
tool holds no generation slot. generate returns the engine's
relax.rollout.engine.Completion: token_ids, logprobs (one per token), finish_reason ("stop", "length", "abort" once
the step's batch is full, "error" with error saying why). append_generated and append_masked extend a
sample's response by a turn the engine sampled (loss mask 1, its logprobs) or by ids the function adds itself (a
tool's output, the chat template's turn ids: mask 0, logprob 0.0), keeping tokens, loss_mask, rollout_log_probs,
response_length, response and status aligned.

What it returns carries slime's sample fields: `tokens` (the prompt's ids, then the response's: tool tokens are
response tokens; at most max_new_tokens response tokens in all), `response_length` (the response's count: the prompt
is tokens[:len(tokens) - response_length], at least one id), `loss_mask` (one per response token, None: all trained),
`rollout_log_probs` (one per response token), `reward` (set: the reward function is not called for it) and `status`:
COMPLETED or TRUNCATED are trained, ABORTED goes back to the prompt stream for a later step unscored (with
--partial-rollout with what it holds, below; in an evaluation, which puts nothing back, it fails), FAILED fails the
sample. A sample that raises, returns something else, or is misaligned (sample_problem, completion_of) fails too, with
the reason, as a request the engine refused does: in a rollout counted (rollout/failed_samples) and its group generated
anew from another prompt, in an evaluation its prompt left out of the metrics (eval/NAME/failed_prompts).

Partial rollout (--partial-rollout), slime's contract: a call that returns one ABORTED sample with a response (its
function maps the engine's finish reason "abort" to it, as append_generated does, once the step's batch is full) has
it kept with its prompt, as relax keeps its own aborted responses (relax.rollout.partial): tokens, response,
loss_mask, rollout_log_probs, its own prompt ids, metadata (JSON, as a checkpoint saves it: other metadata fails the
sample) and the step that sampled each response token. A later step calls the function again with that sample
(continued_sample): status ABORTED, its fields as it returned them, sampling_params as a new call's (max_new_tokens the
whole response's budget: tokens_left is what remains; a sample holding the whole budget is TRUNCATED without a call,
as slime's generate returns it: relax.rollout.partial.GroupSoFar.to_continue), its engine requests (generate's) ahead
of new ones in the engine's queue (SGLang's priority; a request posted to /generate carries nothing of its sample and
goes without). The function continues it: it sends sample.tokens (prompt and response so far) and appends what the
engine adds (append_generated, append_masked), as this is written:

    async def one_turn(args, sample, sampling_params):  # a new sample, or one continued
        left = tokens_left(sample, sampling_params)
        append_generated(sample, await generate(sample.tokens, {**sampling_params, "max_new_tokens": left}))
        return sample

What it returns must keep the response it was given (continuation_problem: the same prompt ids, tokens, loss mask,
logprobs and text, then its new ones), so each token keeps the policy version that sampled it (--max-staleness, the
rollout/partial_* metrics); it may return it ABORTED again, or ABORTED with no response to have a later step call it
anew from the prompt (an agent session's aborted sample comes back so: relax.rollout.agent_session). A call whose
sample is dropped so is counted (rollout/partial_restarted_calls).

A call may return a list of 1 to MAX_SAMPLES_PER_CALL samples, its fan-out (completions_of), as slime's may: each is
checked as one returned alone (a bad one fails the call, its reason naming its place in the list), and each joins the
prompt's group, which then holds more than --n-samples-per-prompt samples (relax.rollout.groups.Sample.group_size): its
advantages, dynamic sampling's filter and an evaluation's metrics take the whole group, and the step trains every
sample (relax.train.batch.optimizer_step_sizes). A list with an ABORTED sample sends the call's prompt back with
nothing kept, even with --partial-rollout, and so does a call that continued a sample and returns a list of several:
a later step calls it anew from the prompt (counted as above where it dropped a response). A fan-out's samples join
the group as new ones, whose tokens this step sampled; one that copied a continued sample's tokens would pass them for
this step's, and which one continues the sample is not said.

The prompt a sample trains on is its own: the function may start from other ids than the data row's (it rewrote the
prompt, added a system prompt or tool descriptions: an agent's own first call in an agent session). relax then trains
on the sample's prompt ids and its response, the loss mask and logprobs over the response only, as any sample, and
carries those ids wherever the sample goes (Completion.prompt_ids, relax.rollout.groups.Sample.prompt_ids, the saved
rollout data). The reward function still reads the data row (its prompt text, label and metadata); the engine refuses
a request whose prompt with its budget exceeds the context length, which fails the sample.
"""

import argparse
import contextvars
import enum
import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from relax.rollout.data import Prompt
from relax.rollout.engine import Completion
from relax.rollout.partial import ResponseSoFar
from relax.rollout.user_functions import import_user_function

FLAG = "--custom-generate-function-path"
CONTRACT = "async def fn(args, sample, sampling_params) (and optionally evaluation=False)"


@dataclass
class Sample:
    """One sample as a custom generate function reads and returns it: slime's field names."""

    class Status(enum.Enum):
        PENDING = "pending"  # as the function gets a new sample (a continued one comes ABORTED, as it was returned)
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    prompt: str  # the prompt as the model sees it (the chat template applied with --apply-chat-template)
    label: Any = None
    metadata: dict = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)  # the prompt's ids, then the response's
    response: str = ""  # the response's text: what the reward function reads
    response_length: int = 0  # tokens of the response (len(tokens) - the prompt's)
    loss_mask: list[int] | None = None  # per response token: 1 trained, 0 not (None: all trained)
    rollout_log_probs: list[float] | None = None  # per response token: the engine's, 0.0 where masked
    reward: float | None = None  # set by the function: the reward function is not called for the sample
    status: Status = Status.PENDING


FINISH_REASONS = {Sample.Status.COMPLETED: "stop", Sample.Status.TRUNCATED: "length"}
STATUS_OF_FINISH = {"stop": Sample.Status.COMPLETED, "length": Sample.Status.TRUNCATED,
                    "abort": Sample.Status.ABORTED, "error": Sample.Status.FAILED}


@dataclass(frozen=True)
class SlimeArgs:
    """What the engine actors need to give a custom generate function its `args` (as_namespace): the function's
    spec and slime's names of the run's settings."""

    spec: str  # as the flag gave it
    settings: dict  # slime's name -> value

    def as_namespace(self, router_ip: str, router_port: int) -> argparse.Namespace:
        """The `args` of a function run in the engine actor whose /generate endpoint is at router_ip:router_port
        (relax.rollout.generate_server), under slime's names of its router's address."""
        return argparse.Namespace(**self.settings, sglang_router_ip=router_ip, sglang_router_port=router_port)


def slime_args(spec: str, flags: argparse.Namespace, requests_per_engine: int) -> SlimeArgs:
    """The function's `args` from relax's parsed flags, under slime's names (relax spells these as slime does, but
    --eval-n-samples-per-prompt; the eval settings are None without --eval-prompt-data). `requests_per_engine`: the
    most requests an engine runs at once in a rollout, which slime's functions read as sglang_server_concurrency
    (their semaphore's size)."""
    names = ("hf_checkpoint", "rollout_max_response_len", "rollout_temperature", "rollout_top_p", "rollout_top_k",
             "rollout_stop_token_ids", "n_samples_per_prompt", "rollout_batch_size", "apply_chat_template",
             "apply_chat_template_kwargs", "seed", "eval_max_response_len", "eval_temperature", "eval_top_p",
             "use_rollout_routing_replay", "partial_rollout")  # routing replay is refused with a function: False
    return SlimeArgs(spec, {**{name: getattr(flags, name) for name in names},
                            "n_samples_per_eval_prompt": flags.eval_n_samples_per_prompt,
                            "sglang_server_concurrency": requests_per_engine})


@dataclass(frozen=True)
class CustomGenerateFn:
    fn: Callable
    spec: str  # as the flag gave it
    takes_evaluation: bool  # declares an `evaluation` parameter: told whether it generates for an evaluation

    async def __call__(self, args, sample, sampling_params, evaluation: bool = False):
        if self.takes_evaluation:
            return await self.fn(args, sample, sampling_params, evaluation=evaluation)
        return await self.fn(args, sample, sampling_params)


def load_custom_generate_fn(spec: str) -> CustomGenerateFn:
    fn = import_user_function(spec, FLAG)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{FLAG} {spec}: not an async function; the rollout awaits it: {CONTRACT}")
    signature = inspect.signature(fn)
    takes_evaluation = "evaluation" in signature.parameters
    call = "fn(args, sample, sampling_params" + (", evaluation=False)" if takes_evaluation else ")")
    try:
        signature.bind(None, None, None, **({"evaluation": False} if takes_evaluation else {}))
    except TypeError as e:
        raise ValueError(f"{FLAG} {spec}: its signature {signature} cannot be called as {call} ({e}); "
                         f"write it as {CONTRACT}") from e
    return CustomGenerateFn(fn, spec, takes_evaluation)


# --- generating: the engine a function runs beside ---------------------------------------------------------

EngineRequest = Callable[[list[int], dict], Awaitable[Completion]]
_ENGINE: contextvars.ContextVar[EngineRequest] = contextvars.ContextVar("relax_custom_generate_engine")


async def generate(input_ids: list[int], sampling_params: dict) -> Completion:
    """One request of token ids with SGLang's `sampling_params` to the engine of the actor the calling function runs
    in: the response's token_ids, logprobs (one per token), finish_reason and text. A request the engine refuses
    comes back with finish_reason "error" and the reason in `error`."""
    return await current_engine("relax.rollout.custom_generate.generate")(list(input_ids), dict(sampling_params))


def current_engine(caller: str) -> EngineRequest:
    """The requests of the sample the calling function generates (answered aborted after an abort), for `caller`
    named in the error when no function of relax's runs."""
    try:
        return _ENGINE.get()
    except LookupError:
        raise RuntimeError(
            f"{caller} reaches an engine only from a function that relax calls for {FLAG} (it runs in the engine's "
            "actor)"
        ) from None


def tokens_left(sample: Sample, sampling_params: dict) -> int:
    """What the sample's response budget (sampling_params' max_new_tokens) leaves after its response so far: the
    max_new_tokens of its next request (a continued sample's holds tokens already)."""
    return sampling_params["max_new_tokens"] - sample.response_length


def append_generated(sample: Sample, result: Completion) -> None:
    """The engine's answer to a request (generate's) as the sample's next response tokens: trained (loss mask 1), with
    the engine's logprobs; the sample's status follows the request's finish reason."""
    if len(result.logprobs) != len(result.token_ids):
        raise ValueError(f"the engine's answer has {len(result.token_ids)} token ids but {len(result.logprobs)} "
                         "logprobs")
    _append(sample, result.token_ids, result.text, 1, result.logprobs)
    sample.status = STATUS_OF_FINISH.get(result.finish_reason, Sample.Status.FAILED)


def append_masked(sample: Sample, token_ids: list[int], text: str) -> None:
    """Ids the function adds to the response itself (a tool's output, the chat template's turn ids), `text` their
    text: not trained (loss mask 0, logprob 0.0); the status stays."""
    _append(sample, token_ids, text, 0, [0.0] * len(token_ids))


def _append(sample: Sample, token_ids: list[int], text: str, mask: int, logprobs: list[float]) -> None:
    if sample.rollout_log_probs is None and sample.response_length:
        raise ValueError(f"the sample has {sample.response_length} response tokens but no rollout_log_probs: set "
                         "them with its tokens (or build the whole response with append_generated/append_masked)")
    mask_so_far = [1] * sample.response_length if sample.loss_mask is None else sample.loss_mask  # None: all trained
    sample.tokens = sample.tokens + list(token_ids)
    sample.loss_mask = mask_so_far + [mask] * len(token_ids)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + list(logprobs)
    sample.response_length += len(token_ids)
    sample.response += text


async def generate_samples(fn: CustomGenerateFn, args: argparse.Namespace, prompt: Prompt, sampling_params: dict,
                          engine: EngineRequest, evaluation: bool = False, so_far: ResponseSoFar | None = None,
                          keep_aborted: bool = False) -> list[Completion]:
    """One call of the function for `prompt`, its requests sent to `engine`: a completion per sample it returned (one,
    or its fan-out: completions_of). A call that fails, or returns a sample that cannot be trained on, is one failed
    completion saying why. `so_far`: the response an earlier step's call left ABORTED, which this call continues
    (partial rollout: continued_sample); `keep_aborted` (--partial-rollout): an ABORTED sample comes back with what it
    holds, for a later step to continue."""
    if so_far is None:
        sample = Sample(prompt.text, prompt.label, dict(prompt.metadata), list(prompt.token_ids))
    else:
        sample = continued_sample(prompt, so_far)
    _ENGINE.set(engine)  # in this coroutine's own context: each call of a group runs as a task of its own
    try:
        returned = await fn(args, sample, dict(sampling_params), evaluation=evaluation)
    except Exception as error:  # a user's function may fail in any way: the sample fails, the run goes on
        return [Completion.refused(f"{FLAG} {fn.spec} raised {type(error).__name__}: {error}")]
    completions = completions_of(returned, prompt.token_ids, sampling_params["max_new_tokens"], so_far, keep_aborted)
    if evaluation and completions[0].finish_reason == "abort":
        completions = [Completion.refused("returned a sample with status ABORTED in an evaluation, which puts no "
                                          "prompt back")]
    if completions[0].error is not None:
        return [Completion.refused(f"{FLAG} {fn.spec}: {completions[0].error}")]
    return completions


MAX_SAMPLES_PER_CALL = 16  # a call's fan-out: more is far likelier a function's bug than a design, and each one grows
# the step's trained batch (and its memory) past what the flags size it for


def continued_sample(prompt: Prompt, so_far: ResponseSoFar) -> Sample:
    """The sample a call continues: as the function returned it ABORTED in an earlier step (partial rollout), its
    tokens its prompt's ids (its own, or the data row's) and its response so far, with its loss mask, rollout logprobs,
    response text and metadata; copies, so the function's changes leave `so_far` as it was."""
    prompt_ids = prompt.token_ids if so_far.prompt_ids is None else so_far.prompt_ids
    return Sample(
        prompt.text, prompt.label, dict(prompt.metadata if so_far.metadata is None else so_far.metadata),
        tokens=list(prompt_ids) + list(so_far.token_ids), response=so_far.text,
        response_length=len(so_far.token_ids), loss_mask=None if so_far.loss_mask is None else list(so_far.loss_mask),
        rollout_log_probs=list(so_far.logprobs), status=Sample.Status.ABORTED,
    )


def completions_of(returned, prompt_ids: list[int], budget: int, so_far: ResponseSoFar | None = None,
                   keep_aborted: bool = False) -> list[Completion]:
    """What one call returned for the data row's prompt `prompt_ids`: a Sample, or a list of 1 to
    MAX_SAMPLES_PER_CALL Samples (fan-out: each joins the prompt's group), each checked as completion_of checks one.
    One failed completion (the reason, naming the list's element, in `error`) when any element fails. A call keeps a
    partial sample (`keep_aborted`) only when it returns that one sample: a list of several is one aborted completion,
    with nothing kept, when any of them is ABORTED or the call continued a response (`so_far`); the call starts again
    from the prompt in a later step (Completion.restarted where it dropped a response)."""
    if not isinstance(returned, list):
        return [completion_of(returned, prompt_ids, budget, so_far, keep_aborted)]
    if not 1 <= len(returned) <= MAX_SAMPLES_PER_CALL:
        return [Completion.refused(f"returned a list of {len(returned)} samples: return 1 to {MAX_SAMPLES_PER_CALL} "
                                   "samples per call")]
    if len(returned) == 1:
        return [completion_of(returned[0], prompt_ids, budget, so_far, keep_aborted)]
    completions = [completion_of(sample, prompt_ids, budget) for sample in returned]
    failed = next((i for i, c in enumerate(completions) if c.error is not None), None)
    if failed is not None:
        return [Completion.refused(f"sample {failed} of the {len(returned)} it returned: {completions[failed].error}")]
    continued = so_far is not None and bool(so_far.token_ids)
    aborted = [sample for sample in returned if sample.status is Sample.Status.ABORTED]
    if aborted or continued:
        return [Completion.aborted(restarted=keep_aborted and (continued or any(s.response_length for s in aborted)))]
    return completions


def completion_of(returned, prompt_ids: list[int], budget: int, so_far: ResponseSoFar | None = None,
                  keep_aborted: bool = False) -> Completion:
    """One sample a function returned for the data row's prompt `prompt_ids`, as the rollout takes a completion:
    failed (the reason in `error`) unless it is a Sample with aligned fields, at most `budget` response tokens and a
    final status, or ABORTED. A sample whose prompt (its tokens before the response) is not `prompt_ids` carries its
    own (prompt_ids). An ABORTED sample is unscored: with `keep_aborted` (partial rollout) and a response, it comes
    back with what it holds, checked as a finished one and its metadata JSON (a checkpoint saves it); otherwise with
    nothing. A sample that continues `so_far` (the response an earlier step's call left) must keep it
    (continuation_problem): the completion holds what the call added after it."""
    if not isinstance(returned, Sample):
        return Completion.refused(f"returned {type(returned).__name__}, not a relax.rollout.custom_generate.Sample")
    continued = so_far is not None and bool(so_far.token_ids)
    aborted = returned.status is Sample.Status.ABORTED
    if aborted and not (keep_aborted and returned.response_length):  # unscored: its prompt goes back
        return Completion.aborted(restarted=continued)
    if not aborted and returned.status not in FINISH_REASONS:
        return Completion.refused(f"returned a sample with status {returned.status.name}")
    problem = sample_problem(returned)
    if problem is None and returned.response_length > budget:
        problem = (f"its response has {returned.response_length} tokens, over its budget of {budget} "
                   "(sampling_params' max_new_tokens, the ids the function added included)")
    if problem is None and returned.rollout_log_probs is None:
        problem = "its rollout_log_probs are None: give the engine's logprob of each response token (append_generated)"
    if problem is None and returned.reward is not None and not isinstance(returned.reward, (int, float)):
        problem = f"its reward is {type(returned.reward).__name__}, not a number"
    if problem is None and continued:
        problem = continuation_problem(returned, so_far, prompt_ids)
    if problem is None and aborted:
        problem = metadata_problem(returned.metadata)
    if problem:
        return Completion.refused(problem)
    prompt_length = len(returned.tokens) - returned.response_length
    own_prompt = returned.tokens[:prompt_length]
    kept = len(so_far.token_ids) if continued else 0  # the response's tokens an earlier step's call sampled
    return Completion(
        token_ids=returned.tokens[prompt_length + kept:], logprobs=list(returned.rollout_log_probs[kept:]),
        finish_reason="abort" if aborted else FINISH_REASONS[returned.status],
        text=returned.response[len(so_far.text):] if continued else returned.response,
        loss_mask=None if returned.loss_mask is None else list(returned.loss_mask[kept:]),
        reward=None if aborted or returned.reward is None else float(returned.reward),
        prompt_ids=None if own_prompt == list(prompt_ids) else own_prompt,
        metadata=dict(returned.metadata) if aborted else None,
    )


def continuation_problem(returned: Sample, so_far: ResponseSoFar, prompt_ids: list[int]) -> str | None:
    """Why a sample that continues `so_far` (an earlier step's ABORTED sample of the data row's prompt `prompt_ids`:
    continued_sample) did not keep it; None when it did: the same prompt ids, then the response so far, its loss mask,
    rollout logprobs and text unchanged, and whatever the call added after them. The tokens an earlier step sampled
    keep that step's policy version (their age: --max-staleness, the rollout/partial_* metrics)."""
    kept = len(so_far.token_ids)
    given_prompt = prompt_ids if so_far.prompt_ids is None else so_far.prompt_ids
    prompt_length = len(returned.tokens) - returned.response_length
    fix = ("a continued sample keeps the prompt and the response it was given and adds after them (append_generated, "
           "append_masked); to start it again, return it ABORTED with no response")
    if returned.tokens[:prompt_length] != list(given_prompt):
        return f"it continues a sample of {len(given_prompt)} prompt ids but its prompt changed: {fix}"
    mask = [1] * returned.response_length if returned.loss_mask is None else returned.loss_mask
    given_mask = [1] * kept if so_far.loss_mask is None else so_far.loss_mask
    changed = [name for name, now, before in (
        ("tokens", returned.tokens[prompt_length:prompt_length + kept], so_far.token_ids),
        ("loss_mask", mask[:kept], given_mask),
        ("rollout_log_probs", returned.rollout_log_probs[:kept], so_far.logprobs),
    ) if list(now) != list(before)]
    if not (isinstance(returned.response, str) and returned.response.startswith(so_far.text)):
        changed.append("response")
    if changed:
        return f"it continues a response of {kept} tokens but changed its {', '.join(changed)}: {fix}"
    return None


def metadata_problem(metadata) -> str | None:
    """Why an ABORTED sample's metadata cannot be kept for a later step (a checkpoint saves it as JSON); None."""
    if not isinstance(metadata, dict):
        return f"its metadata is {type(metadata).__name__}, not a dict"
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as error:
        return (f"its metadata cannot be kept for a later step (--partial-rollout): a checkpoint saves it as JSON, "
                f"which it is not ({error})")
    return None


def sample_problem(sample) -> str | None:
    """Why the fields of `sample` are not aligned; None when they are. Its prompt is its tokens before its last
    response_length: at least one id. A loss_mask or rollout_log_probs of None is absent (slime's default: every
    response token trained)."""
    tokens = getattr(sample, "tokens", None)
    if not isinstance(tokens, list):
        return f"its tokens are {type(tokens).__name__}, not a list of token ids"
    if not all(isinstance(token, int) and not isinstance(token, bool) for token in tokens):
        return "its tokens hold values other than integer token ids"
    response_length = getattr(sample, "response_length", None)
    if not (isinstance(response_length, int) and 0 <= response_length < len(tokens)):
        return (f"its response_length is {response_length!r}, but its {len(tokens)} tokens must hold the prompt's "
                "ids (at least one), then the response's: give tokens = prompt ids + response ids and "
                "response_length = the response's count")
    for name in ("loss_mask", "rollout_log_probs"):
        values = getattr(sample, name, None)
        if values is not None and len(values) != response_length:
            return f"its {name} has {len(values)} entries for {response_length} response tokens"
    mask = getattr(sample, "loss_mask", None)
    if mask is not None and any(value not in (0, 1) for value in mask):
        return "its loss_mask holds values other than 0 and 1"
    return None
