"""A run's held-out evaluation: of a policy with the run's settings, and of a checkpoint (``jaxrl-llm eval``)."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from typing import Any

import jax

from jaxrl_llm import compilation_cache, models, training
from jaxrl_llm.episodes import scoring
from jaxrl_llm.rewards.combine import called_in
from jaxrl_llm.runs import build
from jaxrl_llm.runs.config import RunConfig
from jaxrl_llm.runs.directory import write_json
from jaxrl_llm.runs.policy import restore_policy


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
    sampling settings, as training's evaluations record them (``eval_*``: they are
    :func:`jaxrl_llm.training.loop.evaluation_metrics`), with ``num_samples`` samples per
    prompt (default ``train.eval_samples``), decoded over ``mesh``."""
    train = config.train if num_samples is None else dataclasses.replace(config.train, eval_samples=num_samples)
    strategy = scoring.rollout_strategy(
        task,
        tools=build.tools(config.task),
        environment_factory=build.environment_factory(config.task),
        episodes=train.episodes,
    )
    return training.loop.evaluation_metrics(model, params, task, train, mesh=mesh, strategy=strategy)


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
    write_json(path, results)
    return results


def format_results(results: dict[str, Any]) -> str:
    """An evaluation as a two-column text table."""
    width = max(map(len, results))
    lines = []
    for name, value in results.items():
        shown = f"{value:.4f}" if isinstance(value, float) and math.isfinite(value) and value != int(value) else value
        lines.append(f"{name:<{width}}  {shown}")
    return "\n".join(lines)
