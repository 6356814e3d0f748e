"""What a run reads before any worker starts, each read once: whether its output directories hold an earlier run's
record, the reward function, the checkpoint --load names, the rollout data --load-rollout-data replays, and the
prompt data and eval sets (every row checked and tokenized; the longest prompt with its response budget checked
against the model's context length). A restart after a worker failed reads only the checkpoint it resumes from
(Inputs.resumed).

`relax train --dry-run` reads them and prints the report; `relax train` reads them before its console opens (so an
output directory it refuses is left as it was) and runs on what was read. Bad input raises InputError or the
reader's own error (PromptDataError, CheckpointError, RolloutDataError), each naming the input and the fix.

A dry run may name inputs that are not there yet (a preset checked on a machine without its data or model): they
are reported as not checked (a missing --hf-checkpoint only where flags give the model's size: relax.args). A run
checks that every step's rollout data file is there and reads each whole at its step; a dry run reads them all now,
which alone finds a malformed group before the run.
"""

from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from relax.args.settings import (
    ContextLength,
    OutputSettings,
    RolloutSettings,
    RunSettings,
    rollout_requests_per_engine,
)
from relax.args.sglang import server_args_fields
from relax.rollout.data import Prompt, PromptLoader, load_prompts
from relax.rollout.dump import check_rollout_data
from relax.rollout.engine import SamplingConfig
from relax.rollout.engine_fields import decode_graph_shortfall
from relax.rollout.evaluation import EvalSet, load_eval_sets
from relax.rollout.rewards import RewardFn, load_reward_fn
from relax.run.metrics import earlier_record
from relax.run.state import Checkpoint, read_checkpoint
from relax.train.saved_steps import LATEST


class InputError(ValueError):
    """An input the run cannot use; the message names it and the fix."""


@dataclass(frozen=True)
class Inputs:
    report: list[str]  # one line per input, as the dry run prints them and the run logs them
    checkpoint: Checkpoint | None  # the one the run resumes from (--load)
    prompts: list[Prompt] | None  # None: the run reads no prompt data (it replays rollouts, or only evaluates)
    eval_sets: list[EvalSet]
    reward_fn: RewardFn | None  # None: nothing is scored

    def loader(self, seed: int, shuffle: bool) -> PromptLoader | None:
        """The prompt loader of a run, where the checkpoint left it when resuming."""
        if self.prompts is None:
            return None
        if self.checkpoint is not None:
            return self.checkpoint.loader(self.prompts)
        return PromptLoader(self.prompts, seed=seed, shuffle=shuffle)

    def resumed(self, run: RunSettings) -> "Inputs":
        """The inputs of a run restarted from run.load (relax.run.loop.run_with_restarts): a checkpoint of the last
        step is taken too, where what remains is the evaluation after it. The rest was read at the start."""
        if run.load is None:
            return self
        return replace(
            self, checkpoint=read_checkpoint(run.load, run.hf_checkpoint, run.seed, run.num_steps, finished_ok=True)
        )


def read_inputs(config, dry_run: bool = False) -> Inputs:
    """Every input of `config` (relax.args.TrainConfig) read and checked, the cheap checks first."""
    run, rollout, evaluation, outputs = config.run, config.rollout, config.evaluation, config.outputs
    if run.load is None:
        check_new_record(outputs)
    reward_fn = None
    if run.mode.reads_prompts or evaluation.datasets:  # something is generated, then scored
        try:
            reward_fn = load_reward_fn(rollout.reward_fn, rollout.reward_timeout)
        except ValueError as error:  # its message names --reward-fn and what is wrong
            raise InputError(str(error)) from error
    report, checkpoint, start_step = [], None, 0
    if run.load is not None:
        absent = _absent(("--load", run.load), ("--hf-checkpoint", run.hf_checkpoint)) if dry_run else ""
        if absent:
            report.append(f"--load: not checked ({absent})")
            start_step = None  # unknown
        else:
            checkpoint = read_checkpoint(run.load, run.hf_checkpoint, run.seed, run.num_steps)
            start_step = checkpoint.next_step
            report.append(f"--load: {checkpoint.directory}, the run resumes at step {start_step}")
    if run.mode.replays_rollouts:
        report.append(f"rollout data: {_replayed(rollout, start_step, run.num_steps, dry_run)}")

    @cache
    def tokenizer():  # loaded once, and only where rows are read
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(run.hf_checkpoint)

    prompts = None
    if run.mode.replays_rollouts:
        report.append("prompt data: not read (the run replays --load-rollout-data)")
    elif not run.mode.reads_prompts:
        report.append(
            "prompt data: none (--eval-only evaluates --hf-checkpoint on the eval sets once; the training flags, "
            "--num-steps, batch sizes, optimizer and loss, are checked as for a run but unused)"
        )
    else:
        given = (("--prompt-data", rollout.data.path), ("--hf-checkpoint", run.hf_checkpoint))
        absent = _absent(*given) if dry_run else ""
        if absent:
            report.append(f"prompt data: not checked ({absent})")
        else:
            prompts, loaded = load_prompts(rollout.data, tokenizer())
            report.append(f"prompt data: {loaded.summary()}")
            report += [
                f"prompt data: {line}"
                for line in _within_context(
                    prompts, f"--prompt-data {loaded.path}", "--rollout-max-response-len", rollout.sampling,
                    rollout.context,
                )
            ]
        shortfall = decode_graph_shortfall(server_args_fields(config.sglang), rollout_requests_per_engine(config.flags))
        report += [f"decode graphs: {shortfall}"] if shortfall else []
    eval_sets = []
    for name, data in evaluation.datasets.items():
        flag = f"--eval-prompt-data {name}"
        absent = _absent((flag, data.path), ("--hf-checkpoint", run.hf_checkpoint)) if dry_run else ""
        if absent:
            report.append(f"eval set {name}: not checked ({absent})")
            continue
        (eval_set,), (loaded,) = load_eval_sets({name: data}, tokenizer())
        eval_sets.append(eval_set)
        report.append(f"eval set {name}: {loaded.summary()}")
        report += [
            f"eval set {name}: {line}"
            for line in _within_context(
                eval_set.prompts, f"{flag} {loaded.path}", "--eval-max-response-len", evaluation.sampling,
                rollout.context,
            )
        ]
    return Inputs(report, checkpoint, prompts, eval_sets, reward_fn)


def check_new_record(outputs: OutputSettings) -> None:
    """A new run (no --load) never mixes its steps with an earlier run's metrics or checkpoints; a resumed run
    continues its own record (relax.run.metrics)."""
    found = earlier_record(outputs.output_dir)
    if found and not outputs.overwrite_output_dir:
        raise InputError(
            f"--output-dir {outputs.output_dir} holds an earlier run's record ({', '.join(found)}) and a new run would "
            "mix its steps into it: pass --overwrite-output-dir to replace that record, choose another --output-dir, "
            "or resume the earlier run with --load"
        )
    if outputs.save is not None and (Path(outputs.save) / LATEST).is_file():
        raise InputError(
            f"--save {outputs.save} holds an earlier run's checkpoints and a new run would mix its own among them: "
            f"resume that run with --load {outputs.save}, or choose another --save (relax does not delete checkpoints)"
        )
    if outputs.save_hf is not None and any(Path(outputs.save_hf).glob("step_*")):
        raise InputError(
            f"--save-hf {outputs.save_hf} holds an earlier run's HF directories and a new run would mix its own among "
            "them: resume that run with --load, or choose another --save-hf"
        )


def _within_context(
    prompts: list[Prompt], data: str, budget_flag: str, sampling: SamplingConfig, context: ContextLength | None
) -> list[str]:
    """Refuses (InputError) now what SGLang would refuse request by request mid-run: a prompt that with
    sampling.max_new_tokens (`budget_flag`) does not fit the engines' context length, unless sampling.clip_to_context
    gives it the budget the context leaves; a prompt that fills the context alone, always. Only the longest prompt
    needs checking. Returns the report's lines: the clipped prompts, or why nothing was checked."""
    if context is None:
        return [
            "not checked against the model's context length (config.json has no max_position_embeddings and "
            "--sglang-context-length is not given)"
        ]
    longest = max(prompts, key=lambda prompt: len(prompt.token_ids))
    length, max_new_tokens = len(longest.token_ids), sampling.max_new_tokens
    found = f"{data}: the longest prompt (row {longest.row}) has {length} tokens"
    limit = f"the model's context length of {context.tokens} tokens ({context.source})"
    if length >= context.tokens:
        raise InputError(
            f"{found}, which leaves no room for a response within {limit}: shorten such prompts, or drop them with "
            f"--max-prompt-length {context.tokens - 1} or less"
        )
    if length + max_new_tokens <= context.tokens:
        return []
    if sampling.clip_to_context is None:
        drop = (
            f"shorten the prompts (--max-prompt-length {context.tokens - max_new_tokens} drops longer ones), "
            if max_new_tokens < context.tokens
            else ""
        )
        raise InputError(
            f"{found}; with {budget_flag} {max_new_tokens} its requests need {length + max_new_tokens} tokens, more "
            f"than {limit}: {drop}lower {budget_flag} to {context.tokens - length}, or pass "
            "--rollout-clip-response-to-context to give such prompts the response budget the context leaves them"
        )
    clipped = sum(len(prompt.token_ids) + max_new_tokens > context.tokens for prompt in prompts)
    return [
        f"{clipped} of {len(prompts)} prompts respond in fewer than {budget_flag} {max_new_tokens} tokens, clipped "
        f"to {limit} (--rollout-clip-response-to-context); the smallest budget {context.tokens - length} tokens "
        f"(row {longest.row})"
    ]


def _replayed(rollout: RolloutSettings, start_step: int | None, num_steps: int, dry_run: bool) -> str:
    """The report of the rollout data replayed from `start_step` on, checked in the run's batch shape (read whole
    under a dry run, one file at a time)."""
    if start_step is None:
        return "not checked (the run's first step is that of the --load checkpoint, not checked)"
    return check_rollout_data(
        rollout.load_data, range(start_step, num_steps), rollout.batch_size, rollout.sampling.n,
        rollout.routing_replay, read_samples=dry_run,
    )


def _absent(*given: tuple[str, str | None]) -> str:
    """The (flag, path) pairs whose path is not given or not there, in words; empty when all are there."""
    return "; ".join(
        f"{flag} {'not given' if path is None else f'{path} does not exist'}"
        for flag, path in given
        if path is None or not Path(path).exists()
    )

