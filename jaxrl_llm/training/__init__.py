"""Training on the language model: the train state, the jitted train step, the loop.

* :mod:`~jaxrl_llm.training.config`: :class:`TrainConfig`;
* :mod:`~jaxrl_llm.training.batch`: :class:`Batch` and :class:`ScoredBatch`, what a step consumes;
* :mod:`~jaxrl_llm.training.state`: :class:`TrainState`, everything a run carries, and
  :func:`init_state`;
* :mod:`~jaxrl_llm.training.optim`: the learning-rate schedule, AdamW with its weight-decay
  mask and float32 master weights (:func:`make_optimizer`), the non-finite guard;
* :mod:`~jaxrl_llm.training.losses`: the policy and value losses on a batch's rows;
* :mod:`~jaxrl_llm.training.accumulation`: gradient accumulation over micro-batches;
* :mod:`~jaxrl_llm.training.step`: the pure ``score`` / ``update`` halves of a train step
  (:func:`make_train_step`), with TRPO's update in :mod:`~jaxrl_llm.training.trpo_update`;
* :mod:`~jaxrl_llm.training.critic`: PPO's value model;
* :mod:`~jaxrl_llm.training.collect`: a task's prompts to scored rollouts (the loop's and
  the evaluator's one path), DAPO's dynamic sampling;
* :mod:`~jaxrl_llm.training.loop`: :func:`train`, the host loop with metrics;
* :mod:`~jaxrl_llm.training.sft`: a supervised warm start;
* :mod:`~jaxrl_llm.training.checkpoint`: :class:`Checkpointer`, the state saved and
  restored with orbax.
"""

from jaxrl_llm.training.config import TrainConfig
from jaxrl_llm.training.critic import CriticParams, completion_values, init_critic
from jaxrl_llm.training.checkpoint import Checkpointer
from jaxrl_llm.training.collect import collect_batch, fit_overlong_buffer, rollout_and_score
from jaxrl_llm.training.loop import NonFiniteUpdates, RunInterrupted, RunStopped, StepEnd, evaluation_metrics, train
from jaxrl_llm.training.sft import sft_loss, supervised_finetune
from jaxrl_llm.training.batch import Batch, ScoredBatch, batch_shardings
from jaxrl_llm.training.optim import in_float32, make_optimizer
from jaxrl_llm.training.state import (TrainState, check_params, check_state, init_state, rollout_key, state_shardings,
                                      uses_reference)
from jaxrl_llm.training.step import TrainStep, check_supported, make_train_step

__all__ = [
    "Batch", "Checkpointer", "CriticParams", "NonFiniteUpdates", "RunInterrupted", "RunStopped", "ScoredBatch", "StepEnd", "TrainConfig",
    "TrainState", "TrainStep", "batch_shardings", "check_params", "check_state", "check_supported", "collect_batch", "completion_values", "evaluation_metrics",
    "fit_overlong_buffer", "in_float32", "init_critic", "init_state", "make_optimizer", "make_train_step", "rollout_and_score", "rollout_key",
    "state_shardings", "sft_loss", "supervised_finetune", "train", "uses_reference",
]
