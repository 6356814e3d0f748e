"""slime's custom generate function (--custom-generate-function-path): a user's async function that generates one
prompt's sample in place of relax's own request, so a rollout written for slime (multi-turn, tools, agents) runs in
relax. slime names it `module.path.function`; relax takes that and `module:function`. slime calls it as

    async def generate(args, sample, sampling_params): ...                     # returns the sample, or a list
    async def generate(args, sample, sampling_params, evaluation=False): ...  # told when it generates for an eval

and passes `evaluation` only to a function that declares it. load_custom_generate_fn imports the function and checks
that it can be called so, before a run starts (--dry-run's check): a function that cannot is refused, naming why.
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
