"""Prompt data: rows of a dataset turned into token-id prompts, served in seeded epochs.

Where rows come from: a .jsonl or .parquet file, a directory written by `datasets`' save_to_disk, or a
Hub-style dataset directory (data files under a folder, e.g. data/train-*.parquet, as a dataset downloaded
from the Hub lies on disk; read by `datasets.load_dataset`). A directory with several splits gives its
`train` split.

A row holds a prompt (a string, or a list of chat messages), a label (what the reward compares against)
and, optionally, metadata (a JSON object passed to the reward function; a row without it has none). Keys
are configurable and may be dotted paths into nested fields (`reward_model.ground_truth`, as DAPO-Math-17k
stores its answers).

The chat template (when on) renders each prompt with the tokenizer's template: a string becomes one user
message, a system prompt (if given) is put first unless the row's messages start with their own, and the
template's own options (Qwen3's `enable_thinking`) pass through chat_template_kwargs; with tools (--tools) the
template renders their descriptions too (its `tools`: a template that does not read them is refused). A list of
messages needs the chat template: with it off, such a row is refused rather than flattened into text in a format
the model was not trained on.

Every row is checked and tokenized when the file is loaded, so a bad row fails at start with the file,
the row number and what is wrong, not halfway through training. With `skip_bad_rows` such rows are
counted and listed in the load report instead. Prompts over `max_prompt_tokens` are filtered (and
counted) separately: they are not errors.

PromptLoader serves the prompts in epochs, each a permutation seeded by (seed, epoch); prompts a rollout took but
did not use (over-sampling's aborted groups) are put back and served first, with what their responses had generated
under partial rollout (relax.rollout.partial.GroupSoFar). Its state_dict (position, the prompts put back and their
responses so far, seed, shuffle, prompt count) is all a checkpoint needs to resume exactly where it stopped.
"""

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax.rollout.partial import GroupSoFar

MAX_REPORTED_BAD_ROWS = 20


class PromptDataError(ValueError):
    """A data file or one of its rows cannot be used; the message names the file, the row and the fix."""


@dataclass(frozen=True)
class PromptDataConfig:
    path: str
    prompt_key: str = "prompt"  # a string, or a list of {"role", "content"} messages
    label_key: str | None = "label"  # None: rows carry no label
    metadata_key: str | None = None  # None: no metadata; rows may lack it; where present, a JSON object
    apply_chat_template: bool = True  # wrap the prompt as chat and render it with the tokenizer's template
    chat_template_kwargs: dict = field(default_factory=dict)  # the template's own options: {"enable_thinking": False}
    system_prompt: str | None = None  # prepended as a system message when the chat template is applied
    max_prompt_tokens: int | None = None  # longer prompts are filtered out (and counted)
    skip_bad_rows: bool = False  # count and report bad rows instead of failing on the first one
    # The tools the model may call (--tools), as the chat template takes them (relax.rollout.tools.tool_schema)
    tools: tuple[dict, ...] = ()


@dataclass
class Prompt:
    row: int  # 1-based row number in the file (the line number for jsonl)
    token_ids: list[int]
    text: str  # the prompt as the model sees it (chat template applied)
    label: Any = None
    metadata: dict = field(default_factory=dict)


@dataclass
class LoadReport:
    path: str
    rows: int = 0
    kept: int = 0
    filtered_too_long: int = 0
    bad_rows: int = 0
    bad_row_reasons: list[str] = field(default_factory=list)  # the first MAX_REPORTED_BAD_ROWS

    def summary(self) -> str:
        text = (
            f"{self.path}: {self.rows} rows, {self.kept} prompts kept, "
            f"{self.filtered_too_long} over the prompt length limit, {self.bad_rows} bad rows skipped"
        )
        if self.bad_row_reasons:
            text += "\n  " + "\n  ".join(self.bad_row_reasons)
            if self.bad_rows > len(self.bad_row_reasons):
                text += f"\n  ... and {self.bad_rows - len(self.bad_row_reasons)} more"
        return text


class _BadRow(Exception):
    pass


TRAIN_SPLIT = "train"


def _read_rows(path: Path):
    """Yield (row number, row dict or _BadRow) for every row of a jsonl or parquet file or a dataset directory."""
    if path.is_dir():
        yield from enumerate(_dataset_directory(path), start=1)
        return
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        yield from _jsonl_rows(path)
    elif suffix == ".parquet":
        import datasets

        yield from enumerate(_read_with_datasets(path, "a parquet file", datasets.Dataset.from_parquet), start=1)
    else:
        raise PromptDataError(
            f"{path}: unsupported data file type {suffix!r}; use a .jsonl or .parquet file or a dataset directory"
        )


def _jsonl_rows(path: Path):
    try:
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    yield line_number, _BadRow(f"invalid JSON ({e.msg} at column {e.colno})")
                    continue
                if not isinstance(row, dict):
                    yield line_number, _BadRow(f"expected a JSON object, got {type(row).__name__}")
                    continue
                yield line_number, row
    except UnicodeDecodeError as e:
        raise PromptDataError(f"{path}: not UTF-8 text ({e}); save it as UTF-8") from None
    except OSError as e:
        raise PromptDataError(f"{path}: cannot be read ({e.strerror})") from None


def _dataset_directory(path: Path):
    """The rows of a save_to_disk directory or a Hub-style one: its only split, or its train split."""
    import datasets

    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():  # what save_to_disk writes
        dataset = _read_with_datasets(path, "a saved dataset", datasets.load_from_disk)
    else:
        dataset = _read_with_datasets(path, "a dataset directory", datasets.load_dataset)
    if not isinstance(dataset, datasets.DatasetDict):
        return dataset
    if len(dataset) == 1:
        return next(iter(dataset.values()))
    if TRAIN_SPLIT in dataset:
        return dataset[TRAIN_SPLIT]
    raise PromptDataError(
        f"{path}: a dataset with splits {', '.join(dataset)} and none named {TRAIN_SPLIT!r}; point --prompt-data at "
        "the split's data file or its directory"
    )


def _read_with_datasets(path: Path, kind: str, read):
    """read(str(path)), with `datasets`' and pyarrow's refusals turned into a PromptDataError naming the path."""
    import datasets

    try:
        return read(str(path))
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        raise PromptDataError(f"{path}: cannot be read as {kind} ({type(e).__name__}: {e})") from None


def _lookup(row: dict, key: str):
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            available = ", ".join(sorted(row)) if isinstance(row, dict) else "none"
            raise _BadRow(f"key {key!r} missing (row has keys: {available})")
        value = value[part]
    return value


def _has_key(row: dict, key: str) -> bool:
    try:
        _lookup(row, key)
    except _BadRow:
        return False
    return True


def _messages(prompt, config: PromptDataConfig) -> list[dict]:
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        if not prompt:
            raise _BadRow(f"{config.prompt_key!r} is an empty list of chat messages")
        for i, message in enumerate(prompt):
            if not (isinstance(message, dict) and isinstance(message.get("content"), str) and "role" in message):
                raise _BadRow(
                    f"{config.prompt_key!r} message {i} must be an object with 'role' and string 'content', "
                    f"got {message!r:.80}"
                )
        messages = list(prompt)
    else:
        raise _BadRow(
            f"{config.prompt_key!r} must be a string or a list of chat messages, got {type(prompt).__name__}"
        )
    if config.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": config.system_prompt}, *messages]
    return messages


def _prompt_text(prompt, config: PromptDataConfig, tokenizer) -> str:
    if config.apply_chat_template:
        return tokenizer.apply_chat_template(
            _messages(prompt, config), tools=list(config.tools) or None, tokenize=False, add_generation_prompt=True,
            **config.chat_template_kwargs,
        )
    if not isinstance(prompt, str):
        raise _BadRow(
            f"{config.prompt_key!r} is a list of chat messages but the chat template is off; "
            "turn on apply_chat_template (--apply-chat-template) or store plain-text prompts"
        )
    return prompt


def _check_chat_template(config: PromptDataConfig, tokenizer) -> None:
    """The template must exist when it is applied, and read every option given to it (Jinja ignores a variable
    the template never mentions, so a misspelt or foreign option would change nothing, silently)."""
    if not config.apply_chat_template:
        return
    template = tokenizer.chat_template
    if not template:
        raise PromptDataError(
            f"{config.path}: the tokenizer has no chat template to apply; drop --apply-chat-template or use a "
            "checkpoint whose tokenizer_config.json has one"
        )
    text = template if isinstance(template, str) else " ".join(template.values())  # named templates
    if config.tools and not re.search(r"\btools\b", text):
        raise PromptDataError(
            f"{config.path}: --tools, but the tokenizer's chat template does not read `tools`, so the prompts would "
            "not show the model its tools; use a checkpoint whose chat template renders tools (Qwen's)"
        )
    unread = [name for name in config.chat_template_kwargs if not re.search(rf"\b{re.escape(name)}\b", text)]
    if unread:
        raise PromptDataError(
            f"--apply-chat-template-kwargs: the tokenizer's chat template does not read {', '.join(unread)}, "
            "so it would change nothing; check the spelling against the template in tokenizer_config.json"
        )


def _parse_row(row: dict, config: PromptDataConfig, tokenizer, row_number: int) -> Prompt:
    text = _prompt_text(_lookup(row, config.prompt_key), config, tokenizer)
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not token_ids:
        raise _BadRow(f"{config.prompt_key!r} tokenizes to no tokens (text {text!r:.80})")
    label = _lookup(row, config.label_key) if config.label_key is not None else None
    return Prompt(row=row_number, token_ids=list(token_ids), text=text, label=label, metadata=_metadata(row, config))


def _metadata(row: dict, config: PromptDataConfig) -> dict:
    """The row's metadata object; a row without the key, or with null there (how a column with gaps reads from
    parquet), has none."""
    if config.metadata_key is None or not _has_key(row, config.metadata_key):
        return {}
    metadata = _lookup(row, config.metadata_key)
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise _BadRow(f"{config.metadata_key!r} must be an object, got {type(metadata).__name__}")
    return metadata


def load_prompts(config: PromptDataConfig, tokenizer) -> tuple[list[Prompt], LoadReport]:
    """Read, check and tokenize every row of config.path. Raises PromptDataError on the first bad row
    unless config.skip_bad_rows; then bad rows are counted in the report."""
    path = Path(config.path)
    if not path.exists():
        raise PromptDataError(f"prompt data {path} does not exist")
    _check_chat_template(config, tokenizer)
    report = LoadReport(path=str(path))
    prompts = []
    for row_number, row in _read_rows(path):
        report.rows += 1
        try:
            if isinstance(row, _BadRow):
                raise row
            prompt = _parse_row(row, config, tokenizer, row_number)
        except _BadRow as e:
            reason = f"{path} row {row_number}: {e}"
            if not config.skip_bad_rows:
                raise PromptDataError(f"{reason} (pass skip_bad_rows / --skip-bad-rows to skip such rows)") from None
            report.bad_rows += 1
            if len(report.bad_row_reasons) < MAX_REPORTED_BAD_ROWS:
                report.bad_row_reasons.append(reason)
            continue
        if config.max_prompt_tokens is not None and len(prompt.token_ids) > config.max_prompt_tokens:
            report.filtered_too_long += 1
            continue
        prompts.append(prompt)
    report.kept = len(prompts)
    if not prompts:
        raise PromptDataError(f"no usable prompts in {path}: {report.summary()}")
    return prompts, report


@dataclass(frozen=True)
class LoaderPosition:
    epoch: int = 0
    index: int = 0  # prompts of this epoch already served


class PromptLoader:
    """Serves prompts in epochs; each epoch's order is a permutation seeded by (seed, epoch). Prompts put back
    (put_back) are served before the epoch goes on, in the order they were put back.

    Its position and the prompts put back are all the state there is: a loader built with the same prompts, seed,
    a saved position and the same prompts put back serves exactly what the original would have served next.
    """

    def __init__(
        self,
        prompts: list[Prompt],
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = None,  # None: endless
        position: LoaderPosition = LoaderPosition(),
        put_back: list[int] = (),  # indices into `prompts` of prompts put back, served first
        put_back_progress: list[GroupSoFar | None] | None = None,  # what each one's responses generated (partial)
    ):
        if not prompts:
            raise PromptDataError("PromptLoader needs at least one prompt")
        if not 0 <= position.index < len(prompts):
            raise PromptDataError(
                f"resume position index {position.index} is outside the {len(prompts)} prompts of an epoch; "
                "was the checkpoint made with different data or filters?"
            )
        self.prompts = prompts
        self.seed = seed
        self.shuffle = shuffle
        self.num_epochs = num_epochs
        self.position = position
        self._index = {id(prompt): index for index, prompt in enumerate(prompts)}
        if not all(0 <= index < len(prompts) for index in put_back):
            raise PromptDataError(
                f"the prompts put back {list(put_back)} are not all among the {len(prompts)} prompts; was the "
                "checkpoint made with different data or filters?"
            )
        self._put_back: list[int] = list(put_back)
        self._progress: list[GroupSoFar | None] = list(put_back_progress or [None] * len(self._put_back))
        self._order_epoch = None
        self._order: list[int] = []

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            order = list(range(len(self.prompts)))
            if self.shuffle:
                random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    @property
    def exhausted(self) -> bool:
        return not self._put_back and self.num_epochs is not None and self.position.epoch >= self.num_epochs

    def put_back(self, prompts: list[Prompt], progress: list[GroupSoFar | None] | None = None) -> None:
        """Prompts taken but not used (a rollout's aborted groups): the next take serves them first, in this order,
        each with what its responses had generated (`progress`, partial rollout; None: nothing)."""
        # New lists, not in place: a copy of the loader (copy.copy, the state a checkpoint saves) keeps its own.
        self._put_back = self._put_back + [self._index[id(prompt)] for prompt in prompts]
        self._progress = self._progress + (progress or [None] * len(prompts))

    def take(self, count: int) -> list[Prompt]:
        """The next `count` prompts: those put back first, then the epochs', continuing into the next epoch as
        needed; fewer only when the last epoch ends. A prompt put back with its responses so far is not served
        here (take_with_progress serves them): it would lose what they generated."""
        if any(progress is not None for progress in self._progress[:count]):
            raise RuntimeError("prompts put back with their partial responses must be taken with take_with_progress")
        return [prompt for prompt, _ in self.take_with_progress(count)]

    def take_with_progress(self, count: int) -> list[tuple[Prompt, GroupSoFar | None]]:
        """take's prompts, each with (a copy of) what its responses had generated when it was put back (None:
        nothing)."""
        batch = [
            (self.prompts[index], None if progress is None else progress.copy())
            for index, progress in zip(self._put_back[:count], self._progress)
        ]
        self._put_back, self._progress = self._put_back[count:], self._progress[count:]
        epoch, index = self.position.epoch, self.position.index
        while len(batch) < count and not (self.num_epochs is not None and epoch >= self.num_epochs):
            order = self._epoch_order(epoch)
            step = min(count - len(batch), len(order) - index)
            batch.extend((self.prompts[i], None) for i in order[index : index + step])
            index += step
            if index == len(order):
                epoch, index = epoch + 1, 0
        self.position = LoaderPosition(epoch, index)
        return batch

    def state_dict(self) -> dict:
        """Plain JSON values: the position, the prompts put back, and what fixes each epoch's order (seed, shuffle,
        prompt count)."""
        return {
            "epoch": self.position.epoch,
            "index": self.position.index,
            "put_back": list(self._put_back),
            "put_back_progress": [None if group is None else group.state_dict() for group in self._progress],
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.prompts),
        }

    @classmethod
    def from_state_dict(cls, prompts: list[Prompt], state: dict, num_epochs: int | None = None) -> "PromptLoader":
        """A loader that serves what the saved one would have served next. The prompts must be the same
        (same file and filters): the permutation is over prompt indices."""
        if state["num_prompts"] != len(prompts):
            raise PromptDataError(
                f"the saved loader served {state['num_prompts']} prompts, this run has {len(prompts)}; resume with "
                "the same --prompt-data and the same filters (--max-prompt-length, --skip-bad-rows)"
            )
        return cls(
            prompts,
            seed=state["seed"],
            shuffle=state["shuffle"],
            num_epochs=num_epochs,
            position=LoaderPosition(state["epoch"], state["index"]),
            put_back=state.get("put_back", []),  # absent from older checkpoints
            put_back_progress=[
                None if group is None else GroupSoFar.from_state_dict(group)
                for group in state.get("put_back_progress", [None] * len(state.get("put_back", [])))
            ],
        )
