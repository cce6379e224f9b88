"""The sandbox: results, limits, and containment of hostile programs.

Each containment case is checked twice where it can be: with the audit hook (the default,
available everywhere) and without it, which tests the OS layers alone -- skipped, with the
reason, where this machine lacks the layer that case needs."""

import ast
import dataclasses
import glob
import importlib.util
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import hypothesis
import hypothesis.strategies as st
import pytest

from jaxrl_llm.rewards import sandbox
from jaxrl_llm.rewards.sandbox import ExecutionResult, SandboxLimits, run_many, run_python

FAST = SandboxLimits(timeout=5.0, cpu_seconds=5, memory_mb=256)
NO_HOOK = SandboxLimits(timeout=5.0, cpu_seconds=5, memory_mb=256, audit_hook=False)


@pytest.fixture(scope="module")
def layers() -> frozenset[str]:
    """The protections this machine gives without the audit hook."""
    result = run_python("pass", limits=NO_HOOK)
    assert result.passed, result
    return frozenset(result.protections)


def need(layers, *any_of):
    if not set(any_of) & layers:
        pytest.skip(f"needs one of {any_of}; active here: {sorted(layers)}")


def running(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker`` (zombies have none)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


@pytest.fixture
def private_tmp(monkeypatch):
    """A temp root of this test's own (world-traversable, like /tmp), so sandboxes that
    other xdist workers run at the same time do not show up in it."""
    base = tempfile.mkdtemp(prefix="jaxrl-sandbox-test-")
    os.chmod(base, 0o755)
    monkeypatch.setattr(tempfile, "tempdir", base)
    yield base
    os.rmdir(base)  # fails if a working directory leaked


def workdirs(base: str) -> list[str]:
    return glob.glob(os.path.join(base, "jaxrl-sandbox-*"))


# ------------------------------------------------------------------------ results


def test_passing_program():
    result = run_python("import math\nprint(math.factorial(5))", limits=FAST)
    assert isinstance(result, ExecutionResult)
    assert (result.status, result.returncode, result.stdout, result.completed) == ("passed", 0, "120\n", True)
    assert result.passed and 0 < result.seconds < 5
    assert {"session", "rlimits", "clean_env", "private_tmpdir", "audit_hook"} <= set(result.protections)


@pytest.mark.parametrize(
    "source, error",
    [("assert 1 == 2", "AssertionError"), ("def f(:\n  pass", "SyntaxError"), ("raise KeyError('k')", "KeyError")],
)
def test_failing_program(source, error):
    result = run_python(source, limits=FAST)
    assert (result.status, result.returncode, result.passed) == ("failed", 1, False)
    assert error in result.stderr and "solution.py" in result.stderr


@pytest.mark.parametrize("exit_call", ["import sys; sys.exit(0)", "import os; os._exit(0)"])
def test_exit_before_the_end_is_not_a_pass(exit_call):
    # The reward-hacking shortcut: leave with status 0 before the appended tests run.
    result = run_python(f"{exit_call}\nassert False, 'the tests'", limits=FAST)
    assert (result.status, result.returncode, result.completed) == ("failed", 0, False)


def test_program_runs_in_a_private_writable_directory_that_is_removed(private_tmp):
    source = "import os, tempfile\nopen('a.txt', 'w').write('hi')\ntempfile.mkstemp()\nprint(os.getcwd())"
    result = run_python(source, limits=FAST)
    assert result.passed, result.stderr
    workdir = result.stdout.strip()
    assert os.path.basename(workdir).startswith("jaxrl-sandbox-")
    assert workdir.startswith(private_tmp)
    assert not os.path.exists(workdir) and workdirs(private_tmp) == []


def test_ordinary_code_is_not_blocked():
    source = """
import asyncio, concurrent.futures, json, re, signal, tempfile, numpy as np
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    assert sum(pool.map(abs, range(-5, 5))) == 25
async def f():
    return 3
assert asyncio.run(f()) == 3
with tempfile.TemporaryFile() as t:
    t.write(b"x")
print(np.arange(4).sum(), open('/dev/null', 'w').write('x'))
"""
    result = run_python(source, limits=SandboxLimits(timeout=10.0))
    assert result.passed, result.stderr
    assert result.stdout == "6 1\n"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(timeout=0), "SandboxLimits.timeout must be finite and > 0"),
        (dict(timeout=float("inf")), "SandboxLimits.timeout must be finite and > 0"),
        (dict(timeout="1"), "SandboxLimits.timeout must be a number"),
        (dict(cpu_seconds=0), "SandboxLimits.cpu_seconds must be >= 1"),
        (dict(memory_mb=8), "SandboxLimits.memory_mb must be >= 64"),
        (dict(max_processes=1.5), "SandboxLimits.max_processes must be an int"),
        (dict(max_output_bytes=0), "SandboxLimits.max_output_bytes must be >= 1"),
        (dict(audit_hook=1), "SandboxLimits.audit_hook must be True or False"),
    ],
)
def test_limits_are_validated(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        SandboxLimits(**kwargs)


def test_bad_arguments():
    with pytest.raises(TypeError, match="source must be str"):
        run_python(b"print(1)")
    with pytest.raises(TypeError, match="not one str"):
        run_many("print(1)")
    with pytest.raises(ValueError, match="max_workers must be None or an int >= 1"):
        run_many(["pass"], max_workers=0)
    assert run_many([]) == []


def test_run_many_keeps_order_and_isolates():
    sources = ["print(0)", "while True: pass", "print(2)", "raise SystemExit(3)", "print(4)"]
    results = run_many(sources, limits=SandboxLimits(timeout=1.5, memory_mb=256), max_workers=2)
    assert [r.status for r in results] == ["passed", "timeout", "passed", "failed", "passed"]
    assert [r.stdout for r in results[::2]] == ["0\n", "2\n", "4\n"] and results[3].returncode == 3


def test_fallback_without_namespaces_still_contains():
    limits = SandboxLimits(timeout=5.0, namespaces=False)
    result = run_python("import os; print(os.getpid() != 1)", limits=limits)
    if os.geteuid() == 0 and result.status == "error":
        # As root where an unprivileged uid cannot read the interpreter: the program would keep
        # uid 0 on the host's file system (it could write site-packages), so it does not run ...
        assert "without a mount namespace the program would run as root" in result.stderr, result
        assert "not readable by an unprivileged uid" in result.stderr and result.stdout == ""
        # ... unless root is asked for.
        limits = dataclasses.replace(limits, drop_privileges=False)
        result = run_python("import os; print(os.getpid() != 1)", limits=limits)
    assert result.passed and result.stdout == "True\n"
    assert not {"pid_namespace", "network_namespace", "readonly_fs"} & set(result.protections)
    assert {"session", "rlimits", "clean_env", "audit_hook"} <= set(result.protections)


# -------------------------------------------------------------------- containment


def test_infinite_loop_times_out_fast():
    start = time.monotonic()
    result = run_python("print('started', flush=True)\nwhile True: pass", limits=SandboxLimits(timeout=1.0))
    assert (result.status, result.returncode, result.passed) == ("timeout", None, False)
    assert result.stdout == "started\n"  # output up to the kill is kept
    assert time.monotonic() - start < 3.0


def test_cpu_limit_ends_a_busy_program():
    result = run_python("while True: pass", limits=SandboxLimits(timeout=20.0, cpu_seconds=1))
    assert result.status == "timeout" and result.returncode == -signal.SIGXCPU
    assert result.seconds < 6.0


def test_memory_bomb_fails():
    result = run_python("x = bytearray(2 * 1024**3)", limits=FAST)
    assert result.status == "failed" and "MemoryError" in result.stderr


def test_file_size_limit():
    result = run_python("open('big', 'wb').write(b'x' * (3 << 20))", limits=SandboxLimits(file_size_mb=1))
    assert result.status == "failed" and "File too large" in result.stderr


DISK_FILLER = """
import os
written = 0
try:
    for i in range(64):  # 16 MiB files, as many as the disk takes
        with open(f"f{i}", "wb") as f:
            f.write(b"x" * (16 << 20))
        written += 16
except OSError as e:
    print(written, e.strerror, flush=True)
    raise
"""


def test_the_files_of_a_program_together_are_capped(layers):
    need(layers, "mount_namespace")
    before = shutil.disk_usage(tempfile.gettempdir()).used
    limits = SandboxLimits(timeout=20.0, cpu_seconds=10, memory_mb=256, file_size_mb=16, disk_mb=40)
    results = run_many([DISK_FILLER, DISK_FILLER], limits=limits)
    for result in results:
        assert "disk_quota" in result.protections and result.status == "failed", result
        written, reason = result.stdout.split(maxsplit=1)
        assert int(written) <= 40 and "No space left" in reason, result.stdout
    assert shutil.disk_usage(tempfile.gettempdir()).used - before < 16 << 20  # nothing reached the host's disk


FORK_BOMB = """
import os, time
print(os.getcwd(), flush=True)
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
except OSError:
    print(n, flush=True)
    raise
"""


def test_fork_bomb_is_refused_by_the_hook():
    result = run_python(FORK_BOMB, limits=FAST)
    assert result.status == "failed" and "os.fork is not allowed" in result.stderr


def test_fork_bomb_is_bounded_by_the_process_limit(layers):
    if os.geteuid() == 0:
        need(layers, "uid_drop")  # RLIMIT_NPROC does not bind root
    limits = SandboxLimits(timeout=5.0, memory_mb=256, max_processes=6, audit_hook=False)
    result = run_python(FORK_BOMB, limits=limits)
    assert result.status == "failed" and "Resource temporarily unavailable" in result.stderr
    workdir, forked = result.stdout.split()
    assert int(forked) == limits.max_processes - 1  # the program itself is the sixth
    assert running(workdir) == []  # the sleeping children are gone


def _serve():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    return server


def _assert_no_connection(server):
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()


CONNECT = "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')"


def test_network_is_refused_by_the_hook():
    server = _serve()
    result = run_python(CONNECT.format(port=server.getsockname()[1]), limits=FAST)
    assert result.status == "failed" and "PermissionError" in result.stderr
    _assert_no_connection(server)


def test_network_namespace_has_no_route(layers):
    need(layers, "network_namespace")
    server = _serve()
    result = run_python(CONNECT.format(port=server.getsockname()[1]), limits=NO_HOOK)
    assert result.status == "failed" and "Network is unreachable" in result.stderr
    _assert_no_connection(server)


@pytest.mark.parametrize("hook", [True, False])
def test_write_outside_the_directory(tmp_path, layers, hook):
    if not hook:
        need(layers, "readonly_fs")
    tmp_path.chmod(0o777)  # writable by anyone: only the sandbox stands in the way
    target = tmp_path / "pwned"
    source = f"open({str(target)!r}, 'w').write('x')"
    result = run_python(source, limits=FAST if hook else NO_HOOK)
    assert result.status == "failed"
    assert not target.exists()


@pytest.mark.parametrize("hook", [True, False])
def test_parent_environment_is_not_visible(monkeypatch, layers, hook):
    if not hook:
        need(layers, "pid_namespace", "uid_drop")  # otherwise /proc/<parent>/environ is readable
    secret = "jaxrl-test-secret-4d1f0a"
    monkeypatch.setenv("JAXRL_SANDBOX_SECRET", secret)
    source = f"""
import os
print(dict(os.environ))
for pid in ({os.getpid()}, {os.getppid()}, 1):
    try:
        print(open(f'/proc/{{pid}}/environ', 'rb').read())
    except OSError as e:
        print(e)
"""
    result = run_python(source, limits=FAST if hook else NO_HOOK)
    assert result.passed, result.stderr
    assert "JAXRL_SANDBOX_SECRET" not in result.stdout and secret not in result.stdout + result.stderr
    assert "'HOME'" in result.stdout  # it did print its own environment


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_flood_is_capped(stream):
    limits = SandboxLimits(timeout=10.0, max_output_bytes=10_000)
    start = time.monotonic()
    result = run_python(f"import sys\nwhile True: sys.{stream}.write('x' * 65536)", limits=limits)
    assert result.status == "output_limit"
    assert len(getattr(result, stream)) == 10_000 and set(getattr(result, stream)) == {"x"}
    assert time.monotonic() - start < 5.0


DAEMON = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])
    os._exit(0)
os.wait()
time.sleep(0.3)
print('daemon started', flush=True)
{tail}
"""


def test_daemon_is_refused_by_the_hook():
    result = run_python(DAEMON.format(marker="jaxrl-marker-hook", tail=""), limits=FAST)
    assert result.status == "failed" and "os.fork is not allowed" in result.stderr
    assert running("jaxrl-marker-hook") == []


@pytest.mark.parametrize("tail", ["", "while True: pass"], ids=["exits", "hangs"])
def test_daemonized_grandchild_does_not_survive(layers, tail):
    need(layers, "pid_namespace", "uid_drop")
    marker = f"jaxrl-marker-{os.getpid()}-{len(tail)}"
    result = run_python(DAEMON.format(marker=marker, tail=tail), limits=SandboxLimits(timeout=2.0, audit_hook=False))
    assert result.stdout == "daemon started\n", result.stderr
    assert result.status == ("passed" if not tail else "timeout")
    assert running(marker) == []


def test_program_that_leaves_its_session_is_killed():
    source = "import os\nos.setsid()\nprint(os.getcwd(), flush=True)\nwhile True: pass"
    result = run_python(source, limits=SandboxLimits(timeout=1.0))
    assert result.status == "timeout"
    assert running(result.stdout.strip()) == []


def test_no_workdirs_leak_from_killed_programs(private_tmp):
    flood = "import sys\nwhile True: sys.stdout.write('x' * 4096)"
    sources = ["while True: pass", flood, "import os; os.chmod('.', 0)"]
    results = run_many(sources, limits=SandboxLimits(timeout=1.0, max_output_bytes=1000))
    assert [r.status for r in results] == ["timeout", "output_limit", "passed"]
    assert workdirs(private_tmp) == []


@pytest.mark.parametrize("namespaces", [True, False])
def test_cleaning_up_changes_nothing_outside_the_working_directory(private_tmp, namespaces):
    # A working directory closed to everyone, and one moved away with a link to another
    # directory left in its place: the temporary root keeps its mode, the link's target
    # its files. (Without a mount namespace, the moved directory stays: the program's.)
    os.chmod(private_tmp, 0o1777)
    target = tempfile.mkdtemp(dir=os.path.dirname(private_tmp))
    try:
        with open(os.path.join(target, "keep"), "w") as f:
            f.write("x")
        move = f"import os\nhere = os.getcwd()\nos.rename(here, here + '-moved')\nos.symlink({target!r}, here)"
        # (Without namespaces, as root, the program may only run as root: asked for here.)
        limits = SandboxLimits(
            timeout=5.0, memory_mb=256, namespaces=namespaces, drop_privileges=namespaces, audit_hook=False
        )
        run_many(["import os\nos.chmod('.', 0)", move], limits=limits)
        assert stat.S_IMODE(os.stat(private_tmp).st_mode) == 0o1777
        assert os.listdir(target) == ["keep"]
    finally:
        shutil.rmtree(target)
    for moved in glob.glob(os.path.join(private_tmp, "*-moved")):
        shutil.rmtree(moved)
    assert workdirs(private_tmp) == []


def test_temp_dir_with_a_space_and_non_ascii(tmp_path, monkeypatch, layers):
    # /proc/self/mountinfo escapes the space; the working directory must stay writable.
    need(layers, "readonly_fs")
    base = tmp_path / "with space é"
    base.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    result = run_python("import os\nopen('f', 'w').write('x')\nprint(os.getcwd())", limits=NO_HOOK)
    assert result.passed, result.stderr
    assert result.stdout.startswith(str(base)) and "readonly_fs" in result.protections
    assert list(base.iterdir()) == []


# ---------------------------------------------------------- forging a pass

# What a forger writes wherever it might reach a channel that reports a pass: every
# descriptor named in a frame, every int in a dict on the heap, every descriptor number
# 3..255. The payloads: the completion marker of an earlier design, the tests' process's
# word to the supervisor, and, framed as the channel frames its messages, an "exit 0"
# and the launcher's own list of names. Then a status-0 exit.
FORGE = """
def forge():
    import gc, json, os, sys
    fds = set(range(3, 256))
    frame = sys._getframe(0)
    while frame is not None:
        for scope in (frame.f_globals, frame.f_locals):
            fds.update(v for v in scope.values() if type(v) is int and 0 <= v < 4096)
        frame = frame.f_back
    for o in gc.get_objects():
        if type(o) is dict:
            fds.update(v for v in o.values() if type(v) is int and 0 <= v < 4096)
    frames = [json.dumps(m).encode() for m in (["exit", 0], ["ok", True, []], ["loaded", []])]
    payload = b'{"completed": true}\\n' + b"returned\\n" + b"".join(len(f).to_bytes(8, "big") + f for f in frames)
    for fd in sorted(fds - {0, 1, 2}):
        try:
            os.write(fd, payload)
        except OSError:
            pass
    os._exit(0)
"""
ADD = "\ndef add(a, b):\n    return a + b\n"
FAILING = "assert add(1, 2) == 4, 'the tests'"  # fails for the honest add above

FORGERIES = {
    # The fault probe's attack on the design before this one, where the tests ran in the
    # program's process: its launcher's pipes, read from the frame that ran the
    # solution, and its protocol replayed.
    "the protocol replayed": ADD
    + """
import os, sys
scope = sys._getframe(1).f_locals
status, release = scope.get("status_w"), scope.get("release_r")
os.write(status, b"solution-done\\n")
data = b""
while len(data) < 8 or len(data) < 8 + int.from_bytes(data[:8], "big"):
    data += os.read(release, 65536)
os.write(status, b"tests-done\\n")
os.write(status, os.read(release, 33))
os._exit(0)
""",
    # The same on this design: every descriptor in the launcher's frames, by the names
    # they have now, sent every message a pass could be made of.
    "the launcher's locals": ADD
    + """
import os, sys
frame = sys._getframe(0)
while frame is not None:
    for name, fd in frame.f_locals.items():
        if type(fd) is int and name in ("status_w", "calls", "answers", "verdict"):
            for message in (b"solution-done\\n", b"tests-done\\n", b"returned\\n"):
                try:
                    os.write(fd, message)
                except OSError:
                    pass
    frame = frame.f_back
os._exit(0)
""",
    "every reachable descriptor": ADD + FORGE + "forge()",
    "from the function the tests call": FORGE + "def add(a, b):\n    forge()",
    "replaced exit": ADD + "import sys, builtins\nsys.exit = builtins.exit = lambda *a, **k: None",
    "patched failure path": ADD
    + FORGE
    + """
import builtins, os, sys, traceback
sys.exit = builtins.exit = builtins.quit = os._exit = lambda *a, **k: None
traceback.print_exception = traceback.print_exc = lambda *a, **k: None
sys.excepthook = lambda *a: forge()
builtins.AssertionError = builtins.SystemExit = type('Harmless', (Exception,), {})
builtins.__build_class__ = lambda *a, **k: forge()
""",
    "a thread during the tests": ADD
    + FORGE
    + "import threading, time\nthreading.Thread(target=forge, daemon=True).start()",
    "equal to everything": """
class Anything:
    def __eq__(self, other):
        return True
    __ne__ = lambda self, other: False
    __hash__ = object.__hash__
    __bool__ = lambda self: True
def add(a, b):
    return Anything()
""",
    "an int equal to everything": """
class Four(int):
    __eq__ = lambda self, other: True
def add(a, b):
    return Four(a + b)
""",
    "a patched module the tests use": ADD + "import math\nmath.isclose = lambda *a, **k: True",
    "garbage on the channel": FORGE.replace("payload = ", "payload = b'\\xff' * 64 or ")
    + "def add(a, b):\n    forge()",
    # Found by a review of this design, each of which passed before it was fixed:
    # importing a module by the program's word (IPython.__main__ runs the configuration
    # files under $HOME, which is the program's directory) ...
    "a module whose import runs the program's code": ADD
    + """
import os, types
os.makedirs(".ipython/profile_default", exist_ok=True)
with open(".ipython/profile_default/ipython_config.py", "w") as f:
    f.write("import os, sys\\nframe = sys._getframe()\\n"
            "while frame.f_code.co_name != 'run_tests':\\n    frame = frame.f_back\\n"
            "os.write(frame.f_locals['verdict'], b'returned\\\\n')\\nos._exit(0)\\n")
trigger = types.ModuleType("IPython.__main__")
""",
    # ... the program's names over the tests' builtins and modules ...
    "a built-in shadowed": "def sorted(*args, **kwargs):\n    return [1, 2, 3]\ndef f(x):\n    return [3, 1]",
    "a module name shadowed": ADD + "class Close:\n    def isclose(self, *a):\n        return True\nmath = Close()",
    "a module alias shadowed": ADD + "class Close:\n    def allclose(self, *a):\n        return True\nnp = Close()",
    # ... the tests' __builtins__ replaced through the launcher's own list of names ...
    "the tests' builtins replaced": """
import sys
launcher = sys._getframe(1).f_globals
write = launcher["write_message"]
def fake_sorted(*args, **kwargs):
    return [1, 2, 3]
def forged(fd, message):
    if message[0] == "loaded":
        refer = sys._getframe(1).f_locals["refer"]
        message[1].append(["__builtins__", ["dict", [["sorted", refer(fake_sorted)]]]])
    write(fd, message)
launcher["write_message"] = forged
def f(x):
    return [3, 1]
""",
    # ... and a StopIteration out of a call, which ended the tests' loop around it.
    "a StopIteration out of a call": "def add(a, b):\n    raise StopIteration",
    # A second review: a module under another's name (numpy's isclose is looser) ...
    "a module under another's name": ADD + "import numpy as math",
    # ... and an installed package's name that is not Python's own.
    "an installed package's name": ADD
    + "class Special:\n    def comb(self, *a):\n        return 3\n"
    + "class Scipy:\n    special = Special()\nscipy = Scipy()",
}
FORGERY_TESTS = {
    "a patched module the tests use": "assert math.isclose(add(1, 2), 4)",
    "a built-in shadowed": "assert sorted(f(3)) == [1, 2, 3]",
    "a module name shadowed": "assert math.isclose(add(1, 2), 4)",
    "a module alias shadowed": "assert np.allclose(add(1, 2), 4)",
    "the tests' builtins replaced": "assert sorted(f(3)) == [1, 2, 3]",
    "a StopIteration out of a call": "for got, want in zip(map(add, [1], [2]), [4]):\n    assert got == want",
    "a module under another's name": "assert math.isclose(add(1, 2), 3.00002)",
    "an installed package's name": "assert add(1, 2) == scipy.special.comb(5, 2)",
}


@pytest.mark.parametrize("forgery", list(FORGERIES), ids=list(FORGERIES))
def test_a_forged_completion_does_not_pass(forgery):
    tests = FORGERY_TESTS.get(forgery, FAILING)
    result = run_python(FORGERIES[forgery], tests=tests, limits=FAST)
    assert (result.status, result.completed) == ("failed", False), result


def test_a_forked_child_cannot_forge_completion():
    source = ADD + FORGE + "import os\nif os.fork() == 0:\n    forge()\nos.wait()\nos._exit(0)"
    result = run_python(source, tests=FAILING, limits=NO_HOOK)
    assert (result.status, result.completed) == ("failed", False), result


@pytest.mark.parametrize("daemon", [True, False])
def test_threads_left_running(daemon):
    # A normal exit waits for the threads that are not daemons, so their program's code
    # has not returned before they end; a daemon thread is no matter: the verdict is the
    # tests' process's, and the program is killed when they are done.
    seconds = 60 if daemon else 0.3
    source = f"import threading, time\nthreading.Thread(target=time.sleep, args=({seconds},), daemon={daemon}).start()"
    result = run_python(source, tests="assert 1 + 1 == 2", limits=FAST)
    assert (result.status, result.returncode, result.completed) == ("passed", 0, True), result
    assert result.seconds < (2.0 if daemon else 5.0)


def test_tests_run_after_the_program_unseen_by_it():
    source = """
import gc, sys
seen = open(__file__).read() + open('/proc/self/cmdline', 'rb').read().decode('latin-1')
seen += ' '.join(o for o in gc.get_objects() if type(o) is str)
print('jaxrl-' + 'hidden' in seen)
def add(a, b):
    return a + b
"""
    result = run_python(source, tests="assert add(1, 2) == 3, 'jaxrl-hidden'", limits=FAST)
    assert (result.status, result.completed, result.stdout) == ("passed", True, "False\n"), result
    result = run_python(source, tests="x = 1\nassert add(1, 2) == 4, 'jaxrl-hidden'", limits=FAST)
    assert (result.status, result.returncode, result.completed) == ("failed", 1, False)
    assert 'File "<tests>", line 2' in result.stderr and "assert add(1, 2) == 4" in result.stderr


SOLUTION = """
import collections, math
LIMIT = 10 ** 30
TABLE = list(range(300_000))  # past the 1 MiB a name's value may take as data: a stand-in
def add(a, b):
    return a + b
def union(a, b):
    return a | b
class Solution:
    def two_sum(self, nums, target):
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return [seen[target - x], i]
            seen[x] = i
def sort_in_place(xs, *, table):
    xs.sort()
    table['sorted'] = True
    table['rows'][0].append(0)
def countdown(n):
    yield from range(n, 0, -1)
class Node:
    def __init__(self, value, next=None):
        self.value, self.next = value, next
def last(node):
    while node.next is not None:
        node = node.next
    return node
class InvalidInput(Exception):
    pass
def check(x):
    if x < 0:
        raise ValueError(f"negative: {x}")
    raise InvalidInput(x)
def counts(text):
    return collections.Counter(text)
def interrupt():
    raise KeyboardInterrupt("in the program")
print('program', add(2, 3))
"""
TESTS_OF_SOLUTION = """
assert add(1, 2) == 3 and add('a', 'b') == 'ab' and add((1,), (2,)) == (1, 2)
assert add(LIMIT, 1) == 10 ** 30 + 1 and add(float('inf'), 1) == float('inf') and add(1j, 1) == 1 + 1j
assert add([1, {2: b'x'}], [{3}]) == [1, {2: b'x'}, {3}] and type(union(frozenset({1}), {2})) is frozenset
assert Solution().two_sum([2, 7, 11, 15], 9) == [0, 1]
xs, table = [3, 1, 2], {'rows': [[5]]}
row = table['rows'][0]
assert sort_in_place(xs, table=table) is None
assert xs == [1, 2, 3] and table == {'rows': [[5, 0]], 'sorted': True} and row == [5, 0]
assert list(countdown(3)) == [3, 2, 1] and sum(countdown(4)) == 10
head = Node(1, Node(2, Node(3)))
assert last(head).value == 3 and last(head) is last(head) and last(head) is head.next.next
head.next.next.next = Node(4)
assert last(head).value == 4 and len([1 for _ in countdown(2)]) == 2
try:
    check(-1)
except ValueError as e:
    assert e.args == ('negative: -1',), e.args
try:
    check(1)
except Exception as e:
    assert type(e) is Exception and str(e) == 'InvalidInput: 1'
assert counts('abca') == {'a': 2, 'b': 1, 'c': 1} and math.isclose(add(0.1, 0.2), 0.3)
try:
    interrupt()
except Exception as e:  # the program's, not the tests' process's: an Exception here
    assert str(e) == 'KeyboardInterrupt: in the program'
else:
    raise AssertionError
try:
    add(lambda: 1, 2)
except TypeError as e:
    assert 'the tests can give the program data' in str(e) and 'not function' in str(e)
assert len(TABLE) == 300_000 and TABLE[-1] == 299_999 and 7 in TABLE and TABLE[2:4] == [2, 3]
print('tests', add(3, 4))
"""


def test_tests_see_the_programs_objects_as_data():
    result = run_python(SOLUTION, tests=TESTS_OF_SOLUTION, limits=FAST)
    assert (result.status, result.returncode, result.completed) == ("passed", 0, True), result
    assert result.stdout == "program 5\ntests 7\n"


@pytest.mark.parametrize("right", [True, False])
def test_unittest_main_runs_the_tests_test_cases(right):
    # They are found in the tests' own __main__, with argv of their own; unittest.main()
    # ends in SystemExit, a pass when its status is 0.
    tests = """
import unittest
class Adding(unittest.TestCase):
    def test_small(self):
        self.assertEqual(add(1, 2), 3)
    def test_large(self):
        self.assertEqual(add(10**20, 1), 10**20 + 1)
unittest.main()
"""
    source = "def add(a, b):\n    return a + b" if right else "def add(a, b):\n    return a - b"
    result = run_python(source, tests=tests, limits=FAST)
    assert (result.status, result.completed) == (("passed", True) if right else ("failed", False)), result
    assert "Ran 2 tests" in result.stderr


def test_an_exception_in_the_program_shows_both_tracebacks():
    result = run_python(SOLUTION, tests="x = 1\ncheck(-2)", limits=FAST)
    assert (result.status, result.returncode, result.completed) == ("failed", 1, False)
    stderr = result.stderr
    assert (
        'File "<tests>", line 2' in stderr and "solution.py" in stderr and stderr.count("ValueError: negative: -2") == 2
    )
    assert 'File "<string>"' not in stderr  # the launcher's own frames are left out


@pytest.mark.parametrize(
    "during_the_tests, status, returncode",
    [
        ("import os\ndef add(a, b):\n    os._exit(0)", "failed", 0),
        ("import sys\ndef add(a, b):\n    sys.exit(5)", "failed", 5),
        ("import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGSEGV)", "crashed", -11),
    ],
)
def test_a_program_that_ends_during_its_tests_fails(during_the_tests, status, returncode):
    tests = "try:\n    add(1, 2)\nexcept BaseException:\n    pass"  # the tests cannot swallow its end
    result = run_python(during_the_tests, tests=tests, limits=FAST)
    assert (result.status, result.returncode, result.completed) == (status, returncode, False), result


def test_answers_that_are_not_data_fail_the_run():
    # An oversized frame, then one that is not JSON: each says why.
    for payload in ("(1 << 40).to_bytes(8, 'big')", "(5).to_bytes(8, 'big') + b'{{{{{'"):
        source = f"""
import os, sys
def add(a, b):
    answers = sys._getframe(2).f_locals['answers']
    os.write(answers, {payload})
    return 3
"""
        result = run_python(source, tests="assert add(1, 2) == 3", limits=FAST)
        assert (result.status, result.returncode, result.completed) == ("failed", 2, False), result
        assert "the program's answer could not be read as data" in result.stderr


def test_a_report_with_two_exit_statuses_is_an_error():
    # The supervisor writes one; a second came from something else that reached the pipe.
    exit_line = b'{"event": "exit", "returncode": 0, "completed": true, "cpu_seconds": 0.1}\n'
    report = b'{"event": "ready", "active": [], "problems": []}\n' + exit_line * 2
    result = sandbox._classify("exited", b"", b"", report, time.monotonic(), set(), [], FAST)
    assert (result.status, result.completed) == ("error", False)
    assert "more than one exit status" in result.stderr


def test_launcher_encodes_values_losslessly():
    # Everything the channel sends as data comes back equal and of the same types, at
    # every depth; what is not data goes through ``refer``.
    launcher = _load_launcher()
    strategy = st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.integers(min_value=2**63)
        | st.floats()
        | st.text()
        | st.binary()
        | st.complex_numbers()
        | st.builds(range, st.integers(), st.integers(), st.integers().filter(bool))
        | st.builds(slice, st.none() | st.integers(), st.integers(), st.none() | st.integers()),
        lambda inner: (
            st.lists(inner)
            | st.tuples(inner, inner)
            | st.dictionaries(st.integers() | st.text(), inner)
            | st.frozensets(st.integers())
            | st.sets(st.text())
        ),
        max_leaves=20,
    )

    def typed(value):  # equality that tells 1, 1.0 and True apart and nan from nan
        if isinstance(value, (float, complex)):
            return (type(value), repr(value))  # nan as nan
        if isinstance(value, dict):
            return (dict, sorted((repr(typed(k)), typed(v)) for k, v in value.items()))
        if isinstance(value, (list, tuple)):
            return (type(value), [typed(v) for v in value])
        if isinstance(value, (set, frozenset)):
            return (type(value), sorted(repr(typed(v)) for v in value))
        return (type(value), value)

    @hypothesis.given(strategy)
    def round_trip(value):
        refused = lambda v: pytest.fail(f"sent as a stand-in: {v!r}")  # noqa: E731
        wire = json.loads(json.dumps(launcher.encode(value, refused), allow_nan=False))
        assert typed(launcher.decode(wire, refused)) == typed(value)

    round_trip()
    stand_ins = []
    nested = [[[]]]
    for _ in range(200):
        nested = [nested]
    encoded = launcher.encode([object, nested], lambda v: stand_ins.append(v) or ["ref", len(stand_ins)])
    assert encoded[0] == "list" and encoded[1][0] == ["ref", 1]
    assert stand_ins[0] is object and len(stand_ins) == 2  # the class, and the list past MAX_DEPTH
    for bad in ([], ["list"], ["dict", [[1]]], ["float", "1e500"], ["nope", 1], {"a": 1}, ["int", 5]):
        with pytest.raises((ValueError, TypeError)):
            launcher.decode(bad, lambda v: pytest.fail("not a stand-in"))


def _load_launcher():
    spec = importlib.util.spec_from_file_location("sandbox_launcher_under_test", sandbox._LAUNCHER)
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    return launcher


def test_trace_functions_are_refused_by_the_hook():
    result = run_python("import sys\nsys.settrace(lambda *a: None)", limits=FAST)
    assert result.status == "failed" and "sys.settrace is not allowed" in result.stderr


def test_tests_arguments_are_checked():
    with pytest.raises(TypeError, match="tests must be None or str"):
        run_python("pass", tests=b"assert True")
    with pytest.raises(ValueError, match="one entry per source, got 1 for 2"):
        run_many(["pass", "pass"], tests=["pass"])
    with pytest.raises(TypeError, match=r"tests\[1\] must be None or str"):
        run_many(["pass", "pass"], tests=[None, 3])
    results = run_many(["x = 1", "x = 2"], tests=["assert x == 1", None], limits=FAST)
    assert [r.status for r in results] == ["passed", "passed"]


# -------------------------------------------------------------------- the launcher


def test_launcher_is_a_standard_library_program_of_its_own():
    # Every import in it, at any depth, is of the standard library ...
    tree = ast.parse(open(sandbox._LAUNCHER, encoding="utf-8").read())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported and {name.split(".")[0] for name in imported} <= sys.stdlib_module_names
    # ... and loading it, isolated as the sandbox runs it, defines its functions, runs
    # nothing (no configuration in argv here) and loads neither this package nor JAX.
    check = f"""
import importlib.util, sys
before = set(sys.modules)
spec = importlib.util.spec_from_file_location("sandbox_launcher", {sandbox._LAUNCHER!r})
launcher = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launcher)
print(callable(launcher.main), sorted(m for m in set(sys.modules) - before
                                      if m.split(".")[0] not in sys.stdlib_module_names))
"""
    done = subprocess.run([sys.executable, "-I", "-B", "-c", check], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "True []\n", "")


def test_launcher_directory_is_not_on_the_programs_path():
    # Run with -I -c, no directory of the package is on sys.path: rewards/code.py
    # must not shadow the standard library's code module.
    launcher_dir = os.path.dirname(sandbox._LAUNCHER)
    result = run_python("import code, sys\nprint(sys.path)\nprint(code.__file__)", limits=FAST)
    assert result.passed, result.stderr
    path, code_file = result.stdout.splitlines()
    assert launcher_dir not in path and not code_file.startswith(launcher_dir)


def test_sandbox_runs_from_another_working_directory(tmp_path, monkeypatch):
    # The program runs in a directory of its own, wherever the caller is.
    monkeypatch.chdir(tmp_path)
    result = run_python("import os\nprint(os.path.basename(os.getcwd()))", limits=FAST)
    assert (result.status, result.completed) == ("passed", True), result
    assert result.stdout.startswith("jaxrl-sandbox-")


def test_launcher_runs_from_the_source_read_at_import(monkeypatch):
    # The file is read once: a sandboxed program that overwrote it (or an install that
    # moved it) would change no later run. Without the file at run time, runs still pass.
    monkeypatch.setattr(sandbox, "_LAUNCHER", "/nonexistent/sandbox_launcher.py")
    result = run_python("print(6 * 7)", limits=FAST)
    assert (result.status, result.completed, result.stdout) == ("passed", True, "42\n"), result
