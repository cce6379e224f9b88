r"""The episodes' sampler, the multi-turn counterpart of :mod:`jaxrl_llm.sampling`: every row
its own conversation, all rows decoded as one batch, the KV cache carried across turns.
(:mod:`jaxrl_llm.episodes.scoring` is the counterpart of :mod:`jaxrl_llm.rollouts`: it
turns a task's prompts into scored episodes through this module.)

.. code-block:: text

    prefill the P prompts once, copy the cache to their B = P G rows
    feed each row's own opening (an environment's observation), if any
    repeat:  decode a turn for the rows still going: each stops at an end-of-turn id
             or at its budget                 (jitted, on the device, by segments of steps)
             parse each turn; run the tools of the rows that called some, all at once
                                                                (host threads)
             feed each continuing row its end-of-turn id, the tool results and the
             template ids before its next turn into the existing cache: only the new
             tokens, never the conversation again               (jitted: models.extend)

Rows share the cache's slot index, so a row that writes nothing in a turn leaves a gap
(its slots stay invalid), and its keys never see another row's tokens. When the rows
still going fit in half the batch, the batch shrinks to the next power of two holding
them (the cache's rows gathered, and its slots compacted to each row's valid ones), so
finished rows stop costing compute.

**The cache follows the episode.** Every step attends over all the cache's slots, so the
cache is not allocated for the whole episode up front: it starts with the prompt and one
segment (an eighth of the episode's width, at least 32 slots) and grows by segments. A
turn is decoded by calls of at most a segment of steps; before each call, and before each
feed of tool results (padded to 8, 12, 16, 24, 32, 48, ... ids), the rows' slots are
compacted if they have gaps, and the cache grows if that does not make room. A turn's
tokens do not depend on how it is cut into calls.

**An episode as training data.** The completion is the row's opening, then its turns,
each followed by the template's and tools' ids: everything after the prompt that a
from-scratch pass over the conversation reads, in order and without gaps. The loss mask
is 1 on the model's own tokens (each turn's tokens, its end-of-turn id included) and 0
on the rest; their log-probs are the sampler's (:mod:`jaxrl_llm.sampling`'s
convention), the old log-probs of an on-policy step. The group's ``G`` rows share the
longest common prefix of their rendered prompts as their prompt (``[P, S]``); the rest
of a row's prompt is its opening.

**Limits** (TRL's): ``sampling.max_new_tokens`` bounds everything after the prompt, the
tool results and template ids included (TRL's ``max_completion_length``); a tool result
that would pass it is dropped with its messages and ends the episode, truncated.
:attr:`EpisodeConfig.max_turns` bounds the tool-calling rounds (TRL's
``max_tool_calling_iterations``); :attr:`EpisodeConfig.tool_timeout` cuts off a tool
that hangs.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import models, rollouts, sampling, sharding, tasks
from jaxrl_llm.episodes import conversation, parsing
from jaxrl_llm.episodes.config import EpisodeConfig
from jaxrl_llm.episodes.environments import Environments, append_observation
from jaxrl_llm.episodes.tools import call_tools, check_tools


@dataclasses.dataclass
class Episodes:
    """Host copies of ``B = P G`` episodes, prompt ``p``'s rows ``p G ... p G + G - 1``."""

    prompt_tokens: np.ndarray  # [P, S] int32: each group's shared prompt, left-padded
    prompt_mask: np.ndarray  # [P, S] bool
    completion_tokens: np.ndarray  # [B, C] int32: opening, turns and tool results, pad after
    completion_mask: np.ndarray  # [B, C] bool: the model's tokens (the loss mask)
    logprobs: np.ndarray  # [B, C] float32: log pi_T of the model's tokens, 0 elsewhere
    lengths: np.ndarray  # [B] int32: completion tokens of every kind
    openings: np.ndarray  # [B] int32: the first of them, the row's rest of its prompt (an observation)
    truncated: np.ndarray  # [B] bool: the budget ended the episode (mid-turn, or before a tool result)
    turn_limited: np.ndarray  # [B] bool: max_turns ended it with tool calls unanswered
    turns: np.ndarray  # [B] int32: the model's messages
    tool_calls: np.ndarray  # [B] int32
    tool_failures: np.ndarray  # [B] int32: calls whose result is an error (timeouts included)
    tool_timeouts: np.ndarray  # [B] int32
    prompts: list  # [B] each row's prompt messages (an environment's observation appended)
    completions: list  # [B] each row's messages after the prompt, TRL's conversational format
    completion_ids: list  # [B] each row's completion ids (lengths[b] of them)
    environments: list | None  # [B] each row's environment instance, or None without environments

    @property
    def model_tokens(self) -> np.ndarray:
        """``[B]`` the model's tokens per episode."""
        return self.completion_mask.sum(axis=1).astype(np.int32)

    @property
    def tool_tokens(self) -> np.ndarray:
        """``[B]`` the tool results' tokens per episode, with the template's ids around them."""
        return self.lengths - self.openings - self.model_tokens


class _Turn(NamedTuple):
    """One turn's tokens, or a segment of it."""

    tokens: Any  # [b, W] int32: the turn's tokens, 0 after a row's last
    logprobs: Any  # [b, W] float32
    lengths: Any  # [b] int32
    stopped: Any  # [b] bool: ended on an end-of-turn id
    steps: Any  # [] int32: decode steps taken (cache slots used)


@functools.partial(jax.jit, static_argnames=("model", "group", "cache_size"))
def _prefill(model, params, tokens, mask, *, group: int, cache_size: int):
    """``[P, S]`` prompts into a cache of ``cache_size`` slots, copied to ``P G`` rows."""
    logits, cache = models.prefill(model, params, tokens, mask, cache_size=cache_size, last_logits_only=True)
    return jnp.repeat(logits, group, axis=0), cache.repeat_rows(group)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("logits", "cache"))
def _extend(model, params, tokens, mask, logits, cache):
    """Feeds ``tokens`` ``[b, E]`` where ``mask``; rows fed nothing keep their ``logits``."""
    new_logits, cache = models.extend(model, params, tokens, mask, cache, last_logits_only=True)
    return jnp.where(jnp.any(mask, axis=1)[:, None], new_logits, logits), cache


@jax.jit
def _regather(cache: models.KVCache, logits, rows):
    """The cache and logits of rows ``rows`` ``[b']``, each row's valid slots moved to the
    front in order (its keys keep their positions): the slot index becomes the largest
    count of valid slots."""
    cache = cache.take_rows(rows)
    order = jnp.argsort(~cache.valid, axis=1, stable=True)  # [b', K]: valid slots first, in order

    def gather(kv):  # [b', KVH, K, D], or [L, b', KVH, K, D]
        index = order[:, None, :, None] if kv.ndim == 4 else order[None, :, None, :, None]
        return jnp.take_along_axis(kv, index, axis=kv.ndim - 2)

    keys, values = jax.tree.map(gather, (cache.keys, cache.values))  # per-layer tuples or stacked arrays
    valid = jnp.take_along_axis(cache.valid, order, axis=1)
    index = jnp.max(jnp.sum(valid, axis=1)).astype(jnp.int32)
    return cache._replace(keys=keys, values=values, valid=valid, index=index), logits[rows]


@functools.partial(jax.jit, static_argnames=("slots",))
def _grow(cache: models.KVCache, *, slots: int) -> models.KVCache:
    """The cache with ``slots`` slots, the new ones empty (invalid) after the old."""

    def pad(kv):  # [B, KVH, K, D], or [L, B, KVH, K, D]: slots are axis -2
        return jnp.pad(kv, [(0, 0)] * (kv.ndim - 2) + [(0, slots - kv.shape[-2]), (0, 0)])

    keys, values = jax.tree.map(pad, (cache.keys, cache.values))  # per-layer tuples or stacked arrays
    valid = jnp.pad(cache.valid, [(0, 0), (0, slots - cache.valid.shape[1])])
    return cache._replace(keys=keys, values=values, valid=valid)


@functools.partial(
    jax.jit,
    static_argnames=("model", "width", "draws", "draw_rows", "top_k", "use_top_p", "use_min_p", "greedy", "stop_ids"),
    donate_argnames=("logits", "cache"),
)
def _decode_segment(
    model, params, logits, cache, budget, key, offset, temperature, top_p, min_p, *, width, draws, draw_rows, top_k,
    use_top_p, use_min_p, greedy, stop_ids,
):  # fmt: skip
    """Up to ``width`` steps of the turn of every row with ``budget > 0`` (``[b]`` tokens it
    may still write): sample and record (:func:`jaxrl_llm.sampling.draw_live` and
    :func:`~jaxrl_llm.sampling.record`, as the single-turn loop does), and feed the token
    unless it ends the row's turn (an id of ``stop_ids``) or its budget; the last token of a
    turn is recorded, not fed (the next round feeds it with the tool results). Step ``offset + s`` of a turn draws the
    uniforms of row ``offset + s`` of ``uniform(key, [draws, draw_rows])``, so a turn's tokens
    do not depend on how it is cut into segments; ``draw_rows`` is ``b`` but on a mesh, whose
    batch may carry padding rows past it (they draw zeros, and are done). Returns the
    :class:`_Turn` segment, the next-token logits and the cache."""
    batch = logits.shape[0]
    uniforms = jnp.pad(
        jax.random.uniform(key, (draws, draw_rows)), [(0, width), (0, batch - draw_rows)]
    )  # [draws + W, b]
    uniforms = jax.lax.dynamic_slice_in_dim(uniforms, offset, width)  # [W, b]: never clamped

    class State(NamedTuple):
        step: jax.Array
        logits: jax.Array  # [b, V]
        cache: models.KVCache
        tokens: jax.Array  # [b, W]
        logprobs: jax.Array  # [b, W]
        lengths: jax.Array  # [b]
        stopped: jax.Array  # [b]
        done: jax.Array  # [b]

    def going(state: State) -> jax.Array:
        return (state.step < width) & ~jnp.all(state.done)

    def step(state: State) -> State:
        live = ~state.done
        drawn = sampling.draw_live(
            state.logits,
            uniforms[state.step],
            live,
            pad_id=0,
            stop_ids=stop_ids,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p if use_top_p else None,
            min_p=min_p if use_min_p else None,
            greedy=greedy,
        )
        lengths = state.lengths + live.astype(jnp.int32)
        stopped = state.stopped | drawn.stopped
        done = state.done | stopped | (lengths >= budget)
        feed = live & ~done
        new_logits, cache = models.extend(
            model, params, drawn.token[:, None], feed[:, None], state.cache, last_logits_only=True
        )
        return State(
            step=state.step + 1,
            logits=jnp.where(feed[:, None], new_logits, state.logits),
            cache=cache,
            tokens=sampling.record(state.tokens, drawn.token, state.step),
            logprobs=sampling.record(state.logprobs, drawn.logp, state.step),
            lengths=lengths,
            stopped=stopped,
            done=done,
        )

    init = State(
        step=jnp.zeros((), jnp.int32),
        logits=logits,
        cache=cache,
        tokens=jnp.zeros((batch, width), jnp.int32),
        logprobs=jnp.zeros((batch, width), jnp.float32),
        lengths=jnp.zeros((batch,), jnp.int32),
        stopped=jnp.zeros((batch,), bool),
        done=budget <= 0,
    )
    final = jax.lax.while_loop(going, step, init)
    turn = _Turn(final.tokens, final.logprobs, final.lengths, final.stopped, final.step)
    return turn, final.logits, final.cache


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _power_of_two(value: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(value, 1))))


def _feed_width(value: int) -> int:
    """The padded width of a feed of ``value`` ids: the next of 8, 12, 16, 24, 32, 48, ...
    (at most a third wasted, and few widths to compile)."""
    width = 8
    while width < value:
        width = width * 3 // 2 if width & (width - 1) == 0 else width * 4 // 3
    return width


def _segment(completion_width: int) -> int:
    """Decode steps per call, and the cache's growth step: an eighth of the episode's
    width, at least 32 (the cache stays within a segment of the episode's length, and has
    at most about 16 sizes to compile)."""
    return min(completion_width, max(32, _power_of_two(completion_width) // 8))


def _cache_slots(prompt_width: int, completion_width: int) -> int:
    """The most slots the episodes' KV cache grows to: the prompt and twice the
    completion, room for the gaps that rows finishing their turns at different times
    leave (compacted when full)."""
    return prompt_width + 2 * _round_up(completion_width, 16)


def max_cache_slots(*, max_prompt_length: int, max_new_tokens: int) -> int:
    """The most cache slots (positions the model must allow) :func:`sample_episodes` needs
    with these settings: prompts up to ``max_prompt_length`` tokens, and an episode's
    completion of ``max_new_tokens`` after an opening as long as a whole prompt."""
    return _cache_slots(max_prompt_length, _round_up(max_new_tokens + max_prompt_length, 16))


def _shared_prefix(rows: Sequence[list[int]]) -> int:
    """The length of the longest common prefix of ``rows``."""
    first, length = rows[0], min(map(len, rows))
    for row in rows[1:]:
        same = np.flatnonzero(np.asarray(row[:length]) != np.asarray(first[:length]))
        length = int(same[0]) if len(same) else length
    return length


@dataclasses.dataclass
class _Row:
    """One episode's host state."""

    prompt: list
    toolbox: dict
    tools: tuple
    environment: Any
    opening: int  # ids of the prompt's own part, at the start of the completion
    shared_prompt: list = dataclasses.field(default_factory=list)  # the group's shared prompt ids
    ids: list = dataclasses.field(default_factory=list)  # completion ids so far
    by_model: list = dataclasses.field(default_factory=list)  # bool per id: written by the model
    logprobs: list = dataclasses.field(default_factory=list)
    messages: list = dataclasses.field(default_factory=list)
    finished: bool = False
    truncated: bool = False
    turn_limited: bool = False
    rounds: int = 0  # tool-calling rounds
    calls: int = 0
    failures: int = 0
    timeouts: int = 0
    pending: tuple = ()  # the last turn's tool calls

    @property
    def used(self) -> int:
        """Tokens of the episode's budget used: everything after its opening."""
        return len(self.ids) - self.opening

    def add(self, ids, *, model: bool, logprobs=None) -> None:
        self.ids += [int(i) for i in ids]
        self.by_model += [model] * len(ids)
        self.logprobs += [0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs]


class _DeviceRows:
    """The rows being decoded, on the device: their next-token logits, their KV cache, the
    episode each holds and the cache's next slot; and the jitted steps that move them on
    (feed ids, decode a turn, drop finished rows), making room in the cache before each.

    The cache starts with room for the openings and one decode segment and grows by
    segments: every step attends over the slots allocated, so they follow the episode.
    """

    def __init__(
        self,
        model: models.Model,
        params: models.Params,
        prompt_tokens: np.ndarray,
        prompt_mask: np.ndarray,
        *,
        group: int,
        first_feed: int,
        segment: int,
        draws: int,
        stop_ids: tuple[int, ...],
        sampling_config: sampling.SamplingConfig,
        mesh: jax.sharding.Mesh | None = None,
    ):
        """Prefills the ``[P, S]`` prompts and copies them to ``P G`` rows, with room for a
        first feed of ``first_feed`` ids and a segment. ``segment``: decode steps per call and
        the cache's growth step; ``draws``: the uniforms a turn may draw (its width).
        Float32 weights with a narrower compute dtype are cast once here, as the single-turn
        sampler casts them once per rollout, not again at every decode step.

        With a ``mesh``, the rows are split over its ``data`` devices (``P`` a multiple of
        them) and the weights copied whole to each: the prompts and every later batch of
        rows (:meth:`keep_only`) are placed so, and XLA partitions each jitted step along
        the rows it is given, every row's numbers its own."""
        self.model, self.params = model, models.in_compute_dtype(model, params)
        self.row_sharding, self.row_devices = None, 1
        if mesh is not None:
            self.row_sharding, self.row_devices = sharding.rows(mesh), sharding.data_size(mesh)
            self.params = jax.device_put(self.params, sharding.replicated(mesh))
        self.width, self.segment, self.draws, self.stop_ids = prompt_tokens.shape[1], segment, draws, stop_ids
        self.traced, self.static = sampling.draw_settings(
            temperature=sampling_config.temperature,
            top_k=sampling_config.top_k,
            top_p=sampling_config.top_p,
            min_p=sampling_config.min_p,
        )
        self.logits, self.cache = _prefill(
            model, self.params, self._on_rows(prompt_tokens), self._on_rows(prompt_mask), group=group,
            cache_size=self._slots_for(self.width + first_feed + segment),
        )  # fmt: skip
        self.episode_of = np.arange(prompt_tokens.shape[0] * group)  # [b] each device row's episode (-1: padding)
        self.draw_rows = len(self.episode_of)  # the rows the turns' draws are for: b, or fewer on a mesh
        self.index = self.width  # the cache's next slot (the host's copy)

    def _on_rows(self, array: np.ndarray) -> jax.Array:
        """``array`` ``[rows, ...]`` on the device, split over the mesh's rows if there is one."""
        return jnp.asarray(array) if self.row_sharding is None else jax.device_put(array, self.row_sharding)

    def _slots_for(self, needed: int) -> int:
        return self.width + _round_up(needed - self.width, self.segment)

    def _room(self, slots: int) -> None:
        """Makes room for ``slots`` more: compacts the rows' slots if they have gaps, then
        grows the cache if that is not enough."""
        if self.index + slots <= self.cache.valid.shape[1]:
            return
        if int(jnp.max(jnp.sum(self.cache.valid, axis=1))) < self.index:
            self._regather(np.arange(len(self.episode_of)))
        if self.index + slots > self.cache.valid.shape[1]:
            self.cache = _grow(self.cache, slots=self._slots_for(self.index + slots))

    def _regather(self, keep: np.ndarray) -> None:
        """Keeps device rows ``keep`` (padding repeats the first), slots compacted."""
        self.cache, self.logits = _regather(self.cache, self.logits, self._on_rows(np.asarray(keep, np.int32)))
        self.index = int(self.cache.index)
        self.episode_of = self.episode_of[keep]

    def keep_only(self, going: list[int]) -> None:
        """Shrinks the batch to the next power of two holding device rows ``going`` when that
        is smaller: finished rows stop costing compute. On a mesh the batch is then padded
        further, to a multiple of its row devices, and the draws stay those of the power of
        two, so that the episodes are the single device's."""
        size = _power_of_two(len(going))
        if size < self.draw_rows:
            width = _round_up(size, self.row_devices)
            self._regather(np.array(going + [going[0]] * (width - len(going))))
            self.episode_of = np.where(np.arange(width) >= len(going), -1, self.episode_of)
            self.draw_rows = size

    def feed(self, extensions: dict[int, list[int]]) -> None:
        """Feeds each episode of ``extensions`` its ids (padded to :func:`_feed_width`)."""
        length = _feed_width(max(map(len, extensions.values())))
        self._room(length)
        tokens = np.zeros((len(self.episode_of), length), np.int32)
        mask = np.zeros((len(self.episode_of), length), bool)
        for slot, row in enumerate(self.episode_of):
            if (ids := extensions.get(int(row))) is not None:
                tokens[slot, : len(ids)], mask[slot, : len(ids)] = ids, True
        self.logits, self.cache = _extend(
            self.model, self.params, self._on_rows(tokens), self._on_rows(mask), self.logits, self.cache
        )
        self.index += length

    def decode_turn(self, remaining: np.ndarray, key: jax.Array) -> _Turn:
        """Every device row's turn, ``remaining`` ``[b]`` tokens at most, decoded by
        segments with room made before each: the segments' host copies joined."""
        parts, left, offset = [], remaining, 0
        while (left > 0).any():
            self._room(min(self.segment, int(left.max())))
            part, self.logits, self.cache = _decode_segment(
                self.model, self.params, self.logits, self.cache, self._on_rows(left), key, offset, *self.traced,
                width=self.segment, draws=self.draws, draw_rows=self.draw_rows, stop_ids=self.stop_ids, **self.static,
            )  # fmt: skip
            part = jax.device_get(part)
            steps = int(part.steps)
            self.index += steps
            offset += steps
            parts.append(part._replace(tokens=part.tokens[:, :steps], logprobs=part.logprobs[:, :steps]))
            left = np.where(part.stopped, 0, left - part.lengths)
        return _Turn(
            tokens=np.concatenate([p.tokens for p in parts], axis=1),
            logprobs=np.concatenate([p.logprobs for p in parts], axis=1),
            lengths=sum(p.lengths for p in parts),
            stopped=np.any([p.stopped for p in parts], axis=0),
            steps=offset,
        )


def sample_episodes(
    model: models.Model,
    params: models.Params,
    tokenizer: Any,
    prompts: Sequence[Sequence[Mapping[str, Any]]],
    key: jax.Array,
    *,
    num_samples: int,
    eos_ids: Sequence[int],
    pad_id: int,
    sampling_config: sampling.SamplingConfig | None = None,
    tools: Sequence[Callable] = (),
    environments: Environments | None = None,
    columns: Mapping[str, Sequence[Any]] | None = None,
    config: EpisodeConfig | None = None,
    prompt_bucket: int = 8,
    mesh: jax.sharding.Mesh | None = None,
) -> Episodes:
    """Runs ``num_samples`` episodes of each prompt (see the module docstring).

    Args:
      model, params: the policy.
      tokenizer: a Hugging Face tokenizer with a chat template that renders tools and
        tool calls (prompts are rendered with ``apply_chat_template``).
      prompts: ``[P]`` conversations (lists of messages, TRL's conversational format).
      key: a PRNG key; the same key, prompts and tool results give the same episodes.
      num_samples: ``G`` episodes per prompt.
      eos_ids: the ids that end a turn (the template's end-of-turn, the tokenizer's EOS).
      pad_id: written after each completion.
      sampling_config: temperature, top-k/p, min-p, the episode's token budget
        (``max_new_tokens``) and the prompts' length limit (default: ``SamplingConfig()``).
      tools: standalone tool functions (TRL's ``tools``).
      environments: TRL's ``environment_factory``, built (one instance per episode).
      columns: ``[P]`` values per name: each example's other columns (an environment's
        ``reset`` gets them; a dict factory reads ``environment``).
      config: the episode limits and the tool-call format (default: ``EpisodeConfig()``).
      prompt_bucket: the narrowest prompt width (see :func:`jaxrl_llm.rollouts.prompt_width`).
      mesh: decode the rows split over this mesh's ``data`` devices (``P`` a multiple of
        them), the weights whole on each: the episodes of one device (default: one device).
    """
    if mesh is not None and len(prompts) % sharding.data_size(mesh):
        raise ValueError(
            f"sample_episodes: the {len(prompts)} prompts must split evenly over the mesh's "
            f"{sharding.data_size(mesh)} {sharding.DATA!r} devices."
        )
    sampling_config = sampling_config or sampling.SamplingConfig()
    config = config or EpisodeConfig()
    stop_ids = tuple(sorted({int(e) for e in eos_ids}))
    call_format = config.tool_call_format
    if call_format == "auto":
        call_format = parsing.detect_format(tokenizer)
    rows = _start_rows(prompts, num_samples, tools=tools, environments=environments, columns=dict(columns or {}))
    prompt_tokens, prompt_mask, openings = _group_prompts(
        rows, tokenizer, num_samples, pad_id=pad_id, max_length=sampling_config.max_prompt_length, bucket=prompt_bucket
    )
    budget = sampling_config.max_new_tokens
    token_chars = tasks.base.longest_token_chars(tokenizer)
    longest_opening = max(map(len, openings))
    completion_width = _round_up(budget + longest_opening, 16) if longest_opening else budget
    _check_cache(model.config, prompt_tokens.shape[1], completion_width)
    device = _DeviceRows(
        model, params, prompt_tokens, prompt_mask, group=num_samples,
        first_feed=_feed_width(longest_opening) if longest_opening else 0,
        segment=_segment(completion_width), draws=completion_width, stop_ids=stop_ids, sampling_config=sampling_config,
        mesh=mesh,
    )  # fmt: skip
    if longest_opening:
        device.feed({b: ids for b, ids in enumerate(openings) if ids})
    turn_index = 0
    while True:
        for row in rows:  # a tool result that used up the budget leaves no room for a turn
            if not row.finished and row.used >= budget:
                row.finished = row.truncated = True
        going = [slot for slot, row in enumerate(device.episode_of) if row >= 0 and not rows[row].finished]
        if not going:
            break
        device.keep_only(going)
        remaining = np.array(
            [0 if row < 0 or rows[row].finished else budget - rows[row].used for row in device.episode_of], np.int32
        )
        turn = device.decode_turn(remaining, jax.random.fold_in(key, turn_index))
        calling = _record_turn(rows, device.episode_of, turn, tokenizer, call_format=call_format,
                               max_turns=config.max_turns, stop_ids=stop_ids)  # fmt: skip
        if calling:
            extensions = _run_tools(
                rows, calling, tokenizer, timeout=config.tool_timeout, budget=budget, token_chars=token_chars
            )
            if extensions:
                device.feed(extensions)
        turn_index += 1
    return _episodes(rows, prompt_tokens, prompt_mask, completion_width, pad_id, environments is not None)


def _start_rows(
    prompts: Sequence[Sequence[Mapping[str, Any]]],
    group: int,
    *,
    tools: Sequence[Callable],
    environments: Environments | None,
    columns: dict[str, Sequence[Any]],
) -> list[_Row]:
    """The ``P G`` episodes' rows: each its prompt's messages (an environment's observation
    appended), its tools and, with environments, its instance, reset on its example."""
    num_prompts = len(prompts)
    batch = num_prompts * group
    tools = check_tools(tools, where="tools") if environments is None else environments.tools
    examples = [{name: values[p] for name, values in columns.items()} for p in range(num_prompts)]
    row_examples = [copy.deepcopy(examples[b // group]) for b in range(batch)]
    if environments is None:
        instances = [None] * batch
        observations = [None] * batch
        row_tools = [tuple(tools)] * batch
        toolboxes = [{tool.__name__: tool for tool in tools}] * batch
    else:
        names = environments.names({name: [e[name] for e in row_examples] for name in columns}, batch)
        instances = environments.acquire(names)
        observations = environments.reset(instances, row_examples)
        row_tools = [environments.tools_for(name) for name in names]
        toolboxes = [environments.toolbox(instance) for instance in instances]
    rows = []
    for b in range(batch):
        prompt = [dict(m) for m in prompts[b // group]]
        if observations[b] is not None:
            prompt = append_observation(prompt, observations[b])
        rows.append(_Row(prompt=prompt, toolbox=toolboxes[b], tools=row_tools[b], environment=instances[b], opening=0))
    return rows


def _group_prompts(
    rows: list[_Row], tokenizer: Any, group: int, *, pad_id: int, max_length: int, bucket: int
) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    """Renders the rows' prompts: each group's common prefix is its prompt, the rest of a
    row's its opening, recorded as the start of its completion. Returns the prompts
    ``[P, S]`` (left-padded ids, mask) and the ``[B]`` openings."""
    rendered = [conversation.render_prompt(tokenizer, row.prompt, row.tools) for row in rows]
    num_prompts = len(rows) // group
    shared = [_shared_prefix(rendered[p * group : (p + 1) * group]) for p in range(num_prompts)]
    if min(shared) == 0:
        raise ValueError(
            "sample_episodes: the rows of a prompt share no first token; the chat template must begin alike."
        )
    if (longest := max(len(r) for r in rendered)) > max_length:
        raise ValueError(
            f"sample_episodes: a rendered prompt (tools' schemas and observation included) has {longest} tokens, more "
            f"than max_prompt_length={max_length}. Raise max_prompt_length or shorten the prompt or the tools' "
            "docstrings."
        )
    width = rollouts.prompt_width(max(shared), bucket=bucket, max_length=max_length)
    prompt_tokens, prompt_mask = tasks.base.left_pad(
        [rendered[p * group][:length] for p, length in enumerate(shared)], pad_id=pad_id, width=width
    )
    openings = [rendered[b][shared[b // group] :] for b in range(len(rows))]
    for b, (row, opening) in enumerate(zip(rows, openings, strict=True)):
        row.shared_prompt, row.opening = rendered[b][: shared[b // group]], len(opening)
        row.add(opening, model=False)
    return prompt_tokens, prompt_mask, openings


def _check_cache(config: models.ModelConfig, prompt_width: int, completion_width: int) -> None:
    """Raises ValueError if the model cannot hold the episodes' cache: more slots than its
    positions, or a sliding window narrower than the cache."""
    max_slots = _cache_slots(prompt_width, completion_width)
    if max_slots > config.max_position_embeddings:
        raise ValueError(
            f"sample_episodes: prompts of {prompt_width} tokens and episodes of {completion_width} need a cache of up "
            f"to {max_slots} slots (twice the episode, for its turns' gaps), more than the model's "
            f"max_position_embeddings ({config.max_position_embeddings})."
        )
    if any(w is not None and w < max_slots for w in (config.window(i) for i in range(config.num_layers))):
        raise ValueError(
            f"sample_episodes: sliding-window attention narrower than the episode's cache ({max_slots} slots) is not "
            f"supported: a window counts cache slots, and an episode's rows have gaps between their turns."
        )


def _record_turn(rows, on_device, turn: _Turn, tokenizer, *, call_format, max_turns, stop_ids) -> dict[int, int]:
    """Appends each row's turn to its episode and parses it; returns ``{row: end-of-turn
    id}`` of the rows whose turn called tools they may run (the others are finished)."""
    calling = {}
    for slot, row_index in enumerate(on_device):
        length = int(turn.lengths[slot])
        if row_index < 0 or length == 0:
            continue
        row = rows[row_index]
        ids = turn.tokens[slot, :length].tolist()
        row.add(ids, model=True, logprobs=turn.logprobs[slot, :length])
        stopped = bool(turn.stopped[slot])
        text = tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
        prefix = None
        if call_format == "response_template":
            # The whole conversation before the turn: a template may pre-write part of it.
            prefix = tokenizer.decode(row.shared_prompt + row.ids[: len(row.ids) - length], skip_special_tokens=False)
        parsed = parsing.parse_turn(
            text, call_format=call_format, tokenizer=tokenizer, prefix=prefix, tools=list(row.tools)
        )
        row.messages.append(parsed.message)
        row.pending = parsed.calls
        if not stopped:
            row.finished = row.truncated = True
        elif not parsed.calls:
            row.finished = True
        elif max_turns is not None and row.rounds >= max_turns:
            row.finished = row.turn_limited = True
        else:
            calling[int(row_index)] = ids[-1]
    return calling


def _run_tools(
    rows, calling: dict[int, int], tokenizer, *, timeout, budget: int, token_chars: int
) -> dict[int, list[int]]:
    """Runs the pending calls of the rows in ``calling`` (all at once), appends the tool
    messages and returns ``{row: ids to feed}`` (the end-of-turn id, then the template's
    ids around the results); a row whose results do not fit its budget is finished. Text
    results longer than the budget left times ``token_chars`` (the most characters a token
    stands for) cannot fit and are dropped untokenized: a tool that returns megabytes costs
    no more than one that returns a line."""
    jobs = [(row, call) for row in calling for call in rows[row].pending]
    results = call_tools([(rows[row].toolbox, call) for row, call in jobs], timeout=timeout)
    by_row: dict[int, list] = {}
    for (row, _), result in zip(jobs, results, strict=True):
        by_row.setdefault(row, []).append(result)
    extensions = {}
    for row_index, end_of_turn in calling.items():
        row, results = rows[row_index], by_row[row_index]
        row.rounds += 1
        row.calls += len(results)
        row.failures += sum(r.failed for r in results)
        row.timeouts += sum(r.timed_out for r in results)
        messages = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
        characters = sum(len(r.content) for r in results if isinstance(r.content, str))
        if characters > (budget - row.used) * token_chars:
            row.finished = row.truncated = True
            continue
        suffix = conversation.tool_suffix_ids(tokenizer, messages, end_of_turn=end_of_turn)
        if row.used + len(suffix) > budget:  # TRL: the results are dropped, the episode ends
            row.finished = row.truncated = True
            continue
        row.messages += messages
        row.add(suffix, model=False)
        extensions[row_index] = [end_of_turn, *suffix]
    return extensions


def _episodes(rows, prompt_tokens, prompt_mask, width: int, pad_id: int, with_environments: bool) -> Episodes:
    batch = len(rows)
    tokens = np.full((batch, width), pad_id, np.int32)
    model_mask = np.zeros((batch, width), bool)
    logprobs = np.zeros((batch, width), np.float32)
    for b, row in enumerate(rows):
        n = len(row.ids)
        tokens[b, :n], model_mask[b, :n], logprobs[b, :n] = row.ids, row.by_model, row.logprobs
    counts = {
        name: np.array([getattr(row, name) for row in rows], np.int32) for name in ("calls", "failures", "timeouts")
    }
    return Episodes(
        prompt_tokens=prompt_tokens,
        prompt_mask=prompt_mask,
        completion_tokens=tokens,
        completion_mask=model_mask,
        logprobs=logprobs,
        lengths=np.array([len(row.ids) for row in rows], np.int32),
        openings=np.array([row.opening for row in rows], np.int32),
        truncated=np.array([row.truncated for row in rows]),
        turn_limited=np.array([row.turn_limited for row in rows]),
        turns=np.array([sum(m["role"] == "assistant" for m in row.messages) for row in rows], np.int32),
        tool_calls=counts["calls"],
        tool_failures=counts["failures"],
        tool_timeouts=counts["timeouts"],
        prompts=[row.prompt for row in rows],
        completions=[row.messages for row in rows],
        completion_ids=[list(row.ids) for row in rows],
        environments=[row.environment for row in rows] if with_environments else None,
    )
