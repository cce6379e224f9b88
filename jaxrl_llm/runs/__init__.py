"""Runs: the settings of a run (:class:`RunConfig`), the run directory it trains in
(:func:`train_run`: checkpoints, exact resume, records), and its evaluation and export.
The ``jaxrl-llm`` command line (:mod:`jaxrl_llm.cli`) is a thin layer over these."""

from jaxrl_llm.runs.config import (MeshSpec, ModelSpec, OptimizerConfig, RunConfig, SamplingConfig, TaskSpec,
                                   WarmStartConfig, from_dict, load, to_dict)
from jaxrl_llm.runs.records import RunRecorder, read_metrics, read_samples
from jaxrl_llm.runs.run import (
    RunDirectoryError,
    RunResult,
    evaluate_model,
    evaluate_run,
    export_run,
    restore_policy,
    stored_config,
    train_run,
)

__all__ = [
    "MeshSpec", "ModelSpec", "OptimizerConfig", "RunConfig", "RunDirectoryError", "RunRecorder", "RunResult",
    "SamplingConfig", "TaskSpec", "WarmStartConfig", "evaluate_model", "evaluate_run", "export_run", "from_dict",
    "load", "read_metrics", "read_samples", "restore_policy", "stored_config", "to_dict", "train_run",
]
