"""A run in a directory: train with checkpoints and records, and resume.

What ``jaxrl-llm train`` calls: :func:`train_run` takes a
:class:`~jaxrl_llm.runs.config.RunConfig` and a run directory
(:mod:`~jaxrl_llm.runs.directory`: its layout, marker and lock)::

    runs.train_run(RunConfig(), "runs/default")       # or continue it: the same call again

A run's evaluation and export are :mod:`~jaxrl_llm.runs.evaluate` and
:mod:`~jaxrl_llm.runs.export`; its LoRA base and the policy a checkpoint holds,
:mod:`~jaxrl_llm.runs.policy`.

**Resuming.** Training into a directory that holds a run continues it from its latest
complete checkpoint, provided the config is the same except for the settings of
:data:`~jaxrl_llm.runs.directory.RUN_MANAGEMENT` (more ``steps``, other cadences); the
records of steps after that checkpoint (a killed run logs steps it had not saved) are
dropped and run again. The prompts, PRNG keys and counters live in the state, so a resumed
run's parameters and metrics (timings aside) are those of the uninterrupted run, bit for bit
(tested with SIGKILL on CPU). A LoRA run (``[lora]``) reads its base again, from
``model.path`` or ``base/``, and refuses to continue if an array's digest differs from
``base.json``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxrl_llm import compilation_cache, distributed, evaluation, models, sharding, training
from jaxrl_llm.rewards.combine import called_in
from jaxrl_llm.runs import build, records
from jaxrl_llm.runs import config as run_config
from jaxrl_llm.runs.config import RunConfig, to_dict
from jaxrl_llm.runs.directory import (
    CHECKPOINTS,
    CONFIG_FILE,
    MARKER_FILE,
    RUN_ENTRIES,
    WARM_START_FILE,
    RunDirectoryError,
    check_run_directory,
    clear,
    latest_checkpoint,
    locked,
    storage_failure,
    write_json,
)
from jaxrl_llm.runs.evaluate import evaluate_model
from jaxrl_llm.runs.policy import (
    abstract_checkpoint,
    checkpoint_shardings,
    checkpointed,
    load_base,
    placed,
    policy_of,
    restore_checkpoint,
    save_base,
)


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
    base: models.Params | None = None
    """A LoRA run's base, the params its adapters (``state.params``) adapt:
    ``training.policy_params(state, base=base)`` is its policy. ``None`` without LoRA."""


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
    config = run_config.absolute_paths(config)
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

    base = reference = None  # what `params` are to the run: LoRA's base, or the reference saved beside each state
    if config.lora.build() is not None:
        base = params
    elif training.state.uses_reference(config.algorithm, config.train):
        if mesh is not None:  # placed as `train` places it, which then places no copy
            placement = training.fixed_shardings(training.FixedParams(params), mesh, rules).reference
            params = distributed.put(params, placement)
        reference = params
    steps = _RunSteps(config, recorder, checkpointer, evaluate=evaluated, reference=reference)
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
    return RunResult(run_dir, config, state, history, warm, summary, base=base)


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
            clear(run_dir)
        for entry in run_dir.iterdir():  # a killed writer's temporary (.metrics.png.<pid>.tmp, ...): no writer now
            if entry.name not in RUN_ENTRIES and any(entry.name.startswith(f".{name}.") for name in RUN_ENTRIES):
                entry.unlink(missing_ok=True) if not entry.is_dir() or entry.is_symlink() else shutil.rmtree(entry)
        (run_dir / MARKER_FILE).write_text("A jaxrl_llm run directory: `jaxrl-llm train --run-dir` continues it.\n")
        write_json(run_dir / CONFIG_FILE, to_dict(config))
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
    checkpoint (restored straight into its shards on ``mesh``): ``params`` are the run's
    reference (the state's policy when it keeps none), or a LoRA run's base
    (:func:`load_base`). The checkpoints after it that cannot be used are moved aside, so
    their steps are saved again."""
    model, abstract_params = build.model(config, task, abstract=True)
    like = abstract_checkpoint(config, model, abstract_params)
    if mesh is not None:
        like = placed(like, checkpoint_shardings(like, config.algorithm, config.train, mesh, rules))
    params = None if config.lora.build() is None else load_base(run_dir, config, task, mesh=mesh)
    try:
        state, reference = restore_checkpoint(checkpointer, like)
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
    if params is None:
        params = state.params if reference is None else reference
    return model, params, state, warm


def _aside(checkpoints: pathlib.Path, step: int) -> pathlib.Path:
    """Where an unreadable checkpoint of ``step`` is moved: ``unreadable-<step>``, or
    ``unreadable-<step>.<k>`` when its step was set aside before (corrupted again)."""
    aside, again = checkpoints / f"unreadable-{step}", 1
    while aside.exists():
        again += 1
        aside = checkpoints / f"unreadable-{step}.{again}"
    return aside


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
        save_base(run_dir, config, params, task.tokenizer, stored=stored, main=main)
    if main:
        write_json(run_dir / WARM_START_FILE, warm)
    if "eval_greedy_accuracy" in warm:
        before = f"After the warm start ({warm['steps']} steps)" if warm["steps"] else "Before training"
        accuracy = records.accuracy_with_interval(warm["eval_greedy_accuracy"], warm["eval_examples"])
        _print(f"{before}: held-out greedy accuracy {accuracy} in {warm['eval_seconds']:.0f} s.", stream)
    return model, params, adapters, warm


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
        reference: models.Params | None,
    ):
        self.config, self.recorder, self.checkpointer, self.evaluate = config, recorder, checkpointer, evaluate
        self.reference = reference  # saved beside each state (policy.checkpointed)

    def save(self, state: training.TrainState, metrics: dict[str, float] | None = None) -> None:
        """A checkpoint of ``state``, unless it is step 0 or saved already (also by a save Ctrl-C interrupted)."""
        step = int(state.step)
        if step == 0 or step in self.checkpointer.all_steps():
            return
        metadata = {"reward": metrics.get("reward")} if metrics else None
        self.checkpointer.save(step, checkpointed(state, self.reference), metadata=metadata)

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


@contextlib.contextmanager
def _reported(what: str, stream):
    """Runs the body; an exception in it is printed as one line (``Could not <what>: ...``)
    on stderr, not raised: for the steps that keep what they can while a run stops."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 (the run's own error is the one to raise)
        reason = storage_failure(error) or f"{type(error).__name__}: {error}"
        _print(f"Could not {what}: {reason}.", sys.stderr if stream is not None else None)


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
