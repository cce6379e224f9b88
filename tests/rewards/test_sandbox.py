"""The sandbox: results, limits, and containment of hostile programs.

Each containment case is checked twice where it can be: with the audit hook (the default,
available everywhere) and without it, which tests the OS layers alone -- skipped, with the
reason, where this machine lacks the layer that case needs."""

import glob
import os
import signal
import socket
import tempfile
import time

import pytest

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
    result = run_python("import os; print(os.getpid() != 1)", limits=SandboxLimits(timeout=5.0, namespaces=False))
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
    sources = ["while True: pass", "import sys\nwhile True: sys.stdout.write('x' * 4096)", "import os; os.chmod('.', 0)"]
    results = run_many(sources, limits=SandboxLimits(timeout=1.0, max_output_bytes=1000))
    assert [r.status for r in results] == ["timeout", "output_limit", "passed"]
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
