"""What a person sees while `relax train` runs, and the run's log file, which holds every line.

While a RunConsole is open (the `relax train` driver opens one around the run), the terminal shows:
- relax's own lines: what relax's code in the driver writes through say() (the prompt and rollout data reports,
  the run summary, the `relax train: ...` messages), the progress bar (progress_stream()), and the lines a worker writes
  that begin with "relax" (relax's code in the actors writes its lines so);
- upstream errors: Python tracebacks, whole (chained ones, the exception's message of several lines and its notes:
  UpstreamFilter says where one ends), and lines holding a level word ERROR, CRITICAL or FATAL;
- with `verbose`, every line; with `shown_actors`, every line of those actors (--engine-logs: the SGLang engines).
Every line but the progress bar also goes to <output-dir>/run.log (RUN_LOG_FILE).

Upstream lines are whatever reaches the driver's sys.stdout and sys.stderr: the driver's own warnings and log lines
(Ray's, transformers') and, above all, the workers' output, which Ray relays there as "(ActorClass pid=N) line":
SGLang's, Megatron's and fla's warnings and log lines from the actors and from the scheduler and detokenizer
processes SGLang spawns (they write into their actor's output). The filter sits here, where everything arrives,
rather than in each worker: SGLang's spawned processes set up their logging and warnings afresh, out of relax's
reach, and each worker's own log file (which relax names when a worker dies) keeps all its output as it is.
Upstream lines carry no reliable level (SGLang's format has none, warnings and progress bars neither), so the
choice is errors or everything (--verbose), not a level.
"""

import logging
import re
import sys
import threading
from pathlib import Path
from typing import TextIO

RUN_LOG_FILE = "run.log"
TRACEBACK_START = "Traceback (most recent call last):"
# The line between the parts of a chained traceback (Python writes a blank line before and after it).
CHAIN_LINKS = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
# How a new log record begins: SGLang's "[2026-12-02 02:55:09] ...", Ray's and Python logging's
# "2026-12-02 03:04:48,963 ...", Ray's core "[2026-12-02 03:04:48,963 E 12 34] ...".
LOG_RECORD_START = re.compile(r"\[?\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}")
# Unindented lines after the exception's line that still count as its message and notes: relax's and upstream's
# messages of several lines run to a few; more is rather the process going on after a logged exception.
MESSAGE_LINES_MAX = 20
ERROR_WORD = re.compile(r"\b(ERROR|CRITICAL|FATAL)\b")
RELAX_MARK = "relax"  # how every line relax's code writes in a worker begins
# Ray's prefix of a line relayed from a worker: "(EngineWorker pid=123)" or "(pid=123, ip=10.0.0.2)", maybe coloured.
_COLOUR = r"(?:\x1b\[[0-9;]*m)?"
WORKER_PREFIX = re.compile(rf"{_COLOUR}\((?P<actor>[\w.]+ )?pid=[^)]*\){_COLOUR} ?")

_open_console: "RunConsole | None" = None


def say(text: str, error: bool = False) -> None:
    """Write one of relax's own lines (or a block of them): to the terminal and run.log while a RunConsole is open,
    else to stdout (stderr when `error`)."""
    if _open_console is None:
        print(text, file=sys.stderr if error else sys.stdout, flush=True)
    else:
        _open_console.write_relax_line(text, error)


def progress_stream() -> TextIO:
    """Where the progress bar draws: the terminal while a RunConsole is open (not run.log: it redraws its line),
    else sys.stderr."""
    return _open_console.terminal_err if _open_console is not None else sys.stderr


def worker_line(line: str) -> tuple[str | None, str] | None:
    """(actor class name or None, the worker's own text) of a line Ray relayed from a worker; None for others."""
    match = WORKER_PREFIX.match(line)
    if match is None:
        return None
    return (match["actor"] or "").strip() or None, line[match.end():]


class UpstreamFilter:
    """Decides, line by line, which upstream lines reach the terminal. Tracebacks are followed per source (the
    driver, or each worker process), as Ray interleaves the workers' lines.

    A source's traceback runs from its line holding "Traceback (most recent call last):" through its frames (the
    indented lines), the exception's line (the first unindented one) and the lines after that, which are the
    exception's message and notes (and, for an error a Ray worker relays, that worker's stack) and, in a chained
    traceback, the blank line, the CHAIN_LINKS line and the blank line before the next "Traceback ...". It ends at a
    line that begins something else (that line is then judged on its own):
    - a line of relax's, or a new log record (a line beginning with a date: LOG_RECORD_START);
    - after a blank line, any line but a blank one, a CHAIN_LINKS line or a new traceback;
    - past the exception's line, the unindented line after MESSAGE_LINES_MAX of them (indented lines, such as a
      relayed stack's frames, are not counted): output that goes on and on is not a message; run.log keeps it.
    A blank line that ends a traceback is shown with it (a line is judged before the next one arrives)."""

    def __init__(self, verbose: bool = False, shown_actors: tuple[str, ...] = ()):
        self.verbose = verbose
        self.shown_actors = set(shown_actors)
        self._tracebacks: dict[str, _OpenTraceback] = {}  # by source: the tracebacks being written

    def shows(self, line: str) -> bool:
        relayed = worker_line(line)
        if relayed is None:
            source, actor, text = "", None, line
        else:
            actor, text = relayed
            source = line[: len(line) - len(text)]
            if text.startswith(RELAX_MARK):
                self.relax_line_written(source)
                return True
        in_error = self._is_error(source, text)
        return self.verbose or in_error or actor in self.shown_actors

    def relax_line_written(self, source: str = "") -> None:
        """A line of relax's from `source` ends its traceback (the driver's lines come through say(), not shows())."""
        self._tracebacks.pop(source, None)

    def _is_error(self, source: str, text: str) -> bool:
        if TRACEBACK_START in text:
            self._tracebacks[source] = _OpenTraceback()
            return True
        traceback = self._tracebacks.get(source)
        if traceback is not None and traceback.goes_on(text):
            return True
        self._tracebacks.pop(source, None)
        return ERROR_WORD.search(text) is not None


class _OpenTraceback:
    """Where a source is in the traceback it is writing (the rule is UpstreamFilter's)."""

    def __init__(self):
        self.past_frames = False  # the exception's line was written
        self.after_blank = False  # the last line was blank
        self.message_lines = 0  # unindented lines past the exception's line

    def goes_on(self, text: str) -> bool:
        """Whether `text`, the source's next line (not a new traceback's first), is part of this traceback."""
        indented = text[:1].isspace()
        if not self.past_frames:
            self.past_frames = not indented
            return True
        if self.after_blank and text.strip() not in ("", *CHAIN_LINKS):
            return False
        if LOG_RECORD_START.match(text):
            return False
        if not indented:
            self.message_lines += 1
            if self.message_lines > MESSAGE_LINES_MAX:
                return False
        self.after_blank = not text.strip()
        return True


class _UpstreamStream:
    """Stands in for sys.stdout or sys.stderr: complete lines go to run.log, and to the terminal when the filter
    shows them."""

    def __init__(self, console: "RunConsole", terminal: TextIO):
        self._console, self._terminal, self._partial = console, terminal, ""

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self._console.write_upstream_line(line, self._terminal)
        return len(text)

    def flush(self) -> None:
        self._terminal.flush()

    def close_partial(self) -> None:
        if self._partial:
            self._console.write_upstream_line(self._partial, self._terminal)
            self._partial = ""

    def fileno(self) -> int:
        return self._terminal.fileno()

    def isatty(self) -> bool:
        return self._terminal.isatty()

    @property
    def encoding(self) -> str:
        return self._terminal.encoding


class RunConsole:
    """The run's console (see the module's description) for a `with` block: sys.stdout and sys.stderr filtered,
    run.log written in `output_dir` (appended to with `append`: a resumed run continues its record)."""

    def __init__(self, output_dir: str | Path, verbose: bool = False, shown_actors: tuple[str, ...] = (),
                 append: bool = False):
        self.log_path = Path(output_dir) / RUN_LOG_FILE
        self._filter = UpstreamFilter(verbose, shown_actors)
        self._append = append
        self._lock = threading.Lock()  # Ray relays the workers' lines from a thread of its own

    def __enter__(self) -> "RunConsole":
        global _open_console
        if _open_console is not None:
            raise RuntimeError("RunConsole: a run's console is already open")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("a" if self._append else "w")
        self.terminal_out, self.terminal_err = sys.stdout, sys.stderr
        sys.stdout = _UpstreamStream(self, self.terminal_out)
        sys.stderr = _UpstreamStream(self, self.terminal_err)
        # Log handlers made before now (Ray's, at its import) hold the terminal's streams themselves.
        self._repointed = _point_handlers(
            {id(self.terminal_out): sys.stdout, id(self.terminal_err): sys.stderr}
        )
        _open_console = self
        return self

    def __exit__(self, *exc) -> None:
        global _open_console
        _open_console = None
        for stream in (sys.stdout, sys.stderr):
            stream.close_partial()
        sys.stdout, sys.stderr = self.terminal_out, self.terminal_err
        for handler, stream in self._repointed:
            handler.setStream(stream)
        self._log.close()

    def write_relax_line(self, text: str, error: bool) -> None:
        terminal = self.terminal_err if error else self.terminal_out
        with self._lock:
            self._filter.relax_line_written()
            terminal.write(text + "\n")
            terminal.flush()
            self._log.write(text + "\n")
            self._log.flush()

    def write_upstream_line(self, line: str, terminal: TextIO) -> None:
        with self._lock:
            self._log.write(line + "\n")
            self._log.flush()
            if self._filter.shows(line):
                terminal.write(line + "\n")
                terminal.flush()


def _point_handlers(streams: dict[int, TextIO]) -> list[tuple[logging.StreamHandler, TextIO]]:
    """Point every logging StreamHandler that writes to one of the streams (by id) at its stand-in; returns
    (handler, former stream) pairs to undo it."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    handlers = {handler for logger in loggers for handler in getattr(logger, "handlers", ())}
    repointed = []
    for handler in handlers:
        if isinstance(handler, logging.StreamHandler) and id(handler.stream) in streams:
            repointed.append((handler, handler.setStream(streams[id(handler.stream)])))
    return repointed
