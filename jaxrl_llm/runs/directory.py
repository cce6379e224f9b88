"""The run directory: what it holds, its marker and lock, and the checks before a run takes it.

**Its layout**::

    .jaxrl-llm-run       marks it as a run's: only such a directory is ever replaced
    .jaxrl-llm-lock      flock-ed by the process training in it (its pid and host)
    config.json          the resolved RunConfig (every field)
    warm_start.json      the warm start's losses and its held-out evaluation
    metrics.jsonl        one line per step: {"step": s, every metric of training.train}
    samples.jsonl        every `samples_every` steps: prompts, completions, rewards
    metrics.png          reward, held-out accuracy, KL, length, clip fraction, entropy
    tensorboard/         TensorBoard event files
    checkpoints/<step>/  orbax checkpoints of the whole TrainState and a KL run's reference (the
                         last `keep_checkpoints`); a LoRA run's hold the adapters and their
                         optimizer state, not the base
    base.json            a LoRA run's base: where it is and the digest of each of its arrays
    base/                a LoRA run's base when it is not model.path's weights as they are (the
                         built-in model, a warm start): one orbax checkpoint, written once
    eval/step-<s>.json   what `jaxrl-llm eval` measured
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pathlib
import re
import shutil
import socket
import tempfile
import time
from typing import Any

from jaxrl_llm import training
from jaxrl_llm.rewards.combine import RewardFunctionError
from jaxrl_llm.runs import records
from jaxrl_llm.runs.config import RunConfig, differences, from_dict, to_dict

CONFIG_FILE = "config.json"
WARM_START_FILE = "warm_start.json"
CHECKPOINTS = "checkpoints"
BASE_FILE = "base.json"
BASE_CHECKPOINT = "base"
MARKER_FILE = ".jaxrl-llm-run"
"""Marks a directory as a run's: written with its config, before anything else of the run."""
LOCK_FILE = ".jaxrl-llm-lock"
"""Held (``flock``) by the process training in the run directory; names it (pid, host)."""
RUN_ENTRIES = frozenset(
    {
        CONFIG_FILE,
        WARM_START_FILE,
        CHECKPOINTS,
        BASE_FILE,
        BASE_CHECKPOINT,
        "eval",
        MARKER_FILE,
        LOCK_FILE,
        "wandb",
        records.METRICS_FILE,
        records.SAMPLES_FILE,
        records.PLOT_FILE,
        records.TENSORBOARD_DIR,
        records.WANDB_ID_FILE,
    }
)
"""What a run directory holds (and ``.<name>.*`` temporaries of these): ``--overwrite``
deletes these, and refuses a directory that holds anything else."""

RUN_MANAGEMENT = (
    "steps",
    "save_every",
    "keep_checkpoints",
    "samples_every",
    "samples_prompts",
    "plot_every",
    "tensorboard",
    "wandb_project",
    "compilation_cache",
    "mesh",
    "model.remat",
    "model.attention",
)
"""Settings a continued run may change, by dotted name: they decide how long it runs, what
it writes, on which devices (a checkpoint restores onto another mesh) and how the model
executes, not what it computes (``steps`` also sets the end of a decaying learning-rate
schedule without ``train.optimizer.decay_steps``, and is then fixed). ``model.scan_layers``
is not one: it is the layout of the params the checkpoints hold."""


class RunDirectoryError(ValueError):
    """The run directory does not fit the request (another run, nothing to resume, ...)."""


def _foreign_entries(run_dir: pathlib.Path) -> list[str]:
    """The names in ``run_dir`` that are not a run's (:data:`RUN_ENTRIES`)."""

    def ours(name: str) -> bool:
        return name in RUN_ENTRIES or any(name.startswith(f".{entry}.") for entry in RUN_ENTRIES)

    return sorted(entry.name for entry in run_dir.iterdir() if not ours(entry.name))


def _is_empty(run_dir: pathlib.Path) -> bool:
    """Whether ``run_dir`` holds nothing but a lock or marker (a start that wrote nothing else)."""
    return all(entry.name in (LOCK_FILE, MARKER_FILE) for entry in run_dir.iterdir())


def stored_config(run_dir: str | os.PathLike) -> RunConfig | None:
    """The config a run directory holds; ``None`` if it does not exist or is empty.

    Raises RunDirectoryError if it holds files but no readable ``config.json``."""
    run_dir = pathlib.Path(run_dir)
    if not run_dir.exists():
        return None
    if not run_dir.is_dir():
        raise RunDirectoryError(f"run directory {str(run_dir)!r} is a file.")
    if _is_empty(run_dir):
        return None
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise RunDirectoryError(
            f"{str(run_dir)!r} is not empty and holds no {CONFIG_FILE}: not a run directory. "
            "Choose another --run-dir (--overwrite replaces only run directories)."
        )
    try:
        return from_dict(json.loads(path.read_text(encoding="utf-8")), where=str(path))
    except (ValueError, json.JSONDecodeError) as error:
        raise RunDirectoryError(f"{path} cannot be read as a run config: {error}") from None


def has_completed_step(run_dir: str | os.PathLike) -> bool:
    """Whether a run directory records a completed train step (a checkpoint or a line of
    ``metrics.jsonl``): one without is not a run yet (a start that failed its checks or
    stopped in the warm start) and a new run may take its place."""
    run_dir = pathlib.Path(run_dir)
    metrics = run_dir / records.METRICS_FILE
    return latest_checkpoint(run_dir) is not None or bool(metrics.is_file() and records.read_metrics(run_dir))


def latest_checkpoint(run_dir: str | os.PathLike) -> int | None:
    """The step of the latest complete checkpoint in a run directory (``None``: none, or
    the directory cannot be read)."""
    checkpoints = pathlib.Path(run_dir) / CHECKPOINTS
    try:
        return max((int(entry.name) for entry in checkpoints.iterdir() if entry.name.isdigit()), default=None)
    except OSError:
        return None


_CHECKPOINT_ENTRY = re.compile(r"\d+|unreadable-\d+(\.\d+)?|\d+\.orbax-checkpoint-tmp.*")
"""The entries of a run's ``checkpoints/``: steps, those set aside as unreadable, and orbax's temporaries."""


def _is_legacy_run(run_dir: pathlib.Path) -> bool:
    """Whether a directory without :data:`MARKER_FILE` is a run's from before markers:
    everything in it is what a run writes. Its ``config.json`` is a whole run config (every
    section a run writes, not ``{}``), ``checkpoints/`` holds only checkpoints, ``eval/``
    only ``step-<n>.json`` files, and ``wandb/`` exists only if the config logs there."""
    try:
        config = stored_config(run_dir)
        written = json.loads((run_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (RunDirectoryError, OSError, ValueError):
        return False
    if config is None or not isinstance(written, dict) or not set(to_dict(RunConfig())) <= set(written):
        return False

    def holds_only(name: str, pattern: str) -> bool:
        directory = run_dir / name
        if not directory.exists():
            return True
        return directory.is_dir() and all(re.fullmatch(pattern, entry.name) for entry in directory.iterdir())

    return (
        holds_only(CHECKPOINTS, _CHECKPOINT_ENTRY.pattern)
        and holds_only("eval", r"step-\d+\.json")
        and (config.wandb_project is not None or not (run_dir / "wandb").exists())
    )


def _check_replaceable(run_dir: pathlib.Path) -> None:
    """Raises RunDirectoryError unless ``run_dir`` is recognisably a run's (its marker, or
    a run from before markers) and holds nothing but a run's entries (:data:`RUN_ENTRIES`)."""
    if not run_dir.is_dir():
        raise RunDirectoryError(f"--overwrite: {str(run_dir)!r} is a file, not a run directory; nothing was deleted.")
    if not ((run_dir / MARKER_FILE).is_file() or _is_legacy_run(run_dir)):
        raise RunDirectoryError(
            f"--overwrite: {str(run_dir.resolve())!r} is not a run directory (no {MARKER_FILE} "
            f"and no run {CONFIG_FILE}); nothing was deleted. Choose another --run-dir."
        )
    foreign = _foreign_entries(run_dir)
    if foreign:
        listed = ", ".join(foreign[:8]) + (", ..." if len(foreign) > 8 else "")
        raise RunDirectoryError(
            f"--overwrite: {str(run_dir.resolve())!r} holds files that are not the run's "
            f"({listed}); nothing was deleted. Move them out, or choose another --run-dir."
        )


def clear(run_dir: pathlib.Path) -> None:
    """Deletes a run's own entries in ``run_dir`` (not its lock, nor anything else; a link
    is removed, never followed)."""
    keep = {LOCK_FILE, *_foreign_entries(run_dir)}
    for entry in run_dir.iterdir():
        if entry.name not in keep:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


@contextlib.contextmanager
def locked(run_dir: str | os.PathLike):
    """Holds ``run_dir``'s lock (creating the directory) while the body runs: a second
    process training in the same directory is refused, naming the holder. The lock is an
    ``flock`` on :data:`LOCK_FILE`, released by the kernel when its process dies, so a
    killed run never blocks its resumption. Where no run started (no :data:`MARKER_FILE`),
    the lock file, and the directories this call created, are removed again.

    Raises RunDirectoryError: another process holds the lock, or the directory cannot be
    made or locked."""
    run_dir = pathlib.Path(run_dir)
    created = [path for path in (run_dir, *run_dir.parents) if not path.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        file = _lock(run_dir)
    except OSError as error:
        for path in created:
            with contextlib.suppress(OSError):
                path.rmdir()
        raise RunDirectoryError(
            f"cannot use {str(run_dir.resolve())!r} as a run directory: {error.strerror or error}."
        ) from None
    try:
        yield run_dir
    finally:
        if not (run_dir / MARKER_FILE).exists():  # no run started here: leave the directory as it was
            with contextlib.suppress(OSError):
                (run_dir / LOCK_FILE).unlink()
                for path in created:
                    path.rmdir()
        file.close()


def _lock(run_dir: pathlib.Path):
    """The open, locked :data:`LOCK_FILE`, now naming this process. Raises RunDirectoryError
    if another process holds it."""
    path = run_dir / LOCK_FILE
    while True:
        file = open(path, "a+", encoding="utf-8")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "a process that has not yet said which"
            file.close()
            raise RunDirectoryError(
                f"{str(run_dir)!r} is in use by another run ({holder}); wait for it to end, or "
                "choose another --run-dir."
            ) from None
        try:
            if os.stat(path).st_ino == os.fstat(file.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        file.close()  # its holder removed the file as we locked it: lock the file that is there now
    file.seek(0)
    file.truncate()
    file.write(f"pid {os.getpid()} on host {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    file.flush()
    return file


def _ignorable(config: RunConfig) -> tuple[str, ...]:
    optimizer = config.train.optimizer
    decays = optimizer.lr_schedule != "constant" and optimizer.decay_steps is None
    return tuple(name for name in RUN_MANAGEMENT if not (decays and name == "steps"))


def check_run_directory(
    config: RunConfig, run_dir: str | os.PathLike, *, resume: bool = False, overwrite: bool = False
) -> RunConfig | None:
    """Checks, before any compute, that ``config`` may run in ``run_dir``; returns the
    config stored there (``None``: a new run, in place of whatever run files are there).

    A run directory (:data:`MARKER_FILE`) whose run never completed a step
    (:func:`has_completed_step`) is not a run yet: a new one takes its place without
    ``overwrite``.

    Raises RunDirectoryError: ``resume`` without a run to resume; a directory holding a
    different run (the differing fields named) without ``overwrite``; other files; with
    ``overwrite``, a directory that is not recognisably a run's (:func:`_check_replaceable`)."""
    if resume and overwrite:
        raise RunDirectoryError("--resume continues the run in the directory, --overwrite deletes it: pass one.")
    run_dir = pathlib.Path(run_dir)
    if overwrite:
        if run_dir.exists() and not (run_dir.is_dir() and _is_empty(run_dir)):
            _check_replaceable(run_dir)
        return None
    stored = stored_config(run_dir)
    if stored is not None and (run_dir / MARKER_FILE).is_file() and not has_completed_step(run_dir):
        if resume:
            raise RunDirectoryError(
                f"--resume: {str(run_dir)!r} holds no completed step to resume from (a start "
                "that stopped before its first step); run without --resume to start it."
            )
        return None
    if resume and (stored is None or not training.Checkpointer(run_dir / CHECKPOINTS).all_steps()):
        raise RunDirectoryError(
            f"--resume: {str(run_dir)!r} holds no {'run' if stored is None else 'checkpoint'} to resume from."
        )
    if stored is not None:
        changed = differences(stored, config, ignore=_ignorable(stored))
        if changed:
            hint = (
                " (`steps` sets the end of the decaying learning rate: set train.optimizer.decay_steps to extend a run)"
                if any(c.startswith("steps:") for c in changed)
                else ""
            )
            listed = "; ".join(changed[:8]) + ("; ..." if len(changed) > 8 else "")
            raise RunDirectoryError(
                f"{str(run_dir)!r} holds a different run ({len(changed)} "
                f"{'settings differ' if len(changed) > 1 else 'setting differs'}, stored -> requested: "
                f"{listed}){hint}. "
                "Choose another --run-dir, or pass --overwrite to replace it."
            )
    return stored


def write_json(path: pathlib.Path, data: Any) -> None:
    """``data`` as JSON at ``path``, atomically (a temporary file renamed over it)."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as file:
        json.dump(records.json_ready(data), file, indent=2)
        file.write("\n")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(file.name, 0o666 & ~umask)  # as open() would create it; a temporary file is 0o600
    os.replace(file.name, path)


STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)
"""The OS errors that mean the disk cannot take the run's files."""


STORAGE_TEXTS = {
    errno.ENOSPC: "No space left on device",
    errno.EDQUOT: "Disk quota exceeded",
    errno.EROFS: "Read-only file system",
    errno.EACCES: "Permission denied",
}
"""How those read inside other errors' messages (orbax's tensorstore raises ``ValueError`` s)."""


def storage_failure(error: BaseException) -> str | None:
    """What a failure to write or read the run's files comes to, in a few words (``"no space
    left on device"``, with the path when known), found in ``error``'s chain; ``None`` if it
    is not one. The chain is not followed into a reward function's error: what the user's
    code failed to read is theirs to fix, not the disk's."""
    seen = set()
    while error is not None and id(error) not in seen and not isinstance(error, RewardFunctionError):
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
            where = f" ({os.path.abspath(error.filename)})" if error.filename else ""
            return f"{os.strerror(error.errno).lower()}{where}"
        for errno_, text in STORAGE_TEXTS.items():
            if text in str(error):
                return os.strerror(errno_).lower()
        error = error.__cause__ or error.__context__
    return None
