"""slime's custom generate function (--custom-generate-function-path): a user's async function that generates one
prompt's sample in place of relax's own request, so a rollout written for slime (multi-turn, tools, agents) runs in
relax. slime names it `module.path.function`; relax takes that and `module:function`. slime calls it as

    async def generate(args, sample, sampling_params): ...                     # returns the sample, or a list
    async def generate(args, sample, sampling_params, evaluation=False): ...  # told when it generates for an eval

and passes `evaluation` only to a function that declares it. load_custom_generate_fn imports the function and checks
that it can be called so, before a run starts (--dry-run's check): a function that cannot is refused, naming why.

What it returns carries slime's sample fields: `tokens` (the prompt's ids, then the response's: tool tokens are
response tokens), `response_length`, `loss_mask` (one per response token: 1 sampled, 0 tool or template tokens) and
`rollout_log_probs` (one per response token). sample_problem says why a returned sample cannot be trained on, so
the rollout fails and counts it instead of training on misaligned tokens.
"""

import inspect
from dataclasses import dataclass
from typing import Callable

from relax.rollout.user_functions import import_user_function

FLAG = "--custom-generate-function-path"
CONTRACT = "async def fn(args, sample, sampling_params) (and optionally evaluation=False)"


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


def sample_problem(sample, prompt_ids: list[int]) -> str | None:
    """Why the fields of `sample`, returned for the prompt `prompt_ids`, are not aligned; None when they are. A
    loss_mask or rollout_log_probs of None is absent (slime's default: every response token trained)."""
    tokens = getattr(sample, "tokens", None)
    if not isinstance(tokens, list):
        return f"its tokens are {type(tokens).__name__}, not a list of token ids"
    if tokens[: len(prompt_ids)] != list(prompt_ids):
        return f"its tokens do not start with the prompt's {len(prompt_ids)} ids"
    response_length = len(tokens) - len(prompt_ids)
    if getattr(sample, "response_length", None) != response_length:
        return (f"its response_length is {getattr(sample, 'response_length', None)!r}, but its tokens hold "
                f"{response_length} after the prompt")
    for name in ("loss_mask", "rollout_log_probs"):
        values = getattr(sample, name, None)
        if values is not None and len(values) != response_length:
            return f"its {name} has {len(values)} entries for {response_length} response tokens"
    mask = getattr(sample, "loss_mask", None)
    if mask is not None and any(value not in (0, 1) for value in mask):
        return "its loss_mask holds values other than 0 and 1"
    return None
