"""A run in a directory: train with checkpoints and records, resume, evaluate, export.

These are what ``jaxrl-llm train | eval | export`` call; each takes a
:class:`~jaxrl_llm.runs.config.RunConfig` or a run directory::

    runs.train_run(RunConfig(), "runs/default")       # or continue it: the same call again
    runs.evaluate_run("runs/default", step=None)      # the latest checkpoint
    runs.export_run("runs/default", "out/policy")     # a Hugging Face directory

**The run directory**::

    .jaxrl-llm-run       marks it as a run's: only such a directory is ever replaced
    .jaxrl-llm-lock      flock-ed by the process training in it (its pid and host)
    config.json          the resolved RunConfig (every field)
    warm_start.json      the warm start's losses and its held-out evaluation
    metrics.jsonl        one line per step: {"step": s, every metric of training.train}
    samples.jsonl        every `samples_every` steps: prompts, completions, rewards
    metrics.png          reward, held-out accuracy, KL, length, clip fraction, entropy
    tensorboard/         TensorBoard event files
    checkpoints/<step>/  orbax checkpoints of the whole TrainState (the last `keep_checkpoints`);
                         a LoRA run's hold the adapters and their optimizer state, not the base
    base.json            a LoRA run's base: where it is and the digest of each of its arrays
    base/                a LoRA run's base when it is not model.path's weights as they are (the
                         built-in model, a warm start): one orbax checkpoint, written once
    eval/step-<s>.json   what `jaxrl-llm eval` measured

**Resuming.** Training into a directory that holds a run continues it from its latest
complete checkpoint, provided the config is the same except for the settings of
:data:`RUN_MANAGEMENT` (more ``steps``, other cadences); the records of steps after that
checkpoint (a killed run logs steps it had not saved) are dropped and run again. The
prompts, PRNG keys and counters live in the state, so a resumed run's parameters and
metrics (timings aside) are those of the uninterrupted run, bit for bit (tested with
SIGKILL on CPU). A LoRA run (``[lora]``) reads its base again, from ``model.path`` or
``base/``, and refuses to continue if an array's digest differs from ``base.json``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import importlib.util
import json
import math
import os
import pathlib
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np

from jaxrl_llm import compilation_cache, distributed, evaluation, models, sharding, training
from jaxrl_llm.rewards.combine import RewardFunctionError, called_in
from jaxrl_llm.runs import build, records
from jaxrl_llm.runs import config as run_config
from jaxrl_llm.runs.config import RunConfig, differences, from_dict, to_dict

CONFIG_FILE = "config.json"
WARM_START_FILE = "warm_start.json"
CHECKPOINTS = "checkpoints"
BASE_FILE = "base.json"
BASE_CHECKPOINT = "base"

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

TIMING_METRICS = ("tokens_per_second", "score_traces", "update_traces")
"""Metrics (besides ``*_seconds``) that depend on the machine or the process, not the run."""


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


class RunDirectoryError(ValueError):
    """The run directory does not fit the request (another run, nothing to resume, ...)."""


def is_timing(name: str) -> bool:
    """Whether metric ``name`` measures the machine (time, throughput, compilations), not the run."""
    return name.endswith("_seconds") or name in TIMING_METRICS


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


def _clear(run_dir: pathlib.Path) -> None:
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


def absolute_paths(config: RunConfig) -> RunConfig:
    """``config`` with its model, data, reward, tool, environment and adapter paths absolute
    (a ``module:function`` in the current directory as its file's path) and a LoRA
    adapter's settings filled in: a run continues from anywhere."""

    def absolute(path: str | None) -> str | None:
        return None if path is None else os.path.abspath(os.path.expanduser(path))

    task = run_config.code_sources(config.task, [os.getcwd()])
    lora = config.lora.resolved()  # an adapter's settings, stored: a resumed run does not read it again
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, path=absolute(config.model.path)),
        task=dataclasses.replace(task, path=absolute(task.path), test_path=absolute(task.test_path)),
        lora=dataclasses.replace(lora, adapter=absolute(lora.adapter)),
    )


def _write_json(path: pathlib.Path, data: Any) -> None:
    """``data`` as JSON at ``path``, atomically (a temporary file renamed over it)."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as file:
        json.dump(records.json_ready(data), file, indent=2)
        file.write("\n")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(file.name, 0o666 & ~umask)  # as open() would create it; a temporary file is 0o600
    os.replace(file.name, path)


@dataclasses.dataclass
class RunResult:
    """What :func:`train_run` returns."""

    run_dir: pathlib.Path
    config: RunConfig
    state: training.TrainState | None
    """The final state (``None`` when the run was already complete)."""
    history: list[dict[str, float]]
    """The metrics of the steps this call ran."""
    warm_start: dict[str, Any]
    """``warm_start.json``: the warm start's losses and its evaluation (``eval_*``)."""
    summary: str


def _print(text: str, stream) -> None:
    if stream is not None:
        print(text, file=stream, flush=True)


def train_run(
    config: RunConfig,
    run_dir: str | os.PathLike,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
    stream: Any = "stdout",
) -> RunResult:
    """Runs ``config`` in ``run_dir``, or continues the run there from its latest checkpoint.

    Everything is checked before any compute: the directory (:func:`check_run_directory`),
    the model path, the task and its reward functions. Then: a fresh run warm-starts
    (``config.warm_start``) and evaluates the warm start; ``training.train`` runs the
    remaining steps, logging every step (:class:`~jaxrl_llm.runs.records.RunRecorder`) and
    saving a checkpoint every ``save_every`` steps and at the end. Ctrl-C, or an error in a
    step, saves the state of the last completed step before the exception
    (``training.RunInterrupted`` / ``RunStopped`` / ``NonFiniteUpdates``) propagates.

    Args:
      config: the run's settings.
      run_dir: its directory (created).
      resume: require a run to continue in ``run_dir``.
      overwrite: replace the run in ``run_dir`` (only a run directory's own entries are
        deleted; see :func:`check_run_directory`).
      progress: the progress bar on standard error (``None``: when that is a terminal,
        else a line every few steps on ``stream``; ``False``: neither).
      stream: where messages, progress lines and the summary go: a text stream, ``None``
        (nowhere) or ``"stdout"``, ``sys.stdout`` at the time of the call.
    """
    stream = sys.stdout if stream == "stdout" else stream
    with contextlib.ExitStack() as lock:
        refused = None
        if distributed.is_main_process():  # process 0 holds the directory for the run
            try:
                lock.enter_context(locked(run_dir))
            except RunDirectoryError as error:
                refused = error
        if jax.process_count() > 1 and distributed.process_sum(np.int32(refused is not None)) and refused is None:
            raise RunDirectoryError(f"process 0 cannot take {str(run_dir)!r} (its log says why).")
        if refused is not None:
            raise refused
        return _train_run(config, run_dir, resume=resume, overwrite=overwrite, progress=progress, stream=stream)


def _train_run(
    config: RunConfig, run_dir: str | os.PathLike, *, resume: bool, overwrite: bool, progress: bool | None, stream
) -> RunResult:
    called = time.perf_counter()
    run_dir = pathlib.Path(run_dir)
    config = absolute_paths(config)
    main = distributed.is_main_process()  # over several processes, process 0 writes and prints
    stream = stream if main else None
    mesh, rules = config.mesh.build(), sharding.RULES[config.mesh.rules]
    stored, task = _checked_start(config, run_dir, mesh, resume=resume, overwrite=overwrite)
    _open_run_directory(config, run_dir, new=stored is None, main=main)
    checkpointer = training.Checkpointer(run_dir / CHECKPOINTS, max_to_keep=config.keep_checkpoints)
    state, start, adapters = None, 0, None
    if stored is not None and checkpointer.latest_step() is not None:
        model, params, state, warm = _continued(
            config, task, checkpointer, run_dir, mesh, rules, main=main, stream=stream
        )
        start = int(state.step)
    else:
        model, params, adapters, warm = _warm_started(config, task, run_dir, mesh, main=main, stream=stream)
    if start >= config.steps:
        checkpointer.close()
        summary = _summary(run_dir, warm, time.perf_counter() - called, steps=start)
        _print(
            f"{run_dir} is complete: its latest checkpoint holds {start} steps (--steps {config.steps}). Pass a "
            f"larger --steps to continue it, or --overwrite to start again.\n{summary}",
            stream,
        )
        return RunResult(run_dir, config, None, [], warm, summary)
    policy = policy_of(config, model, params, state)
    if adapters is not None:  # a new run from an adapter: its policy is the adapter's
        policy = models.lora.adapted(model, config.lora.build()), models.lora.combine(params, adapters)
    recorder = _recorder(
        config, run_dir, start, *policy, task, mesh, main=main, progress=progress, stream=stream, before=warm
    )

    def evaluated(state: training.TrainState) -> dict[str, float]:
        with called_in(f"the held-out evaluation after train step {int(state.step) - 1}"):
            return evaluate_model(*policy_of(config, model, params, state), task, config, mesh=mesh)

    steps = _RunSteps(config, recorder, checkpointer, evaluate=evaluated)
    try:
        state, history = training.train(
            model,
            params,
            config.algorithm,
            config.train,
            steps=config.steps - start,
            task=task,
            state=state,
            callback=steps.on_step,
            mesh=mesh,
            rules=rules,
            compilation_cache=config.compilation_cache,
            tools=build.tools(config.task),
            environment_factory=build.environment_factory(config.task),
            lora=config.lora.build(),
            adapters=adapters,
        )
    except (training.RunStopped, training.RunInterrupted) as stopped:  # NonFiniteUpdates: finite params
        steps.keep(stopped, start=start, stream=stream)
        stopped.checkpoint_step = latest_checkpoint(run_dir)  # what the CLI names to continue from
        raise
    recorder.close()
    checkpointer.close()
    summary = _summary(run_dir, warm, time.perf_counter() - called, steps=int(state.step)) if main else ""
    _print(summary, stream)
    return RunResult(run_dir, config, state, history, warm, summary)


def _checked_start(
    config: RunConfig, run_dir: pathlib.Path, mesh: jax.sharding.Mesh | None, *, resume: bool, overwrite: bool
) -> tuple[RunConfig | None, Any]:
    """Everything checked before any compute or write: the processes and mesh, the run
    directory, the positions, wandb, the task and its demonstrations. Returns the config
    stored in ``run_dir`` (``None``: a new run) and the task."""
    training.loop.check_processes(config.train, mesh)  # before anything is written
    stored = check_run_directory(config, run_dir, resume=resume, overwrite=overwrite)
    distributed.barrier("run directory checked")  # before process 0 changes it
    build.check_positions(config)
    if config.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        raise ValueError(
            f"wandb_project={config.wandb_project!r} logs to Weights & Biases, which needs `wandb`: "
            "`pip install wandb`, or leave wandb_project unset."
        )
    task = build.run_task(config)
    build.check_memory(config, task)
    training.loop.check_evaluation(task, config.train)
    if config.warm_start.enabled:
        build.check_demonstrations(config, task)
    return stored, task


def _open_run_directory(config: RunConfig, run_dir: pathlib.Path, *, new: bool, main: bool) -> None:
    """Marks ``run_dir`` as the run's and writes its config (process 0; a ``new`` run first
    clears a run's files there), then turns on the compilation cache."""
    if main:
        if new:  # a new run, in place of a run's files (--overwrite, or a start with no step)
            _clear(run_dir)
        for entry in run_dir.iterdir():  # a killed writer's temporary (.metrics.png.<pid>.tmp, ...): no writer now
            if entry.name not in RUN_ENTRIES and any(entry.name.startswith(f".{name}.") for name in RUN_ENTRIES):
                entry.unlink(missing_ok=True) if not entry.is_dir() or entry.is_symlink() else shutil.rmtree(entry)
        (run_dir / MARKER_FILE).write_text("A jaxrl_llm run directory: `jaxrl-llm train --run-dir` continues it.\n")
        _write_json(run_dir / CONFIG_FILE, to_dict(config))
    distributed.barrier("run directory ready")
    if config.compilation_cache:
        compilation_cache.enable()


def _continued(
    config: RunConfig,
    task,
    checkpointer: training.Checkpointer,
    run_dir: pathlib.Path,
    mesh: jax.sharding.Mesh | None,
    rules: sharding.Rules,
    *,
    main: bool,
    stream,
) -> tuple[models.Model, models.Params, training.TrainState, dict[str, Any]]:
    """``(model, params, state, warm_start)`` of a run continued from its latest readable
    checkpoint (restored straight into its shards on ``mesh``): ``params`` are the state's,
    or a LoRA run's base (:func:`load_base`). The checkpoints after it that cannot be used
    are moved aside, so their steps are saved again."""
    model, abstract_params = build.model(config, task, abstract=True)
    like = build.abstract_state(config, model, abstract_params)
    if mesh is not None:
        like = _placed(like, training.state_shardings(like, config.algorithm, config.train, mesh, rules))
    params = None if config.lora.build() is None else load_base(run_dir, config, task, mesh=mesh)
    try:
        state = _restore(checkpointer, like)
    except RuntimeError:  # none can be read: each one's error is in ``skipped``
        unreadable = "; ".join(f"checkpoint {step}: {why}" for step, why in checkpointer.skipped.items())
        raise RunDirectoryError(
            f"cannot resume {str(run_dir)!r}: none of its checkpoints can be read ({unreadable}). Start again in "
            f"another --run-dir, or in this one with --overwrite (which deletes them)."
        ) from None
    start = int(state.step)
    for unreadable in (s for s in checkpointer.all_steps() if s > start):
        aside = _aside(run_dir / CHECKPOINTS, unreadable)
        if main:
            os.replace(run_dir / CHECKPOINTS / str(unreadable), aside)
        why = checkpointer.skipped.get(unreadable, "not restored")
        _print(
            f"Checkpoint {unreadable} cannot be used ({why}); moved to {aside}, continuing from step {start}.", stream
        )
    distributed.barrier("checkpoints restored")
    checkpointer.reload()  # without those moved aside: their steps are saved again, not counted to keep
    warm = json.loads((run_dir / WARM_START_FILE).read_text()) if (run_dir / WARM_START_FILE).is_file() else {}
    _print(f"Continuing {run_dir} from its checkpoint of step {start} (of {config.steps}).", stream)
    return model, state.params if params is None else params, state, warm


def _aside(checkpoints: pathlib.Path, step: int) -> pathlib.Path:
    """Where an unreadable checkpoint of ``step`` is moved: ``unreadable-<step>``, or
    ``unreadable-<step>.<k>`` when its step was set aside before (corrupted again)."""
    aside, again = checkpoints / f"unreadable-{step}", 1
    while aside.exists():
        again += 1
        aside = checkpoints / f"unreadable-{step}.{again}"
    return aside


def _placed(like, shardings):
    """Abstract leaves ``like`` with ``shardings`` set: what a checkpoint restores straight into its shards."""
    return jax.tree.map(
        lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where), like, shardings
    )


def _warm_started(
    config: RunConfig, task, run_dir: pathlib.Path, mesh: jax.sharding.Mesh | None, *, main: bool, stream
) -> tuple[models.Model, models.Params, models.Params | None, dict[str, Any]]:
    """``(model, params, adapters, warm_start)`` of a new run: the model built, warm-started
    (``config.warm_start``), quantized after it (``model.quantization``, which the warm start
    trains without), the adapters of ``lora.adapter`` read over it (else ``None``), and the
    policy evaluated when the run evaluates; ``warm_start.json`` written."""
    quantization = config.model.quantization
    trained = config  # the warm start trains the unquantized model
    if quantization is not None and config.warm_start.enabled:
        trained = dataclasses.replace(config, model=dataclasses.replace(config.model, quantization=None))
    model, params = build.model(trained, task, mesh=mesh)
    started = time.perf_counter()
    params, losses = build.warm_start(config, model, params, task)
    if quantization is not None and model.config.quantization is None:
        model, params = models.quantize.quantize(model, params, quantization=quantization)
    warm = {
        "steps": len(losses),
        "first_loss": losses[0] if losses else None,
        "last_loss": float(np.mean(losses[-20:])) if losses else None,
        "seconds": time.perf_counter() - started,
    }
    adapters = None
    if config.lora.adapter is not None:
        lora_model, adapters = models.lora.load_adapter(config.lora.adapter, model, dtype=config.lora.build().dtype)
        if lora_model.config.lora != config.lora.build():
            raise RunDirectoryError(
                f"lora.adapter {config.lora.adapter} changed since the run stored its settings "
                f"({lora_model.config.lora} now, {config.lora.build()} stored)."
            )
    if config.train.eval_every:
        _print(f"Evaluating on the {task.split_size('test')} held-out prompts (greedy)...", stream)
        policy = (model, params) if adapters is None else (lora_model, models.lora.combine(params, adapters))
        with called_in(f"the held-out evaluation {'after the warm start' if losses else 'before training'}"):
            warm.update(evaluate_model(*policy, task, config, mesh=mesh))
    if config.lora.build() is not None:
        stored = bool(losses) or config.model.path is None
        _save_base(run_dir, config, params, task.tokenizer, stored=stored, main=main)
    if main:
        _write_json(run_dir / WARM_START_FILE, warm)
    if "eval_greedy_accuracy" in warm:
        before = f"After the warm start ({warm['steps']} steps)" if warm["steps"] else "Before training"
        accuracy = records.accuracy_with_interval(warm["eval_greedy_accuracy"], warm["eval_examples"])
        _print(f"{before}: held-out greedy accuracy {accuracy} in {warm['eval_seconds']:.0f} s.", stream)
    return model, params, adapters, warm


def _save_base(
    run_dir: pathlib.Path, config: RunConfig, params: models.Params, tokenizer, *, stored: bool, main: bool
) -> None:
    """Records a LoRA run's base before its first step: ``base.json`` (``model.path``, or
    ``None`` when the base is ``stored`` in ``base/``, and the digest of every array) and,
    when ``stored``, the base itself (the built-in model, or weights a warm start changed)."""
    if stored:
        if main and (run_dir / BASE_CHECKPOINT).exists():  # a start that died before its first checkpoint
            shutil.rmtree(run_dir / BASE_CHECKPOINT)
        distributed.barrier("run's base cleared")
        with training.Checkpointer(run_dir / BASE_CHECKPOINT, max_to_keep=None) as checkpointer:
            checkpointer.save(0, params)
    digests = training.checkpoint.digests(params)
    record = {"path": None if stored else config.model.path, "digests": digests}
    if not stored:  # a model directory or GGUF file: its config and tokenizer must stay too
        record.update(_model_file_digests(config.model.path, tokenizer))
    if main:
        _write_json(run_dir / BASE_FILE, record)


def _model_file_digests(path: str, tokenizer) -> dict[str, str]:
    """SHA-256 digests of a model directory's or GGUF file's config (as :func:`models.read_config`
    reads it) and of ``tokenizer``, the run's, read from it (its vocabulary, added tokens and
    chat template): what a LoRA run's base is besides its arrays."""
    config = dataclasses.asdict(models.read_config(path))
    vocabulary = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "added": sorted((t.content, i) for i, t in tokenizer.added_tokens_decoder.items()),
        "chat_template": tokenizer.chat_template,
    }
    return {
        f"{name}_digest": hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
        for name, value in (("config", config), ("tokenizer", vocabulary))
    }


def load_base(
    run_dir: str | os.PathLike, config: RunConfig, task, *, mesh: jax.sharding.Mesh | None = None
) -> models.Params:
    """A LoRA run's base, as its first step had it: ``model.path``'s weights, or those
    stored in ``base/``; read straight into their shards on ``mesh``.

    Raises RunDirectoryError: no readable ``base.json`` or ``base/``, or an array whose
    digest differs from the one recorded (the model directory's weights changed since the
    run started)."""
    run_dir = pathlib.Path(run_dir)
    record = base_record(run_dir)
    if record["path"] is None:
        _, like = build.model(config, task, abstract=True)
        if mesh is not None:
            like = _placed(like, sharding.param_shardings(like, mesh, sharding.RULES[config.mesh.rules]))
        try:
            with training.Checkpointer(run_dir / BASE_CHECKPOINT) as checkpointer:
                params = checkpointer.restore(0, like=like)
        except (FileNotFoundError, RuntimeError) as error:
            raise RunDirectoryError(f"the base of the LoRA run in {str(run_dir)!r} cannot be read: {error}") from None
        where = f"{run_dir / BASE_CHECKPOINT}"
    else:
        _, params = build.model(config, task, mesh=mesh)
        where = f"model.path {record['path']!r}"
        now = _model_file_digests(record["path"], task.tokenizer)
        if changed := [name.removesuffix("_digest") for name in now if name in record and record[name] != now[name]]:
            raise RunDirectoryError(
                f"the base of the LoRA run in {str(run_dir)!r} ({where}) is not the one it started from: its "
                f"{' and its '.join(changed)} changed since (a setting such as rms_norm_eps, or token ids). Put "
                "back the model it trained over, or start a new run."
            )
    digests, expected = training.checkpoint.digests(params), record["digests"]
    changed = sorted(name for name in digests.keys() | expected.keys() if digests.get(name) != expected.get(name))
    if changed:
        listed = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise RunDirectoryError(
            f"the base of the LoRA run in {str(run_dir)!r} ({where}) is not the one it started from: "
            f"{len(changed)} of its arrays differ from the digests in {BASE_FILE} ({listed}). Put back "
            "the weights it trained over, or start a new run."
        )
    return params


def base_record(run_dir: str | os.PathLike) -> dict[str, Any]:
    """A LoRA run's ``base.json``: ``{"path": model.path or None, "digests": {path: digest}}``.

    Raises RunDirectoryError: it is missing, not JSON, or lacks either key."""
    path = pathlib.Path(run_dir) / BASE_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(record, dict) or not {"path", "digests"} <= record.keys():
            raise ValueError(f"it must hold `path` and `digests`; got {record!r:.200}")
    except (OSError, ValueError) as error:
        raise RunDirectoryError(
            f"{str(path)!r}, the LoRA run's record of its base (where it is, its arrays' digests), cannot be "
            f"used: {error}."
        ) from None
    return record


def policy_of(
    config: RunConfig, model: models.Model, params: models.Params, state: training.TrainState | None
) -> tuple[models.Model, models.Params]:
    """The policy of a run at ``state`` (``None``: before its first step, ``params`` itself):
    ``model`` over ``state.params``, or for a LoRA run the LoRA model over the base ``params``
    and the state's adapters."""
    lora = config.lora.build()
    if state is None:
        return model, params
    if lora is None:
        return model, state.params
    return models.lora.adapted(model, lora), models.lora.combine(params, state.params)


def _recorder(
    config: RunConfig,
    run_dir: pathlib.Path,
    start: int,
    model: models.Model,
    params: models.Params,
    task,
    mesh: jax.sharding.Mesh | None,
    *,
    main: bool,
    progress: bool | None,
    stream=None,
    before: dict[str, Any] | None = None,
):
    """The run's records from step ``start`` on (process 0's; the others write nothing),
    with a progress bar on standard error when ``progress``, or by default when standard
    error is a terminal; otherwise, unless ``progress`` is False, a line every few steps
    on ``stream`` (:func:`~jaxrl_llm.runs.records.step_line`).

    Ctrl-C during the evaluation of step ``start - 1`` left its record without it; the
    checkpoint holds the params it evaluates, so it is run now, as it would have been."""
    unevaluated = _unevaluated_record(run_dir, start, config)
    if unevaluated is not None:
        unevaluated.update(evaluate_model(model, params, task, config, mesh=mesh))
    if not main:
        return _NoRecords()
    bar = records.is_terminal(sys.stderr) if progress is None else progress
    recorder = records.RunRecorder(
        run_dir,
        total_steps=config.steps,
        start_step=start - (unevaluated is not None),
        tensorboard=config.tensorboard,
        plot_every=config.plot_every,
        progress=bar,
        wandb_project=config.wandb_project,
        wandb_config=to_dict(config),
        step_lines=stream if progress is None and not bar else None,
        before=before,
    )
    if unevaluated is not None:
        recorder.log(start - 1, unevaluated)
    return recorder


class _RunSteps:
    """What :func:`train_run` does at the end of each step (records, samples, checkpoints
    every ``save_every`` steps and at the last, the held-out evaluation of the last step
    when ``train.eval_every`` did not fall on it) and when the run stops early."""

    def __init__(
        self,
        config: RunConfig,
        recorder,
        checkpointer: training.Checkpointer,
        *,
        evaluate: Callable[[training.TrainState], dict[str, float]],
    ):
        self.config, self.recorder, self.checkpointer, self.evaluate = config, recorder, checkpointer, evaluate

    def save(self, state: training.TrainState, metrics: dict[str, float] | None = None) -> None:
        """A checkpoint of ``state``, unless it is step 0 or saved already (also by a save Ctrl-C interrupted)."""
        step = int(state.step)
        if step == 0 or step in self.checkpointer.all_steps():
            return
        self.checkpointer.save(step, state, metadata={"reward": metrics.get("reward")} if metrics else None)

    def on_step(self, end: training.StepEnd) -> None:
        """``training.train``'s callback."""
        config = self.config
        done = end.step + 1
        if done == config.steps and config.train.eval_every and "eval_greedy_accuracy" not in end.metrics:
            end.metrics.update(self.evaluate(end.state))  # the run's last step is always evaluated
        self.recorder.log(end.step, end.metrics)
        if config.samples_prompts and (end.step + 1) % config.samples_every == 0:
            self.recorder.log_samples(
                end.step,
                records.sample_rows(end.collected.first_round, step=end.step, max_prompts=config.samples_prompts),
            )
        if done % config.save_every == 0 or done == config.steps:
            self.save(end.state, end.metrics)

    def keep(self, stopped: training.RunStopped | training.RunInterrupted, *, start: int, stream) -> None:
        """Keeps what can be kept of a run that stopped: the records of its completed steps and
        a checkpoint of its last state. What fails on the way (a full disk fails everything) is
        one line each: the run's own error is the one raised."""
        step = int(stopped.state.step)
        with _reported(f"record the steps before step {step}", stream):
            # Completed, not recorded: Ctrl-C came during its evaluation or hook.
            for done, metrics in enumerate(stopped.history, start=start):
                if not self.recorder.rows or self.recorder.rows[-1]["step"] < done:
                    self.recorder.log(done, metrics)
        if step > 0:  # step 0 is the starting point, never saved
            with _reported(f"save a checkpoint of step {step}", stream):
                self.save(stopped.state)
                _print(f"Saved a checkpoint of step {step}.", stream)
        with _reported("close the records", stream):
            self.recorder.close()
        with _reported("close the checkpoints", stream):
            self.checkpointer.close()


def latest_checkpoint(run_dir: str | os.PathLike) -> int | None:
    """The step of the latest complete checkpoint in a run directory (``None``: none, or
    the directory cannot be read)."""
    checkpoints = pathlib.Path(run_dir) / CHECKPOINTS
    try:
        return max((int(entry.name) for entry in checkpoints.iterdir() if entry.name.isdigit()), default=None)
    except OSError:
        return None


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


@contextlib.contextmanager
def _reported(what: str, stream):
    """Runs the body; an exception in it is printed as one line (``Could not <what>: ...``)
    on stderr, not raised: for the steps that keep what they can while a run stops."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 (the run's own error is the one to raise)
        reason = storage_failure(error) or f"{type(error).__name__}: {error}"
        _print(f"Could not {what}: {reason}.", sys.stderr if stream is not None else None)


def _restore(checkpointer: training.Checkpointer, like: training.TrainState) -> training.TrainState:
    """The latest readable checkpoint, restored into ``like``. A checkpoint saved with a
    reference the run no longer keeps (methods without a KL term, saved before they
    dropped it) is read with it, and the reference then dropped."""
    try:
        return checkpointer.restore(like=like)
    except ValueError as error:
        if like.ref_params is not None or "ref_params" not in str(error):
            raise
        return checkpointer.restore(like=like._replace(ref_params=like.params))._replace(ref_params=None)


class _NoRecords:
    """The recorder of a process other than 0: it writes nothing."""

    rows: list = []

    def log(self, *args, **kwargs) -> None:
        pass

    log_samples = log
    close = log


def _unevaluated_record(run_dir: pathlib.Path, start: int, config: RunConfig) -> dict[str, Any] | None:
    """The metrics of step ``start - 1`` (without ``step``) if it should have, and has not,
    its evaluation; else ``None``."""
    every = config.train.eval_every
    if not (start and every and start % every == 0):
        return None
    last = next((row for row in records.read_metrics(run_dir) if row["step"] == start - 1), None)
    if last is None or "eval_greedy_accuracy" in last:
        return None
    return {name: value for name, value in last.items() if name != "step"}


def _summary(run_dir: pathlib.Path, warm: dict[str, Any], wall_seconds: float, *, steps: int) -> str:
    """The run's summary over its first ``steps`` steps, those its latest checkpoint holds (a run
    killed after logging steps it had not saved has their lines until it continues)."""
    rows = [row for row in records.read_metrics(run_dir) if row["step"] < steps]
    lines = [
        f"Run {run_dir}:",
        f"wall time {records.duration(wall_seconds)} (loading, warm start, steps, evaluations, checkpoints and plots)",
        records.summarize(rows),
    ]
    evaluated = [row for row in rows if row.get("eval_greedy_accuracy") is not None]
    if "eval_greedy_accuracy" in warm and evaluated:
        last = evaluated[-1]
        lines.append(
            f"Held-out greedy accuracy: {warm['eval_greedy_accuracy']:.2f} "
            f"{'after the warm start' if warm.get('steps') else 'before training'} -> "
            f"{last['eval_greedy_accuracy']:.2f} at step {last['step'] + 1} "
            f"({100 * (last['eval_greedy_accuracy'] - warm['eval_greedy_accuracy']):+.0f} points); 95% intervals "
            f"{_interval(warm)} -> {_interval(last)}."
        )
    lines.append(f"Plots: {run_dir / records.PLOT_FILE}; TensorBoard: tensorboard --logdir {run_dir}")
    return "\n".join(lines)


def _interval(evaluated: dict[str, Any]) -> str:
    """The Wilson 95% interval of an evaluation's greedy accuracy, ``"0.59-0.72"``."""
    low, high = evaluation.wilson_interval(
        evaluated["eval_greedy_accuracy"] * evaluated["eval_examples"], evaluated["eval_examples"]
    )
    return f"{low:.2f}-{high:.2f}"


# ----------------------------------------------------------------------------------------
# Evaluation and export


def restore_policy(run_dir: str | os.PathLike, step: int | None = None):
    """``(config, task, model, params, step)`` of checkpoint ``step`` of a run (default: the
    latest readable one); of a LoRA run, the LoRA model and its base and adapters together
    (``models.lora.split`` takes them apart, ``models.lora.merge`` makes a plain model)."""
    run_dir = pathlib.Path(run_dir)
    config = stored_config(run_dir)
    if config is None:
        raise RunDirectoryError(f"{str(run_dir)!r} holds no run.")
    build.check_model_path(config.model)
    task = build.run_task(config)
    model, abstract_params = build.model(config, task, abstract=True)
    with training.Checkpointer(run_dir / CHECKPOINTS) as checkpointer:
        if not checkpointer.all_steps():
            raise RunDirectoryError(f"{str(run_dir)!r} has no complete checkpoint yet.")
        state = checkpointer.restore(step, like=build.abstract_state(config, model, abstract_params))
    base = None if config.lora.build() is None else load_base(run_dir, config, task)
    return config, task, *policy_of(config, model, base, state), int(state.step)


def evaluate_model(
    model: models.Model,
    params: models.Params,
    task,
    config: RunConfig,
    *,
    num_samples: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> dict[str, float]:
    """Greedy accuracy, mean rewards and pass@k on ``task``'s test split with the run's
    sampling settings (:func:`jaxrl_llm.evaluation.evaluate`), as training's evaluations
    record them (``eval_*``), with ``num_samples`` samples per prompt (default
    ``train.eval_samples``), decoded over ``mesh``."""
    train = config.train
    started = time.perf_counter()
    results = evaluation.evaluate(
        model,
        params,
        task,
        sampling=train.sampling,
        num_samples=train.eval_samples if num_samples is None else num_samples,
        seed=train.seed,
        on_reward_error=train.on_reward_error,
        progress=False,
        mesh=mesh,
        tools=build.tools(config.task),
        environment_factory=build.environment_factory(config.task),
        episodes=train.episodes,
    )
    return evaluation.as_metrics(results, seconds=time.perf_counter() - started)


def evaluate_run(
    run_dir: str | os.PathLike, *, step: int | None = None, num_samples: int | None = None
) -> dict[str, Any]:
    """Evaluates checkpoint ``step`` of a run (default: the latest) on its task's test
    split; writes and returns ``eval/step-<s>.json``."""
    config, task, model, params, step = restore_policy(run_dir, step)
    if config.compilation_cache:
        compilation_cache.enable()
    with called_in(f"the evaluation of checkpoint {step}"):
        results = {"step": step, **evaluate_model(model, params, task, config, num_samples=num_samples)}
    path = pathlib.Path(run_dir) / "eval" / f"step-{step}.json"
    path.parent.mkdir(exist_ok=True)
    _write_json(path, results)
    return results


def export_run(
    run_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    overwrite: bool = False,
    adapter: bool = False,
    format: Literal["hf", "gguf"] = "hf",  # noqa: A002 (the CLI's --format)
    file_type: str = "f16",
) -> int:
    """Writes checkpoint ``step``'s policy (default: the latest) with its tokenizer and the
    task's stop ids and the run's sampling settings (the policy trained is the one sampled at
    ``train.sampling.temperature``); returns the step.

    ``format="hf"``: a Hugging Face directory with a generation config holding those. A LoRA
    run's policy is written merged (``W + s A B``), or with ``adapter`` as its adapters alone
    in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``), naming its base:
    ``model.path`` (with its tokenizer), or, for a base that is not a model directory's
    weights as they are (the built-in model, a warm start, a GGUF file), the Hugging Face
    directory ``out/base``, with the tokenizer and generation config, written beside them.
    ``out`` must not hold anything unless ``overwrite`` (the files it writes are then
    replaced, other files kept).

    ``format="gguf"``: ``out``, a ``.gguf`` file for llama.cpp (:func:`jaxrl_llm.models.save_gguf`),
    its matrices as ``file_type``, the sampling settings as its ``general.sampling`` defaults; a
    LoRA run's policy merged. ``out`` must not exist unless ``overwrite``.

    ``out`` must not lie in the run directory. Raises RunDirectoryError for such an ``out``,
    ``adapter`` for a run without LoRA or with ``format="gguf"``, or an unknown ``format``,
    before reading the checkpoint; ValueError for a tokenizer GGUF cannot hold, before writing."""
    if format not in ("hf", "gguf"):
        raise RunDirectoryError(f"--format must be hf or gguf; got {format!r}.")
    out_path, run_path = pathlib.Path(out).resolve(), pathlib.Path(run_dir).resolve()
    if format == "gguf" and out_path.suffix.lower() != models.gguf.SUFFIX:
        raise RunDirectoryError(f"--format gguf writes one file: name it with .gguf (--out {out_path.name}.gguf).")
    if out_path == run_path or run_path in out_path.parents:
        raise RunDirectoryError(f"--out {str(out)!r} lies in the run directory {str(run_dir)!r}; export elsewhere.")
    existing = next(path for path in (out_path, *out_path.parents) if path.exists())
    if existing != out_path and not existing.is_dir():
        raise RunDirectoryError(
            f"--out {str(out)!r} lies under {str(existing)!r}, which is a file; choose another directory."
        )
    if out_path.exists() and (not out_path.is_dir() or any(out_path.iterdir())) and not overwrite:
        what = "the GGUF file" if format == "gguf" else "the model and tokenizer files there"
        raise RunDirectoryError(
            f"--out {str(out_path)!r} exists{'' if format == 'gguf' else ' and is not empty'}; choose another "
            f"{'file' if format == 'gguf' else 'directory'}, or pass --overwrite to replace {what}."
        )
    if format == "gguf" and out_path.is_dir():
        raise RunDirectoryError(f"--out {str(out_path)!r} is a directory; name the GGUF file to write.")
    if adapter and format == "gguf":
        raise RunDirectoryError(
            "--adapter writes a LoRA run's adapters in PEFT's format; a GGUF export holds the policy with its "
            "adapters merged: drop --adapter."
        )
    if adapter:
        stored = stored_config(run_dir)
        if stored is not None and stored.lora.build() is None:
            raise RunDirectoryError(
                f"--adapter writes a LoRA run's adapters; the run in {str(run_dir)!r} trained every weight "
                "(lora.rank = 0). Export it without --adapter."
            )
    config, task, model, params, step = restore_policy(run_dir, step)
    sampling = config.train.sampling
    truncation = {"top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p}
    truncation = {k: v for k, v in truncation.items() if v is not None}
    if format == "gguf":
        models.save_gguf(
            out_path,
            model,
            params,
            tokenizer=task.tokenizer,
            file_type=file_type,
            name=f"{out_path.stem} (step {step})",
            eos_token_ids=task.eos_ids,
            sampling={"temperature": sampling.temperature, **truncation},
        )
        return step
    generation = {
        "eos_token_id": list(task.eos_ids),
        "pad_token_id": task.pad_id,
        "do_sample": True,
        "temperature": sampling.temperature,
        **truncation,
    }
    if not adapter:
        models.save_pretrained(out, model, params, tokenizer=task.tokenizer, generation_config=generation)
        return step
    base_path = base_record(run_dir)["path"]
    if base_path is None or models.gguf.find_file(base_path) is not None:
        # The base goes beside the adapters, named relative to them: the directory moves whole.
        base_path = BASE_CHECKPOINT
        base, _ = models.lora.split(params)
        models.save_pretrained(
            out_path / base_path,
            models.lora.base_model(model),
            base,
            tokenizer=task.tokenizer,
            generation_config=generation,
        )
    models.lora.save_adapter(out, model, params, base_model_name_or_path=base_path)
    return step


def format_results(results: dict[str, Any]) -> str:
    """An evaluation as a two-column text table."""
    width = max(map(len, results))
    lines = []
    for name, value in results.items():
        shown = f"{value:.4f}" if isinstance(value, float) and math.isfinite(value) and value != int(value) else value
        lines.append(f"{name:<{width}}  {shown}")
    return "\n".join(lines)
