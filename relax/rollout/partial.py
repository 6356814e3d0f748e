"""Partial rollout (--partial-rollout, slime's name): a group aborted when its step's batch was full keeps what its
responses had generated, and a later step continues them instead of starting again.

A GroupSoFar holds a group's sampling.n responses as far as they went: each response's tokens, their engine
logprobs and the step whose rollout sampled each token (its age in steps is the training step minus that), and
how it ended: "abort" (to be continued: the rest of its budget is sampled after prompt + its tokens), or "stop" /
"length" (complete: it finished before the abort and is kept as it is). A multi-turn response (--tools) keeps its
loss mask and what its turns did (ToolUse) too: its continuation finishes the turn the abort cut short and goes on
with the turns and budget left (relax.rollout.multi_turn.generate_multi_turn). A custom generate function's sample
(relax.rollout.custom_generate) keeps its own prompt ids and metadata too, and the function is called again with it;
its finished samples keep their preset reward, and a call's fan-out joins the group as responses of their own. The
prompt loader holds a GroupSoFar beside the prompt it puts back (relax.rollout.data.PromptLoader.put_back), so a
checkpoint saves it with the loader and a resumed run continues it.

--max-staleness K bounds the age: when a group is taken again, a response with a token sampled more than K steps
before the step that takes it starts again from the prompt (counted: rollout/partial_stale_samples).
"""

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from relax.rollout.tool_calls import ToolUse

if TYPE_CHECKING:  # the prompt loader imports this module: no engine import at run time
    from relax.rollout.engine import Completion

CONTINUED = "abort"  # the finish reason of a response to be continued


@dataclass
class ResponseSoFar:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the engine's, one per token
    # The step whose rollout sampled each token: its policy's, by the loop's schedule (the next step's where the
    # engines got the step's trained weights mid-rollout: relax.run.loop_async, after an engine restart)
    steps: list[int] = field(default_factory=list)
    finish_reason: str = CONTINUED  # or "stop", "length", "error" (the engine refused its request: error)
    text: str = ""
    error: str | None = None
    # The experts the engine's routers chose (routing replay) in its last request, which covered the prompt and
    # every token before the last (the earlier tokens prefilled again); not saved (state_dict).
    routed_experts: torch.Tensor | None = None
    # A multi-turn response's (Completion's fields; None otherwise): per token 1 sampled, 0 appended by relax; what
    # its turns did, all of them (a continuation's completion counts the turns before it too).
    loss_mask: list[int] | None = None
    tool_use: ToolUse | None = None
    reward: float | None = None  # a custom generate function's preset one (Completion's), of a finished sample
    # A custom generate function's sample's (Completion's): its own prompt ids (None: the data row's), which its
    # continuation goes on after, and the metadata of an ABORTED one, which the function gets back with it.
    prompt_ids: list[int] | None = None
    metadata: dict | None = None

    def extended(self, completion: "Completion", step: int) -> "ResponseSoFar":
        """This response continued by `completion` (its new tokens, sampled in `step`'s rollout); a custom generate
        function's call that dropped its response (Completion.restarted) starts it again. A refused request keeps
        the response's own prompt ids and metadata, which a later step's continuation needs."""
        if completion.restarted:
            return ResponseSoFar()
        masked = self.loss_mask is not None or completion.loss_mask is not None
        loss_mask = _mask(self.token_ids, self.loss_mask) + _mask(completion.token_ids, completion.loss_mask)
        refused = completion.error is not None
        return ResponseSoFar(
            self.token_ids + completion.token_ids, self.logprobs + completion.logprobs,
            self.steps + [step] * len(completion.token_ids), completion.finish_reason, self.text + completion.text,
            completion.error, completion.routed_experts, loss_mask if masked else None, completion.tool_use,
            completion.reward, self.prompt_ids if refused else completion.prompt_ids,
            self.metadata if refused else completion.metadata,
        )

    def to_continue_later(self) -> "ResponseSoFar":
        """This response as a later step continues it: an aborted or refused request goes on from its tokens."""
        if self.finish_reason in (CONTINUED, "error"):
            return replace(self, finish_reason=CONTINUED, error=None, routed_experts=None, reward=None)
        return self


def _mask(token_ids: list[int], loss_mask: list[int] | None) -> list[int]:
    """The loss mask of `token_ids`: every token trained where none is given."""
    return [1] * len(token_ids) if loss_mask is None else loss_mask


@dataclass
class GroupSoFar:
    responses: list[ResponseSoFar]  # sampling.n, in request order

    @classmethod
    def new(cls, n: int) -> "GroupSoFar":
        return cls([ResponseSoFar() for _ in range(n)])

    def copy(self) -> "GroupSoFar":
        """A group whose changes (its responses replaced, never changed in place) leave this one as it is."""
        return GroupSoFar(list(self.responses))

    def to_continue(self, budget: int) -> list[int]:
        """The indices of the responses still to generate; a response aborted with its whole `budget` of tokens is
        complete ("length")."""
        for j, response in enumerate(self.responses):
            if response.finish_reason == CONTINUED and len(response.token_ids) >= budget:
                self.responses[j] = replace(response, finish_reason="length")
        return [j for j, response in enumerate(self.responses) if response.finish_reason == CONTINUED]

    def drop_stale(self, step: int, max_staleness: int | None) -> int:
        """Start again every response with a token sampled more than `max_staleness` steps before `step`; how
        many."""
        if max_staleness is None:
            return 0
        stale = [j for j, r in enumerate(self.responses) if r.steps and step - min(r.steps) > max_staleness]
        for j in stale:
            self.responses[j] = ResponseSoFar()
        return len(stale)

    @property
    def begun(self) -> bool:
        """Whether any response has a token (a group without one is put back as its bare prompt)."""
        return any(response.token_ids for response in self.responses)

    def state_dict(self) -> dict:
        """Plain JSON values (the prompt loader's checkpoint state)."""
        return {"responses": [_response_state(r) for r in self.responses]}

    @classmethod
    def from_state_dict(cls, state: dict) -> "GroupSoFar":
        return cls([_response_of_state(response) for response in state["responses"]])


SAVED_FIELDS = ("token_ids", "logprobs", "steps", "finish_reason", "text", "loss_mask")  # of a group put back
# A custom generate function's sample's, saved where set: its preset reward, own prompt ids and metadata
SAVED_WHERE_SET = ("reward", "prompt_ids", "metadata")


def _response_state(response: ResponseSoFar) -> dict:
    """A response's saved fields, its ToolUse as a dict (None for a single-turn response)."""
    tool_use = None if response.tool_use is None else asdict(response.tool_use)
    custom = {name: getattr(response, name) for name in SAVED_WHERE_SET if getattr(response, name) is not None}
    return {**{name: getattr(response, name) for name in SAVED_FIELDS}, "tool_use": tool_use, **custom}


def _response_of_state(state: dict) -> ResponseSoFar:
    """A saved response; a state without "tool_use" (as earlier checkpoints hold) is a single-turn response's, one
    without the custom generate function's fields (earlier checkpoints') has none of them."""
    tool_use = state.get("tool_use")
    return ResponseSoFar(**{**state, "tool_use": None if tool_use is None else ToolUse(**tool_use)})


@dataclass
class PartialStats:
    """The partial rollout's counts of one step (rollout/partial_* metrics)."""

    resumed_samples: int = 0  # samples of the batch that continued a response begun in an earlier step
    stale_samples: int = 0  # responses started again for --max-staleness
    carried_tokens: int = 0  # tokens of the groups put back with what they generated, for a later step
    restarted_calls: int = 0  # calls of a custom generate function whose response so far was dropped (Completion's)

    def metrics(self, old_token_steps: list[int], tokens: int, step: int) -> dict[str, float]:
        """The counts, and of a batch of `tokens` response tokens in step `step`, of which an earlier step's rollout
        sampled those of `old_token_steps` (the step of each), the oldest token's age and their share."""
        return {
            "rollout/partial_resumed_samples": self.resumed_samples,
            "rollout/partial_stale_samples": self.stale_samples,
            "rollout/partial_carried_tokens": self.carried_tokens,
            "rollout/partial_restarted_calls": self.restarted_calls,
            "rollout/partial_oldest_token_age": step - min(old_token_steps) if old_token_steps else 0,
            "rollout/partial_old_token_fraction": len(old_token_steps) / max(tokens, 1),
        }
