"""The Python tool (relax.rollout.tools.PythonTool) in its real sandbox (relax/rollout/tool_sandbox.py): each
call a process of its own in Linux namespaces. What the model's code may do (compute, print, use its scratch
directory) works; what it may not (leave the scratch, reach the network, see a device, undo the sandbox, outrun
its limits, leave a process behind) fails and comes back as failed output with the reason."""

import os
import time
from pathlib import Path

import psutil
import pytest

from relax.rollout.tools import PythonLimits, PythonTool, python_sandbox_problem

SANDBOX_PROBLEM = python_sandbox_problem()
pytestmark = pytest.mark.skipif(SANDBOX_PROBLEM is not None, reason=f"no sandbox here: {SANDBOX_PROBLEM}")
# A call starts a Python process: on CI's two loaded cores that alone has taken more than 3 s.
LIMITS = PythonLimits(timeout_s=10, cpu_seconds=10, memory_bytes=512 << 20, file_bytes=1 << 20, output_chars=1000)


@pytest.fixture(scope="module")
def python():
    return PythonTool(LIMITS)


def test_the_code_runs_and_its_output_comes_back(python):
    code = "import math, sys\nprint(math.factorial(20))\nprint('to stderr', file=sys.stderr)"
    output = python({"code": code})
    assert not output.failed and output.text == "2432902008176640000\nto stderr\n"


def test_an_exception_comes_back_as_the_codes_own_traceback(python):
    output = python({"code": "def f():\n    return 1 / 0\nf()"})
    assert output.failed
    assert output.text.startswith('Traceback (most recent call last):\n  File "<tool>", line 3, in <module>')
    assert "ZeroDivisionError: division by zero" in output.text and "tool_sandbox" not in output.text


def test_the_scratch_directory_is_writable_empty_at_each_call_and_gone_after(python):
    first = python({"code": "import os\nopen('notes.txt', 'w').write('kept?')\nprint(os.getcwd())"})
    assert not first.failed
    scratch = first.text.strip()
    assert not Path(scratch).exists()  # the host's mount point is removed; the files lived in the call's tmpfs
    second = python({"code": "import os\nprint(os.listdir('.'))"})
    assert second.text == "[]\n"


@pytest.mark.parametrize("path", ["/tmp/relax-tool-escape", str(Path.home() / "relax-tool-escape"),
                                  str(Path(__file__).with_name("relax-tool-escape"))])
def test_nothing_outside_the_scratch_directory_can_be_written(python, path):
    output = python({"code": f"open({path!r}, 'w').write('x')"})
    assert output.failed and "Read-only file system" in output.text, output
    assert not os.path.exists(path)


def test_there_is_no_network_and_no_device_but_the_harmless_four(python):
    network = python({"code": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)"})
    assert network.failed and "Network is unreachable" in network.text, network
    devices = python({"code": "import os\nprint(sorted(os.listdir('/dev')))\nopen('/dev/null', 'w').write('x')"})
    assert devices.text == "['null', 'random', 'urandom', 'zero']\n", devices


def test_the_code_cannot_remount_what_the_sandbox_made_read_only(python):
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.mount(None, b'/', None, 32 | 4096, None), ctypes.get_errno())"  # MS_REMOUNT | MS_BIND, rw
    )
    assert python({"code": code}).text == "-1 1\n"  # EPERM: no capability left


@pytest.mark.parametrize("code, reason", [
    ("x = bytearray(1 << 30)", "MemoryError"),
    ("open('big', 'wb').write(b'x' * (2 << 20))", "File too large"),
    ("while True:\n    print('x' * 100)", "[output cut at 1000 characters]"),
    ("import sys\nsys.exit(4)", "[exit status 4]"),
])
def test_a_limit_hit_is_failed_output_saying_which(python, code, reason):
    output = python({"code": code})
    assert output.failed and not output.timed_out and reason in output.text, output
    assert len(output.text) < LIMITS.output_chars + 100


def test_a_call_that_hangs_ends_at_the_wall_clock_limit_with_every_process_it_started(python):
    code = "import subprocess, time\nsubprocess.Popen(['sleep', '1000'])\ntime.sleep(1000)"
    start = time.monotonic()
    output = python({"code": code})
    assert output.failed and output.timed_out and f"[timed out after {LIMITS.timeout_s:g} s]" in output.text
    assert time.monotonic() - start < LIMITS.timeout_s + 5
    sleeping = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "1000"]]
    assert not sleeping, sleeping
