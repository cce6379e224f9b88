"""Training on the language model: train state, the jitted update step, the loop."""

from jaxrl_llm.training.engine import (
    Batch,
    TrainConfig,
    TrainState,
    init_state,
    make_optimizer,
    make_update_step,
    train,
)

__all__ = [
    "Batch", "TrainConfig", "TrainState", "init_state", "make_optimizer", "make_update_step",
    "train",
]
