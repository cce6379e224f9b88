"""Reward functions in TRL's convention, and how the trainer calls them.

Each reward function is called with keyword arguments only,
``fn(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=...,
log_extra=..., log_metric=...) -> list[float | None]``
(see :mod:`jaxrl_llm.rewards.combine`); the built-ins follow the same convention, so they
can be passed as they are or with options bound by ``functools.partial``:

* :mod:`~jaxrl_llm.rewards.text`: :func:`exact_match`, :func:`math_equivalence`, :func:`format_reward`;
* :mod:`~jaxrl_llm.rewards.extraction`: answer extraction (last number, ``\\boxed{}``, tags, regex);
* :mod:`~jaxrl_llm.rewards.length`: :func:`soft_overlong_punishment` (DAPO), :func:`length_penalty`;
* :mod:`~jaxrl_llm.rewards.code`: :func:`code_execution` in :mod:`~jaxrl_llm.rewards.sandbox`;
* :mod:`~jaxrl_llm.rewards.reward_model`: :class:`RewardModel`, a learned scalar reward.

The package exports what a user calls; the library's own helpers stay in their modules
(``rewards.combine.reward_names``, the names metrics are logged under;
``rewards.combine.completion_text``, ``rewards.reward_model.score_tokens``, ...).
"""

from jaxrl_llm.rewards import extraction, sandbox
from jaxrl_llm.rewards.code import code_execution, extract_code
from jaxrl_llm.rewards.combine import RewardFunctionError, RewardResult, TrainerState, compute_rewards
from jaxrl_llm.rewards.length import length_penalty, overlong_penalty, soft_overlong_punishment
from jaxrl_llm.rewards.reward_model import RewardModel
from jaxrl_llm.rewards.text import exact_match, format_reward, math_equivalence

__all__ = [
    "RewardFunctionError",
    "RewardModel",
    "RewardResult",
    "TrainerState",
    "code_execution",
    "compute_rewards",
    "exact_match",
    "extract_code",
    "extraction",
    "format_reward",
    "length_penalty",
    "math_equivalence",
    "overlong_penalty",
    "sandbox",
    "soft_overlong_punishment",
]
