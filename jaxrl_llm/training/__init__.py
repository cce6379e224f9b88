"""Training on the language model: the train state, the jitted train step, the loop.

* :mod:`~jaxrl_llm.training.config`: :class:`TrainConfig` and its :class:`OptimizerConfig`
  (its ``sampling`` is :class:`jaxrl_llm.sampling.SamplingConfig`);
* :mod:`~jaxrl_llm.training.batch`: :class:`Batch` and :class:`ScoredBatch`, what a step consumes;
* :mod:`~jaxrl_llm.training.state`: :class:`TrainState`, what a run's steps change
  (:func:`init_state`), and :class:`FixedParams`, what they only read (:func:`fixed_params`);
* :mod:`~jaxrl_llm.training.optim`: the learning-rate schedule, AdamW with its weight-decay
  mask and float32 master weights (:func:`make_optimizer`), the non-finite guard;
* :mod:`~jaxrl_llm.training.losses`: the teacher-forced passes (``TeacherForcing``) and the
  policy and value losses on a batch's rows;
* :mod:`~jaxrl_llm.training.accumulation`: gradient accumulation over micro-batches;
* :mod:`~jaxrl_llm.training.step`: the pure ``score`` / ``update`` halves of a train step
  (:func:`make_train_step`), with TRPO's update in :mod:`~jaxrl_llm.training.trpo_update`;
* :mod:`~jaxrl_llm.training.critic`: PPO's value model;
* :mod:`~jaxrl_llm.training.collect`: a step's scored rollouts (through
  :func:`jaxrl_llm.rollouts.rollout_and_score`, the evaluator's path too), DAPO's dynamic sampling;
* :mod:`~jaxrl_llm.training.loop`: :func:`train`, the host loop with metrics;
* :mod:`~jaxrl_llm.training.sft`: a supervised warm start;
* :mod:`~jaxrl_llm.training.checkpoint`: :class:`Checkpointer`, the state saved and
  restored with orbax.

The package exports what a user calls; the library's own helpers stay in their modules
(``training.state.check_state``, ``training.state.rollout_key``, ...).
"""

from jaxrl_llm.training.batch import Batch, ScoredBatch
from jaxrl_llm.training.checkpoint import Checkpointer
from jaxrl_llm.training.collect import fit_overlong_buffer
from jaxrl_llm.training.config import OptimizerConfig, TrainConfig
from jaxrl_llm.training.loop import NonFiniteUpdates, RunInterrupted, RunStopped, StepEnd, train
from jaxrl_llm.training.optim import make_optimizer
from jaxrl_llm.training.sft import supervised_finetune
from jaxrl_llm.training.state import (
    FixedParams,
    TrainState,
    fixed_params,
    fixed_shardings,
    init_state,
    policy_params,
    state_shardings,
)
from jaxrl_llm.training.step import TrainStep, make_train_step

__all__ = [
    "Batch",
    "Checkpointer",
    "FixedParams",
    "NonFiniteUpdates",
    "OptimizerConfig",
    "RunInterrupted",
    "RunStopped",
    "ScoredBatch",
    "StepEnd",
    "TrainConfig",
    "TrainState",
    "TrainStep",
    "fit_overlong_buffer",
    "fixed_params",
    "fixed_shardings",
    "init_state",
    "make_optimizer",
    "make_train_step",
    "policy_params",
    "state_shardings",
    "supervised_finetune",
    "train",
]
