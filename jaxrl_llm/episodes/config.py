"""The limits of an episode and how its tool calls are read (``TrainConfig.episodes``)."""

from __future__ import annotations

import dataclasses

from jaxrl_llm import _checks
from jaxrl_llm.episodes.parsing import TOOL_CALL_FORMATS


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeConfig:
    """How long episodes may run and how tool calls are read. The token budget of an
    episode is the sampling's ``max_new_tokens`` (tool results included, as TRL's
    ``max_completion_length``)."""

    max_turns: int | None = None
    """Tool-calling rounds per episode (TRL's ``max_tool_calling_iterations``): after this
    many, a turn that calls tools ends the episode (``turn_limited``). ``None``: no limit
    but the token budget."""
    tool_timeout: float | None = 30.0
    """Seconds one tool call may take; a call still running is cut off with an error
    result (:func:`jaxrl_llm.episodes.tools.call_tools`). ``None``: wait."""
    tool_call_format: str = "auto"
    """How the model writes tool calls: ``"auto"`` (from the tokenizer:
    :func:`jaxrl_llm.episodes.parsing.detect_format`) or one of
    :data:`jaxrl_llm.episodes.TOOL_CALL_FORMATS`."""

    def __post_init__(self):
        where = "EpisodeConfig"
        if self.max_turns is not None:
            _checks.nonnegative_int(where, "max_turns", self.max_turns)
        if self.tool_timeout is not None:
            _checks.finite_number(where, "tool_timeout", self.tool_timeout)
            _checks.positive(where, "tool_timeout", self.tool_timeout)
        _checks.one_of(where, "tool_call_format", self.tool_call_format, ("auto", *TOOL_CALL_FORMATS))
