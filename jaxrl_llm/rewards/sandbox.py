"""Run untrusted Python source (model completions) in a contained subprocess.

``run_python(source, tests=..., limits=...)`` executes one program, then its tests;
``run_many`` runs a batch on a bounded thread pool (each program still gets its own
process). Both return :class:`ExecutionResult` values, never raise for anything the
program does.

Containment is layered. Each layer is used where the machine allows it and the result
says which were active (``ExecutionResult.protections``); a missing layer never stops the
others. The layers, outermost first:

``session``
    The program gets its own session / process group (``start_new_session``); the whole
    group is SIGKILLed when the run ends, on success too.
``wall_timeout`` / ``output_cap``
    A wall-clock deadline, and at most ``max_output_bytes`` read from each of stdout and
    stderr (the parent never buffers more; a program that writes more is killed).
``clean_env`` / ``private_tmpdir``
    A minimal environment (``PATH``, ``LANG``, ``HOME`` = ``TMPDIR`` = a fresh ``0700``
    temporary directory, one-thread BLAS settings): none of the parent's variables. The
    directory is the working directory and is removed afterwards.
``rlimits``
    ``RLIMIT_CPU`` (SIGXCPU, then SIGKILL a second later), ``RLIMIT_AS``,
    ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_NPROC`` (threads count), no core dumps.
    Set per process, so the memory of a batch of processes can reach
    ``max_processes * memory_mb``.
``pid_namespace`` / ``network_namespace`` / ``ipc_namespace`` / ``mount_namespace``
    With util-linux ``unshare`` (as root; as a user through ``user_namespace``, where
    the kernel allows unprivileged user namespaces): the first process of the sandbox is
    a small trusted supervisor (:mod:`~jaxrl_llm.rewards.sandbox_launcher`, a program of
    its own that uses only the standard library), PID 1 of a new PID namespace, so when
    it exits the kernel kills every process left inside, ``setsid()`` daemons included,
    and no host process is visible or signalable. The network namespace has only a downed loopback:
    no connection leaves it (Unix sockets on the file system are hidden, see below).
``hidden_dirs`` / ``readonly_fs``
    In the mount namespace ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run``, ``/home``,
    ``/root`` and the parent's ``$HOME`` are covered with empty read-only tmpfs (the
    interpreter's own directories are bound back in), and every other mount is
    remounted read-only, except the working directory.
``disk_quota``
    The working directory is a tmpfs of ``disk_mb`` in the mount namespace: the program's
    processes together write at most that, and nothing of it reaches the host's disk.
``uid_drop`` (as root)
    The program runs as a fresh unprivileged uid/gid, unique to the execution, with no
    supplementary groups: ``RLIMIT_NPROC`` binds (it does not bind root), the program
    cannot signal or trace anything else, and the parent finally kills every process of
    that uid. Skipped, with a note, when that uid could not read the interpreter (e.g. a
    pyenv under ``/root`` with no mount namespace to bind it into view).
``no_capabilities`` (in a user namespace, or root that kept its uid)
    The capabilities are dropped (bounding set, ambient, effective, permitted) and
    ``SECBIT_NOROOT`` locked, also across ``exec``: the program cannot undo the read-only
    remounts (they are locked against nested namespaces too).
``no_new_privs``
    ``PR_SET_NO_NEW_PRIVS``: setuid binaries and file capabilities grant nothing.
``audit_hook``
    A ``sys.addaudithook`` hook installed just before the program's first line refuses:
    socket connect / bind / send / name lookups; ``fork``, ``exec*``, ``posix_spawn``,
    ``system``, ``subprocess``; signals to other processes; opening for writing,
    creating, renaming, removing or changing anything outside the working directory
    (``/dev/null`` and friends allowed); reading ``/proc/<pid>`` of other processes;
    every ``ctypes`` call and (re)importing ``ctypes`` / ``cffi`` / ``_posixsubprocess``;
    ``sys.settrace`` / ``sys.setprofile``.

Tests
    Exit status 0 is not a pass: a program can leave early (``os._exit(0)``), write
    whatever a launcher would, or make itself look right from inside (an object equal to
    everything, a patched ``math.isclose``, a replaced ``AssertionError``). So ``tests``
    never run in the program's process. The supervisor -- the sandbox's first process,
    which the program cannot read, write or reopen the descriptors of (non-dumpable and,
    with ``drop_privileges``, another uid or no capabilities) -- starts the program, and
    once it is ready, a second process of its own for the tests, which never runs a line
    of the program's code (it has the program's limits and privileges, the program's uid
    or no capabilities, and is non-dumpable: the program cannot read or write its memory
    or reach its descriptors):

    1. The program runs ``source`` as ``__main__`` (waiting for its threads that are not
       daemons, as an exit would), then sends what its top-level names hold and answers
       requests over a pair of pipes.
    2. The tests run in the tests' process, in a namespace of those names: data (``None``,
       ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``bytearray``,
       ``range``, ``slice`` and lists, tuples, sets, dicts and deques of them, NumPy
       scalars as Python numbers; at most 64 MiB an answer) by value; its functions,
       classes and other objects as stand-ins; its modules as the tests' process's own
       module of that name, one it has loaded or one of a fixed list it imports itself
       (``math``, ``re``, ``collections``, ``numpy``, ...: never a name the program
       chose, since importing runs code), else left out. Nor do the program's names
       shadow the tests' built-ins (``sorted``, ``isinstance``) or the name of a module
       (``math``, ``np``, any installed here) with anything but that module. The tests
       run as ``__main__`` with ``argv`` of their own (``unittest.main()`` finds their
       cases; its ``SystemExit`` with status 0 is their end). Calling a stand-in, or reading its
       attributes, items, length, iteration, membership, truth, ``repr`` or ``str``, is
       a request, and what comes back is data or a stand-in again; the arguments go as
       data (the mutable ones come back as the call left them) or as the stand-ins they
       are. An exception the program's code raised is raised in the tests as the
       built-in exception of that name (``Exception`` for the program's own classes;
       ``StopIteration`` out of a call becomes ``RuntimeError``, as out of a generator),
       with the program's traceback as a note. A stand-in equals only itself.
    3. The verdict is the tests' process's: once the tests' code has returned it writes
       "returned" on a pipe only it holds and exits 0. :attr:`ExecutionResult.completed`
       is whether it did. Anything else fails: an exception or failed ``assert``, the
       program ending before the tests did (even if the tests catch that), or an answer
       that is not data.

    So the tests compare values they built with values that crossed as data: nothing
    the program prepares, patches or returns decides a comparison, and no descriptor,
    frame, thread or process of the program reaches the verdict. What the tests rely on
    is the program's answers, as they would for any program. The semantics differ from
    running the tests in the program's process in a few places, each a failure rather
    than a pass: the program's global values are read once, when its code has returned;
    a stand-in's equality and hash are by identity (``isinstance`` with the program's
    class, or comparing two of its dataclasses, does not work); the tests can pass the
    program data and its own objects, not functions of theirs; ``except`` a class the
    program defined does not match (it arrives as ``Exception``); the tests cannot capture
    the program's output (``redirect_stdout``); a module the tests use they import
    themselves, unless it is one of the fixed list. And a name the tests use without
    defining or importing it is the program's: ``isclose`` after the program's ``from math
    import isclose`` is whatever the program made it, so tests import what they use. The
    tests' working directory is the program's, so files it left there can steer what the
    tests' libraries read at run time (``./matplotlibrc``), never code they run.

What is not protected: an audit hook is a tripwire, not a boundary -- code that sets out
to defeat it can (monkeypatch the stdlib functions it relies on, race it from a thread,
import a native extension that makes raw system calls). Where namespaces are unavailable
(no ``unshare``; containers whose seccomp profile forbids it; kernels without
unprivileged user namespaces) and the parent is not root, the OS layers left are
rlimits, the session and the clean environment: a program that gets past the hook can
then write the user's files, read their secrets, reach the network, signal their
processes and leave ``setsid()`` daemons behind. Root without namespaces whose
interpreter only root can read is refused ("error", saying so), since it would run as
uid 0 on the host's file system (it could write site-packages, and every later run with
it); ``drop_privileges=False`` runs it as root anyway. Without the audit hook, Unix
sockets outside the hidden directories stay reachable. Reads are not confined: what is
not hidden stays readable (read-only), the interpreter's import path included. The
kernel is shared (no seccomp filter, no VM), and memory is bounded per process, not per
sandbox (no cgroup): ``max_processes * memory_mb`` at worst. The tests are the caller's
code: they run under the program's limits and privileges, but not the audit hook.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import pwd
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Literal

__all__ = ["ExecutionResult", "SandboxLimits", "Status", "run_many", "run_python"]

Status = Literal["passed", "failed", "timeout", "output_limit", "crashed", "error"]

_WORKDIR_PREFIX = "jaxrl-sandbox-"
_PROGRAM_NAME = "solution.py"
_REPORT_CAP = 1 << 16  # bytes read from the supervisor's report pipe
_UID_RANGE = (1 << 30, (1 << 30) + (1 << 24))  # fresh uids for root runs; no passwd entry
_HIDE = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/var/run", "/home", "/root")
# The sandbox's first process, a program of its own (stdlib only, never imported here). Its source is
# read once, now, and run with ``python -I -c``: it loads nothing of this package, no directory of it is
# on the program's sys.path, and a program that overwrites the file on disk changes no later run.
_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")
with open(_LAUNCHER, encoding="utf-8") as _file:
    _LAUNCHER_SOURCE = _file.read()


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Limits and layer switches for one sandboxed execution.

    Each switch means "use this layer where the machine allows it"; which layers were
    active is reported per result.
    """

    timeout: float = 10.0
    """Wall-clock seconds for the whole execution, interpreter start-up included."""
    cpu_seconds: int = 10
    """CPU seconds per process (``RLIMIT_CPU``); a program over it ends as ``timeout``."""
    memory_mb: int = 1024
    """Address space per process, MiB (``RLIMIT_AS``); over it, allocations fail."""
    file_size_mb: int = 16
    """Largest file a process may write, MiB (``RLIMIT_FSIZE``)."""
    disk_mb: int = 64
    """What all the program's files together may take, MiB: its working directory is a
    tmpfs of this size in the mount namespace (``disk_quota``); without one, only
    ``file_size_mb`` holds."""
    max_processes: int = 16
    """Processes and threads the program may have at once (``RLIMIT_NPROC``)."""
    max_open_files: int = 64
    """File descriptors per process (``RLIMIT_NOFILE``)."""
    max_output_bytes: int = 65536
    """Bytes kept from each of stdout and stderr; a program writing more is killed."""
    namespaces: bool = True
    """PID, network, IPC and mount namespaces (hidden dirs, read-only file system)."""
    drop_privileges: bool = True
    """As root, run as a fresh unprivileged uid; in a user namespace, drop capabilities."""
    audit_hook: bool = True
    """Refuse network, subprocesses, ctypes and writes outside the working directory."""

    def __post_init__(self):
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)):
            raise TypeError(f"SandboxLimits.timeout must be a number of seconds, got {self.timeout!r}")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"SandboxLimits.timeout must be finite and > 0 seconds, got {self.timeout!r}")
        minimum = {
            "cpu_seconds": 1,
            "memory_mb": 64,  # the interpreter itself needs a few tens of MiB
            "file_size_mb": 0,
            "disk_mb": 1,
            "max_processes": 1,
            "max_open_files": 16,
            "max_output_bytes": 1,
        }
        for name, low in minimum.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"SandboxLimits.{name} must be an int, got {value!r}")
            if value < low:
                raise ValueError(f"SandboxLimits.{name} must be >= {low}, got {value}")
        for name in ("namespaces", "drop_privileges", "audit_hook"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SandboxLimits.{name} must be True or False, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutionResult:
    """What one sandboxed execution did.

    ``status``:

    - ``"passed"``: the program's code returned and then its tests' code did, in the
      tests' own process (module docstring, "Tests");
    - ``"failed"``: an exception or a failed ``assert`` in either (``MemoryError``
      under the address-space limit included), an exit before the end (``sys.exit(0)``,
      ``os._exit(0)``: in the program's code the tests did not run; in a function they
      call they did not end), or an answer to the tests that is not data (``stderr``
      says so);
    - ``"timeout"``: past the wall-clock deadline or the CPU-seconds limit;
    - ``"output_limit"``: wrote more than ``max_output_bytes`` to stdout or stderr;
    - ``"crashed"``: killed by a signal (segfault, file-size limit, ...);
    - ``"error"``: the sandbox could not run the program (``stderr`` says why).
    """

    status: Status
    returncode: int | None
    """The run's exit status: 0 for a pass; the program's own when it ended before its
    tests did; else the tests' process's (1 for failed tests); ``-N`` for signal N;
    ``None`` if the sandbox was killed at its deadline or for its output."""
    stdout: str
    stderr: str
    """Decoded as UTF-8 (invalid bytes replaced), each at most ``max_output_bytes``."""
    seconds: float
    """Wall-clock seconds from spawn to clean-up."""
    completed: bool
    """True when the tests' code returned, in the tests' own process (module docstring,
    "Tests")."""
    protections: tuple[str, ...]
    """The containment layers that were active (module docstring), sorted."""
    notes: tuple[str, ...] = ()
    """Why layers that were asked for were unavailable."""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_python(source: str, *, tests: str | None = None, limits: SandboxLimits = SandboxLimits()) -> ExecutionResult:
    """Run Python ``source`` as a program in a fresh sandboxed interpreter, then ``tests``.

    The program runs as ``__main__`` from ``solution.py`` in a new, empty working
    directory, with stdin at ``/dev/null``. ``tests`` (Python source, e.g. ``assert``
    statements) run after it, in a process of their own, in a namespace of the names the
    program defined, whose functions and objects answer them across a channel that
    carries only data; the program never sees them (module docstring, "Tests"). Returns the
    :class:`ExecutionResult`; raises only for bad arguments. See the module docstring
    for what is and is not contained.
    """
    if not isinstance(source, str):
        raise TypeError(f"source must be str (Python source text), got {type(source).__name__}")
    if tests is not None and not isinstance(tests, str):
        raise TypeError(f"tests must be None or str (Python source text), got {type(tests).__name__}")
    if not isinstance(limits, SandboxLimits):
        raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
    return _execute(source, tests or "", limits)


def run_many(
    sources: Sequence[str],
    *,
    tests: Sequence[str | None] | None = None,
    limits: SandboxLimits = SandboxLimits(),
    max_workers: int | None = None,
) -> list[ExecutionResult]:
    """:func:`run_python` over ``sources`` (with ``tests[i]`` after ``sources[i]``, where
    given) on at most ``max_workers`` threads (default: the CPU count), each in its own
    sandbox. Results are in the order of ``sources``."""
    if isinstance(sources, str) or isinstance(tests, str):
        raise TypeError("sources and tests must be sequences of program texts, not one str")
    sources = list(sources)
    tests = [None] * len(sources) if tests is None else list(tests)
    if len(tests) != len(sources):
        raise ValueError(f"tests must have one entry per source, got {len(tests)} for {len(sources)}")
    bad_workers = isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1
    if max_workers is not None and bad_workers:
        raise ValueError(f"max_workers must be None or an int >= 1, got {max_workers!r}")
    for i, (source, test) in enumerate(zip(sources, tests)):
        if not isinstance(source, str):
            raise TypeError(f"sources[{i}] must be str, got {type(source).__name__}")
        if test is not None and not isinstance(test, str):
            raise TypeError(f"tests[{i}] must be None or str, got {type(test).__name__}")
    if not sources:
        return []
    workers = min(len(sources), max_workers or os.cpu_count() or 1)
    run = functools.partial(_run_one, limits=limits)
    if workers == 1:
        return list(map(run, sources, tests))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(run, sources, tests))


def _run_one(source: str, tests: str | None, *, limits: SandboxLimits) -> ExecutionResult:
    return run_python(source, tests=tests, limits=limits)


# --------------------------------------------------------------------------------------
# Parent side.


def _execute(source: str, tests: str, limits: SandboxLimits) -> ExecutionResult:
    start = time.monotonic()
    protections = {"session", "wall_timeout", "output_cap", "clean_env", "private_tmpdir"}
    notes: list[str] = []
    is_root = os.geteuid() == 0
    uid = _claim_uid() if (is_root and limits.drop_privileges) else None
    workdir = os.path.realpath(tempfile.mkdtemp(prefix=_WORKDIR_PREFIX))
    report_r = report_w = tests_fd = None
    try:
        program = _write_program(workdir, source, uid)
        command = [sys.executable, "-I", "-B", "-u", "-c", _LAUNCHER_SOURCE]
        unshare = _namespace_command() if limits.namespaces else None
        if unshare:
            command = [*unshare, *command]
            protections |= {"pid_namespace", "network_namespace", "ipc_namespace", "mount_namespace"}
            if not is_root:
                protections.add("user_namespace")
        elif limits.namespaces:
            notes.append("namespaces: util-linux unshare is missing or not permitted here")
        if is_root and uid is None:
            notes.append(
                "drop_privileges=False as root: the program keeps root's capabilities, so neither "
                "RLIMIT_NPROC nor the namespaces and read-only mounts hold against it"
            )

        report_r, report_w = os.pipe()
        tests_fd = _tests_file(tests)
        config = {
            "workdir": workdir,
            "program": program,
            "report_fd": report_w,
            "tests_fd": tests_fd,
            "rlimits": _rlimits(limits, _process_limit(limits.max_processes, is_root, bool(unshare))),
            "uid": uid,
            "mounts": bool(unshare),
            "disk_mb": limits.disk_mb,
            "hide": _hide_candidates() if unshare else [],
            "drop_privileges": limits.drop_privileges,
            "audit": limits.audit_hook,
        }
        try:
            proc = subprocess.Popen(
                [*command, json.dumps(config)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=_environment(workdir),
                start_new_session=True,
                pass_fds=(report_w, tests_fd),
            )
        except OSError as e:
            why = f"sandbox: could not start: {e}".encode()
            return _result("error", None, b"", why, start, False, protections, notes)
        for fd in (report_w, tests_fd):
            os.close(fd)
        report_w = tests_fd = None
        outcome, out, err, report = _collect(proc, report_r, limits, uid)
        if outcome == "exited" and proc.returncode != 0:  # the supervisor ends in os._exit(0) when it reports
            err += f"\nsandbox: the supervisor ended with status {proc.returncode}\n".encode()
            report = b""
        return _classify(outcome, out, err, report, start, protections, notes, limits)
    finally:
        for fd in (report_r, report_w, tests_fd):
            if fd is not None:
                os.close(fd)
        _remove_tree(workdir)
        _release_uid(uid)


def _write_program(workdir: str, source: str, uid: int | None) -> str:
    """Write ``source`` to the program's file in ``workdir``, both owned by ``uid`` where
    given (the program's own files, as any other program's would be); return its path."""
    program = os.path.join(workdir, _PROGRAM_NAME)
    with open(program, "w", encoding="utf-8") as f:
        f.write(source)
    if uid is not None:
        for path in (workdir, program):
            os.chown(path, uid, uid)
    return program


def _process_limit(max_processes: int, is_root: bool, namespaced: bool) -> int:
    """The ``RLIMIT_NPROC`` that leaves the program ``max_processes`` tasks. It counts every
    task (thread) of the real uid -- per user namespace when there is one -- so allow for
    what is not the program's."""
    if is_root:
        return max_processes + 1  # a fresh uid owns only the program and the tests' process (root is exempt)
    if namespaced:
        return max_processes + 3  # unshare, the supervisor and the tests' process share the namespace
    return _count_tasks(os.getuid()) + 2 + max_processes  # the supervisor and the tests' process


def _rlimits(limits: SandboxLimits, nproc: int) -> dict[str, list[int]]:
    """The program's rlimits, ``{name: [soft, hard]}``, as the launcher sets them."""
    return {
        "RLIMIT_CPU": [limits.cpu_seconds, limits.cpu_seconds + 1],
        "RLIMIT_AS": [limits.memory_mb << 20] * 2,
        "RLIMIT_FSIZE": [limits.file_size_mb << 20] * 2,
        "RLIMIT_NOFILE": [limits.max_open_files] * 2,
        "RLIMIT_NPROC": [nproc] * 2,
        "RLIMIT_CORE": [0, 0],
    }


def _environment(workdir: str) -> dict[str, str]:
    """The program's whole environment: none of the parent's variables, ``workdir`` as its
    home and temporary directory, one thread per BLAS library."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _collect(
    proc: subprocess.Popen, report_r: int, limits: SandboxLimits, uid: int | None
) -> tuple[str, bytes, bytes, bytes]:
    """Wait for the sandbox to end (:func:`_wait`), kill what is left of it, and return the
    outcome ("exited", "timeout" or "output_limit"), its stdout and stderr (each at most
    ``max_output_bytes``) and what the supervisor reported."""
    streams = {proc.stdout.fileno(): limits.max_output_bytes, proc.stderr.fileno(): limits.max_output_bytes}
    caps = {**streams, report_r: _REPORT_CAP}
    data = {fd: bytearray() for fd in caps}
    try:
        outcome = _wait(proc, data, caps, limits.timeout)
    finally:
        _kill_all(proc, uid)
        for fd in caps:  # what is left in the pipes; every writer is dead now
            while len(data[fd]) <= caps[fd] and _read_some(fd, data[fd], caps[fd]):
                pass
        proc.stdout.close()
        proc.stderr.close()
    if any(len(data[fd]) > cap for fd, cap in streams.items()):
        outcome = "output_limit"
    out, err = (bytes(data[fd][: streams[fd]]) for fd in streams)
    return outcome, out, err, bytes(data[report_r])


def _tests_file(tests: str) -> int:
    """A descriptor of an anonymous file (no path) holding ``tests``, read from offset 0."""
    data = tests.encode("utf-8", "surrogatepass")  # bad code points become a SyntaxError in the sandbox
    try:
        fd = os.memfd_create("jaxrl-sandbox-tests")
    except (AttributeError, OSError):
        fd = os.dup(tempfile.TemporaryFile().fileno())  # the file object closes; the copy stays
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    return fd


def _wait(proc: subprocess.Popen, data: dict, caps: dict, timeout: float) -> str:
    """Read the pipes (at most cap + 1 bytes each) until the process exits ("exited"), the
    deadline passes ("timeout") or stdout / stderr overflows ("output_limit")."""
    deadline = time.monotonic() + timeout
    try:
        pidfd = os.pidfd_open(proc.pid)  # readable once the process exits
    except (AttributeError, OSError):
        pidfd = None  # old kernel: poll instead
    with selectors.DefaultSelector() as sel:
        for fd in caps:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "timeout"
                for key, _ in sel.select(remaining if pidfd is not None else min(remaining, 0.02)):
                    if key.fd != pidfd and not _read_some(key.fd, data[key.fd], caps[key.fd]):
                        sel.unregister(key.fd)
                if any(len(data[fd]) > caps[fd] for fd in (proc.stdout.fileno(), proc.stderr.fileno())):
                    return "output_limit"
                if _has_exited(proc.pid):
                    return "exited"
        finally:
            if pidfd is not None:
                os.close(pidfd)


def _read_some(fd: int, buf: bytearray, cap: int) -> bool:
    """Append one non-blocking read to ``buf`` (past ``cap + 1`` bytes, discard). False at EOF
    or when nothing more is available now."""
    try:
        chunk = os.read(fd, 1 << 16)
    except OSError:  # BlockingIOError: nothing more for now
        return False
    if not chunk:
        return False
    room = cap + 1 - len(buf)
    if room > 0:
        buf += chunk[:room]
    return True


def _has_exited(pid: int) -> bool:
    """Whether ``pid`` has exited, without reaping it (its pid and process group stay ours)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_all(proc: subprocess.Popen, uid: int | None) -> None:
    """SIGKILL everything the execution started, then reap it. Idempotent.

    The namespace supervisor is PID 1 of its namespace: its death makes the kernel kill
    every process inside and it turns zombie only once they are all gone, so we wait for
    that. A fresh uid is swept too (the no-namespace fallback for ``setsid`` daemons)."""
    if proc.returncode is not None:
        return
    inits = _children(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the leader is unreaped, so the group id is still ours
    except (ProcessLookupError, PermissionError):
        pass
    for pid in inits:
        _signal_pid(pid)
    if uid is not None:
        _sweep_uid(uid)
    proc.wait()
    deadline = time.monotonic() + 5.0
    while inits and time.monotonic() < deadline:
        inits = [pid for pid in inits if _is_running(pid)]
        if inits:
            time.sleep(0.002)
    if uid is not None:
        _sweep_uid(uid)


def _classify(outcome, out, err, report, start, protections, notes, limits) -> ExecutionResult:
    messages = []
    for line in report.decode("utf-8", "replace").splitlines():
        try:
            messages.append(json.loads(line))
        except ValueError:
            continue
    ready = next((m for m in messages if m.get("event") == "ready"), None)
    exits = [m for m in messages if m.get("event") == "exit"]
    if len(exits) > 1:  # the supervisor writes one; more came from elsewhere
        err += b"\nsandbox: the supervisor's report has more than one exit status\n"
        return _result("error", None, out, err, start, False, protections, notes)
    final = exits[0] if exits else None
    failure = next((m for m in messages if m.get("event") == "setup_error"), None)
    for m in messages:
        if m.get("event") in ("ready", "setup"):
            protections |= set(m.get("active", ()))
            notes += m.get("problems", ())
    if failure is not None or (ready is None and outcome == "exited"):
        why = failure["message"] if failure else "the sandbox supervisor exited before the program started"
        return _result("error", None, out, err + f"\nsandbox: {why}\n".encode(), start, False, protections, notes)
    if outcome == "timeout":
        return _result("timeout", None, out, err, start, False, protections, notes)
    if outcome == "output_limit":
        return _result("output_limit", None, out, err, start, False, protections, notes)
    if final is None:
        err += b"\nsandbox: no exit status from the supervisor\n"
        return _result("error", None, out, err, start, False, protections, notes)
    code, completed = int(final["returncode"]), bool(final.get("completed"))
    if final.get("why"):
        err += f"\nsandbox: {final['why']}\n".encode()
    if code == 0:
        status = "passed" if completed else "failed"
    elif code == -signal.SIGXCPU or (code == -signal.SIGKILL and final.get("cpu_seconds", 0) >= limits.cpu_seconds):
        status = "timeout"
    elif code < 0:
        status = "crashed"
    else:
        status = "failed"
    return _result(status, code, out, err, start, completed and code == 0, protections, notes)


def _result(status, code, out, err, start, completed, protections, notes) -> ExecutionResult:
    return ExecutionResult(
        status=status,
        returncode=code,
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        seconds=time.monotonic() - start,
        completed=completed,
        protections=tuple(sorted(protections)),
        notes=tuple(dict.fromkeys(notes)),
    )


@functools.cache
def _namespace_command_for(euid: int) -> tuple[str, ...] | None:
    """The ``unshare`` prefix that works on this machine for this user, or None."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/bin", "/usr/sbin", "/sbin"])
    exe = shutil.which("unshare", path=search)
    if exe is None:
        return None
    flags = ["--fork", "--kill-child", "--pid", "--mount-proc", "--net", "--ipc", "--uts", "--propagation", "private"]
    if euid != 0:
        flags.insert(0, "--map-root-user")  # a user namespace in which we may do the rest
    command = (exe, *flags)
    probe = "import os, socket; assert os.getpid() == 1; socket.create_connection(('1.1.1.1', 53), timeout=1)"
    try:
        done = subprocess.run(
            [*command, sys.executable, "-I", "-S", "-c", probe],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=20,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
    except (OSError, subprocess.SubprocessError):
        return None
    # The probe must start as PID 1 and then fail to reach the network.
    ok = done.returncode != 0 and b"AssertionError" not in done.stderr and b"OSError" in done.stderr
    return command if ok else None


def _namespace_command() -> tuple[str, ...] | None:
    return _namespace_command_for(os.geteuid())


def _hide_candidates() -> list[str]:
    """Directories to cover with an empty tmpfs, parents first. The supervisor skips any
    that holds the interpreter and binds the interpreter's own directories back in."""
    paths = {os.path.realpath(p) for p in (*_HIDE, os.path.expanduser("~")) if os.path.isdir(p)}
    return sorted(paths - {"/"}, key=lambda p: (p.count("/"), p))


_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


def _claim_uid() -> int:
    """A random unused uid (no passwd entry, not in use by this process) for one execution."""
    while True:
        uid = random.randrange(*_UID_RANGE)
        try:
            pwd.getpwuid(uid)
            continue
        except KeyError:
            pass
        with _uid_lock:
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid


def _release_uid(uid: int | None) -> None:
    if uid is not None:
        with _uid_lock:
            _uids_in_use.discard(uid)


def _proc_pids():
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for name in entries:
        if name.isdigit():
            yield int(name)


def _proc_status(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            return dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}


def _count_tasks(uid: int) -> int:
    """Tasks (threads) owned by real uid ``uid``: what RLIMIT_NPROC counts."""
    total = 0
    for pid in _proc_pids():
        status = _proc_status(pid)
        if status.get("Uid", "").split()[:1] == [str(uid)]:
            total += int(status.get("Threads", "1").strip() or 1)
    return total


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        pass
    return [p for p in _proc_pids() if _proc_status(p).get("PPid", "").strip() == str(pid)]


def _is_running(pid: int) -> bool:
    state = _proc_status(pid).get("State", "").strip()[:1]
    return state not in ("", "Z", "X")


def _signal_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _sweep_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (real, effective or saved) until none is left."""
    for _ in range(200):
        found = False
        for pid in _proc_pids():
            ids = _proc_status(pid).get("Uid", "").split()[:3]
            if str(uid) in ids and _is_running(pid):
                found = True
                _signal_pid(pid)
        if not found:
            return
        time.sleep(0.001)


def _remove_tree(path: str) -> None:
    """Remove the working directory ``path`` and what is in it, taking back the directories
    the program made unwritable; a link put in its place is removed, not followed, and
    nothing outside ``path`` is changed."""
    if os.path.islink(path):
        os.unlink(path)
        return

    def inside(where: str) -> bool:
        return where == path or where.startswith(path + os.sep)

    def retry(func, target, _exc):
        try:
            if inside(os.path.dirname(target)):
                os.chmod(os.path.dirname(target), stat.S_IRWXU)
            if inside(target) and os.path.isdir(target) and not os.path.islink(target):
                os.chmod(target, stat.S_IRWXU)
            func(target)
        except FileNotFoundError:
            pass

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=retry)
