"""Directories written so that a crash never leaves a half-written one in their place.

:func:`staged_directory` gives a hidden staging directory beside the target to write into and
swaps it in when the block ends (:func:`swap_in`); a save killed at any point leaves the
previous directory or the new one, and its leftovers, named for the process that made them
(:func:`_sibling`), are cleaned up by the next save or load on the same machine once that
process has ended (:func:`recover`). :func:`jaxrl_llm.models.hf.save_pretrained` and
:func:`jaxrl_llm.models.lora.save_adapter` write through it.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator

__all__ = ["recover", "staged_directory", "swap_in"]


@contextlib.contextmanager
def staged_directory(target: pathlib.Path, *, replaced: Callable[[], set[str]]) -> Iterator[pathlib.Path]:
    """A hidden staging directory beside ``target`` (``.{name}.saving.*``) to write into; when
    the block ends without an exception, its files get ``0o666 & ~umask`` and it is swapped
    in for ``target`` (:func:`swap_in`, dropping ``target``'s ``replaced()`` names), else it
    is removed. First cleans up after dead saves to ``target`` (:func:`recover`). What
    :func:`jaxrl_llm.models.hf.save_pretrained` and :func:`jaxrl_llm.models.lora.save_adapter`
    write through."""
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)
    file_mode = 0o666 & ~umask()
    staging = _sibling(target, "saving")
    staging.mkdir()  # 0o777 & ~umask
    try:
        yield staging
        for file in staging.iterdir():
            if file.is_file():  # not a tokenizer's template directory
                os.chmod(file, file_mode)  # safetensors creates its files 0o600
        swap_in(staging, target, replaced=replaced())
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def swap_in(staging: pathlib.Path, target: pathlib.Path, *, replaced: set[str]) -> None:
    """Moves the finished ``staging`` directory to ``target``.

    An existing ``target``'s entries other than the ``replaced`` names (the previous
    checkpoint's files) and the names ``staging`` holds are carried into ``staging`` first:
    symlinks as symlinks, files by hard link where possible. Then ``target`` is renamed aside,
    ``staging`` renamed to ``target`` (the old directory goes back if that fails) and the old
    directory removed. A working directory inside ``target`` is re-entered.
    """
    if not target.exists():
        os.replace(staging, target)
        return
    with os.scandir(target) as entries:
        for entry in entries:
            destination = staging / entry.name
            if entry.name in replaced or os.path.lexists(destination):
                continue
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), destination)
            elif entry.is_dir():
                shutil.copytree(entry.path, destination, symlinks=True, copy_function=link_or_copy)
            else:
                link_or_copy(entry.path, destination)
    try:
        cwd = pathlib.Path(os.getcwd())
    except OSError:  # the working directory was deleted
        cwd = None
    retired = _sibling(target, "old")
    try:
        os.replace(target, retired)
        os.replace(staging, target)
    except BaseException:  # an interrupt too: never leave the path without a checkpoint
        if os.path.lexists(retired):
            _put_back(retired, target)
        raise
    if cwd is not None and (cwd == target or target in cwd.parents):
        os.chdir(cwd)  # the old inode is going: enter the same path in the new directory
    shutil.rmtree(retired, ignore_errors=True)


def link_or_copy(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


# --- Leftovers of interrupted saves --------------------------------------------------------------


def _sibling(target: pathlib.Path, kind: str) -> pathlib.Path:
    """A fresh hidden name next to ``target`` that records this process as its owner:
    ``.{name}.{kind}.{host name}.{pid namespace}.{pid}.{start time}.{8 hex digits}``."""
    pid = os.getpid()
    owner = f"{_machine()}.{pid}.{start_time(pid) or 0}"
    return target.with_name(f".{target.name}.{kind}.{owner}.{secrets.token_hex(4)}")


def _machine() -> str:
    """``{host name}.{pid namespace}``: the scope in which a pid names one process."""
    try:
        namespace = re.sub(r"\D", "", os.readlink("/proc/self/ns/pid"))
    except OSError:  # no Linux /proc
        namespace = "0"
    return f"{socket.gethostname()}.{namespace}"


def start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot), ``"zombie"`` once it has exited;
    None where unknown (no such process, or no Linux /proc)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return "zombie" if fields[0] in ("Z", "X") else fields[19]


def _ended(pid: int, start: str) -> bool:
    """Whether the process ``pid`` that started at ``start`` has ended: the pid is free, a
    zombie's, or a later process's (another start time). Unknown counts as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process
        pass
    now = start_time(pid)
    return now is not None and now != start


def _put_back(retired: pathlib.Path, target: pathlib.Path) -> None:
    """A previous checkpoint renamed aside goes back to ``target`` if that is missing, else away."""
    if os.path.lexists(target):
        shutil.rmtree(retired, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):  # another process put one back first; else the next recovery retries
            os.replace(retired, target)


def recover(target: pathlib.Path) -> None:
    """Cleans up after saves to ``target`` whose process died on this machine.

    Their staging directories are removed; a previous checkpoint they renamed aside goes back
    to ``target`` if that is missing (the save died between its two renames), else is
    removed. Leftovers whose owner (:func:`_sibling`) runs, or ran on another machine, stay.
    """
    leftover = re.compile(
        rf"\.{re.escape(target.name)}\.(saving|old)\.{re.escape(_machine())}\.(\d{{1,9}})\.(\d+)\.[0-9a-f]{{8}}"
    )
    try:
        names = sorted(os.listdir(target.parent))
    except OSError:  # no parent directory, or an unreadable one
        return
    for name in names:
        match = leftover.fullmatch(name)
        if match is None or not _ended(int(match[2]), match[3]):
            continue
        if match[1] == "old":
            _put_back(target.parent / name, target)
        else:
            shutil.rmtree(target.parent / name, ignore_errors=True)


def umask() -> int:
    """The process's umask: from /proc on Linux, else by setting and restoring it."""
    try:
        match = re.search(r"^Umask:\s+([0-7]+)$", pathlib.Path("/proc/self/status").read_text(), re.M)
    except OSError:
        match = None
    if match:
        return int(match[1], 8)
    mask = os.umask(0o077)  # not race-free: a file another thread creates meanwhile gets the strictest mask
    os.umask(mask)
    return mask
