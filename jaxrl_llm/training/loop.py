r"""The host loop: rollout -> rewards -> score -> update, with metrics and timings.

.. code-block:: python

    state, history = training.train(model, params, algorithms.GRPO, training.TrainConfig(), steps=100)

Each step:

1. **rollout**: ``P`` prompts from the task's train stream; the rollout backend draws ``G``
   completions of each from the current params (the old policy; a snapshot is free,
   arrays are immutable);
2. **rewards**: the completions are decoded and the task's reward functions run on the
   host, in TRL's convention (:mod:`jaxrl_llm.rewards`). DAPO's soft overlong penalty is
   added here. With dynamic sampling (DAPO) the groups whose task rewards are all equal
   are dropped and more rollouts refill the batch, up to ``max_refill_rounds`` extra rounds;
   groups still missing are masked out (:mod:`jaxrl_llm.training.collect`);
3. **score** and **update**: the two jitted halves of :mod:`jaxrl_llm.training.step`.

Prompts are left-padded to one of a few widths (``8, 16, 32, ...`` up to
``max_prompt_length``), so both halves trace at most once per width: once per run when
the task's prompts fit one (the digit task's do). ``history[i]["score_traces"]`` and
``["update_traces"]`` count the traces. The prompt stream is addressed by
``(seed, state.prompts_drawn)`` and every PRNG key lives in the state, so a run
continued from a saved state (``state=``) sees the prompts and draws the samples the
uninterrupted run would have.

A run that ends early loses nothing: an exception inside a step, Ctrl-C, or too many
non-finite updates in a row raise :class:`RunStopped`, :class:`RunInterrupted` or
:class:`NonFiniteUpdates`, each carrying the state after the last completed step and the
history, from which ``train(..., state=error.state)`` continues the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import _checks, algorithms, distributed, evaluation, host, models, rewards, sampling, sharding, tasks
from jaxrl_llm import compilation_cache as compilation_cache_lib
from jaxrl_llm.episodes import scoring
from jaxrl_llm.rewards.combine import called_in
from jaxrl_llm.rollouts import RolloutStrategy
from jaxrl_llm.training.batch import Batch, batch_shardings
from jaxrl_llm.training.collect import CollectedBatch, collect_batch
from jaxrl_llm.training.config import TrainConfig
from jaxrl_llm.training.state import (
    FixedParams,
    TrainState,
    check_params,
    check_state,
    check_tree,
    fixed_params,
    fixed_shardings,
    init_state,
    policy_params,
    rollout_key,
    state_shardings,
)
from jaxrl_llm.training.step import make_train_step


class StepEnd(NamedTuple):
    """What ``train``'s ``callback`` receives after each step."""

    step: int
    """The step just completed, from 0 (``state.step`` before its update)."""
    metrics: dict[str, float]
    """The step's metrics (and its evaluation's ``eval_*`` on evaluation steps)."""
    state: TrainState
    """The state after the step. The next step's update consumes (donates) it: save or
    copy it here, do not keep a reference."""
    collected: CollectedBatch
    """The step's rollouts: ``collected.first_round`` holds the prompts, the decoded
    completions and each reward function's values."""


class _StoppedRun:
    """What is left of a run that ended before its last step."""

    def __init__(self, message: str, state: TrainState, history: list[dict[str, float]]):
        super().__init__(message)
        # The state after the last completed step, or the one the run started from (the
        # caller's, intact) if none completed; `train(..., state=error.state)` continues
        # the run, drawing the stopped step again.
        self.state = state
        self.history = history  # one dict of metrics per completed step

    def __reduce__(self):  # pickles whole (multiprocessing), cause aside
        return type(self), (str(self), self.state, self.history)


class RunStopped(_StoppedRun, RuntimeError):
    """:func:`train` ended early because a step raised (a reward function, the task, a
    callback, ...): the original exception is ``__cause__``; ``state`` and ``history``
    hold the run up to its last completed step."""


class RunInterrupted(_StoppedRun, KeyboardInterrupt):
    """:func:`train` was interrupted (Ctrl-C, a notebook's stop button); ``state`` and
    ``history`` hold the run up to its last completed step. A ``KeyboardInterrupt``, so
    code that stops on Ctrl-C still does."""


class NonFiniteUpdates(RunStopped, FloatingPointError):
    """Raised after ``max_consecutive_skips`` non-finite updates in a row. ``state`` holds the
    run's state (params of the last finite update) and ``history`` the metrics so far."""


@contextlib.contextmanager
def _interrupts_held():
    """Holds Ctrl-C (SIGINT) while the body runs and delivers it after; a second Ctrl-C
    is delivered at once (the user insists: a hung callback must not need a SIGKILL).

    The update consumes (donates) the state it is given: an interrupt between its dispatch
    and the assignment of its result would lose both states. Only the main thread receives
    signals; elsewhere, with Ctrl-C ignored, and under a handler not set from Python, this
    does nothing.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (None, signal.SIG_IGN):
        yield
        return

    def deliver(frame):
        if callable(previous):
            previous(signal.SIGINT, frame)
        else:  # SIG_DFL
            raise KeyboardInterrupt

    received = []

    def hold(signum, frame):
        received.append(frame)
        if len(received) > 1:
            signal.signal(signal.SIGINT, previous)
            deliver(frame)

    try:
        signal.signal(signal.SIGINT, hold)
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        deliver(received[0])


@contextlib.contextmanager
def _interrupts_noticed():
    """Yields a list that gets an entry at every Ctrl-C (SIGINT) on which the handler there
    was raises ``KeyboardInterrupt`` while the body runs.

    Python drops an exception raised inside a garbage-collection callback (JAX registers
    one) after printing it: a Ctrl-C that lands there would be lost, so the loop checks the
    list after each step and raises it then. Only the main thread receives signals;
    elsewhere, or when Ctrl-C has no Python handler, the list stays empty.
    """
    previous = signal.getsignal(signal.SIGINT)
    noticed: list[int] = []
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield noticed
        return

    def notice(signum, frame):
        try:
            previous(signum, frame)
        except KeyboardInterrupt:
            noticed.append(signum)
            raise

    try:
        signal.signal(signal.SIGINT, notice)
        yield noticed
    finally:
        signal.signal(signal.SIGINT, previous)


def check_evaluation(task: tasks.Task, config: TrainConfig) -> None:
    """Raises ValueError if ``config.eval_every`` asks for evaluations the task's test split cannot give."""
    if config.eval_every and not task.split_size("test"):
        raise ValueError(
            f"train: eval_every={config.eval_every} evaluates on the task's test split, but it has "
            f"{'no end' if task.split_size('test') is None else 'no examples'}; give the task a test "
            f"split (test_records=, test_fraction=) or set eval_every=0."
        )


def check_processes(config: TrainConfig, mesh: jax.sharding.Mesh | None, *, custom_rollout: bool = False) -> None:
    """Raises ValueError when a run over several processes cannot go on: it needs a mesh
    over every process's devices, and cannot take its own rollout backend (each process
    would draw its own samples). Nothing in one process."""
    if jax.process_count() == 1:
        return
    if mesh is None or mesh.devices.size != jax.device_count():
        raise ValueError(
            f"This run spans {jax.process_count()} processes: pass a mesh over all their "
            f"{jax.device_count()} devices (train(mesh=sharding.make_mesh(...)), or --mesh.fsdp / "
            f"--mesh.data / --mesh.tensor whose sizes multiply to {jax.device_count()})."
        )
    if custom_rollout:
        raise ValueError(
            "Over several processes a run cannot take its own `rollout` backend: every process "
            "must draw the same samples. Leave `rollout` unset (the built-in sampler decodes over "
            "the mesh)."
        )


def evaluation_metrics(
    model: models.Model,
    params: models.Params,
    task: tasks.Task,
    config: TrainConfig,
    *,
    prompt_bucket: int = 8,
    mesh: jax.sharding.Mesh | None = None,
    strategy: RolloutStrategy | None = None,
) -> dict[str, float]:
    """What ``train`` adds to the metrics every ``config.eval_every`` steps: the task's test
    split evaluated with the run's sampling settings (:func:`jaxrl_llm.evaluation.evaluate`,
    decoded over ``mesh``; rolled out by the run's ``strategy``, default the one
    ``config.episodes`` and the task's own tools make), as ``eval_*`` metrics and ``eval_seconds``."""
    if strategy is None:
        strategy = scoring.rollout_strategy(task, episodes=config.episodes)
    started = time.perf_counter()
    results = evaluation.evaluate(
        model,
        params,
        task,
        sampling=config.sampling,
        num_samples=config.eval_samples,
        prompt_bucket=prompt_bucket,
        seed=config.seed,
        on_reward_error=config.on_reward_error,
        progress=False,
        mesh=mesh,
        strategy=strategy,
    )
    return evaluation.as_metrics(results, seconds=time.perf_counter() - started)


def _placement(
    config: TrainConfig, *, mesh: jax.sharding.Mesh | None, rollout_mesh: jax.sharding.Mesh | None, custom_rollout: bool
) -> jax.sharding.Mesh | None:
    """The mesh the rollouts and evaluations decode over (``None``: one device): ``rollout_mesh``,
    or the train ``mesh`` when it has a ``data`` axis. Raises ValueError for meshes that do
    not fit the run or each other."""
    check_processes(config, mesh, custom_rollout=custom_rollout)
    if custom_rollout and rollout_mesh is not None:
        raise ValueError(
            "train: pass `rollout_mesh` or your own `rollout` backend (which places its own work), not both."
        )
    if mesh is not None:
        unknown = [axis for axis in mesh.axis_names if axis not in sharding.AXES]
        if unknown or rollout_mesh is not None:
            raise ValueError(
                f"train: the mesh's axes must be among {', '.join(sharding.AXES)} (got "
                f"{', '.join(mesh.axis_names)}), and `rollout_mesh` is then the same mesh: pass one."
            )
        row_devices = mesh.shape.get(sharding.DATA, 1) * mesh.shape.get(sharding.FSDP, 1)
        if config.batch_size % row_devices or config.num_prompts % mesh.shape.get(sharding.DATA, 1):
            raise ValueError(
                f"train: the batch's B = {config.batch_size} rows are split over data x fsdp = "
                f"{row_devices} devices and its {config.num_prompts} prompts over data = "
                f"{mesh.shape.get(sharding.DATA, 1)}: each must divide."
            )
        if sharding.DATA in mesh.axis_names:
            rollout_mesh = mesh
    if rollout_mesh is not None and config.num_prompts % sharding.data_size(rollout_mesh):
        raise ValueError(
            f"train: num_prompts ({config.num_prompts}) must be a multiple of the rollout mesh's "
            f"{sharding.data_size(rollout_mesh)} {sharding.DATA!r} devices."
        )
    return rollout_mesh


def _initial_state(
    model: models.Model,
    params: models.Params,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
    *,
    state: TrainState | None,
    ref_params: models.Params | None,
) -> tuple[TrainState, FixedParams]:
    """The caller's ``state`` once checked against the run, or a fresh one, and the run's
    fixed params: the reference is ``ref_params`` (or ``params``) itself, not a copy."""
    check_params(model, params)
    if ref_params is not None:
        check_params(model, ref_params, name="ref_params")
    fixed = fixed_params(params, algorithm, config, ref_params=ref_params)
    if state is None:
        return init_state(model, params, algorithm, config), fixed
    check_state(state, model, params, algorithm, config)
    return state, fixed


def _lora_state(
    model: models.Model,
    params: models.Params,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
    lora: models.LoraConfig,
    *,
    state: TrainState | None,
    ref_params: models.Params | None,
    adapters: models.Params | None = None,
) -> tuple[models.Model, TrainState, FixedParams]:
    """The LoRA model, the state and the fixed params of a LoRA run on the base ``params``:
    a fresh state (from ``adapters``, or PEFT's initialisation), or the caller's ``state`` (of
    a LoRA run with this config) once checked."""
    if ref_params is not None:
        raise ValueError("train: with `lora`, the reference is the base `params` itself: do not pass `ref_params`.")
    check_params(model, params)
    lora_model = models.lora.adapted(model, lora)
    if state is None:
        if adapters is None:
            adapters = models.lora.init_adapters(lora_model.config, jax.random.fold_in(jax.random.key(config.seed), 1))
        else:
            check_tree(
                "adapters",
                adapters,
                models.lora.abstract_adapters(lora_model),
                f"the adapters of {lora}",
                dtypes=True,
                advice="Were they loaded (lora.load_adapter) for this model, with this LoraConfig?",
            )
        state = init_state(lora_model, adapters, algorithm, config)
    elif adapters is not None:
        raise ValueError("train: `adapters` start a fresh LoRA run; a `state` to continue from has its own.")
    elif isinstance(state, TrainState) and not jax.tree.leaves(models.lora.split(state.params)[1]):
        raise ValueError("train: with `lora`, `state` must be a LoRA run's state (adapters as its params).")
    else:
        check_state(state, lora_model, models.lora.abstract_adapters(lora_model), algorithm, config)
    return lora_model, state, fixed_params(state.params, algorithm, config, base=params)


class _Compiled(NamedTuple):
    """The jitted halves of a run's train step, the fixed params they read, and where its batches go."""

    jitted_score: Callable
    """``score(state, fixed, batch) -> (scored, metrics)``, jitted."""
    jitted_update: Callable
    """``update(state, fixed, scored) -> (state, metrics)``, jitted, donating the state alone."""
    fixed: FixedParams
    """The run's reference and LoRA base, placed where the state is: the caller's arrays on one device."""
    place_batch: Callable[[Batch], Batch]
    """Puts a host batch where ``score`` takes it (one device, or split over the mesh)."""
    traces: dict[str, int]
    """How many times ``score`` and ``update`` were traced."""

    def score(self, state: TrainState, batch: Batch):
        """``(scored, metrics)`` of ``batch`` at ``state``."""
        return self.jitted_score(state, self.fixed, batch)

    def update(self, state: TrainState, scored) -> tuple[TrainState, dict]:
        """The state after the update on ``scored`` (``state`` is donated)."""
        return self.jitted_update(state, self.fixed, scored)


def _apart_from(fixed: FixedParams, state: TrainState) -> FixedParams:
    """``fixed`` with a copy of each of its leaves that is also a leaf of ``state``: the update
    donates the state, which would delete such a leaf under the fixed params (as continuing
    with ``train(model, state.params, ..., state=state)``, the current policy the reference, asks)."""
    donated = {id(leaf) for leaf in jax.tree.leaves(state)}
    return jax.tree.map(lambda leaf: jnp.copy(leaf) if id(leaf) in donated else leaf, fixed)


def _counting_traces(fn: Callable, traces: dict[str, int], name: str) -> Callable:
    """``fn``, adding one to ``traces[name]`` each time it is traced (not each time it runs)."""

    def traced(*args):
        traces[name] += 1
        return fn(*args)

    return traced


def _compile(
    model: models.Model,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
    state: TrainState,
    fixed: FixedParams,
    *,
    total_steps: int,
    mesh: jax.sharding.Mesh | None,
    rules: sharding.Rules | None,
) -> tuple[TrainState, _Compiled]:
    """The jitted train step of the run, and ``state`` placed where it runs (on ``mesh`` by
    ``rules``, the same on every process, as the fixed params; else as it is). A decaying
    learning rate without ``decay_steps`` ends at ``total_steps``."""
    train_step = make_train_step(model, algorithm, config, total_steps=total_steps)
    traces = {"score": 0, "update": 0}
    place_batch = jax.device_put
    placement = {}  # the update's output shardings, on a mesh: the state stays where the rules put it
    if mesh is not None:
        rules = sharding.RULES["fsdp_tensor"] if rules is None else rules
        shardings = state_shardings(state, algorithm, config, mesh, rules)
        state = distributed.put(state, shardings)
        fixed = distributed.put(fixed, fixed_shardings(fixed, mesh, rules))
        placement = {"out_shardings": (shardings, None)}
        place_batch = functools.partial(distributed.put, shardings=batch_shardings(mesh))
    fixed = _apart_from(fixed, state)
    return state, _Compiled(
        jitted_score=jax.jit(_counting_traces(train_step.score, traces, "score")),
        jitted_update=jax.jit(_counting_traces(train_step.update, traces, "update"), donate_argnums=0, **placement),
        fixed=fixed,
        place_batch=place_batch,
        traces=traces,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Run:
    """What every step of a :func:`train` call uses, built once."""

    model: models.Model
    algorithm: algorithms.Algorithm
    config: TrainConfig
    task: tasks.Task
    rollout: sampling.RolloutBackend
    compiled: _Compiled
    prompt_bucket: int
    rollout_mesh: jax.sharding.Mesh | None
    callback: Callable[[StepEnd], Any] | None
    strategy: RolloutStrategy  # how prompts become scored rollouts: single-turn, or episodes
    decoder: models.Model | None = None  # what rollouts and evaluations decode (None: model)
    decoding_params: Callable[[models.Params], models.Params] | None = None  # policy params -> decoder's

    def decoded(self, state: TrainState) -> tuple[models.Model, models.Params]:
        """The model and params the rollouts and evaluations of ``state``'s policy decode."""
        params = policy_params(state, self.compiled.fixed.base)
        decode = self.decoding_params
        return self.decoder or self.model, params if decode is None else decode(params)


class _Scored(NamedTuple):
    """A step up to its update: the rollouts, their scored batch and the host's metrics."""

    started: float  # perf_counter at the step's start
    collected: CollectedBatch
    scored: Any  # ScoredBatch
    score_metrics: dict
    host_metrics: dict[str, float]


def _rollout_and_score(run: _Run, state: TrainState, *, max_steps: int) -> _Scored:
    """Steps 1-3 up to the update: rollouts and rewards (refilled while groups carry no
    signal, with DAPO's dynamic sampling), then ``score`` (reference and old log-probs,
    values, advantages). ``max_steps``: the steps the run ends at, for the reward
    functions' ``trainer_state``."""
    started = time.perf_counter()
    drawn, train_size = int(state.prompts_drawn), run.task.split_size("train")
    trainer_state = rewards.TrainerState(
        global_step=int(state.step), max_steps=max_steps, epoch=drawn / train_size if train_size else 0.0
    )
    with called_in(f"the rollout of train step {int(state.step)}"):
        collected = collect_batch(
            run.rollout,
            run.decoded(state)[1],
            run.task,
            run.algorithm,
            run.config,
            key=rollout_key(state),
            position=int(state.prompts_drawn),
            prompt_bucket=run.prompt_bucket,
            strategy=run.strategy,
            trainer_state=trainer_state,
        )
    rollouts = collected.rollouts
    batch = Batch.from_rollout(
        rollouts.prompt_tokens, rollouts.prompt_mask, rollouts, rollouts.rewards, prompts_drawn=collected.prompts_drawn
    )
    score_started = time.perf_counter()
    scored, score_metrics = jax.block_until_ready(run.compiled.score(state, run.compiled.place_batch(batch)))
    logprob_seconds = time.perf_counter() - score_started
    host_metrics = dict(
        _rollout_metrics(collected, run.config),
        rollout_seconds=score_started - started - collected.reward_seconds,
        reward_seconds=collected.reward_seconds,
        logprob_seconds=logprob_seconds,
    )
    return _Scored(started, collected, scored, score_metrics, host_metrics)


def _rollout_metrics(collected: CollectedBatch, config: TrainConfig) -> dict[str, float]:
    """The rollouts' own statistics: the first round's rewards (each function's mean), lengths
    and truncations, and what the refills and reward functions did."""
    first = collected.first_round
    task_rewards = first.result.total  # [P * G]: the task's weighted sum, shaping aside
    lengths = first.rollouts.lengths
    grouped = first.rollouts.rewards.reshape(config.num_prompts, config.group_size)  # as the advantages see them
    metrics = dict(
        reward=float(task_rewards.mean()),
        reward_std=float(task_rewards.std()),
        **{f"reward_{name}": mean for name, mean in first.result.means().items()},
        reward_errors=float(collected.reward_errors),
        reward_unscored=float(first.result.unscored.mean()),
        truncated_prompts=float(collected.truncated_prompts),
        completion_length=float(lengths.mean()),
        completion_length_max=float(lengths.max()),
        truncated_fraction=float(np.mean(first.rollouts.truncated)),
        identical_reward_groups=float(np.mean(grouped.max(1) == grouped.min(1))),
        refill_rounds=float(collected.refill_rounds),
        **first.episode_metrics,
    )
    # What the reward functions logged with log_metric, as TRL: each name's mean.
    if clash := sorted(set(first.result.logged) & set(metrics)):
        raise rewards.RewardFunctionError(
            f"A reward function logged metric(s) {clash} with log_metric, names the run's own metrics take; "
            f"choose other names."
        )
    return metrics | {name: float(np.mean(values)) for name, values in first.result.logged.items()}


def _step_metrics(
    scored: _Scored, update_metrics: dict, state: TrainState, traces: dict[str, int], update_started: float
) -> dict[str, float]:
    """The step's metrics, once its update has run (waits for it): the device's, the host's,
    the timings and the skip and trace counters."""
    metrics = {k: float(v) for k, v in jax.device_get({**scored.score_metrics, **update_metrics}).items()}
    now = time.perf_counter()
    metrics.update(
        scored.host_metrics,
        update_seconds=now - update_started,
        step_seconds=now - scored.started,
        tokens_per_second=scored.collected.sampled_tokens / (now - scored.started),
        skipped_updates=float(state.skipped_updates),
        consecutive_skips=float(state.consecutive_skips),
        score_traces=float(traces["score"]),
        update_traces=float(traces["update"]),
    )
    return metrics


def _end_step(
    run: _Run,
    step: int,
    metrics: dict[str, float],
    state: TrainState,
    collected: CollectedBatch,
) -> None:
    """After the update of ``step``: the held-out evaluation when due (into ``metrics``) and
    the callback."""
    config = run.config
    if config.eval_every and (step + 1) % config.eval_every == 0:
        with called_in(f"the held-out evaluation after train step {step}"):
            metrics.update(
                evaluation_metrics(
                    *run.decoded(state),
                    run.task,
                    config,
                    prompt_bucket=run.prompt_bucket,
                    mesh=run.rollout_mesh,
                    strategy=run.strategy,
                )
            )
    if run.callback is not None:  # a Ctrl-C during it (a checkpoint being written, say) comes after it
        with _interrupts_held():
            run.callback(StepEnd(step=step, metrics=metrics, state=state, collected=collected))


def _stop_if_not_finite(
    config: TrainConfig, step: int, metrics: dict[str, float], state: TrainState, history: list[dict[str, float]]
) -> None:
    """Raises ``NonFiniteUpdates`` when ``max_consecutive_skips`` steps in a row skipped an update."""
    if metrics["consecutive_skips"] >= config.max_consecutive_skips:
        raise NonFiniteUpdates(
            f"Stopping at step {step}: {int(metrics['consecutive_skips'])} updates in a row had a non-finite loss, "
            f"gradient or update (max_consecutive_skips={config.max_consecutive_skips}); the state keeps the params "
            f"of the last finite update.",
            state,
            history,
        )


def _run_steps(run: _Run, state: TrainState, steps: int) -> tuple[TrainState, list[dict[str, float]]]:
    """``steps`` train steps from ``state``; an exception or Ctrl-C becomes ``RunStopped`` or
    ``RunInterrupted`` holding the state after the last completed step."""
    history: list[dict[str, float]] = []
    recorded = None  # the arguments of `_step_metrics` for a step whose update is dispatched, not yet recorded
    first_step = int(state.step)
    with _interrupts_noticed() as interrupts, host.full_collections_deferred():  # the first step traces
        try:
            for _ in range(steps):
                step = int(state.step)
                scored = _rollout_and_score(run, state, max_steps=first_step + steps)
                update_started = time.perf_counter()
                # The update consumes (donates) the state: from here on only its result is valid.
                with _interrupts_held():
                    state, update_metrics = run.compiled.update(state, scored.scored)
                    recorded = (scored, update_metrics, state, run.compiled.traces, update_started)
                metrics = _step_metrics(*recorded)
                history.append(metrics)
                recorded = None
                _end_step(run, step, metrics, state, scored.collected)
                if interrupts:  # a Ctrl-C that Python dropped (see _interrupts_noticed)
                    raise KeyboardInterrupt
                _stop_if_not_finite(run.config, step, metrics, state, history)
        except RunStopped:
            raise
        except (Exception, KeyboardInterrupt) as error:
            if recorded is not None:  # the update ran: its step is part of the state, so of the history
                with contextlib.suppress(Exception):  # what failed may have been this; the state is what counts
                    history.append(_step_metrics(*recorded))
            raise _stopped(error, state, history, first_step=first_step, steps=steps) from error
    return state, history


def _stopped(
    error: BaseException, state: TrainState, history: list[dict[str, float]], *, first_step: int, steps: int
) -> _StoppedRun:
    """The ``RunInterrupted`` (Ctrl-C) or ``RunStopped`` that ``error`` ends the run with."""
    where = f"train stopped at step {first_step + len(history)} ({len(history)} of {steps} steps done)"
    if isinstance(error, KeyboardInterrupt):
        return RunInterrupted(f"{where}: interrupted; `.state` and `.history` hold the run so far.", state, history)
    detail = str(error)
    detail = detail[:-1] if detail.endswith(".") and not detail.endswith("..") else detail  # one period, ours
    return RunStopped(
        f"{where}: {type(error).__name__}: {detail}; `.state` and `.history` hold the run so far.", state, history
    )


def train(
    model: models.Model,
    params: models.Params,
    algorithm: algorithms.Algorithm,
    config: TrainConfig,
    *,
    steps: int,
    task: tasks.Task | None = None,
    state: TrainState | None = None,
    ref_params: models.Params | None = None,
    rollout: sampling.RolloutBackend | None = None,
    prompt_bucket: int = 8,
    rollout_mesh: jax.sharding.Mesh | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: sharding.Rules | None = None,
    callback=None,
    compilation_cache: bool = True,
    tools: Sequence[Callable] | None = None,
    environment_factory: Callable[[], Any] | Mapping[str, Callable[[], Any]] | None = None,
    lora: models.LoraConfig | None = None,
    adapters: models.Params | None = None,
    tokenizer: Any = None,
) -> tuple[TrainState, list[dict[str, float]]]:
    """Runs ``steps`` train steps of ``algorithm`` on ``task``.

    Args:
      model, params: the policy at the run's start (``params`` is copied, never donated;
        the reference, when the run has one, is ``params`` itself, or on a ``mesh`` its
        placed copy). Continuing from a ``state``, still the run's initial params: the
        reference (or LoRA's base) and what the state is checked against.
      algorithm: the method (a preset from :mod:`jaxrl_llm.algorithms` or any config).
      config: the run's settings.
      steps: train steps (rollout batches) to run.
      task: prompts, tokenizer, stop ids and reward functions: any
        :class:`jaxrl_llm.tasks.Task` (default: :class:`~jaxrl_llm.tasks.DigitSumTask`, or
        with an ``environment_factory`` that owns the data, TRL's ``GRPOTrainer`` without a
        ``train_dataset``, :func:`jaxrl_llm.tasks.environment_task` over ``tokenizer``). A
        task may have no reward functions when its environments have ``get_reward``, and
        no prompt column when they give the prompts (``reset()``), as under TRL.
      state: continue from this state instead of a fresh one (it is donated: its
        buffers are reused by the first update).
      ref_params: the frozen reference (default: ``params``; only for runs that use one:
        :func:`jaxrl_llm.training.state.uses_reference`). Used as it is, never copied or
        donated; it is not part of the state, so a run continued from a ``state`` passes it
        again (or the same ``params``).
      rollout: the :class:`~jaxrl_llm.sampling.RolloutBackend` that samples completions
        (default: the built-in KV-cache sampler with the task's stop ids and
        ``config.sampling``). The evaluation of ``config.eval_every`` uses the built-in sampler.
      prompt_bucket: the narrowest prompt width; wider ones double it (``8, 16, 32, ...``
        up to ``config.sampling.max_prompt_length``).
      rollout_mesh: decode the rollouts and evaluations data-parallel over this mesh
        (:func:`jaxrl_llm.sharding.make_mesh`; ``num_prompts`` must be a multiple of its
        ``data`` size; evaluation batches split as :func:`jaxrl_llm.sampling.sample`
        says; episodes split their rows over its ``data`` devices, or decode on one device
        when a batch does not split evenly); ``score`` and ``update`` run where the state
        is. Only with the built-in sampler.
      mesh, rules: run ``score`` and ``update`` sharded over this mesh (axes among
        ``data``, ``fsdp``, ``tensor``: :func:`jaxrl_llm.sharding.make_mesh`): the state
        placed by ``rules`` (default ``sharding.RULES["fsdp_tensor"]``: parameters,
        optimizer state and critic really split, the reference and LoRA's base too), the
        batch's rows split over ``data x fsdp``, XLA partitioning the rest; the rollouts and
        evaluations split over ``data x fsdp`` (see :func:`jaxrl_llm.sampling.sample`) with
        the params gathered on each device. The numbers are the single-device run's up to
        float rounding (tested).
      callback: called as ``callback(StepEnd(step, metrics, state, collected))`` after
        each step (logging, checkpoints, samples); an exception it raises stops the run
        (``RunStopped``) with the step counted. A Ctrl-C while it runs is delivered when it
        returns, so a checkpoint it writes is not cut short (a second Ctrl-C stops it). It
        runs, as the steps do, with CPython's full collections deferred
        (:func:`jaxrl_llm.host.full_collections_deferred`; as they were after ``train``).
      compilation_cache: turn on JAX's persistent compilation cache
        (:func:`jaxrl_llm.compilation_cache.enable`: a per-user directory, or
        ``$JAXRL_LLM_COMPILATION_CACHE``; ``off`` there disables it), so that a restarted
        run loads its programs instead of compiling them again. A cache directory you
        configured in JAX is used as it is. ``False`` leaves the cache as it is:
        :func:`jaxrl_llm.models.init` turns it on too unless given ``False`` itself, and
        ``$JAXRL_LLM_COMPILATION_CACHE=off`` keeps it off everywhere.
      tools: TRL's ``tools``: functions the model may call (sync or async, with type
        hints and a Google-style docstring), added to the task's own ``tools`` if it has
        any. With tools or environments the rollouts are multi-turn episodes
        (:mod:`jaxrl_llm.episodes`; limits in ``config.episodes``), the task's prompts
        conversations, and the loss covers the model's tokens only.
      environment_factory: TRL's ``environment_factory``: a callable returning an
        environment (``reset(**example)``, public methods as tools, optional
        ``get_reward()``), or a dict of them chosen by the examples' ``environment`` column.
      lora: train low-rank adapters (:mod:`jaxrl_llm.models.lora`) on ``model`` instead of
        its weights: ``params`` are the base (used as they are, never copied, changed or
        donated, and not part of the state), the adapters (initialised as PEFT does, from
        ``config.seed``) the state's ``params``, the only leaves with optimizer state; the
        reference is the base itself. The rollouts decode the LoRA model unmerged, or merged
        once per rollout with ``config.lora_decoding = "merged"`` (a custom ``rollout`` then
        gets the merged params of the model without adapters), and
        ``training.policy_params(state, base=params)`` of the returned state is the policy's
        whole params (``lora.merge`` makes them a plain model); a ``state`` to continue from
        is a LoRA run's. A method with GAE trains a critic of its own adapters and value head
        over the same base.
      tokenizer: without a ``task``, with an ``environment_factory``: the tokenizer (TRL's
        ``processing_class``; it needs a chat template).
      adapters: with ``lora``, the adapters to start from instead of PEFT's initialisation:
        an adapter trained before (TRL's ``PeftModel`` as the model), read with
        ``lora_model, adapters = lora.load_adapter(path, model)`` and passed with
        ``lora=lora_model.config.lora``. The reference stays the base without them.

    Returns:
      The final state and one dict of float metrics per step.

    Raises:
      ValueError: settings that cannot work together, or a ``state`` / ``params`` that
        does not fit the model and method (before any compute).
      NonFiniteUpdates: after ``config.max_consecutive_skips`` non-finite updates in a row.
      RunStopped: a step raised (a reward function, the task, the callback): the original
        exception is its ``__cause__``.
      RunInterrupted: ``KeyboardInterrupt`` during the run (a Ctrl-C that Python drops,
        as it does inside a garbage-collection callback, stops the run after its step).

    The last three carry ``.state``, the state after the last completed step (the caller's
    ``state``, intact, if none completed), and ``.history``, so nothing is lost: continue
    with ``train(..., state=error.state)``.
    """
    _checks.nonnegative_int("train", "steps", steps)
    _checks.positive_int("train", "prompt_bucket", prompt_bucket)
    if task is None and environment_factory is not None:  # the environment owns the data
        if tokenizer is None:
            raise ValueError(
                "train: without a `task`, the environment gives the prompts, and `tokenizer=` (TRL's "
                "processing_class, with a chat template) renders them; pass it, or pass a task."
            )
        task = tasks.environment_task(tokenizer)
    elif tokenizer is not None:
        raise ValueError("train: `tokenizer=` is for a run without a task; a task brings its own tokenizer.")
    task = tasks.DigitSumTask() if task is None else task
    strategy = scoring.rollout_strategy(
        task, tools=tools, environment_factory=environment_factory, episodes=config.episodes
    )
    tasks.check_task(task, needs_rewards=not strategy.reward_functions())
    if getattr(task, "environment_prompts", False) and not strategy.gives_prompts:
        raise ValueError(f"TextTask: {task.missing_prompt_message()}; only an environment_factory gives prompts.")
    check_evaluation(task, config)
    if isinstance(task, tasks.TextTask):  # every prompt read once, before any compute
        sampling_config = config.sampling
        limit = None
        if sampling_config.prompt_truncation == "error":
            limit = sampling_config.max_prompt_length * tasks.base.longest_token_chars(task.tokenizer)
        for split in ("train", "test") if config.eval_every else ("train",):
            task.check_prompts(split, max_characters=limit)
    if rollout is not None and not strategy.takes_custom_rollout:
        raise ValueError("train: episodes with tools or environments run on the built-in sampler; drop `rollout=`.")
    rollout_mesh = _placement(config, mesh=mesh, rollout_mesh=rollout_mesh, custom_rollout=rollout is not None)
    if lora is None and adapters is not None:
        raise ValueError("train: `adapters` need `lora=`, their LoraConfig (lora_model.config.lora of load_adapter).")
    if compilation_cache:  # before the state is built: its optimizer's initial state loads from the cache too
        compilation_cache_lib.enable()
    if lora is None:
        state, fixed = _initial_state(model, params, algorithm, config, state=state, ref_params=ref_params)
    else:
        model, state, fixed = _lora_state(
            model, params, algorithm, config, lora, state=state, ref_params=ref_params, adapters=adapters
        )
    state, compiled = _compile(
        model, algorithm, config, state, fixed, total_steps=int(state.step) + steps, mesh=mesh, rules=rules
    )
    decoder, decoding_params = model, None
    if lora is not None and config.lora_decoding == "merged":  # W + s A B once per rollout, a plain model
        decoder = models.lora.base_model(model)
        decoding_params = jax.jit(lambda params: models.lora.merge(model, params)[1])
    if rollout is None:
        rollout = sampling.Sampler(
            model=decoder, eos_ids=task.eos_ids, pad_id=task.pad_id, sampling=config.sampling, mesh=rollout_mesh
        )
    run = _Run(
        model=model,
        algorithm=algorithm,
        config=config,
        task=task,
        rollout=rollout,
        compiled=compiled,
        prompt_bucket=prompt_bucket,
        rollout_mesh=rollout_mesh,
        callback=callback,
        strategy=strategy,
        decoder=decoder,
        decoding_params=decoding_params,
    )
    return _run_steps(run, state, steps)
