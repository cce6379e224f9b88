"""The program the sandbox runs as its first process: the supervisor, which starts the
untrusted program and, beside it, the process that runs its tests.

:mod:`jaxrl_llm.rewards.sandbox` reads this file once, when it is imported, and runs its
source behind util-linux ``unshare`` where namespaces work::

    python -I -B -u -c '<this source>' '<configuration as JSON>'

never by ``import`` or ``-m``: ``-I`` keeps ``PYTHONPATH``, the user's site directory and
the current directory off ``sys.path`` (a sibling such as ``code.py`` cannot shadow a
standard module in the program, and a module the program writes into its directory is
never imported by the tests' process), and the source run on its own does not import
:mod:`jaxrl_llm`, which would load JAX into every sandbox. Held in memory, it does not
depend on the file staying in view (the sandbox hides ``/root`` and the home directories)
or unchanged (a program that overwrites the file changes no later run). So it is trusted
code that uses the standard library only; importing it merely defines its functions.

What it reads: one JSON object, its last argument -- ``workdir`` and ``program`` (the
working directory and the program's source file in it), two descriptors it inherits
(``report_fd``, a pipe to the parent; ``tests_fd``, an anonymous file holding the
tests), ``rlimits`` (``{"RLIMIT_CPU": [soft, hard], ...}``), ``uid`` (a fresh uid to run
the program as, or null), ``mounts``, ``disk_mb`` and ``hide`` (whether to set up the file
system, the working directory's size and the directories to cover), and the switches
``drop_privileges`` and ``audit``. Nothing secret is in it: the tests stay in the
anonymous file until the supervisor has started the program.

What it writes: JSON lines on ``report_fd`` -- "setup" and "ready" (the layers active and
the problems met), "setup_error" (the program could not be started) and "exit" (the run's
exit status, whether the tests' code returned, the CPU seconds of both processes).

What it does, as PID 1 of the namespaces: hides directories and remounts the rest
read-only (:func:`setup_filesystem`), then forks the program (:func:`become_program`:
limits, privileges, the audit hook of :func:`install_guard`), which runs its source and
then answers calls (:func:`serve`). Once the program is ready, the supervisor -- now
non-dumpable -- reads the tests and forks the tests' process (:func:`run_tests`), which
runs them in a namespace of its own where the program's functions and objects are
stand-ins (:class:`Remote`): each call, attribute or item crosses to the program as a
request, and what comes back is plain data (:func:`encode`, :func:`decode`), so the
tests compare values they built themselves. The verdict is that process's: it writes
"returned" to the supervisor once the tests' code has returned, then exits 0
(:func:`supervise`, which reports).
"""

import builtins
import collections
import ctypes
import importlib
import importlib.util
import json
import linecache
import math
import os
import re
import resource
import stat
import sys
import time
import traceback

# mount(2) flags
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
KEEP_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
}
# prctl(2) options
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_CHILD_SUBREAPER = 1, 4, 24, 28, 36
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 38, 47

# Exit statuses of the sandbox's processes
SETUP_FAILED = 70  # the program's process could not get ready (EX_SOFTWARE)
TESTS_FAILED = 1  # the tests raised (an assert, or an exception the program's code raised)
PROGRAM_BROKE_PROTOCOL = 2  # the program's answers could not be read as data
PROGRAM_ENDED = 3  # the program was gone before the tests' code returned
RETURNED = b"returned\n"  # the tests' process to the supervisor: the tests' code returned

MAX_MESSAGE_BYTES = 1 << 26  # one request or answer on the channel between the two processes
MAX_DEPTH = 100  # nesting of a value sent as data; deeper, the program's object is sent as a stand-in
SMALL_INT = 1 << 63  # larger ints cross in hexadecimal (no 4,300-digit limit, no JSON number limits)


def main() -> None:
    """Prepare the file system, fork the program, then the tests' process; be the
    supervisor. Every process ends in ``os._exit``, unless the program raises ``SystemExit``."""
    config = json.loads(sys.argv[-1])
    report = config["report_fd"]
    libc = load_libc()
    active, problems = ["rlimits"], []
    if config["mounts"]:
        layers, trouble = setup_filesystem(libc, config["hide"], config["workdir"], config["disk_mb"], config["uid"])
        active += layers
        problems += trouble
    send(report, event="setup", active=active, problems=problems)

    status_r, status_w = os.pipe()  # program -> supervisor: "ready" or "setup_error", one line
    calls_r, calls_w = os.pipe()  # tests -> program: requests
    answers_r, answers_w = os.pipe()  # program -> tests: what its code was, then answers
    verdict_r, verdict_w = os.pipe()  # tests -> supervisor: RETURNED
    supervisor = os.getpid()
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the program stay ours (PID 1 already is)
    program = fork(report)
    if program == 0:
        for fd in (status_r, calls_w, answers_r, verdict_r, verdict_w, config["tests_fd"], report):
            os.close(fd)
        source = become_program(libc, config, status_w, supervisor, active, problems)
        filename = config["program"]
        del libc, config  # the program can walk its frames up to this one: no libc handle, no configuration
        run_program(source, filename, calls_r, answers_w)

    for fd in (status_w, calls_r, answers_w):
        os.close(fd)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no reading or writing our memory, or reopening our descriptors
    layers = forward_ready(status_r, report)
    tests = read_file(config["tests_fd"])  # only now: the program's process never held them
    os.close(config["tests_fd"])
    tester = None
    if layers is not None:
        tester = fork(report)
        if tester == 0:
            os.close(report)
            os.close(verdict_r)
            try:
                become_tests(libc, config, layers, supervisor)
                del libc
                run_tests(tests, calls_w, answers_r, verdict_w)
            finally:
                os._exit(SETUP_FAILED)  # only if something above raised: run_tests ends in os._exit
    for fd in (calls_w, answers_r, verdict_w):
        os.close(fd)
    returncode, returned = supervise(program, tester, verdict_r)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    send(report, event="exit", returncode=returncode, completed=returned, cpu_seconds=usage.ru_utime + usage.ru_stime)
    os._exit(0)


def fork(report: int) -> int:
    """``os.fork()``; if it fails, say so to the parent ("setup_error") and exit."""
    try:
        return os.fork()
    except OSError as e:
        send(report, event="setup_error", message=f"fork: {e}")
        os._exit(SETUP_FAILED)


def send(fd: int, **message) -> None:
    """Write ``message`` to ``fd`` as one JSON line; a reader that is gone is no error."""
    try:
        os.write(fd, (json.dumps(message) + "\n").encode())
    except OSError:
        pass


# --------------------------------------------------------------------------------------
# libc: mount(2) and prctl(2), which the os module does not offer.


def load_libc() -> ctypes.CDLL:
    """The C library, with the argument types of the calls made through it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return libc


def check(rc: int, what: str) -> None:
    """Raise ``OSError`` (with errno) for a C call's non-zero return code."""
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def mount(libc, source, target, fstype, flags, data=None) -> None:
    """mount(2), with ``None`` for an argument that is not given."""

    def encode(text):
        return None if text is None else text.encode()

    check(libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


# --------------------------------------------------------------------------------------
# The file system (in the mount namespace, before the fork).


def under(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or lies below it (by name: no links are followed)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def keep_paths() -> set[str]:
    """What the interpreter needs to stay visible: its prefixes and import path."""
    paths = [
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
        *sys.path,
    ]
    out = set()
    for p in paths:
        if p and os.path.exists(p):
            out.update({os.path.abspath(p), os.path.realpath(p)})
    return out


def unescape(field: str) -> str:
    """A /proc/self/mountinfo path: octal escapes (\\040 = space) back to bytes."""
    raw = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field.encode())
    return raw.decode("utf-8", "surrogateescape")


def setup_filesystem(libc, hide: list[str], workdir: str, disk_mb: int, uid: int | None) -> tuple[list[str], list[str]]:
    """Hide ``hide``, give ``workdir`` ``disk_mb`` MiB of its own and make every other mount
    read-only. Returns the layers now active ("hidden_dirs", "disk_quota", "readonly_fs")
    and the problems met; a layer that fails is left out, not fatal."""
    active, problems = [], []
    try:
        if hide_directories(libc, hide, workdir):
            active.append("hidden_dirs")
        try:
            cap_workdir(libc, workdir, disk_mb, uid)
            active.append("disk_quota")
        except OSError as e:
            problems.append(f"disk_quota: {e}")
        failed = remount_readonly(libc, workdir)
        if failed:
            problems.append("readonly_fs: could not remount " + "; ".join(failed[:5]))
        else:
            active.append("readonly_fs")
    except OSError as e:
        problems.append(f"hidden_dirs/readonly_fs: {e}")
    return active, problems


def hide_directories(libc, hide: list[str], workdir: str) -> list[str]:
    """Cover each directory of ``hide`` (parents first) with an empty tmpfs, then bind back
    in what under it must stay visible: the interpreter, this file and ``workdir``. A
    directory that holds the interpreter is skipped. Returns the directories covered."""
    keep = keep_paths()
    hidden = []
    for h in hide:
        if not os.path.isdir(h) or any(under(h, k) for k in keep):
            continue  # gone (hidden with a parent already), or part of the interpreter
        inside = sorted({k for k in keep | {workdir} if under(k, h) and k != h}, key=len)
        fds = [(k, os.open(k, os.O_PATH | os.O_CLOEXEC)) for k in inside]
        mount(libc, "tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        for k, fd in fds:
            if os.path.exists(k):  # already bound back inside a parent
                os.close(fd)
                continue
            os.makedirs(os.path.dirname(k), 0o755, exist_ok=True)
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.mkdir(k, 0o755)
            else:
                open(k, "a").close()
            mount(libc, f"/proc/self/fd/{fd}", k, None, MS_BIND | MS_REC)
            os.close(fd)
        hidden.append(h)
    return hidden


def cap_workdir(libc, workdir: str, disk_mb: int, uid: int | None) -> None:
    """Mount a tmpfs of ``disk_mb`` MiB over ``workdir``, with its files (the program)
    copied in: all the program's processes together can write no more than that, and it
    is gone with the mount namespace, never on the host's disk."""
    saved = []
    for name in os.listdir(workdir):
        path = os.path.join(workdir, name)
        status = os.lstat(path)
        if stat.S_ISREG(status.st_mode):
            with open(path, "rb") as f:
                saved.append((name, f.read(), status))
    owner = "" if uid is None else f",uid={uid},gid={uid}"
    mount(libc, "tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_mb}m,mode=0700{owner}")
    for name, data, status in saved:
        path = os.path.join(workdir, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, stat.S_IMODE(status.st_mode))
        os.chown(path, status.st_uid, status.st_gid)


def remount_readonly(libc, workdir: str) -> list[str]:
    """Make ``workdir`` its own (writable) mount and remount every other one read-only,
    keeping its flags. Returns the mounts that could not be remounted, and why."""
    with open("/proc/self/mountinfo") as f:
        points = {unescape(line.split()[4]) for line in f}
    if workdir not in points:
        mount(libc, workdir, workdir, None, MS_BIND)
    failed = []
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    for row in rows:
        point, options = unescape(row[4]), row[5].split(",")
        if point == workdir or "ro" in options:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for name, bit in KEEP_FLAGS.items():
            if name in options:
                flags |= bit
        if not any(a in options for a in ("noatime", "relatime")):
            flags |= MS_STRICTATIME
        try:
            mount(libc, None, point, None, flags)
        except OSError as e:
            if e.errno not in (2, 20):  # ENOENT / ENOTDIR: hidden under a tmpfs now
                failed.append(f"{point}: {e.strerror}")
    return failed


# --------------------------------------------------------------------------------------
# The supervisor: the first process, which the program cannot read, write or signal.


def forward_ready(status_r: int, report: int) -> list | None:
    """Pass the program's first line ("ready" or "setup_error") on to the parent; the layers
    active in the program's process once it is ready (it has then started its source), or
    None."""
    line = b""
    while not line.endswith(b"\n") and len(line) < 1 << 16:
        chunk = os.read(status_r, 1 << 16)
        if not chunk:
            break
        line += chunk
    os.close(status_r)
    line = line.split(b"\n")[0]
    try:
        os.write(report, line + b"\n")
    except OSError:
        pass
    try:
        message = json.loads(line)
    except ValueError:
        return None
    ready = type(message) is dict and message.get("event") == "ready" and type(message.get("active")) is list
    return message["active"] if ready else None


def supervise(program: int, tester: int | None, verdict_r: int) -> tuple[int, bool]:
    """Wait for the tests' process (or, without one, the program), reaping every process of
    the sandbox; return the run's exit status and whether the tests' code returned.

    The exit status is 0 when it did; the program's own when the program ended before the
    tests did (an exception, an early exit, a signal); else the tests' process's
    (``TESTS_FAILED``, ``PROGRAM_BROKE_PROTOCOL``, or ``-N`` for signal N)."""
    statuses: dict[int, int] = {}
    while (tester or program) not in statuses:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid in (program, tester):
            statuses[pid] = status
        if pid == program and tester is not None and tester not in statuses:
            kill_descendants(keep={tester})  # what it left could hold its end of the channel open
    returned = tester is not None and read_pipe(verdict_r) == RETURNED
    if program not in statuses:  # told by the tests' process to exit; a moment, then SIGKILL
        deadline = time.monotonic() + 0.5
        while program not in statuses and time.monotonic() < deadline:
            pid, status = os.waitpid(program, os.WNOHANG)
            if pid:
                statuses[program] = status
            else:
                time.sleep(0.002)
    kill_descendants(keep=set())
    reap_all()
    tested = tester is not None and tester in statuses
    tests_code = os.waitstatus_to_exitcode(statuses[tester]) if tested else PROGRAM_ENDED
    if returned and tests_code == 0:
        return 0, True
    if tests_code == PROGRAM_ENDED:
        return (os.waitstatus_to_exitcode(statuses[program]) if program in statuses else -9), False
    return (tests_code or TESTS_FAILED), False  # 0 without RETURNED: an exit from inside the tests


def read_file(fd: int) -> bytes:
    """All of the file open as ``fd``, read from offset 0 (its position is left alone)."""
    size, data = os.fstat(fd).st_size, b""
    while len(data) < size:
        chunk = os.pread(fd, size - len(data), len(data))
        if not chunk:
            break
        data += chunk
    return data


def read_pipe(fd: int, limit: int = 64) -> bytes:
    """What is waiting in the pipe ``fd`` (at most ``limit`` bytes); every writer is gone."""
    os.set_blocking(fd, False)
    data = b""
    while len(data) <= limit:
        try:
            chunk = os.read(fd, limit + 1)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return data


def kill_descendants(keep: set[int]) -> None:
    """SIGKILL every process under this one (the reaper of the whole sandbox) but ``keep``."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    parents[int(name)] = int(f.read().rpartition(b")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    todo, found = [os.getpid()], []
    while todo:
        parent = todo.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in keep]
        found += children
        todo += children
    for pid in found:
        try:
            os.kill(pid, 9)
        except OSError:
            pass


def reap_all() -> None:
    """Reap every child that has exited, without waiting for the others."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# --------------------------------------------------------------------------------------
# The program's process, from the fork to the program's first line.


def become_program(libc, config: dict, status_w: int, supervisor: int, active: list, problems: list) -> str:
    """Set the limits, drop privileges, install the audit hook, say "ready" (with ``active``
    and ``problems``, to which this adds) and return the program's source. A layer the
    machine lacks is skipped and noted; one that breaks halfway fails the run ("error")."""
    why = set_rlimits(config["rlimits"])
    if why is not None:
        fail(status_w, why)
    dropped = False
    if config["uid"] is not None:
        try:
            dropped, problem = drop_uid(config["uid"], config["workdir"], config["program"])
        except OSError as e:
            fail(status_w, f"dropping privileges: {e}")
        if dropped:
            active.append("uid_drop")
        elif not config["mounts"]:  # uid 0 on the host's file system: site-packages, other runs' files
            fail(
                status_w,
                f"{problem.removeprefix('uid_drop: ').split('; ')[0]}, and without a mount namespace the program "
                "would run as root on the host's file system; run where util-linux unshare works "
                "(SandboxLimits(namespaces=True)), install Python where other users can read it, or pass "
                "SandboxLimits(drop_privileges=False) to run it as root",
            )
        else:
            problems.append(problem)
    if config["drop_privileges"] and not dropped and has_capabilities():
        try:
            drop_capabilities(libc)
            active.append("no_capabilities")
        except OSError as e:
            fail(status_w, f"dropping capabilities: {e}")
    try:
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        active.append("no_new_privs")
    except OSError as e:
        problems.append(f"no_new_privs: {e}")
    # Die with the supervisor (a uid change clears any earlier setting).
    libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    if os.getppid() != supervisor:
        os._exit(SETUP_FAILED)
    os.chdir(config["workdir"])

    with open(config["program"], encoding="utf-8") as f:
        source = f.read()
    if config["audit"]:
        try:
            install_guard(config["workdir"])
            active.append("audit_hook")
        except Exception as e:  # degrade: the other layers still hold
            problems.append(f"audit_hook: {e!r}")
    send(status_w, event="ready", active=active, problems=problems)
    os.close(status_w)
    return source


def become_tests(libc, config: dict, layers: list, supervisor: int) -> None:
    """Give the tests' process the program's working directory, its limits but its process
    count (it starts nothing), and its privileges: the program's uid, or no capabilities, as the program
    has (``layers``), then non-dumpable (the program cannot read or write its memory, or
    reopen its descriptors, under the same uid). Exit ``SETUP_FAILED`` if that fails."""
    try:
        os.chdir(config["workdir"])  # before the privileges go: the program may have closed it to others
        why = set_rlimits({name: value for name, value in config["rlimits"].items() if name != "RLIMIT_NPROC"})
        if "uid_drop" in layers:
            uid = config["uid"]
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        elif "no_capabilities" in layers:
            drop_capabilities(libc)
        check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    except OSError as e:
        why = str(e)
    if why is not None or os.getppid() != supervisor:
        print(f"sandbox: the tests' process could not start: {why}", file=sys.stderr)
        os._exit(SETUP_FAILED)


def fail(status_w: int, message: str) -> None:
    """Tell the supervisor (and through it the parent) why the program cannot start; exit."""
    send(status_w, event="setup_error", message=message)
    os._exit(SETUP_FAILED)


def set_rlimits(rlimits: dict) -> str | None:
    """Set ``{"RLIMIT_...": [soft, hard]}``; None, or why one could not be set."""
    for name, (soft, hard) in rlimits.items():
        try:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        except (OSError, ValueError) as e:
            return f"setrlimit {name}: {e}"
    return None


def drop_uid(uid: int, workdir: str, program: str) -> tuple[bool, str | None]:
    """As root: become ``uid`` (and gid), with no supplementary groups, when ``uid`` can
    read the interpreter; else stay uid 0 and take ``workdir`` back. Returns (whether it
    dropped, why not); an ``OSError`` means it broke halfway."""
    needed = [(p, os.R_OK | (os.X_OK if os.path.isdir(p) else 0)) for p in sorted(keep_paths())]
    os.setgroups([])
    os.setegid(uid)
    os.seteuid(uid)  # try the interpreter's files as the new uid, reversibly
    unreadable = [p for p, mode in needed if not os.access(p, mode, effective_ids=True)]
    os.seteuid(0)
    os.setegid(0)
    if unreadable:
        for path in (workdir, program):  # stay uid 0: take the directory back
            os.chown(path, 0, 0)
        return False, (
            "uid_drop: the interpreter is not readable by an unprivileged uid here "
            f"({', '.join(unreadable[:3])}); dropping capabilities instead"
        )
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # clears every capability
    return True, None


def has_capabilities() -> bool:
    """Whether this process holds any capability (permitted or effective)."""
    with open("/proc/self/status") as f:
        return any(line.startswith(("CapPrm:", "CapEff:")) and int(line.split()[1], 16) for line in f)


def drop_capabilities(libc) -> None:
    """Root in a user namespace, or root that could not change uid: keep the uid, lose the
    capabilities, for good (SECBIT_NOROOT: exec as uid 0 grants nothing; locked)."""
    check(libc.prctl(PR_SET_SECUREBITS, 0x2F, 0, 0, 0), "securebits")
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "capbset")
    libc.prctl(PR_CAP_AMBIENT, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")


def install_guard(workdir: str) -> None:
    """Add the audit hook (the sandbox module's docstring, ``audit_hook``) and take away
    the ways to start or signal processes that raise no audit event."""
    import _posixsubprocess
    import _signal
    import posix
    import signal

    # fmt: off
    realpath, join, dirname, basename, isabs = (os.path.realpath, os.path.join, os.path.dirname, os.path.basename,
                                                os.path.isabs)
    getcwd, readlink, fspath, fsdecode, getpid = os.getcwd, os.readlink, os.fspath, os.fsdecode, os.getpid
    root = workdir.rstrip("/") + "/"
    devices = {"/dev/null", "/dev/zero", "/dev/full", "/dev/stdout", "/dev/stderr", "/dev/tty"}
    proc_pid = re.compile(r"/proc/(\d+)(/|$)")
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    blocked = {
        "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system", "os.killpg",
        "subprocess.Popen", "pty.spawn", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
        "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo",
        "socket.sethostname", "sys.settrace", "sys.setprofile",
    }
    no_import = {"ctypes", "_ctypes", "cffi", "_cffi_backend", "_posixsubprocess", "posix", "_signal", "signal"}
    # (path argument index, dir_fd argument index) per mutating event
    mutating = {
        "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.link": ((0, 2), (1, 3)), "os.mkdir": ((0, 2),),
        "os.remove": ((0, 1),), "os.rename": ((0, 2), (1, 3)), "os.rmdir": ((0, 1),), "os.symlink": ((1, 2),),
        "os.truncate": ((0, None),), "os.utime": ((0, 3),), "os.chflags": ((0, None),),
        "os.lchflags": ((0, None),), "os.setxattr": ((0, None),), "os.removexattr": ((0, None),),
    }
    # fmt: on

    def deny(event):
        raise PermissionError(f"sandbox: {event} is not allowed")

    def absolute(path, dir_fd):
        path = fsdecode(fspath(path))
        if not isabs(path):
            base = getcwd() if dir_fd in (None, -1, -100) else readlink(f"/proc/self/fd/{dir_fd}")
            path = join(base, path)
        return path

    def inside(path, dir_fd=None):
        if isinstance(path, int):
            return True  # an already-open descriptor
        path = absolute(path, dir_fd)
        for resolved in (realpath(path), join(realpath(dirname(path)), basename(path))):
            if resolved != workdir and not resolved.startswith(root):
                return False
        return True

    def guard(event, args):
        if event in blocked or event.startswith("ctypes."):
            deny(event)
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance(path, int):
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & write_flags)
            given = absolute(path, None)
            resolved = realpath(given)
            match = proc_pid.match(resolved)
            if match and int(match.group(1)) != getpid():
                deny(f"reading {resolved}")
            if writing and given not in devices and resolved not in devices and not inside(path):
                deny(f"writing {resolved}")
        elif event in mutating:
            for path_index, fd_index in mutating[event]:
                dir_fd = None if fd_index is None or fd_index >= len(args) else args[fd_index]
                if not inside(args[path_index], dir_fd):
                    deny(f"{event} on {args[path_index]!r}")
        elif event == "os.kill":
            if args[0] != getpid():
                deny("signalling another process")
        elif event == "import" and args[0] in no_import:
            deny(f"importing {args[0]}")

    def refuse(*args, **kwargs):
        raise PermissionError("sandbox: starting processes is not allowed")

    _posixsubprocess.fork_exec = refuse
    for module in (os, posix):
        if hasattr(module, "pidfd_open"):
            module.pidfd_open = refuse
    for module in (signal, _signal):
        if hasattr(module, "pidfd_send_signal"):
            module.pidfd_send_signal = refuse
    sys.addaudithook(guard)


def run_program(source: str, filename: str, calls: int, answers: int) -> None:
    """Once the tests' process is set up, run the program's source as ``__main__``, wait
    for its threads (as an exit would), then answer the tests' process (:func:`serve`). An
    exception exits 1, with its traceback; ``SystemExit`` exits as it says, before the
    tests ran."""
    try:  # the tests' process is set up (its uid counts in the program's RLIMIT_NPROC from the start)
        started = read_message(calls) == ["start"]
    except (EOFError, ValueError):
        started = False
    if not started:
        os._exit(SETUP_FAILED)
    module = type(sys)("__main__")
    module.__file__ = filename
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    sys.argv = [filename]
    try:
        exec(compile(source, filename, "exec"), module.__dict__)
        threading = sys.modules.get("threading")
        if threading is not None:
            for thread in threading.enumerate():
                if thread is not threading.current_thread() and not thread.daemon:
                    thread.join()
    except SystemExit:
        raise
    except BaseException as exc:
        sys.stderr.write(describe(exc))
        os._exit(1)
    serve(module.__dict__, calls, answers)


def serve(namespace: dict, calls: int, answers: int) -> None:
    """Send what the program's top-level names hold, then answer requests until told to
    exit: ``call``, ``getattr``, ``setattr``, ``getitem``, ``setitem``, ``delitem``,
    ``len``, ``iter``, ``next``, ``contains``, ``bool``, ``repr`` and ``str`` of an object
    the program sent as a stand-in. The answer to a call also carries the arguments sent
    as data that are mutable (lists, dicts, sets, bytearrays, deques), as the call left
    them. This runs in the program's process: nothing here is trusted by the tests."""
    objects: dict[int, object] = {}  # the objects sent as stand-ins, kept alive: their ids stay theirs

    def refer(value):
        if isinstance(value, type(sys)):
            objects[id(value)] = value
            return ["module", value.__name__, id(value)]
        try:
            if getattr(value, "shape", None) == () and hasattr(value, "item"):  # a NumPy scalar
                return encode(value.item(), refer)
            for base in (bool, int, float, complex, str):  # an IntEnum, a str subclass, ...
                if isinstance(value, base):
                    return encode(base(value), refer)
        except Exception:
            pass
        objects[id(value)] = value
        return ["ref", id(value), type(value).__name__]

    def encode_or_refer(value):
        try:
            return encode(value, refer)
        except Exception:  # a container whose items could not be read
            return refer(value)

    def resolve(encoded):
        return objects[encoded[1]]

    def loaded(value):  # a large value as a stand-in: the tests read the part they need
        encoded = encode_or_refer(value)
        if type(encoded) is list and encoded[0] not in ("ref", "module") and len(json.dumps(encoded)) > 1 << 20:
            objects[id(value)] = value
            return ["ref", id(value), type(value).__name__]
        return encoded

    names = [name for name in namespace if not (name.startswith("__") and name.endswith("__"))]
    write_message(answers, ["loaded", [[name, loaded(namespace[name])] for name in names]])
    while True:
        try:
            request = read_message(calls)
        except EOFError:
            os._exit(0)  # the tests' process is gone
        if request[0] == "exit":
            os._exit(request[1])
        try:
            answer = ["ok", *perform(request, resolve, refer)]
        except SystemExit:
            raise
        except BaseException as exc:
            try:
                args = encode(list(exc.args), refer)
            except Exception:
                args = ["list", []]
            answer = ["raised", type(exc).__name__, args, describe(exc)]
        write_message(answers, answer)


MUTABLE = (list, dict, set, bytearray, collections.deque)


def perform(request: list, resolve, refer) -> tuple:
    """Carry out one request on the program's objects; (the result, the mutable arguments
    sent as data as the call left them, ``[[position or name, value], ...]``)."""
    op, target, *operands = request
    subject = resolve(target)
    changed = []
    if op == "call":
        args = [decode(value, resolve) for value in operands[0]]
        kwargs = {name: decode(value, resolve) for name, value in operands[1]}
        result = subject(*args, **kwargs)
        positional = [(i, encoded, args[i]) for i, encoded in enumerate(operands[0])]
        named = [(name, encoded, kwargs[name]) for name, encoded in operands[1]]
        for key, encoded, value in positional + named:
            if isinstance(value, MUTABLE) and not (type(encoded) is list and encoded[0] == "ref"):
                changed.append([key, encode(value, refer)])
    elif op == "getattr":
        result = getattr(subject, operands[0])
    elif op == "setattr":
        result = setattr(subject, operands[0], decode(operands[1], resolve))
    elif op == "getitem":
        result = subject[decode(operands[0], resolve)]
    elif op == "setitem":
        subject[decode(operands[0], resolve)] = decode(operands[1], resolve)
        result = None
    elif op == "delitem":
        del subject[decode(operands[0], resolve)]
        result = None
    elif op in ("len", "iter", "next", "bool", "repr", "str"):
        result = {"len": len, "iter": iter, "next": next, "bool": bool, "repr": repr, "str": str}[op](subject)
    elif op == "contains":
        result = decode(operands[0], resolve) in subject
    else:
        raise ValueError(f"unknown request {op!r}")
    return encode(result, refer), changed


# --------------------------------------------------------------------------------------
# The tests' process: forked by the supervisor, never running a line of the program's code.


class ProgramEnded(BaseException):
    """The program's process is gone (a ``BaseException``: the tests' ``except Exception``
    does not take it; the tests' process remembers it anyway)."""


class ProgramBrokeProtocol(BaseException):
    """An answer that is not an encoded value."""


class Channel:
    """The tests' end of the channel: one request, one answer, every value checked as it
    is decoded. Once the program is gone or sent garbage, every request fails."""

    def __init__(self, calls: int, answers: int):
        self.calls, self.answers = calls, answers
        self.stand_ins: dict[int, Remote] = {}  # one per object of the program, so ``is`` works
        self.ended = False
        self.broken: str | None = None
        self.loading = True  # reading the program's names: its modules may be the tests' own

    def receive(self) -> list:
        if self.ended:
            raise ProgramEnded
        if self.broken is not None:
            raise ProgramBrokeProtocol(self.broken)
        try:
            message = read_message(self.answers)
            if type(message) is not list or not message or type(message[0]) is not str:
                raise ValueError("an answer must be a list that starts with its kind")
            return message
        except EOFError:
            self.ended = True
            raise ProgramEnded from None
        except (ValueError, RecursionError, MemoryError) as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise ProgramBrokeProtocol(self.broken) from None

    def request(self, op: str, subject, *operands):
        """Send ``[op, subject, *operands]`` (already encoded) and decode the answer."""
        if self.ended:
            raise ProgramEnded
        try:
            write_message(self.calls, [op, ["ref", subject._ref], *operands])
        except OSError:
            self.ended = True
            raise ProgramEnded from None
        answer = self.receive()
        try:
            if answer[0] == "ok" and len(answer) == 3 and type(answer[2]) is list:
                return self.decode(answer[1]), [(key, self.decode(value)) for key, value in answer[2]]
            if not (answer[0] == "raised" and len(answer) == 4 and type(answer[1]) is str and type(answer[3]) is str):
                raise ValueError(f"an answer of kind {answer[0]!r}")
            raised = remote_exception(answer[1], self.decode(answer[2]), answer[3], iterating=op == "next")
        except (ValueError, TypeError, KeyError, RecursionError, MemoryError) as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise ProgramBrokeProtocol(self.broken) from None
        raise raised

    def decode(self, value):
        return decode(value, self.stand_in)

    def stand_in(self, encoded: list):
        """The tests' object for one of the program's: among its names, a module as the
        tests' own module of that name (:func:`trusted_module`); else a :class:`Remote`."""
        if encoded[0] == "module" and len(encoded) == 3 and type(encoded[1]) is str:
            module = trusted_module(encoded[1]) if self.loading else None
            if module is not None:
                return module
            encoded = ["ref", encoded[2], "module"]
        if len(encoded) != 3 or type(encoded[1]) is not int or type(encoded[2]) is not str:
            raise ValueError("a stand-in is ['ref', id, type name]")
        if encoded[1] not in self.stand_ins:
            self.stand_ins[encoded[1]] = Remote(encoded[1], encoded[2][:200])
        return self.stand_ins[encoded[1]]


CHANNEL: Channel | None = None  # the tests' process's channel, set by run_tests


TESTS_MAY_IMPORT = frozenset(
    {"bisect", "cmath", "collections", "copy", "datetime", "decimal", "fractions", "functools", "heapq",
     "itertools", "json", "math", "numpy", "operator", "random", "re", "statistics", "string", "typing"}
)  # fmt: skip
"""Modules the tests' process imports itself when the program has them: their names are
this list's, never the program's word (importing a module runs its code, and some run
more: ``IPython.__main__`` runs the configuration files under ``$HOME``)."""


def trusted_module(name: str):
    """The tests' process's own module ``name``: one it has loaded already, or imports from
    ``TESTS_MAY_IMPORT``; else None."""
    if name == "__main__":
        return None  # here, that is this launcher
    module = sys.modules.get(name)
    if module is None and name in TESTS_MAY_IMPORT:
        try:
            module = importlib.import_module(name)
        except Exception:
            return None
    return module if isinstance(module, type(sys)) else None


def tests_may_take(name: str, value) -> bool:
    """Whether the program's name ``name`` joins the tests' namespace: never one of Python's
    (``__builtins__``, ...) or a built-in's (``sorted``, ``isinstance``); under a module's
    name (``math``, ``numpy``, ``np``: any module installed here) only that module as the
    tests' process's own, and never a module the tests' process does not have
    (:func:`trusted_module`). So the tests' comparisons stay theirs."""
    if (name.startswith("__") and name.endswith("__")) or hasattr(builtins, name):
        return False
    if isinstance(value, type(sys)):  # the tests' own module, under its own name or its usual alias
        return name in (value.__name__, value.__name__.rpartition(".")[2]) or MODULE_ALIASES.get(name) == value.__name__
    return not (isinstance(value, Remote) and value._type == "module") and not names_a_module(name)


MODULE_ALIASES = {"np": "numpy", "pd": "pandas", "plt": "matplotlib.pyplot", "sp": "scipy", "jnp": "jax.numpy"}
"""Names by which tests use modules: the program's objects under them stay out of the tests."""


def names_a_module(name: str) -> bool:
    """Whether ``name`` is a module's the tests could mean: one of Python's, an alias, or
    one installed here (found, not imported)."""
    if name in sys.stdlib_module_names or name in TESTS_MAY_IMPORT or name in MODULE_ALIASES:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return True


def remote_exception(name: str, args, text: str, *, iterating: bool) -> Exception:
    """The exception for one the program's code raised: the built-in exception of that
    name (so the tests' ``except ValueError`` works), else ``Exception``, with the
    program's traceback as a note. ``StopIteration`` only answers ``next`` (``iterating``):
    out of a call it becomes ``RuntimeError``, as out of a generator (PEP 479), so it
    cannot quietly end a loop of the tests around the call."""
    kind = getattr(builtins, name, None)
    described = [f"{name}: {', '.join(map(str, args))}"]
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        kind, args = Exception, described
    elif issubclass(kind, (StopIteration, StopAsyncIteration)) and not iterating:
        kind, args = RuntimeError, described
    try:
        exc = kind(*args)
    except Exception:  # arguments the built-in does not take (UnicodeDecodeError's five, ...)
        exc = Exception(*described)
    exc.add_note("In the program:\n" + text[-4000:].rstrip())
    return exc


class Remote:
    """One of the program's objects (a function, a class, an instance) as the tests see it.

    Calls, attributes, items, ``len``, iteration, membership, truth, ``repr`` and ``str``
    are requests to the program, and their results come back as data or further stand-ins;
    the arguments go as data or as the stand-ins they are. Equality and hashing are by
    identity: an object of the program never decides whether it equals a value of the
    tests."""

    __slots__ = ("_ref", "_type", "__weakref__")

    def __init__(self, ref: int, type_name: str):
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_type", type_name)

    def __call__(self, *args, **kwargs):
        encoded = [encode(value, refer_in_tests) for value in args]
        named = [[name, encode(value, refer_in_tests)] for name, value in kwargs.items()]
        result, changed = CHANNEL.request("call", self, encoded, named)
        for key, value in changed:  # what the call did to the mutable arguments the tests passed
            if type(key) is int and 0 <= key < len(args):
                update_in_place(args[key], value)
            elif type(key) is str and key in kwargs:
                update_in_place(kwargs[key], value)
        return result

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # protocol lookups stay here
        return CHANNEL.request("getattr", self, name)[0]

    def __setattr__(self, name, value):
        CHANNEL.request("setattr", self, name, encode(value, refer_in_tests))

    def __getitem__(self, key):
        return CHANNEL.request("getitem", self, encode(key, refer_in_tests))[0]

    def __setitem__(self, key, value):
        CHANNEL.request("setitem", self, encode(key, refer_in_tests), encode(value, refer_in_tests))

    def __delitem__(self, key):
        CHANNEL.request("delitem", self, encode(key, refer_in_tests))

    def __contains__(self, value):
        return CHANNEL.request("contains", self, encode(value, refer_in_tests))[0] is True

    def __len__(self):
        return CHANNEL.request("len", self)[0]

    def __bool__(self):
        return CHANNEL.request("bool", self)[0] is True

    def __iter__(self):
        return CHANNEL.request("iter", self)[0]

    def __next__(self):
        return CHANNEL.request("next", self)[0]

    def __repr__(self):
        try:
            text = CHANNEL.request("repr", self)[0]
        except Exception:
            text = None
        return text if type(text) is str else f"<{self._type} of the program>"

    def __str__(self):
        try:
            text = CHANNEL.request("str", self)[0]
        except Exception:
            text = None
        return text if type(text) is str else repr(self)

    __eq__ = object.__eq__
    __hash__ = object.__hash__


def refer_in_tests(value):
    """How the tests' side sends what is not plain data: a stand-in as its reference."""
    if isinstance(value, Remote):
        return ["ref", value._ref]
    for base in (bool, int, float, complex, str):
        if isinstance(value, base):
            return encode(base(value), refer_in_tests)
    raise TypeError(
        "the tests can give the program data (None, bool, int, float, complex, str, bytes, bytearray, range, "
        f"slice, and lists, tuples, sets, dicts and deques of them) or its own objects, not {type(value).__name__}"
    )


def update_in_place(old, new) -> None:
    """Make the tests' mutable argument ``old`` hold ``new``, what the program's call left in
    its copy, keeping the objects inside it where their types agree."""
    if isinstance(old, (list, collections.deque)) and isinstance(new, (list, collections.deque)):
        if len(old) != len(new):
            old.clear()
            old.extend(new)
            return
        for i, item in enumerate(new):
            if isinstance(old[i], MUTABLE) and type(old[i]) is type(item):
                update_in_place(old[i], item)
            else:
                old[i] = item
    elif isinstance(old, dict) and isinstance(new, dict):
        for key in [key for key in old if key not in new]:
            del old[key]
        for key, item in new.items():
            if key in old and isinstance(old[key], MUTABLE) and type(old[key]) is type(item):
                update_in_place(old[key], item)
            else:
                old[key] = item
    elif isinstance(old, set) and isinstance(new, set):
        old.clear()
        old.update(new)
    elif isinstance(old, bytearray) and isinstance(new, (bytes, bytearray)):
        old[:] = new


def run_tests(tests: bytes, calls: int, answers: int, verdict: int) -> None:
    """Receive what the program's names hold, run ``tests`` in a namespace of those, then
    tell the supervisor ``RETURNED`` if the tests' code returned, tell the program to exit
    and exit: 0, ``TESTS_FAILED``, ``PROGRAM_ENDED`` or ``PROGRAM_BROKE_PROTOCOL``."""
    global CHANNEL
    CHANNEL = channel = Channel(calls, answers)
    write_message(calls, ["start"])
    module = type(sys)("__main__")  # what unittest.main() and doctest.testmod() look for
    module.__builtins__ = builtins
    sys.modules["__main__"], sys.argv = module, ["<tests>"]
    namespace = module.__dict__
    returned = False
    try:
        loaded = channel.receive()
        if loaded[0] != "loaded" or len(loaded) != 2 or type(loaded[1]) is not list:
            raise ValueError("the first message must be ['loaded', [[name, value], ...]]")
        for name, value in loaded[1]:
            if type(name) is not str:
                raise ValueError("a name must be a str")
            value = channel.decode(value)
            if tests_may_take(name, value):
                namespace[name] = value
        channel.loading = False
    except (ValueError, TypeError, KeyError, RecursionError, MemoryError) as e:
        channel.broken = f"{type(e).__name__}: {e}"
    except (ProgramEnded, ProgramBrokeProtocol):
        pass
    else:
        linecache.cache["<tests>"] = (len(tests), None, tests.decode("utf-8", "replace").splitlines(True), "<tests>")
        try:
            exec(compile(tests, "<tests>", "exec"), namespace)
            returned = True
        except SystemExit as exc:  # unittest.main() ends so: a success if its status is
            returned = exc.code in (None, 0, False)
            if not returned:
                sys.stderr.write(describe(exc))
        except BaseException as exc:
            sys.stderr.write(describe(exc))
    if channel.ended:
        code = PROGRAM_ENDED
    elif channel.broken is not None:
        print(f"sandbox: the program's answer could not be read as data ({channel.broken})", file=sys.stderr)
        code = PROGRAM_BROKE_PROTOCOL
    elif returned:
        os.write(verdict, RETURNED)
        code = 0
    else:
        code = TESTS_FAILED
    try:
        write_message(calls, ["exit", code])
    except OSError:
        pass
    os._exit(code)


def describe(exc: BaseException) -> str:
    """``exc`` with its traceback, as Python prints it, less this launcher's frames."""
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if frame.filename != "<string>"]
    lines = ["Traceback (most recent call last):\n"] if frames else []
    return "".join([*lines, *traceback.format_list(frames), *traceback.format_exception_only(exc)])


# --------------------------------------------------------------------------------------
# Values on the channel: JSON, one message per length-prefixed frame.
#
# None, bool, str, a float that is finite and an int below 2**63 in size are themselves;
# everything else is a list led by its kind: ["int", hex], ["float", "nan" | "inf" |
# "-inf"], ["complex", re, im], ["range" | "slice", start, stop, step], ["bytes", hex],
# ["bytearray", hex], ["list" | "tuple" |
# "set" | "frozenset" | "deque", [items]], ["dict", [[key, value], ...]], and a stand-in,
# ["ref", id, type name] or ["module", name, id] (the tests send ["ref", id]).


SEQUENCES = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset, "deque": collections.deque}


def encode(value, refer, depth: int = 0):
    """``value`` as JSON-ready data; ``refer(value)`` for what is not data (or nested more
    than ``MAX_DEPTH`` deep)."""
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value if -SMALL_INT < value < SMALL_INT else ["int", hex(value)]
    if kind is float:
        return value if math.isfinite(value) else ["float", repr(value)]
    if kind is complex:
        return ["complex", encode(value.real, refer), encode(value.imag, refer)]
    if kind is range or kind is slice:
        return [kind.__name__, *(encode(part, refer, depth + 1) for part in (value.start, value.stop, value.step))]
    if depth >= MAX_DEPTH:
        return refer(value)
    if isinstance(value, (bytes, bytearray)):
        return ["bytearray" if isinstance(value, bytearray) else "bytes", bytes(value).hex()]
    if isinstance(value, dict):
        return ["dict", [[encode(k, refer, depth + 1), encode(v, refer, depth + 1)] for k, v in value.items()]]
    for name, sequence in SEQUENCES.items():
        if isinstance(value, sequence):
            return [name, [encode(item, refer, depth + 1) for item in value]]
    return refer(value)


def decode(value, stand_in):
    """The value ``encode`` made, with ``stand_in(encoded)`` for the references; raises
    ``ValueError`` (or ``TypeError``, ``KeyError``, ``RecursionError``) for anything else."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is not list or not value or type(value[0]) is not str:
        raise ValueError(f"not an encoded value: {str(value)[:100]}")
    tag, rest = value[0], value[1:]
    if tag in SEQUENCES and len(rest) == 1 and type(rest[0]) is list:
        return SEQUENCES[tag](decode(item, stand_in) for item in rest[0])
    if tag == "dict" and len(rest) == 1 and type(rest[0]) is list:
        pairs = rest[0]
        if not all(type(pair) is list and len(pair) == 2 for pair in pairs):
            raise ValueError("a dict is a list of [key, value] pairs")
        return {decode(k, stand_in): decode(v, stand_in) for k, v in pairs}
    if len(rest) == 1 and type(rest[0]) is str:
        if tag == "int":
            return int(rest[0], 16)
        if tag == "float" and rest[0] in ("nan", "inf", "-inf"):
            return float(rest[0])
        if tag in ("bytes", "bytearray"):
            return (bytes if tag == "bytes" else bytearray).fromhex(rest[0])
    if tag in ("range", "slice") and len(rest) == 3:
        parts = [decode(part, stand_in) for part in rest]
        if tag == "range" and all(type(part) is int for part in parts):
            return range(*parts)
        if tag == "slice":
            return slice(*parts)
    if tag == "complex" and len(rest) == 2:
        real, imag = decode(rest[0], stand_in), decode(rest[1], stand_in)
        if type(real) is float and type(imag) is float:
            return complex(real, imag)
    if tag in ("ref", "module"):
        return stand_in(value)
    raise ValueError(f"not an encoded value: {str(value)[:100]}")


def write_message(fd: int, message) -> None:
    """Send ``message`` as JSON, after its length in 8 bytes."""
    data = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    view = memoryview(len(data).to_bytes(8, "big") + data)
    while view:
        view = view[os.write(fd, view) :]


def read_message(fd: int):
    """The next message on ``fd``; ``EOFError`` at its end, ``ValueError`` for one over
    ``MAX_MESSAGE_BYTES`` or not JSON."""
    size = int.from_bytes(read_exactly(fd, 8), "big")
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"a message of {size} bytes (at most {MAX_MESSAGE_BYTES})")
    return json.loads(read_exactly(fd, size))


def read_exactly(fd: int, size: int) -> bytes:
    """``size`` bytes from ``fd``; ``EOFError`` if it ends first."""
    chunks = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


if __name__ == "__main__":
    main()
