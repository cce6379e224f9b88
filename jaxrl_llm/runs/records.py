r"""The records of a training run: what ``jaxrl-llm train --run-dir DIR`` leaves in ``DIR``.

.. code-block:: python

    with RunRecorder(run_dir, total_steps=steps) as recorder:
        training.train(..., steps=steps, callback=lambda end: recorder.log(end.step, end.metrics))
    print(recorder.summary())

The run directory holds:

* ``metrics.jsonl``: one JSON object a train step, ``{"step": 0, "reward": 0.25, ...}``:
  ``step`` first (the 0-based index of the step just completed, the trainer's
  ``state.step`` before its update), then every metric the trainer reported, in its
  order, with the ``eval_*`` metrics on the steps that evaluated. The file is strict
  JSON: a non-finite value (a NaN ``reward_<name>`` of a reward function that applied to
  no row of the batch) is written as ``null``. Each line is flushed as it is written, so
  a killed run loses at most the line being written, and :func:`read_metrics` skips a
  cut-short last line.
* ``samples.jsonl``: the groups of a few prompts now and then, one completion a line
  (:func:`sample_rows`).
* ``tensorboard/``: one scalar a metric (``null`` ones left out), grouped as
  ``train/...``, ``eval/...`` and ``time/...`` (:func:`tensorboard_tag`).
* ``metrics.png``: reward, held-out accuracy, KL, completion length, clip fraction and
  entropy against the step (:func:`plot_metrics`), redrawn every ``plot_every`` steps
  and at the end.
* ``wandb/`` and ``wandb_run_id``, when the run logs to Weights & Biases.

**Resuming.** A run continued from a checkpoint taken after ``k`` steps
(``start_step=k``) may find records of steps ``>= k``, which a killed run logged after
its last checkpoint and which the continued run logs again. Both JSONL files keep only
their lines with ``step < k`` (rewritten atomically: a temporary file, then
``os.replace``), and TensorBoard gets tensorboardX's ``purge_step=k``, which hides the
earlier events of steps ``>= k``, so each step appears once. Weights & Biases continues
the same run (its id is kept in ``wandb_run_id``) but ignores steps it has already seen,
so there the replayed steps keep their first values.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from jaxrl_llm import evaluation

if TYPE_CHECKING:
    from jaxrl_llm.rollouts import ScoredRound

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
PLOT_FILE = "metrics.png"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"

LOOP_REWARD_METRICS = frozenset({"reward_std", "reward_errors", "reward_unscored", "reward_seconds"})
"""Metrics named ``reward_*`` that are not a reward function's mean."""

SUMMARY_WINDOW = 5
"""Steps averaged at each end of the run by :func:`summarize`."""


# ------------------------------------------------------------------------------------------------
# Reading and writing JSON lines


def json_ready(value: Any) -> Any:
    """``value`` with NumPy scalars and arrays as Python values and non-finite floats as
    ``None``, through dicts, lists and tuples: what strict JSON can hold."""
    if isinstance(value, np.ndarray | np.generic):
        value = value.tolist()
    if isinstance(value, Mapping):
        return {str(key): json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(item) for item in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return value


def _json_line(row: Mapping[str, Any]) -> str:
    return json.dumps(row, allow_nan=False, ensure_ascii=False) + "\n"


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The JSON objects of a run's JSONL file, one a line; ``[]`` if it does not exist.

    A cut-short last line (a run killed while writing it, or one still being written)
    is skipped.

    Raises:
      ValueError: a line before the last is not a JSON object with a ``step``.
    """
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")  # the last is b"" when the file ends with its newline
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:  # JSONDecodeError, or UnicodeDecodeError mid-character
            if number == len(lines):
                break
            raise ValueError(
                f"{path}, line {number}: not JSON ({error}); only the last line of a run's records may be cut short."
            ) from error
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(
                f"{path}, line {number}: every line must be a JSON object with an integer `step`; got {line[:80]!r}."
            )
        rows.append(row)
    return rows


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The lines of ``run_dir/metrics.jsonl``: one dict a step, ``None`` for non-finite values."""
    return read_jsonl(Path(run_dir) / METRICS_FILE)


def read_samples(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The lines of ``run_dir/samples.jsonl``: one dict a completion (see :func:`sample_rows`)."""
    return read_jsonl(Path(run_dir) / SAMPLES_FILE)


def _replace_atomically(path: Path, write: Callable[[IO], None], *, binary: bool = False) -> None:
    """Writes ``path`` through a temporary file beside it and ``os.replace``: a reader
    sees the old file or the new one, never a part."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _keep_before(path: Path, step: int) -> list[dict[str, Any]]:
    """Rewrites ``path`` with only its lines of steps before ``step``; returns them."""
    rows = [row for row in read_jsonl(path) if row["step"] < step]
    _replace_atomically(path, lambda file: file.writelines(_json_line(row) for row in rows))
    return rows


# ------------------------------------------------------------------------------------------------
# Samples


def sample_rows(scored_round: ScoredRound, *, step: int, max_prompts: int) -> list[dict[str, Any]]:
    """The completions of the first ``max_prompts`` prompts of a round, as JSON-ready rows.

    Args:
      scored_round: a :class:`~jaxrl_llm.rollouts.ScoredRound` of ``P`` prompts
        and ``R = P G`` completions, prompt ``i``'s in rows ``i G .. (i + 1) G - 1``.
      step: the train step the round belongs to.
      max_prompts: how many prompts' groups to keep (all ``G`` completions of each).

    Returns:
      One dict a completion: ``{"step", "prompt", "completion", "reward", "rewards",
      "length", "truncated"}``, where ``prompt`` is as the reward functions saw it (text or
      chat messages), ``reward`` the task's weighted sum (the logged ``reward``; shaping
      such as DAPO's overlong penalty aside), ``rewards`` each function's value (``None``
      where it did not apply), ``length`` the completion's tokens (its stop token
      included) and ``truncated`` whether it hit the token budget without stopping. An
      episode's ``prompt`` is its own (an environment's observation appended), and its row
      also has ``messages``, the completion as TRL's message list (the model's turns with
      their ``tool_calls``, and the tools'); ``extra``, when reward functions logged
      columns with ``log_extra``, holds the row's value of each.
    """
    if not isinstance(max_prompts, numbers.Integral) or isinstance(max_prompts, bool) or max_prompts < 0:
        raise ValueError(f"sample_rows: `max_prompts` must be an integer >= 0; got {max_prompts!r}.")
    prompts, completions = list(scored_round.prompts), list(scored_round.completions)
    if not prompts or len(completions) % len(prompts):
        raise ValueError(
            f"sample_rows: {len(completions)} completions do not make equal groups for {len(prompts)} prompts."
        )
    group = len(completions) // len(prompts)
    result, rollouts = scored_round.result, scored_round.rollouts
    rows = []
    for prompt_index in range(min(max_prompts, len(prompts))):
        for row in range(prompt_index * group, (prompt_index + 1) * group):
            rows.append(
                {
                    "step": int(step),
                    "prompt": json_ready(
                        prompts[prompt_index] if scored_round.row_prompts is None else scored_round.row_prompts[row]
                    ),
                    "completion": json_ready(completions[row]),
                    "reward": json_ready(float(result.total[row])),
                    "rewards": {name: json_ready(float(values[row])) for name, values in result.values.items()},
                    "length": int(rollouts.lengths[row]),
                    "truncated": bool(rollouts.truncated[row]),
                    **({} if scored_round.messages is None else {"messages": json_ready(scored_round.messages[row])}),
                    **({"extra": {c: json_ready(v[row]) for c, v in result.extra.items()}} if result.extra else {}),
                }
            )
    return rows


# ------------------------------------------------------------------------------------------------
# TensorBoard, plots, summary


def tensorboard_tag(name: str) -> str:
    """The TensorBoard tag of a metric: timings under ``time/``, evaluation metrics under
    ``eval/`` (``eval_pass@4`` -> ``eval/pass_at_4``), the rest under ``train/``."""
    if name.endswith("_seconds") or name == "tokens_per_second":
        tag = f"time/{name}"
    elif name.startswith("eval_"):
        tag = f"eval/{name.removeprefix('eval_')}"
    else:
        tag = f"train/{name}"
    return re.sub(r"[^-/\w.]", "_", tag.replace("@", "_at_"))


def reward_function_metrics(names: Sequence[str]) -> list[str]:
    """The metrics among ``names`` that are a reward function's mean, ``reward_<function>``."""
    return [name for name in names if name.startswith("reward_") and name not in LOOP_REWARD_METRICS]


def _pass_at_k_metrics(names: Sequence[str]) -> list[str]:
    """``eval_pass@k`` metrics among ``names``, by ``k``."""
    found = [name for name in names if re.fullmatch(r"eval_pass@\d+", name)]
    return sorted(found, key=lambda name: int(name.split("@")[1]))


def _all_names(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The metric names of ``rows``, in first-seen order."""
    return list(dict.fromkeys(name for row in rows for name in row if name != "step"))


def _series(rows: Sequence[Mapping[str, Any]], name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of the rows that have ``name``; NaN where it is ``null``."""
    steps = [row["step"] for row in rows if name in row]
    values = [np.nan if row[name] is None else row[name] for row in rows if name in row]
    return np.asarray(steps, np.int64), np.asarray(values, np.float64)


def _before_row(before: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The evaluation before the first step as a metrics row at step -1, where it has ``eval_examples``."""
    return {**before, "step": -1} if before and before.get("eval_examples") else None


def accuracy_points(
    rows: Sequence[Mapping[str, Any]], *, before: Mapping[str, Any] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The held-out greedy accuracies a plot draws with their Wilson 95% intervals: those of
    ``before`` (at step -1) and of each row, where ``eval_examples`` is logged beside
    ``eval_greedy_accuracy`` (the interval needs the count).

    Returns:
      ``(steps [E], accuracies [E], low [E], high [E])`` over the ``E`` such evaluations, in order.
    """
    start = _before_row(before)
    evaluated = [
        (row["step"], row["eval_greedy_accuracy"], row["eval_examples"])
        for row in ([start, *rows] if start else rows)
        if row.get("eval_greedy_accuracy") is not None and row.get("eval_examples")
    ]
    bounds = [evaluation.wilson_interval(accuracy * examples, examples) for _, accuracy, examples in evaluated]
    steps = np.asarray([step for step, _, _ in evaluated], np.int64)
    accuracies = np.asarray([accuracy for _, accuracy, _ in evaluated], np.float64)
    low, high = np.asarray(bounds, np.float64).reshape(-1, 2).T
    return steps, accuracies, low, high


def plot_metrics(
    rows: Sequence[Mapping[str, Any]],
    path: str | os.PathLike,
    *,
    title: str = "",
    before: Mapping[str, Any] | None = None,
) -> None:
    """Draws a run's metrics (:func:`read_metrics`) into a PNG at ``path``, atomically.

    Six panels against the step: reward (the mean, a band of one ``reward_std``, and each
    reward function's mean), held-out accuracy (``eval_greedy_accuracy`` and any
    ``eval_pass@k``; the greedy accuracy with a band of its Wilson 95% interval where
    ``eval_examples`` is logged), KL to the reference (``kl_exact``, ``kl_k3``), completion
    length, clip fraction and entropy. A panel whose metrics were not logged says so.
    ``before``: the evaluation before the first step (``warm_start.json``'s ``eval_*``),
    drawn at step -1 when it has ``eval_examples`` (:func:`accuracy_points`).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    start = _before_row(before)
    names = _all_names([start, *rows] if start else rows)
    panels = [
        ("reward", ["reward", *reward_function_metrics(names)]),
        ("held-out accuracy", ["eval_greedy_accuracy", *_pass_at_k_metrics(names)]),
        ("KL to the reference", ["kl_exact", "kl_k3"]),
        ("completion length (tokens)", ["completion_length"]),
        ("clip fraction", ["clip_fraction"]),
        ("entropy (nats / token)", ["entropy"]),
    ]
    figure = Figure(figsize=(15, 8))
    FigureCanvasAgg(figure)
    # Fixed margins: a constrained layout measures every label on each redraw, twice the drawing's time.
    figure.subplots_adjust(left=0.05, right=0.98, bottom=0.07, top=0.9, wspace=0.22, hspace=0.3)
    axes = figure.subplots(2, 3, sharex=True).ravel()
    for ax, (panel, metrics) in zip(axes, panels, strict=True):
        ax.set_title(panel, y=1.0)  # a fixed place: placing it automatically measures every tick label
        banded = False
        ax.grid(alpha=0.3)
        present = [name for name in metrics if name in names]
        if not present:
            ax.text(
                0.5,
                0.5,
                f"no {' or '.join(metrics)} logged",
                ha="center",
                va="center",
                color="gray",
                transform=ax.transAxes,
            )
            continue
        for name in present:
            steps, values = _series([start, *rows] if start and name in start else rows, name)
            main = name == metrics[0]
            ax.plot(
                steps,
                values,
                label=name,
                linewidth=1.8 if main else 1.0,
                marker="o" if len(steps) <= 50 else None,
                markersize=3,
            )
            if name == "reward" and "reward_std" in names:
                _, spread = _series(rows, "reward_std")
                if len(spread) == len(values):
                    ax.fill_between(steps, values - spread, values + spread, alpha=0.15, label="± reward_std")
            if name == "eval_greedy_accuracy":
                band_steps, _, low, high = accuracy_points(rows, before=before)
                if len(band_steps):
                    ax.fill_between(band_steps, low, high, alpha=0.15, label="95% interval")
                    banded = True
        if len(present) > 1 or (panel == "reward" and "reward_std" in names) or banded:
            ax.legend(fontsize="small")
    for ax in axes[3:]:
        ax.set_xlabel("train step")
        ax.tick_params(labelbottom=True)
    last = max((row["step"] for row in rows), default=None)
    figure.suptitle(f"{title}  (step {last})".strip() if last is not None else title)
    path = Path(path)
    _replace_atomically(path, lambda file: figure.savefig(file, format="png", dpi=90), binary=True)


def _numbers(rows: Sequence[Mapping[str, Any]], name: str) -> list[tuple[int, float]]:
    """``(step, value)`` of the rows where ``name`` has a number."""
    return [(row["step"], row[name]) for row in rows if isinstance(row.get(name), int | float)]


def duration(seconds: float) -> str:
    """``H:MM:SS``."""
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


def step_line(rows: Sequence[Mapping[str, Any]], *, total_steps: int) -> str:
    """One line on the last of ``rows`` (:func:`read_metrics`' records), for a log:
    ``step 12/30  reward 0.44  length 14.2  16.3 s/step  0:04:53 left`` and, when it evaluated,
    ``held-out 0.55 (95% CI 0.48-0.62, n=200) in 31 s``. The time left is the remaining steps at
    the median seconds a step of the last ten, the first step (compiling) left out: none after it."""
    row = rows[-1]
    parts = [f"step {row['step'] + 1}/{total_steps}"]
    for name, label, form in (("reward", "reward", ".3g"), ("completion_length", "length", ".3g")):
        if row.get(name) is not None:
            parts.append(f"{label} {row[name]:{form}}")
    seconds = [r["step_seconds"] for r in rows[1:][-10:] if r.get("step_seconds") is not None]
    if row.get("step_seconds") is not None:
        parts.append(f"{row['step_seconds']:.3g} s/step")
    if seconds and row["step"] + 1 < total_steps:
        parts.append(f"{duration(float(np.median(seconds)) * (total_steps - row['step'] - 1))} left")
    if row.get("eval_greedy_accuracy") is not None:
        held_out = accuracy_with_interval(row["eval_greedy_accuracy"], row.get("eval_examples"))
        spent = f" in {row['eval_seconds']:.0f} s" if row.get("eval_seconds") is not None else ""
        parts.append(f"held-out {held_out}{spent}")
    return "  ".join(parts)


def accuracy_with_interval(accuracy: float, examples: float | None) -> str:
    """``"0.66 (95% CI 0.59-0.72, n=200)"``: an accuracy over ``examples`` held-out examples with its
    Wilson interval (:func:`jaxrl_llm.evaluation.wilson_interval`); the accuracy alone when the count is unknown."""
    if not examples:
        return f"{accuracy:.2f}"
    low, high = evaluation.wilson_interval(accuracy * examples, examples)
    return f"{accuracy:.2f} (95% CI {low:.2f}-{high:.2f}, n={int(examples)})"


def summarize(rows: Sequence[Mapping[str, Any]], *, window: int = SUMMARY_WINDOW) -> str:
    """A short text table of a run (:func:`read_metrics`): steps, the time spent in them
    (train steps and evaluations; not start-up, checkpoints or plots), and how
    reward, each reward function, the KL (``kl_exact``, ``kl_k3``), completion length and entropy moved (the
    means of the first and the last ``window`` steps) and the held-out accuracy (the first
    and the last evaluation)."""
    if not rows:
        return "No train steps recorded."
    train_seconds = sum(value for _, value in _numbers(rows, "step_seconds"))
    eval_seconds = sum(value for _, value in _numbers(rows, "eval_seconds"))
    lines = [f"{len(rows)} train steps recorded (steps {rows[0]['step']} to {rows[-1]['step']})"]
    if train_seconds:
        lines.append(
            f"time in steps {duration(train_seconds + eval_seconds)}: train steps "
            f"{duration(train_seconds)}, evaluation {duration(eval_seconds)}"
        )
    names = _all_names(rows)
    table = []
    for name in ["reward", *reward_function_metrics(names), "kl_exact", "kl_k3", "completion_length", "entropy"]:
        found = [value for _, value in _numbers(rows, name)]
        if found:
            start, end = np.mean(found[:window]), np.mean(found[-window:])
            table.append((name, f"{start:.4g}", f"{end:.4g}", f"means of the first and last {min(window, len(found))}"))
    for name in ["eval_greedy_accuracy", *_pass_at_k_metrics(names)]:
        found = _numbers(rows, name)
        if found:
            (first_step, start), (last_step, end) = found[0], found[-1]
            table.append((name, f"{start:.4g}", f"{end:.4g}", f"at steps {first_step} and {last_step}"))
    if table:
        width = max(len("metric"), *(len(name) for name, *_ in table))
        lines.append(f"{'metric':<{width}}  {'start':>10}  {'end':>10}")
        lines += [f"{name:<{width}}  {start:>10}  {end:>10}  {note}" for name, start, end, note in table]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# The recorder


def _nonnegative_int(name: str, value: object) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise ValueError(f"RunRecorder: `{name}` must be an integer >= 0; got {value!r}.")


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (a progress bar shows there)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class RunRecorder:
    """Writes a training run's records into ``run_dir`` (see the module doc); call
    :meth:`log` from :func:`jaxrl_llm.training.train`'s ``callback`` with the
    :class:`~jaxrl_llm.training.StepEnd`'s ``step`` and ``metrics``.

    Args:
      run_dir: the run directory (created if missing).
      total_steps: the step count at which the run ends (the progress bar's total).
      start_step: steps already done when this run starts: 0 for a fresh run (earlier
        records in ``run_dir`` are discarded), ``k`` for a run continued from a
        checkpoint after ``k`` steps (records of steps ``>= k`` are discarded).
      tensorboard: write TensorBoard event files under ``run_dir/tensorboard``
        (needs ``tensorboardX``).
      plot_every: redraw ``metrics.png`` every this many logged steps and at :meth:`close`;
        0: no plots (and no need for ``matplotlib``).
      progress: show a progress bar on ``stream``; ``None``: only when ``stream`` is a
        terminal.
      step_lines: print a line on this stream after the first and the last step and after
        each step that evaluated or ended at least ``line_seconds`` after the last line
        (:func:`step_line`: the step, reward, completion length, seconds a step, the time
        left, the held-out accuracy): progress for a log file or a batch job, where a
        progress bar does not show. ``None``: no lines.
      line_seconds: the least time between two :func:`step_line` lines.
      before: the evaluation before the first step (``warm_start.json``), which the plot's
        held-out panel starts from (:func:`plot_metrics`).
      wandb_project: also log to this Weights & Biases project (needs ``wandb``; off by
        default).
      wandb_config: the run's settings, recorded by Weights & Biases.
      stream: where the progress bar and :meth:`write` go (default: ``sys.stderr``).

    Raises:
      ValueError: a bad argument.
      ImportError: ``wandb_project`` without ``wandb`` installed, ``tensorboard`` without
        ``tensorboardX``, or ``plot_every`` without ``matplotlib``.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        plot_every: int = 10,
        progress: bool | None = None,
        wandb_project: str | None = None,
        wandb_config: Mapping[str, Any] | None = None,
        stream: IO[str] | None = None,
        step_lines: IO[str] | None = None,
        line_seconds: float = 10.0,
        before: Mapping[str, Any] | None = None,
    ):
        _nonnegative_int("total_steps", total_steps)
        _nonnegative_int("start_step", start_step)
        _nonnegative_int("plot_every", plot_every)
        if start_step > total_steps:
            raise ValueError(f"RunRecorder: `start_step` ({start_step}) is past `total_steps` ({total_steps}).")
        if progress not in (None, True, False):
            raise ValueError(f"RunRecorder: `progress` must be True, False or None; got {progress!r}.")
        self.run_dir = Path(run_dir)
        self.start_step, self.total_steps, self.plot_every = int(start_step), int(total_steps), int(plot_every)
        self._stream = sys.stderr if stream is None else stream
        self._step_lines, self._line_seconds = step_lines, float(line_seconds)
        self._before = dict(before) if before else None
        self._last_line = -math.inf  # time.monotonic() of the last step line
        self._closed = False
        self._logged = 0  # steps logged by this recorder
        self._plotted = 0  # ... when metrics.png was last drawn
        self._files: list[IO[str]] = []
        self._tensorboard = self._wandb = self._bar = None
        if plot_every:
            _require("matplotlib", "plot_every > 0 draws metrics.png", "pass plot_every=0")
        if tensorboard:
            with _torch_hidden():
                _require("tensorboardX", "tensorboard=True writes TensorBoard event files", "pass tensorboard=False")
        if wandb_project is not None:
            _require("wandb", f"wandb_project={wandb_project!r} logs to Weights & Biases", "leave wandb_project unset")

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._rows = _keep_before(self.run_dir / METRICS_FILE, self.start_step)  # all steps so far, JSON-ready
        _keep_before(self.run_dir / SAMPLES_FILE, self.start_step)
        try:
            self._metrics_file = self._open(METRICS_FILE)
            self._samples_file = self._open(SAMPLES_FILE)
            if tensorboard:
                self._tensorboard = _TensorBoardEvents(self.run_dir / TENSORBOARD_DIR, purge_step=self.start_step)
            if wandb_project is not None:
                self._wandb = self._start_wandb(wandb_project, wandb_config)
            if progress is None:
                progress = is_terminal(self._stream)
            if progress:
                self._bar = tqdm(
                    total=self.total_steps,
                    initial=self.start_step,
                    desc="train",
                    unit="step",
                    file=self._stream,
                    dynamic_ncols=True,
                )
        except BaseException:
            self.close()
            raise

    def _open(self, name: str) -> IO[str]:
        file = open(self.run_dir / name, "a", encoding="utf-8")
        self._files.append(file)
        return file

    def _start_wandb(self, project: str, config: Mapping[str, Any] | None):
        """A Weights & Biases run: a new one for a fresh run, the same one (its id kept in
        ``run_dir/wandb_run_id``) for a continued one."""
        import wandb

        id_path = self.run_dir / WANDB_ID_FILE
        run_id = id_path.read_text().strip() if self.start_step and id_path.exists() else ""
        if not run_id:
            run_id = uuid.uuid4().hex[:16]
            id_path.write_text(run_id + "\n")
        return wandb.init(project=project, config=dict(config or {}), id=run_id, resume="allow", dir=str(self.run_dir))

    @property
    def rows(self) -> list[dict[str, Any]]:
        """Every step's metrics so far (kept from before ``start_step``, then logged), as in
        ``metrics.jsonl``."""
        return list(self._rows)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Records train step ``step``'s metrics (``step``: the 0-based index of the step
        just completed) in every sink, and moves the progress bar to ``step + 1``.

        Raises:
          ValueError: ``step`` is not after the last one recorded, or a metric is not a
            number (``None`` is taken as a non-finite value).
        """
        self._check_open("log")
        _nonnegative_int("step", step)
        last = self._rows[-1]["step"] if self._rows else self.start_step - 1
        if step <= last:
            raise ValueError(
                f"RunRecorder.log: step {step} is not after the last step recorded, {last}; log each "
                f"step once, in order (a run continued from a checkpoint passes its `start_step`)."
            )
        row: dict[str, Any] = {"step": int(step)}
        for name, value in metrics.items():
            if name == "step":
                raise ValueError("RunRecorder.log: `step` is the record's own key; rename the metric.")
            if value is not None and not isinstance(value, numbers.Real):
                raise ValueError(f"RunRecorder.log: metric {name!r} must be a number; got {value!r}.")
            row[str(name)] = None if value is None else json_ready(float(value))
        self._metrics_file.write(_json_line(row))
        self._metrics_file.flush()
        self._rows.append(row)
        self._logged += 1
        finite = {name: value for name, value in row.items() if name != "step" and value is not None}
        if self._tensorboard is not None:
            self._tensorboard.add_scalars(finite, step=step)
        if self._wandb is not None:
            self._wandb.log(finite, step=step)
        if self.plot_every and self._logged % self.plot_every == 0:
            self.plot()
            self._plotted = self._logged
        if self._step_lines is not None:
            now = time.monotonic()
            due = step in (self.start_step, self.total_steps - 1) or "eval_greedy_accuracy" in row
            if due or now - self._last_line >= self._line_seconds:
                print(step_line(self._rows, total_steps=self.total_steps), file=self._step_lines, flush=True)
                self._last_line = now
        if self._bar is not None:
            kl = "kl_exact" if row.get("kl_exact") is not None else "kl_k3"  # exact when asked for
            shown = {"reward": "reward", "kl": kl, "step_s": "step_seconds"}
            self._bar.set_postfix(
                {label: f"{row[name]:.3g}" for label, name in shown.items() if row.get(name) is not None}, refresh=False
            )
            self._bar.update(step + 1 - self._bar.n)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Appends ``rows`` (:func:`sample_rows`) to ``samples.jsonl``, each with ``step``
        as its first key."""
        self._check_open("log_samples")
        _nonnegative_int("step", step)
        lines = [
            _json_line({"step": int(step), **{key: json_ready(value) for key, value in row.items() if key != "step"}})
            for row in rows
        ]
        self._samples_file.writelines(lines)
        self._samples_file.flush()

    def write(self, text: str) -> None:
        """Prints ``text`` on the recorder's stream without breaking the progress bar."""
        if self._bar is not None:
            self._bar.write(text, file=self._stream)
        else:
            print(text, file=self._stream, flush=True)

    def plot(self) -> None:
        """Redraws ``run_dir/metrics.png`` from every step so far."""
        if self._rows:
            plot_metrics(self._rows, self.run_dir / PLOT_FILE, title=self.run_dir.name, before=self._before)

    def summary(self) -> str:
        """The run's summary table (:func:`summarize`)."""
        return summarize(self._rows)

    def close(self) -> None:
        """Draws the final plot, then flushes and closes every sink; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.plot_every and self._logged > self._plotted:
                self.plot()
        finally:
            for file in self._files:
                file.close()
            if self._tensorboard is not None:
                self._tensorboard.close()
            if self._wandb is not None:
                self._wandb.finish()
            if self._bar is not None:
                self._bar.close()

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise RuntimeError(f"RunRecorder.{method}: the recorder is closed.")

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class _TensorBoardEvents:
    """A TensorBoard event file written in the caller's thread, through tensorboardX's
    ``EventsWriter``: a write that fails (a full disk) raises in the step that made it,
    where the run handles it. (``SummaryWriter`` writes from a thread of its own, which
    prints the error's traceback after the run's message, and whose full queue would then
    block the next step.)"""

    def __init__(self, directory: Path, *, purge_step: int):
        with _torch_hidden():
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto.event_pb2 import Event, SessionLog
            from tensorboardX.summary import scalar

        self._event, self._scalar = Event, scalar
        directory.mkdir(parents=True, exist_ok=True)
        # The suffix keeps two writers started within one second (the name's timestamp) from sharing a file.
        self._writer = EventsWriter(str(directory / "events"), f".{time.time_ns()}")
        # Hides the events of earlier files at steps >= purge_step (a continued run), as SummaryWriter(purge_step=).
        self._writer.write_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self._writer.flush()

    def add_scalars(self, values: Mapping[str, float], *, step: int) -> None:
        """One scalar event a metric (tagged :func:`tensorboard_tag`), flushed to the file."""
        for name, value in values.items():
            summary = self._scalar(tensorboard_tag(name), value)
            self._writer.write_event(self._event(wall_time=time.time(), step=step, summary=summary))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


@contextlib.contextmanager
def _torch_hidden() -> Iterator[None]:
    """Imports made inside see no torch (``import torch`` raises ImportError), unless torch is
    imported already. tensorboardX's package imports torch where it is installed, about two
    seconds, only to accept torch tensors as values; a run logs floats. Without it, tensorboardX
    takes NumPy's arrays as its arrays."""
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # type: ignore[assignment]  # the import system's "not importable"
    try:
        yield
    finally:
        del sys.modules["torch"]


def _require(module: str, need: str, instead: str) -> None:
    """Imports ``module``, or raises an ImportError saying what needs it and what to do."""
    try:
        __import__(module)
    except ImportError as error:
        raise ImportError(
            f"RunRecorder: {need}, which needs `{module}`: `pip install {module}`, or {instead}."
        ) from error


TIMING_METRICS = ("tokens_per_second", "score_traces", "update_traces")
"""Metrics (besides ``*_seconds``) that depend on the machine or the process, not the run."""


def is_timing(name: str) -> bool:
    """Whether metric ``name`` measures the machine (time, throughput, compilations), not the run."""
    return name.endswith("_seconds") or name in TIMING_METRICS
