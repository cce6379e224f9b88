"""The real-model side-by-side's reward, in TRL's convention, imported by both libraries
(``jaxrl-llm train --task.rewards benchmarks/real_model_reward.py:correct`` and
``trl_real_model.py``'s ``reward_funcs``): the same code scores both. Standard library only."""

import re


def correct(completions, answer, **kwargs):
    """1.0 when the completion's last integer is the answer, else 0.0. A completion is a
    string, or TRL's conversational form, a list holding the assistant message."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    found = [re.findall(r"-?\d+", text) for text in texts]
    return [1.0 if numbers and numbers[-1] == str(a) else 0.0 for numbers, a in zip(found, answer)]
