"""The run's console (relax.console): relax's lines and upstream errors on the terminal, every line in run.log.
The worker lines below are spelt as Ray relays them to the driver (Ray 2.60: a coloured "(Class pid=N)" prefix)."""

import logging
import sys
import traceback
import warnings

import pytest

from relax.console import MESSAGE_LINES_MAX, RUN_LOG_FILE, RunConsole, UpstreamFilter, say, worker_line

CYAN, RESET = "\x1b[36m", "\x1b[0m"


def relayed(actor: str, pid: int, text: str) -> str:
    return f"{CYAN}({actor} pid={pid}){RESET} {text}"


ENGINE_WARNING = [
    relayed("EngineWorker", 7, ".../sglang/srt/layers/quantization/awq/awq.py:53: UserWarning: Only CUDA, HIP and XPU "
            "support AWQ currently."),
    relayed("EngineWorker", 7, '  warnings.warn(f"Only CUDA, HIP and XPU support AWQ currently.")'),
    relayed("EngineWorker", 7, "[2026-12-02 02:55:05] Ignore import error when loading sglang.srt.models.inkling: "
            "No module named 'cutlass'"),
]
ENGINE_TRACEBACK = [
    relayed("EngineWorker", 7, "[2026-12-02 02:55:09] Scheduler hit an exception: Traceback (most recent call last):"),
    relayed("EngineWorker", 7, '  File ".../scheduler.py", line 3, in run'),
    relayed("EngineWorker", 7, "    self.step()"),
    relayed("EngineWorker", 7, "RuntimeError: out of memory"),
]


def test_a_relayed_line_names_its_actor_and_text():
    assert worker_line(relayed("EngineWorker", 7, "hello")) == ("EngineWorker", "hello")
    assert worker_line("(pid=12, ip=10.0.0.2) hello") == (None, "hello")
    assert worker_line("relax: 0/5") is None


def test_upstream_warnings_are_hidden_and_errors_shown_whole():
    shown = UpstreamFilter()
    assert [shown.shows(line) for line in ENGINE_WARNING] == [False] * 3
    assert [shown.shows(line) for line in ENGINE_TRACEBACK] == [True] * 4
    assert not shown.shows(ENGINE_WARNING[2])  # a new log record ended the traceback
    assert shown.shows("2026-12-02 03:04:48,963\tERROR worker.py:2038 -- Unhandled error")
    assert not shown.shows("2026-12-02 03:04:48,963\tINFO worker.py:2038 -- Started a local Ray instance.")


def test_tracebacks_are_followed_per_worker_process():
    shown = UpstreamFilter()
    assert shown.shows(ENGINE_TRACEBACK[0])
    assert not shown.shows(relayed("TrainWorker", 8, "a plain line of another process"))
    assert shown.shows(ENGINE_TRACEBACK[1])


def chained_traceback() -> list[str]:
    """The lines Python writes for an exception raised while handling one that has a cause, a message of several
    lines and a note: a traceback in three parts (Python 3.11 marks the failing expression with "~~^^^^")."""

    def push_weights():
        try:
            {}["layers.0.weight"]
        except KeyError as missing:
            error = RuntimeError("the engine refused the update:\n  layers.0.weight: not sent\nsee the engine's log")
            error.add_note("while pushing step 3's weights")
            raise error from missing

    try:
        try:
            push_weights()
        except RuntimeError:
            raise ValueError("the step failed")
    except ValueError as error:
        return "".join(traceback.format_exception(error)).splitlines()


def test_a_chained_traceback_is_shown_whole_with_its_messages_and_notes():
    lines = chained_traceback()
    for text in ("~~^^^^", "The above exception was the direct cause", "During handling of the above exception",
                 "  layers.0.weight: not sent", "see the engine's log", "while pushing step 3's weights",
                 "ValueError: the step failed"):
        assert any(text in line for line in lines), text
    for relay in (lambda text: text, lambda text: relayed("TrainWorker", 8, text)):  # the driver's, a worker's
        shown = UpstreamFilter()
        assert all(shown.shows(relay(line)) for line in lines)
        assert not shown.shows(relay("[2026-12-02 02:55:09] Received sigquit from a child process."))
        assert shown.shows(relay(lines[0]))
        assert all(shown.shows(relay(line)) for line in lines[1:])
        assert shown.shows(relay(""))  # shown before it is known to end the traceback
        assert not shown.shows(relay("UserWarning: Apex is not installed."))


def test_a_traceback_is_followed_through_another_workers_lines_and_ends_at_a_line_of_relax():
    lines = chained_traceback()
    shown = UpstreamFilter()
    for line in lines:
        assert shown.shows(relayed("TrainWorker", 8, line))
        assert not shown.shows(relayed("EngineWorker", 7, "Prefill batch, #new-seq: 8"))
    assert shown.shows(relayed("TrainWorker", 8, "relax: rank 0 stops"))
    assert not shown.shows(relayed("TrainWorker", 8, "Megatron: a plain line"))


def test_a_message_that_does_not_end_is_cut_after_its_most_lines():
    shown = UpstreamFilter()
    assert all(shown.shows(line) for line in ENGINE_TRACEBACK)
    going_on = [relayed("EngineWorker", 7, f"plain output {n}") for n in range(MESSAGE_LINES_MAX + 2)]
    assert [shown.shows(line) for line in going_on] == [True] * MESSAGE_LINES_MAX + [False] * 2
    # Indented lines (a stack that the message carries) are not counted.
    assert all(shown.shows(line) for line in ENGINE_TRACEBACK)
    assert all(shown.shows(relayed("EngineWorker", 7, "  File \"x.py\", line 1, in f")) for _ in range(50))
    assert shown.shows(relayed("EngineWorker", 7, "RuntimeError: the remote one"))


def test_relax_lines_of_workers_verbose_and_shown_actors():
    assert UpstreamFilter().shows(relayed("TrainWorker", 8, "relax: /model: vision tower kept as it is"))
    assert all(UpstreamFilter(verbose=True).shows(line) for line in ENGINE_WARNING)
    engine_logs = UpstreamFilter(shown_actors=("EngineWorker",))
    assert engine_logs.shows(relayed("EngineWorker", 7, "[2026-12-02] Prefill batch, #new-seq: 8, #cached-token: 0"))
    assert not engine_logs.shows(relayed("TrainWorker", 8, "UserWarning: Apex is not installed."))


def test_the_console_keeps_every_line_in_run_log_and_shows_relax_lines_and_errors(tmp_path, capsys):
    made_before = logging.StreamHandler(sys.stderr)  # as Ray's handler is, at its import
    logger = logging.getLogger("upstream.library")
    logger.addHandler(made_before)
    logger.propagate = False
    try:
        with RunConsole(tmp_path, verbose=False):
            say("relax: prompt data: 8 rows")
            # What warnings.showwarning writes (pytest records warnings instead of letting them be shown).
            sys.stderr.write(warnings.formatwarning("Apex is not installed", UserWarning, "backends.py", 21))
            logger.warning("Started a local Ray instance.")
            print(relayed("EngineWorker", 7, "Ignore import error when loading sglang.srt.models.grok"))
            print("\n".join(ENGINE_TRACEBACK), file=sys.stderr)
            say("relax train: the engine failed", error=True)
    finally:
        logger.removeHandler(made_before)
    assert made_before.stream is sys.stderr  # given back
    terminal = capsys.readouterr()
    assert terminal.out == "relax: prompt data: 8 rows\n"
    assert terminal.err == "\n".join([*ENGINE_TRACEBACK, "relax train: the engine failed"]) + "\n"
    log = (tmp_path / RUN_LOG_FILE).read_text()
    for text in ("relax: prompt data", "UserWarning: Apex is not installed", "Started a local Ray instance.",
                 "Ignore import error", "RuntimeError: out of memory", "relax train: the engine failed"):
        assert text in log, text


def test_a_resumed_run_appends_to_run_log_and_a_new_one_replaces_it(tmp_path):
    for append, text in ((False, "first"), (True, "resumed")):
        with RunConsole(tmp_path, append=append):
            say(text)
    assert (tmp_path / RUN_LOG_FILE).read_text() == "first\nresumed\n"
    with RunConsole(tmp_path):
        say("new")
    assert (tmp_path / RUN_LOG_FILE).read_text() == "new\n"


def test_one_console_at_a_time(tmp_path):
    with RunConsole(tmp_path / "a"):
        with pytest.raises(RuntimeError, match="already open"):
            RunConsole(tmp_path / "b").__enter__()
