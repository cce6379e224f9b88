"""Multi-turn episodes: the model writes, calls tools or acts in an environment, reads the
results and continues; the reward scores the whole episode.

The interfaces are TRL's (``GRPOTrainer(tools=..., environment_factory=...)``): tools are
plain Python functions with type hints and a Google-style docstring, environments are
objects with ``reset(**example)``, public methods that are their tools and an optional
``get_reward()``.
"""
