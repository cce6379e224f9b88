"""Multi-turn episodes: the model writes, calls tools or acts in an environment, reads the
results and continues; the reward scores the whole episode.

The interfaces are TRL's (``GRPOTrainer(tools=..., environment_factory=...)``): tools are
plain Python functions with type hints and a Google-style docstring, environments are
objects with ``reset(**example)``, public methods that are their tools and an optional
``get_reward()``.
"""

from jaxrl_llm.episodes import config, conversation, environments, parsing, sampling, scoring, tools
from jaxrl_llm.episodes.config import EpisodeConfig
from jaxrl_llm.episodes.environments import Environments
from jaxrl_llm.episodes.sampling import Episodes, sample_episodes
from jaxrl_llm.episodes.scoring import Toolset

__all__ = [
    "EpisodeConfig",
    "Environments",
    "Episodes",
    "Toolset",
    "config",
    "conversation",
    "environments",
    "parsing",
    "sample_episodes",
    "sampling",
    "scoring",
    "tools",
]
