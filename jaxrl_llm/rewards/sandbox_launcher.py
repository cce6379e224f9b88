"""The program the sandbox runs as its first process: the supervisor, which launches the untrusted program.

:mod:`jaxrl_llm.rewards.sandbox` reads this file once, when it is imported, and runs its
source behind util-linux ``unshare`` where namespaces work::

    python -I -B -u -c '<this source>' '<configuration as JSON>'

never by ``import`` or ``-m``: ``-I`` keeps ``PYTHONPATH``, the user's site directory and
the current directory off ``sys.path`` (a sibling such as ``code.py`` cannot shadow a
standard module in the program), and the source run on its own does not import
:mod:`jaxrl_llm`, which would load JAX into every sandbox. Held in memory, it does not
depend on the file staying in view (the sandbox hides ``/root`` and the home directories)
or unchanged (a program that overwrites the file changes no later run). So it is trusted
code that uses the standard library only; importing it merely defines its functions.

What it reads: one JSON object, its last argument -- ``workdir`` and ``program`` (the
working directory and the program's source file in it), two descriptors it inherits
(``report_fd``, a pipe to the parent; ``tests_fd``, an anonymous file holding the
tests), ``rlimits`` (``{"RLIMIT_CPU": [soft, hard], ...}``), ``uid`` (a fresh uid to run
the program as, or null), ``mounts`` and ``hide`` (whether to set up the file system, and
the directories to cover), and the switches ``drop_privileges`` and ``audit``. Nothing
secret is in it: the tests stay in the anonymous file until the supervisor hands them
over, and the proof of completion is made later, in the supervisor only.

What it writes: JSON lines on ``report_fd`` -- "setup" and "ready" (the layers active and
the problems met), "setup_error" (the program could not be started) and "exit" (the
program's exit status, whether it returned the proof of completion, its CPU seconds).

What it does, as PID 1 of the namespaces: hides directories and remounts the rest
read-only (:func:`setup_filesystem`), then forks. The first process stays the supervisor
(:func:`supervise`): it runs the completion protocol with the program (the sandbox
module's docstring, "Completion"), waits for it and reports. The other becomes the
program (:func:`become_program`: limits, privileges, the audit hook of
:func:`install_guard`) and runs the source, then the tests (:func:`run`).
"""

import builtins
import ctypes
import json
import linecache
import os
import re
import resource
import stat
import sys
import time
import traceback
import types

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

SETUP_FAILED = 70  # exit status of a program's process that could not get ready (EX_SOFTWARE)
SECRET_SIZE = 33  # the proof of completion: 32 hex digits and a newline


def main() -> None:
    """Prepare the file system, fork, and be the supervisor in one process and the program
    in the other. Both end in ``os._exit``, unless the program raises ``SystemExit``."""
    config = json.loads(sys.argv[-1])
    report = config["report_fd"]
    libc = load_libc()
    active, problems = ["rlimits"], []
    if config["mounts"]:
        layers, trouble = setup_filesystem(libc, config["hide"], config["workdir"], config["disk_mb"], config["uid"])
        active += layers
        problems += trouble
    send(report, event="setup", active=active, problems=problems)

    status_r, status_w = os.pipe()  # program -> supervisor: "ready", "solution-done", "tests-done", the secret
    release_r, release_w = os.pipe()  # supervisor -> program: the tests, then the secret
    supervisor = os.getpid()
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the program stay ours (PID 1 already is)
    try:
        pid = os.fork()
    except OSError as e:
        send(report, event="setup_error", message=f"fork: {e}")
        os._exit(SETUP_FAILED)
    if pid:
        os.close(status_w)
        os.close(release_r)
        status, completed, why = supervise(libc, pid, status_r, release_w, config["tests_fd"], report)
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        send(
            report,
            event="exit",
            returncode=os.waitstatus_to_exitcode(status),
            completed=completed,
            why=why,
            cpu_seconds=usage.ru_utime + usage.ru_stime,
        )
        os._exit(0)

    for fd in (status_r, release_w, config["tests_fd"], report):
        os.close(fd)
    source = become_program(libc, config, status_w, supervisor, active, problems)
    filename = config["program"]
    del libc, config  # the program can walk its frames up to this one: no libc handle, no configuration
    module = types.ModuleType("__main__")
    module.__file__ = filename
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    sys.argv = [filename]
    run(source, filename, module.__dict__, status_w, release_r)


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


def supervise(
    libc, program: int, status_r: int, release_w: int, tests_fd: int, report: int
) -> tuple[int, bool, str | None]:
    """Forward the program's "ready"; hand it the tests once its own code has returned,
    and the secret once the tests have (if it is then alone); return (wait status, whether
    the secret came back, why it was withheld)."""
    import select  # the supervisor's alone: the program's process never loads it

    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no reading or writing our memory, or reopening our descriptors
    tests = read_file(tests_fd)
    os.close(tests_fd)
    stage, partial, out, secret, completed, why, status = "ready", b"", b"", None, False, None, None
    release = release_w

    def handle(line):
        nonlocal stage, out, secret, completed, why, release
        if stage == "ready":  # "ready" or "setup_error", for the parent
            try:
                os.write(report, line + b"\n")
            except OSError:
                pass
            stage = "solution"
        elif stage == "solution" and line == b"solution-done":
            out, stage = len(tests).to_bytes(8, "big") + tests, "tests"
        elif stage == "tests" and line == b"tests-done":
            why = isolate(program)
            if why is None:
                secret = os.urandom(16).hex().encode()  # born now, in this process only
                out, stage = out + secret + b"\n", "proof"
            else:
                os.close(release)  # the program reads EOF and exits 1
                out, stage, release = b"", "refused", None
        elif stage == "proof" and line == secret:
            completed, stage = True, "done"

    def receive():
        """Act on the complete lines waiting in the status pipe; False at EOF."""
        nonlocal partial
        for _ in range(64):  # a flood does not starve the rest of the loop
            try:
                chunk = os.read(status_r, 65536)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            *lines, partial = (partial + chunk).split(b"\n")
            if len(partial) > 4096:
                partial = b"\xff"  # an over-long line, which then matches nothing
            for line in lines:
                handle(line)
        return True

    os.set_blocking(status_r, False)
    os.set_blocking(release_w, False)
    try:
        exited = os.pidfd_open(program)  # readable once the program exits
    except (AttributeError, OSError):
        exited = None
    watch = [status_r] + ([exited] if exited is not None else [])
    while status is None:
        sending = [release] if out and release is not None else []
        ready, writable, _ = select.select(watch, sending, [], None if exited is not None else 0.01)
        if status_r in ready and not receive():
            watch.remove(status_r)  # EOF
        if writable and release is not None:
            try:
                out = out[os.write(release, out[:65536]) :]
            except BlockingIOError:
                pass
            except OSError:
                out = b""  # nobody reads any more
        status = reap(program)
    if status_r in watch:
        receive()  # what it wrote just before it exited
    if release is not None:
        os.close(release)
    return status, completed, why


def read_file(fd: int) -> bytes:
    """All of the file open as ``fd``, read from offset 0 (its position is left alone)."""
    size, data = os.fstat(fd).st_size, b""
    while len(data) < size:
        chunk = os.pread(fd, size - len(data), len(data))
        if not chunk:
            break
        data += chunk
    return data


def reap(program: int) -> int | None:
    """Reap every child that has exited (the supervisor is the reaper of the whole
    sandbox); the wait status of ``program`` if it is one of them, else None."""
    status = None
    while True:
        try:
            reaped, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if reaped == 0:
            break
        if reaped == program:
            status = wait_status
    return status


def isolate(program: int) -> str | None:
    """SIGKILL every process under the supervisor (this process) but ``program``; None once
    that is the only one left and has a single thread, else why not (after a short grace
    period: a joined thread lingers for a moment)."""
    supervisor = os.getpid()
    deadline = time.monotonic() + 0.5
    while True:
        children, threads = {}, 0
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
                children.setdefault(int(fields[1]), []).append((int(name), fields[0]))
                if int(name) == program:
                    threads = int(fields[17])
            except (OSError, ValueError, IndexError):
                continue
        others, todo = [], [supervisor]
        while todo:
            for child, state in children.get(todo.pop(), ()):
                todo.append(child)
                if child != program and state not in (b"Z", b"X"):
                    others.append(child)
        for other in others:
            try:
                os.kill(other, 9)
            except OSError:
                pass
        if not others and threads == 1:
            return None
        if time.monotonic() > deadline:
            if others:
                return f"processes of the program outlived SIGKILL when its tests ended: {others}"
            return (
                f"the program had {threads} threads when its tests ended; it must be down to one "
                "(threads left running could take the proof of completion)"
            )
        time.sleep(0.002)


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
    return source


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


def run(
    source,
    filename,
    namespace,
    status_w,
    release_r,
    size=SECRET_SIZE,
    read=os.read,
    write=os.write,
    splice=getattr(os, "splice", None),  # noqa: B008 (bound once, at definition, before the guard)
    blocking=os.set_blocking,
    _exit=os._exit,
    compile=compile,
    exec=exec,
    modules=sys.modules,
    lines=linecache.cache,
    print_exception=traceback.print_exception,
):
    """The solution, the tests the supervisor then hands over, then the proof. What it
    calls is bound here, before the solution runs, as fast locals (rebinding them would
    take a trace function). An exception exits 1 at once. From "tests-done" on it calls
    only built-in functions, and the secret goes from pipe to pipe inside the kernel
    (splice), never through this process's memory."""
    try:
        exec(compile(source, filename, "exec"), namespace)
        blocking(status_w, True)  # the solution may have cleared it: the flag is shared
        blocking(release_r, True)
        write(status_w, b"solution-done\n")
        data = b""
        while len(data) < 8 or len(data) < 8 + int.from_bytes(data[:8], "big"):
            chunk = read(release_r, 1 << 16)
            if not chunk:
                _exit(1)
            data += chunk
        tests = data[8:]
        lines["<tests>"] = (len(tests), None, tests.decode("utf-8", "replace").splitlines(True), "<tests>")
        exec(compile(tests, "<tests>", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as exc:
        print_exception(type(exc), exc, exc.__traceback__.tb_next)
        _exit(1)
    shutdown = getattr(modules.get("threading"), "_shutdown", None)
    if shutdown is not None:
        shutdown()  # join the threads left behind, as a normal exit does
    blocking(status_w, True)
    blocking(release_r, True)
    write(status_w, b"tests-done\n")
    moved = 0
    while moved < size:
        left = size - moved
        try:
            n = splice(release_r, status_w, left) if splice else write(status_w, read(release_r, left))
        except BlockingIOError:  # cleared again before the supervisor made us alone
            blocking(status_w, True)
            blocking(release_r, True)
            continue
        if not n:
            _exit(1)  # withheld: see the supervisor's report
        moved += n
    _exit(0)


if __name__ == "__main__":
    main()
