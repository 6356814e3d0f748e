"""One sample's multi-turn rollout: the model writes, calls tools, reads their output, writes again, until it answers
without a call, --max-turns is reached or the response's token budget is spent.

Token in, token out: each turn sends the prompt and the response so far as token ids, and the response grows by the
ids the engine sampled (loss mask 1, the engine's logprobs) and the ids relax appended after them (the end of turn,
the tool turn, the next assistant header from relax.rollout.turns: mask 0, logprob 0.0). The response is never
rendered and re-tokenized, so the trained sequence is exactly what the engine saw and sampled.

The engine is any async callable `generate(input_ids, sampling) -> completion` whose completion has token_ids,
logprobs (one per token) and finish_reason ("stop", "length", "abort" or "error", with error saying why), as
relax.rollout.engine.Completion has: one request, sampling.n == 1, sampling.max_new_tokens what is left of the budget.

A response aborted in an earlier step (partial rollout: relax.rollout.partial) is continued where it stopped: its last
turn, which the abort cut short (or kept from starting), goes on after prompt + its ids; the tool calls are read
from that whole turn's text, as without the abort; its turns, calls and tokens so far count toward --max-turns and
the budget, and the tools it called already are not called again.

    response = await generate_multi_turn(generate, prompt_ids, sampling, ChatTurns(tokenizer), tools, max_turns=4)
"""

from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable

import torch

from relax.rollout.engine import SamplingConfig
from relax.rollout.tool_calls import ToolUse, parse_tool_calls, run_tool_calls
from relax.rollout.tools import Tool
from relax.rollout.turns import ChatTurns


# --max-turns when not given: room for a few calls and the answer; the token budget (--rollout-max-response-len)
# bounds the response as well
DEFAULT_MAX_TURNS = 4


@dataclass(frozen=True)
class ToolRollout:
    """--tools and --max-turns: what an engine actor needs to roll its samples out over turns
    (relax.rollout.worker.EngineWorker builds the tools and the chat turns from it, inside the actor)."""

    tools: tuple[str, ...]  # relax.rollout.tools.load_tools specs: built-in names or module:function
    max_turns: int  # assistant turns per sample (ToolUse.turns)
    chat_template_kwargs: dict  # the template's options, as the prompts were rendered with (relax.rollout.turns)


@dataclass
class MultiTurnResponse(ToolUse):
    """A multi-turn response; its ToolUse counts every turn it has, a turn continued after an abort once."""

    token_ids: list[int] = field(default_factory=list)  # each turn's sampled ids, then the ids appended after it
    loss_mask: list[int] = field(default_factory=list)  # per response token: 1 sampled, 0 appended
    logprobs: list[float] = field(default_factory=list)  # per response token: the engine's, 0.0 where appended
    # "stop": the model answered without a tool call. "length": the token budget ran out, or --max-turns did while
    # the model still called tools. "abort" / "error": the last turn's, which keeps what it sampled before.
    finish_reason: str = "stop"
    error: str | None = None  # the engine's reason, with finish_reason "error"
    # Routing replay: the last turn's routed experts, which cover the prompt and every response token but the last
    # (its request held the whole sequence before it, and the response ends on what it sampled).
    routed_experts: torch.Tensor | None = None

    def add(self, token_ids: list[int], logprobs: list[float] | None) -> None:
        """Sampled ids with their logprobs, or appended ids (logprobs None)."""
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise ValueError(f"the engine returned {len(token_ids)} token ids but {len(logprobs)} logprobs")
        self.token_ids += token_ids
        self.loss_mask += [0 if logprobs is None else 1] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids) if logprobs is None else list(logprobs)

    def last_turn_start(self) -> int:
        """Where the ids of the response's last turn begin: after the ids appended before it (every turn but the
        first follows appended ids, and a turn's own ids are all sampled)."""
        return max((i + 1 for i, mask in enumerate(self.loss_mask) if mask == 0), default=0)


async def generate_multi_turn(
    generate: Callable[[list[int], SamplingConfig], Awaitable], prompt_ids: list[int], sampling: SamplingConfig,
    turns: ChatTurns, tools: dict[str, Tool], max_turns: int, so_far: MultiTurnResponse | None = None,
) -> MultiTurnResponse:
    """The response to one prompt. `sampling.max_new_tokens` bounds the whole response, appended ids included (what
    the trainer's sequence length sees); `tools` by the names the model calls them. `so_far`: the response as an
    earlier step's abort left it, which this one continues (and extends in place)."""
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns}: a multi-turn rollout needs at least one turn")
    if sampling.ignore_eos:
        raise ValueError("ignore_eos: a multi-turn rollout needs each turn to end where the model ends it")
    # A turn ends at the template's end-of-turn token even where the tokenizer's EOS is another one (a base model's)
    end_of_turn = turns.end_of_turn_ids[0]
    stop_token_ids = sampling.stop_token_ids + (() if end_of_turn in sampling.stop_token_ids else (end_of_turn,))
    prompt_ids, budget = list(prompt_ids), sampling.max_new_tokens_for(len(prompt_ids))
    if budget < 1:  # refused as the engine refuses such a request: the sample fails, the rollout goes on
        error = f"the prompt's {len(prompt_ids)} tokens leave no room for a response in the {sampling.clip_to_context}"
        return MultiTurnResponse(finish_reason="error", error=error + "-token context")
    response = MultiTurnResponse() if so_far is None else so_far
    response.finish_reason, response.error = "stop", None  # until a turn ends otherwise (so_far's: its abort's)
    # A continued response's last turn was counted when it began: its first request finishes that turn
    new_turn, turn_start = response.turns == 0, response.last_turn_start()
    while True:
        turn_sampling = replace(sampling, n=1, max_new_tokens=budget - len(response.token_ids),
                                stop_token_ids=stop_token_ids)
        completion = await generate(prompt_ids + response.token_ids, turn_sampling)
        if new_turn:
            response.turns += 1
        response.add(completion.token_ids, completion.logprobs)
        response.routed_experts = getattr(completion, "routed_experts", None)
        if completion.finish_reason != "stop":
            response.finish_reason, response.error = completion.finish_reason, getattr(completion, "error", None)
            return response
        turn_ids = response.token_ids[turn_start:]  # the whole turn: a call may span the abort that cut it
        calls = parse_tool_calls(turns.tokenizer.decode(turn_ids, skip_special_tokens=False))
        if not calls:
            return response
        if response.turns >= max_turns:
            response.finish_reason = "length"
            return response
        outputs = await run_tool_calls(calls, tools)
        response.tool_calls += len(calls)
        response.tool_failures += sum(output.failed for output in outputs)
        response.tool_timeouts += sum(output.timed_out for output in outputs)
        appended = turns.after_assistant(turn_ids, [output.text for output in outputs])
        if len(response.token_ids) + len(appended) >= budget:  # no token left for the model to read them with
            response.finish_reason = "length"
            return response
        response.add(appended, None)
        new_turn, turn_start = True, len(response.token_ids)


def multi_turn_metrics(uses: list[ToolUse], loss_masks: list[list[int]], prefix: str = "rollout/"
                       ) -> dict[str, float]:
    """The metrics of multi-turn samples (a step's rollout, or an evaluation's under `prefix` eval/<set>/): each
    one's ToolUse and response loss mask."""
    tokens = sum(len(mask) for mask in loss_masks)
    return {
        f"{prefix}turns_mean": sum(use.turns for use in uses) / len(uses),
        f"{prefix}tool_calls": float(sum(use.tool_calls for use in uses)),
        f"{prefix}tool_failures": float(sum(use.tool_failures for use in uses)),
        f"{prefix}tool_timeouts": float(sum(use.tool_timeouts for use in uses)),
        f"{prefix}masked_token_share": sum(mask.count(0) for mask in loss_masks) / max(tokens, 1),
    }
