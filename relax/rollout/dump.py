"""Rollout data on disk: each step's scored samples, written by --save-rollout-data and replayed by
--load-rollout-data, so a step can be trained again exactly (or inspected by eye).

A path pattern names one file per step: `{step}` is replaced by the step number (`dumps/step_{step}.jsonl`,
or with a format spec, `dumps/step_{step:04d}.jsonl`).
A pattern without `{step}` names one file: saving refuses it for runs of more than one step; loading
replays that same rollout at every step.

Format (version 4): JSON lines, UTF-8. The first line is a header, then one line per prompt group:

    {"format": "relax.rollout_data", "version": 4, "step": 3, "num_groups": 8, "samples_per_prompt": 8,
     "routed_experts": "step_3.jsonl.experts.safetensors"}
    {"prompt": {"row": 17, "token_ids": [...], "text": "...", "label": ..., "metadata": {...}},
     "samples": [{"prompt_token_ids": null, "response_token_ids": [...], "response_logprobs": [...],
                  "loss_mask": [1, ...], "finish_reason": "stop", "response_text": "...", "reward": 1.0,
                  "reward_failed": false}, ...]}

A group holds "samples_per_prompt" samples, but where a custom generate function's fan-out made groups larger
(relax.rollout.custom_generate): the header then holds "group_sizes", each group's count in order, each at least
"samples_per_prompt" (a relax that predates them refuses such a file: its groups are not of the header's size).

A sample's "prompt_token_ids" are the ids its response follows where they are not its prompt row's (a custom generate
function's sample with its own prompt: relax.rollout.groups.Sample.own_prompt_ids), null where they are: a replay
trains each sample on the same sequence.

Rewards are the reward function's scores, before any overlong penalty (the loop applies that after
loading, from the response lengths). Floats are written as Python's repr, so they read back bit for bit.
Labels and metadata must be JSON values.

Routed experts (samples of a --use-rollout-routing-replay run) are millions of small integers per step, so they
lie beside the JSON lines in a safetensors file named after it (`<file name>.experts.safetensors`), which the
header's "routed_experts" names (null: the step has none). It holds one tensor per sample, named by the sample's
index in the file (groups in order, samples in order within each), [prompt + response tokens - 1, layers, top-k]:
the experts of every token but the last. They are stored as uint8 where every id of the step fits (up to 256
experts), else int16, and load as the engine returns them (relax.rollout.engine.ROUTED_EXPERTS_DTYPE). Loading
reads them only for a run that replays them, and refuses a file without them for such a run.

Both files are written to a temporary name and then renamed, the experts first: a run that dies mid-write leaves
no half file under the step's name, and a step's JSON lines, once there, have their experts complete beside them.
Version 1 files (before routed experts were kept; no "routed_experts" in the header) load as a step without them.
Version 1 and 2 files (before loss masks were kept) hold no "loss_mask": every response token was trained then.
Version 1 to 3 files (before samples had prompts of their own) hold no "prompt_token_ids": each sample followed its
prompt row's ids then. A relax that reads up to version 3 refuses version 4 files rather than train other sequences.

Before a replaying run touches a device, check_rollout_data checks every step's file it will read: `relax train
--dry-run` reads each one whole, the run itself only its header (and that its experts are there), as it reads each
file whole at its step.
"""

import json
import math
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError

from relax.files import write_bytes_atomically, write_text_atomically
from relax.rollout.data import Prompt
from relax.rollout.engine import ROUTED_EXPERTS_DTYPE
from relax.rollout.groups import Sample, group_by_prompt
from relax.train.batch import check_routed_experts

FORMAT = "relax.rollout_data"
VERSION = 4  # what saving writes
# version 1: no routed experts; versions 1 and 2: no loss masks; versions 1 to 3: no samples' own prompt ids
READABLE_VERSIONS = (1, 2, 3, 4)
EXPERTS_SUFFIX = ".experts.safetensors"
STORED_DTYPES = (torch.uint8, ROUTED_EXPERTS_DTYPE)  # routed experts on disk: the first that holds every id


class RolloutDataError(ValueError):
    """A rollout data file cannot be written or read; the message names the file and the step."""


def rollout_data_path(pattern: str, step: int) -> Path:
    try:
        return Path(pattern.format(step=step))
    except (KeyError, IndexError, ValueError) as e:
        raise RolloutDataError(
            f"rollout data path pattern {pattern!r}: only the field {{step}} may appear in braces ({e!r})"
        ) from None


def pattern_problem(flag: str, pattern: str | None, num_steps: int) -> str | None:
    """What is wrong with a --save-rollout-data / --load-rollout-data pattern, in words; None if nothing."""
    if pattern is None:
        return None
    try:
        rollout_data_path(pattern, 0)
    except RolloutDataError as e:
        return f"{flag} {e}"
    names_one_file = rollout_data_path(pattern, 0) == rollout_data_path(pattern, 1)
    if flag == "--save-rollout-data" and names_one_file and num_steps > 1:
        return f"{flag} {pattern!r} has no {{step}}: every step of the {num_steps} would overwrite the same file"
    return None


def save_rollout_data(pattern: str, step: int, samples: list[Sample], samples_per_prompt: int) -> Path:
    """Write the step's samples (listed prompt by prompt) to the pattern's file for `step`, their routed experts
    beside it where they carry them; returns its path."""
    path = rollout_data_path(pattern, step)
    groups = group_by_prompt(samples, samples_per_prompt)
    experts_path = experts_path_of(path) if any(s.routed_experts is not None for s in samples) else None
    header = {
        "format": FORMAT, "version": VERSION, "step": step, "num_groups": len(groups),
        "samples_per_prompt": samples_per_prompt,
        "routed_experts": None if experts_path is None else experts_path.name,
    }
    sizes = [len(group.samples) for group in groups]
    if any(size != samples_per_prompt for size in sizes):  # a custom generate function's fan-out
        header["group_sizes"] = sizes
    lines = [json.dumps(header)]
    for group in groups:
        p = group.prompt
        record = {
            "prompt": {
                "row": p.row, "token_ids": p.token_ids, "text": p.text, "label": p.label, "metadata": p.metadata
            },
            "samples": [
                {
                    "prompt_token_ids": s.own_prompt_ids,
                    "response_token_ids": s.response_token_ids,
                    "response_logprobs": s.response_logprobs,
                    "loss_mask": s.loss_mask,
                    "finish_reason": s.finish_reason,
                    "response_text": s.response_text,
                    "reward": s.reward,
                    "reward_failed": s.reward_failed,
                }
                for s in group.samples
            ],
        }
        try:
            lines.append(json.dumps(record, ensure_ascii=False))
        except TypeError as e:
            raise RolloutDataError(
                f"--save-rollout-data, step {step}: cannot write {path}: the label or metadata of prompt row {p.row} "
                f"is not a JSON value ({e})"
            ) from None
    experts_file = None if experts_path is None else _experts_file(samples, f"--save-rollout-data, step {step}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if experts_file is not None:
        write_bytes_atomically(experts_path, experts_file)
    write_text_atomically(path, "\n".join(lines) + "\n")
    return path


def experts_path_of(path: Path) -> Path:
    """Where the routed experts of the rollout data file `path` lie."""
    return path.with_name(path.name + EXPERTS_SUFFIX)


def _experts_file(samples: list[Sample], where: str) -> bytes:
    """The samples' routed experts as a safetensors file, in the smallest of STORED_DTYPES that holds every id."""
    experts = [s.routed_experts for s in samples]
    try:
        check_routed_experts(experts, _token_counts(samples))
    except ValueError as e:
        raise RolloutDataError(f"{where}: the samples' routed experts are inconsistent ({e})") from None
    low, high = min(int(e.min()) for e in experts), max(int(e.max()) for e in experts)
    dtype = next(d for d in STORED_DTYPES if torch.iinfo(d).min <= low and high <= torch.iinfo(d).max)
    return safetensors.torch.save({str(i): e.to(dtype).contiguous() for i, e in enumerate(experts)})


def _token_counts(samples: list[Sample]) -> list[int]:
    return [len(s.prompt_ids) + len(s.response_token_ids) for s in samples]


def load_rollout_data(
    pattern: str, step: int, num_groups: int, samples_per_prompt: int, with_routed_experts: bool = False
) -> list[Sample]:
    """The samples saved for `step` (prompt by prompt), checked against the run's batch shape; with their routed
    experts if `with_routed_experts` (the run replays them), else without."""
    path, where = _existing_file(pattern, step)
    records = [
        (number, _json_line(line, number, where))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if line.strip()
    ]
    if not records:
        raise RolloutDataError(f"{where} is empty")
    (header_line, header), groups = records[0], records[1:]
    experts_name = _check_header(
        header, header_line, where, num_groups, samples_per_prompt, with_routed_experts, groups_in_file=len(groups)
    )
    samples = []
    fanned_out = "group_sizes" in header
    for (number, record), size in zip(groups, _group_sizes(header, where, samples_per_prompt)):
        try:
            samples += _group_samples(record, size, fanned_out)
        except (KeyError, TypeError, ValueError) as e:
            raise RolloutDataError(f"{where} line {number}: malformed group ({type(e).__name__}: {e})") from None
    if experts_name is not None:
        _load_experts(samples, path.parent / experts_name, where)
    return samples


def check_rollout_data(
    pattern: str, steps: range, num_groups: int, samples_per_prompt: int, with_routed_experts: bool,
    read_samples: bool,
) -> str:
    """Check the files a run replaying `pattern` at `steps` reads, before it starts; returns the report. With
    `read_samples` (the dry-run), each file is read whole as load_rollout_data reads it at its step, one at a time;
    without (the run itself, before its workers start: it reads each file whole at its step anyway), only that each
    is there with a header of the run's batch shape, and its routed experts beside it when replayed."""
    first_steps = {}  # each file -> the first step that reads it (a pattern without {step}: one file, every step)
    for step in steps:
        first_steps.setdefault(rollout_data_path(pattern, step), step)
    for step in first_steps.values():
        if read_samples:
            load_rollout_data(pattern, step, num_groups, samples_per_prompt, with_routed_experts)
        else:
            path, where = _existing_file(pattern, step)
            header_line, header = _first_record(path, where)
            experts_name = _check_header(
                header, header_line, where, num_groups, samples_per_prompt, with_routed_experts
            )
            if experts_name is not None:
                _check_experts_exist(path.parent / experts_name, where)
    files = f"{len(first_steps)} file{'s' if len(first_steps) != 1 else ''}"
    what = "read" if read_samples else "found, their headers checked (each is read whole at its step)"
    experts = ", with routed experts" if with_routed_experts else ""
    return (
        f"{pattern}: {files} {what}, steps {steps.start}-{steps.stop - 1}, {num_groups} groups x "
        f"{samples_per_prompt} samples{experts}"
    )


def _existing_file(pattern: str, step: int) -> tuple[Path, str]:
    """The file of `step` and the words that name it in errors; refused if it is not there."""
    path = rollout_data_path(pattern, step)
    where = f"--load-rollout-data, step {step}: {path}"
    if not path.is_file():
        raise RolloutDataError(f"{where} does not exist (write it with --save-rollout-data {pattern})")
    return path, where


def _json_line(line: str, number: int, where: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise RolloutDataError(f"{where} line {number}: invalid JSON ({e.msg} at column {e.colno})") from None


def _first_record(path: Path, where: str) -> tuple[int, object]:
    """The line number and value of the file's first line that is not blank (its header), reading no further."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                return number, _json_line(line, number, where)
    raise RolloutDataError(f"{where} is empty")


def _check_header(
    header, header_line: int, where: str, num_groups: int, samples_per_prompt: int, with_routed_experts: bool,
    groups_in_file: int | None = None,
) -> str | None:
    """Refuse a header that is not one, of a version this relax cannot read, that miscounts the groups after it
    (`groups_in_file`, when they were read), of another batch shape than the run's, or without routed experts for
    a run that replays them. Returns the routed experts' file name (beside the file) when replayed, else None."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise RolloutDataError(f"{where} line {header_line}: not a {FORMAT} header: {str(header)[:120]}")
    if header.get("version") not in READABLE_VERSIONS:
        raise RolloutDataError(
            f"{where}: format version {header.get('version')!r}; this relax reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    if groups_in_file is not None and header.get("num_groups") != groups_in_file:
        raise RolloutDataError(
            f"{where}: the header says {header.get('num_groups')} groups, the file holds {groups_in_file}"
        )
    shape = (header.get("num_groups"), header.get("samples_per_prompt"))
    if shape != (num_groups, samples_per_prompt):
        raise RolloutDataError(
            f"{where} holds {shape[0]} groups of {shape[1]} samples; this run trains on --rollout-batch-size "
            f"{num_groups} groups of --n-samples-per-prompt {samples_per_prompt}: use the flags the file was saved with"
        )
    if not with_routed_experts:
        return None
    experts_name = header.get("routed_experts")  # absent in version 1
    if not isinstance(experts_name, str):
        raise RolloutDataError(
            f"{where} holds no routed experts (saved by a run without --use-rollout-routing-replay, or in "
            "format version 1), and --use-rollout-routing-replay replays them: save the rollouts again with "
            "--use-rollout-routing-replay, or drop it"
        )
    return experts_name


def _group_sizes(header: dict, where: str, samples_per_prompt: int) -> list[int]:
    """Each group's sample count: the header's "group_sizes" (a custom generate function's fan-out), else
    samples_per_prompt each."""
    if "group_sizes" not in header:
        return [samples_per_prompt] * header["num_groups"]
    sizes = header["group_sizes"]
    if not (isinstance(sizes, list) and len(sizes) == header["num_groups"]
            and all(isinstance(size, int) and size >= samples_per_prompt for size in sizes)):
        raise RolloutDataError(f"{where}: the header's group_sizes {str(sizes)[:120]} are not one count of at least "
                               f"{samples_per_prompt} samples per group of its {header['num_groups']}")
    return sizes


def _load_experts(samples: list[Sample], experts_path: Path, where: str) -> None:
    """Set each sample's routed experts from the safetensors file _experts_file wrote."""
    where = _check_experts_exist(experts_path, where)
    try:
        tensors = safetensors.torch.load_file(experts_path)
    except (OSError, SafetensorError) as e:
        raise RolloutDataError(f"{where} cannot be read ({e})") from None
    names = [str(i) for i in range(len(samples))]
    if set(tensors) != set(names):
        raise RolloutDataError(
            f"{where} hold {len(tensors)} tensors; expected one per sample, named 0..{len(names) - 1}"
        )
    experts = [tensors[name] for name in names]
    unexpected = {str(e.dtype) for e in experts if e.dtype not in STORED_DTYPES}
    if unexpected:
        raise RolloutDataError(f"{where} are {', '.join(sorted(unexpected))}; expected one of {STORED_DTYPES}")
    try:
        check_routed_experts(experts, _token_counts(samples))
    except ValueError as e:
        raise RolloutDataError(f"{where} do not match its samples ({e})") from None
    for sample, sample_experts in zip(samples, experts):
        sample.routed_experts = sample_experts.to(ROUTED_EXPERTS_DTYPE)


def _check_experts_exist(experts_path: Path, where: str) -> str:
    """Refuse routed experts the header names that are not there; returns the words that name them in errors."""
    where = f"{where}: its routed experts {experts_path}"
    if not experts_path.is_file():
        raise RolloutDataError(
            f"{where} do not exist (the header names them): keep them beside the file, as --save-rollout-data "
            "wrote them"
        )
    return where


def _group_samples(record: dict, size: int, fanned_out: bool) -> list[Sample]:
    """The samples of a group of `size`, each knowing its group's size where the step's groups fanned out (else
    --n-samples-per-prompt: Sample.group_size None)."""
    p = record["prompt"]
    prompt = Prompt(
        row=_typed(p, "row", int), token_ids=_int_list(p, "token_ids"), text=_typed(p, "text", str),
        label=p["label"], metadata=_typed(p, "metadata", dict),
    )
    entries = _typed(record, "samples", list)
    if len(entries) != size:
        raise ValueError(f"{len(entries)} samples, the header says {size}")
    samples = []
    for s in entries:
        tokens, logprobs = _int_list(s, "response_token_ids"), _typed(s, "response_logprobs", list)
        if not tokens or len(logprobs) != len(tokens):
            raise ValueError(f"{len(tokens)} response tokens and {len(logprobs)} logprobs (need as many, at least 1)")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in logprobs):
            raise TypeError("response_logprobs must be numbers")
        # Files of versions 1 and 2 hold no loss mask: every response token was trained when they were written.
        loss_mask = _int_list(s, "loss_mask") if "loss_mask" in s else None  # Sample's default: every token
        # Files of versions 1 to 3 hold no prompt ids of a sample's own: it followed the row's.
        own_prompt_ids = _int_list(s, "prompt_token_ids") if s.get("prompt_token_ids") is not None else None
        reward = _typed(s, "reward", (int, float))
        if isinstance(reward, bool) or not math.isfinite(reward):
            raise ValueError(f"reward {reward!r} is not a finite number")
        samples.append(
            Sample(
                prompt, tokens, [float(v) for v in logprobs], _typed(s, "finish_reason", str),
                _typed(s, "response_text", str), float(reward), _typed(s, "reward_failed", bool),
                loss_mask=loss_mask, own_prompt_ids=own_prompt_ids,
                group_size=size if fanned_out else None,
            )
        )
    return samples


def _typed(record: dict, key: str, kind):
    value = record[key]
    if not isinstance(value, kind):
        raise TypeError(f"{key} is {type(value).__name__}, expected {getattr(kind, '__name__', kind)}")
    return value


def _int_list(record: dict, key: str) -> list[int]:
    values = _typed(record, key, list)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError(f"{key} must be a list of integers")
    return values
