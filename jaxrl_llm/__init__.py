"""jaxrl_llm: reinforcement-learning post-training of language models in pure JAX.

The functional core, from the bottom up:

* :mod:`jaxrl_llm.ops`: per-token log-probs and entropies, masked aggregation.
* :mod:`jaxrl_llm.kl`: per-token KL estimators (k1, k2, k3) and the exact categorical KL.
* :mod:`jaxrl_llm.advantages`: REINFORCE, baselines, RLOO, GRPO (and Dr. GRPO),
  REINFORCE++, GAE.
* :mod:`jaxrl_llm.objectives`: policy gradient, PPO-clip, GRPO (and GSPO, DAPO), CISPO,
  the value loss and an entropy bonus, each returning ``(loss, metrics)``.
* :mod:`jaxrl_llm.trpo`: conjugate gradient, Fisher-vector products, natural-gradient
  steps with a KL line search.
* :mod:`jaxrl_llm.algorithms`: the named methods as frozen configs of those parts.
"""

from jaxrl_llm import advantages, algorithms, kl, objectives, ops, trpo

__version__ = "0.1.0"

__all__ = ["advantages", "algorithms", "kl", "objectives", "ops", "trpo"]
