"""Runs: the settings of a run (:class:`RunConfig`), the run directory it trains in
(:func:`train_run`: checkpoints, exact resume, records), and its evaluation and export.
The ``jaxrl-llm`` command line (:mod:`jaxrl_llm.cli`) is a thin layer over these.

Modules by concern: ``config`` (the settings), ``directory`` (the run directory's layout,
marker and lock), ``run`` (training in it, and resuming), ``policy`` (a LoRA run's base, the
policy a checkpoint holds), ``evaluate`` and ``export``, ``records`` (metrics, samples, plots)
and ``build`` (a config's model, task and warm start). The package exports what a user calls;
the library's own helpers stay in their modules (``runs.config.from_dict`` /
``runs.config.to_dict``, a config as plain data; ``runs.directory.stored_config``, ...). A
run's sampling and optimizer settings are :class:`jaxrl_llm.sampling.SamplingConfig` and
:class:`jaxrl_llm.training.OptimizerConfig`.
"""

from jaxrl_llm.runs.config import LoraSpec, MeshSpec, ModelSpec, RunConfig, TaskSpec, WarmStartConfig, load
from jaxrl_llm.runs.directory import RunDirectoryError
from jaxrl_llm.runs.evaluate import evaluate_model, evaluate_run
from jaxrl_llm.runs.export import export_run
from jaxrl_llm.runs.policy import load_base, restore_policy
from jaxrl_llm.runs.records import RunRecorder, read_metrics, read_samples
from jaxrl_llm.runs.run import RunResult, train_run

__all__ = [
    "LoraSpec",
    "MeshSpec",
    "ModelSpec",
    "RunConfig",
    "RunDirectoryError",
    "RunRecorder",
    "RunResult",
    "TaskSpec",
    "WarmStartConfig",
    "evaluate_model",
    "evaluate_run",
    "export_run",
    "load",
    "load_base",
    "read_metrics",
    "read_samples",
    "restore_policy",
    "train_run",
]
