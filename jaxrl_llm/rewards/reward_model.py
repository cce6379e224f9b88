r"""A learned reward model as a reward function: a sequence classifier's scalar score.

A Hugging Face ``LlamaForSequenceClassification`` / ``MistralForSequenceClassification``
/ ``Qwen2ForSequenceClassification`` / ``Qwen3ForSequenceClassification`` checkpoint with
one label is the project's decoder (the ``model.*`` tensors) plus a linear head
``score.weight`` ``[1, E]`` without bias. The reward of a text is the head applied to the
final-norm hidden state of its last token:

.. math::
    r(x) = w^\top h_{i^*}(x), \qquad
    i^* = \max\{\, i : m_i = 1,\ x_i \ne \texttt{pad\_token\_id} \,\}

.. code-block:: python

    from jaxrl_llm import rewards

    rm = rewards.RewardModel.from_pretrained("path/to/reward-model", dtype=jnp.bfloat16)
    rm(prompts=["Say hi."], completions=["Hi!"])        # -> [1.73]: TRL's reward-function call
    rm.score_ids([[1, 5, 9, 2]])                         # -> [1] float32 from token ids

**Pooling** follows transformers' ``*ForSequenceClassification`` (``GenericForSequenceClassification``
in transformers 5): the score is read at the rightmost token whose id is not the config's
``pad_token_id``. A real token equal to the pad id (when ``pad_token_id`` is, say, the EOS
that a chat template ends with) is therefore skipped, as in the model's training. Where
transformers would read a padding slot, this reads what it reads for the row alone: with
``pad_token_id = None`` (transformers then refuses batches of more than one row), the last
real token; for a row made only of pad ids, its first token.

**Text.** TRL's ``GRPOTrainer`` scores a reward model on
``apply_chat_template(prompt_messages + completion_messages)`` for conversational data and on
``prompt + completion`` otherwise, tokenized with ``add_special_tokens=False``. Here:

- message lists (TRL's conversational format) are templated exactly as TRL does;
- strings, when the tokenizer has a chat template (``chat_template=None``, the default, or
  ``True``), become ``[{"role": "user", "content": prompt}, {"role": "assistant", "content":
  completion}]`` and are templated the same way: a reward model trained on chat data expects
  its template (TRL would concatenate the strings instead; ``chat_template=False`` does that);
- templated text is tokenized without special tokens (the template holds them); plain
  ``prompt + completion`` is tokenized with them (a BOS, say), unless
  ``add_special_tokens=False``, which is TRL's plain-text call exactly.

**Length.** A row longer than ``max_length`` tokens keeps its *last* ``max_length`` tokens
(truncated from the left): the completion, where the reward is read, survives; the start of
the prompt (and a BOS) is lost.

**Compilation.** Rows are scored ``batch_size`` at a time, longest first, in one
``jax.jit`` function (:func:`score_tokens`) per padded shape: row counts are rounded up to
a power of two (at most ``batch_size``), lengths to a multiple of ``length_bucket`` (at most
``max_length``). Batches of texts whose lengths fall in the same bucket reuse one compiled
function; :attr:`RewardModel.traces` counts the traces.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import _checks
from jaxrl_llm.models import hf
from jaxrl_llm.models.config import ModelConfig, dtype_from_name
from jaxrl_llm.models.functional import Model, Params, hidden_states

SEQUENCE_CLASSIFIERS: dict[str, str] = {
    "llama": "LlamaForSequenceClassification",
    "mistral": "MistralForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
}
"""Architecture family -> the Hugging Face class whose checkpoints :meth:`RewardModel.from_pretrained` loads."""

HEAD_TENSOR = "score.weight"
"""The scalar head's tensor name in a sequence-classification checkpoint, shape ``[1, E]``."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def pooling_index(tokens: jax.Array, attention_mask: jax.Array, *, pad_token_id: int | None) -> jax.Array:
    """``[B]`` int32: the slot each row's score is read at (transformers' rule, see the module).

    The rightmost slot that is real (``attention_mask``) and whose id is not
    ``pad_token_id``; with ``pad_token_id=None``, the rightmost real slot. A row with no
    such slot gets its first real slot (its first slot if it has none).

    Args:
      tokens: ``[B, T]`` token ids (left or right padded).
      attention_mask: ``[B, T]``, bool or 0/1, true for real tokens.
      pad_token_id: the checkpoint config's ``pad_token_id``.
    """
    mask = attention_mask.astype(bool)  # [B, T]
    valid = mask if pad_token_id is None else mask & (tokens != pad_token_id)
    slots = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]  # [1, T]
    last = jnp.max(jnp.where(valid, slots, -1), axis=1)  # [B]; -1: no valid slot
    first_real = jnp.argmax(mask, axis=1).astype(jnp.int32)  # [B]
    return jnp.where(last >= 0, last, first_real)


def score_tokens(
    model: Model, params: Params, head: jax.Array, tokens: jax.Array, attention_mask: jax.Array
) -> jax.Array:
    r"""``[B]`` float32 rewards :math:`w^\top h_{i^*}` of ``tokens`` (pure, jit-able).

    Args:
      model, params: the decoder (:meth:`RewardModel.from_pretrained` loads them);
        ``model.config.pad_token_id`` sets the pooling rule (:func:`pooling_index`).
      head: ``[E]``, the row of ``score.weight``.
      tokens: ``[B, T]`` token ids in ``[0, V)``, left or right padded. Checked when
        concrete; under ``jit`` an out-of-range id reads a clamped embedding (check on the
        host, as :meth:`RewardModel.score_ids` does).
      attention_mask: ``[B, T]``, bool or 0/1. RoPE positions count real tokens from 0 in
        each row, so the padding side does not change the scores.

    Returns:
      ``[B]`` float32: the head's product with each row's final-norm hidden state at
      :func:`pooling_index`, accumulated in float32 whatever the compute dtype.
    """
    hidden = hidden_states(model, params, tokens, attention_mask=attention_mask)  # [B, T, E]
    index = pooling_index(tokens, attention_mask, pad_token_id=model.config.pad_token_id)  # [B]
    pooled = jnp.take_along_axis(hidden, index[:, None, None], axis=1)[:, 0]  # [B, E]
    dtype = model.config.dtype
    return jnp.matmul(pooled.astype(dtype), head.astype(dtype), preferred_element_type=jnp.float32)  # [B]


class _Compiled:
    """The jitted :func:`score_tokens` of one :class:`RewardModel`, counting its traces."""

    def __init__(self):
        self.traces = 0
        self.fn = jax.jit(self._traced)

    def _traced(self, model, params, head, tokens, attention_mask):
        self.traces += 1  # runs once per trace, never per call
        return score_tokens(model, params, head, tokens, attention_mask)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class RewardModel:
    """A sequence-classification reward model, callable as a TRL-convention reward function.

    ``reward_model(prompts=[...], completions=[...], **ignored) -> list[float]``: one score
    per (prompt, completion) pair. Build it with :meth:`from_pretrained`. The module
    docstring gives the pooling, text, truncation and compilation conventions.
    """

    model: Model = dataclasses.field(repr=False)
    """The decoder. Its config has ``tie_word_embeddings=True``: a reward model has no LM
    head, and this keeps one from being allocated; its LM logits mean nothing."""
    params: Params = dataclasses.field(repr=False)
    """The decoder's parameters (``model.*`` in the checkpoint)."""
    head: jax.Array = dataclasses.field(repr=False)
    """``[E]``: ``score.weight[0]``, in the parameters' dtype."""
    tokenizer: Any = dataclasses.field(repr=False)
    """A ``transformers`` tokenizer for the texts."""
    batch_size: int = 32
    """Rows per jitted call; a call with more rows runs several."""
    max_length: int | None = None
    """Longest row in tokens; longer rows keep their last ``max_length`` tokens.
    ``None``: the model's ``max_position_embeddings``."""
    length_bucket: int = 64
    """Padded lengths are multiples of this (capped at ``max_length``): one compiled
    function serves every batch whose longest row falls in the same bucket."""
    chat_template: bool | None = None
    """Score ``tokenizer.apply_chat_template`` of a user/assistant exchange (``True``), the
    plain ``prompt + completion`` (``False``), or the first if the tokenizer has a chat
    template (``None``). Message-list inputs are always templated."""
    add_special_tokens: bool = True
    """Whether plain ``prompt + completion`` text gets the tokenizer's special tokens (a
    BOS, say). Templated text never does: its template writes them."""
    name: str = "reward_model"
    """The reward function's ``__name__``, which logs use."""

    def __post_init__(self):
        fn = "RewardModel"
        config: ModelConfig = self.model.config
        for field in ("batch_size", "length_bucket"):
            _checks.positive_int(fn, field, getattr(self, field))
        limit = config.max_position_embeddings
        if self.max_length is None:
            object.__setattr__(self, "max_length", limit)
        _checks.positive_int(fn, "max_length", self.max_length)
        if self.max_length > limit:
            raise ValueError(
                f"{fn}: `max_length` ({self.max_length}) exceeds the model's max_position_embeddings ({limit})."
            )
        if tuple(self.head.shape) != (config.hidden_size,):
            raise ValueError(f"{fn}: `head` must have shape [E] = [{config.hidden_size}]; got {list(self.head.shape)}.")
        if self.chat_template not in (None, True, False):
            raise ValueError(
                f"{fn}: `chat_template` must be None (automatic), True or False; got {self.chat_template!r}."
            )
        if self.chat_template and not _has_chat_template(self.tokenizer):
            raise ValueError(
                f"{fn}: chat_template=True, but the tokenizer has no chat template; pass "
                f"chat_template=None or False, or a tokenizer with one."
            )
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"{fn}: `name` must be a non-empty string; got {self.name!r}.")
        object.__setattr__(self, "__name__", self.name)
        object.__setattr__(self, "_compiled", _Compiled())

    # --- loading ----------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike,
        *,
        dtype: Any = jnp.float32,
        tokenizer: Any = None,
        batch_size: int = 32,
        max_length: int | None = None,
        length_bucket: int = 64,
        chat_template: bool | None = None,
        add_special_tokens: bool = True,
        name: str = "reward_model",
    ) -> RewardModel:
        """Loads a Hugging Face sequence-classification checkpoint with one label.

        Args:
          directory: ``config.json`` (``architectures`` one of :data:`SEQUENCE_CLASSIFIERS`'
            classes, ``num_labels = 1``), safetensors weights (``model.*`` and
            ``score.weight`` ``[1, E]``), and, unless ``tokenizer`` is given, the tokenizer.
          dtype: the parameters' and activations' dtype (``jnp.float32``, ``jnp.bfloat16``
            or its name); scores are accumulated in float32.
          tokenizer: a ``transformers`` tokenizer to use instead of the directory's.
          batch_size, max_length, length_bucket, chat_template, add_special_tokens, name:
            the fields of :class:`RewardModel`.

        Raises:
          FileNotFoundError: the directory, its ``config.json``, its weights or (with no
            ``tokenizer``) its tokenizer files are missing.
          ValueError: the checkpoint is not a supported sequence classifier (names the
            architectures found and those allowed), has ``num_labels != 1``, lacks
            ``score.weight`` or has one of the wrong shape, or has other tensors that do
            not fit the config.
        """
        import transformers

        path = hf.checkpoint_directory(directory)
        hf_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        found = list(getattr(hf_config, "architectures", None) or [])
        allowed = sorted(SEQUENCE_CLASSIFIERS.values())
        if not found or any(a not in allowed for a in found):
            hint = (
                " For a causal language model use jaxrl_llm.models.from_pretrained."
                if any(a.endswith("ForCausalLM") for a in found)
                else ""
            )
            raise ValueError(
                f"{path} is not a sequence-classification checkpoint: its config.json names "
                f"architectures {found}; a reward model must be one of {', '.join(allowed)}.{hint}"
            )
        model_type = getattr(hf_config, "model_type", None)
        if found != [SEQUENCE_CLASSIFIERS.get(model_type)]:
            raise ValueError(
                f"{path}: config.json has model_type {model_type!r} but architectures {found}; "
                f"expected {[SEQUENCE_CLASSIFIERS.get(model_type, '?')]}."
            )
        if hf_config.num_labels != 1:
            raise ValueError(
                f"{path}: a reward model has one output (num_labels=1); this checkpoint has "
                f"num_labels={hf_config.num_labels} (labels {list(hf_config.id2label.values())})."
            )
        dtype = dtype_from_name(dtype)
        config = ModelConfig.from_hf(hf_config, param_dtype=dtype)
        # No LM head: a tied config allocates none (and ignores a stray lm_head.weight).
        config = dataclasses.replace(config, tie_word_embeddings=True)
        model, params, extras = hf.read_weights(path, config, extra=(HEAD_TENSOR,))
        score = extras[HEAD_TENSOR]
        if tuple(score.shape) != (1, config.hidden_size):
            raise ValueError(
                f"Tensor {HEAD_TENSOR!r} has shape {list(score.shape)} in {path}; a reward head is "
                f"[1, hidden_size] = [1, {config.hidden_size}]."
            )
        if tokenizer is None:
            if not any((path / f).is_file() for f in _TOKENIZER_FILES):
                raise FileNotFoundError(
                    f"No tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {path}; save the "
                    f"tokenizer there or pass tokenizer=."
                )
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(
            model=model,
            params=params,
            head=jnp.asarray(score[0], dtype=dtype),
            tokenizer=tokenizer,
            batch_size=batch_size,
            max_length=max_length,
            length_bucket=length_bucket,
            chat_template=chat_template,
            add_special_tokens=add_special_tokens,
            name=name,
        )

    # --- scoring ----------------------------------------------------------------------------

    @property
    def traces(self) -> int:
        """How many times :func:`score_tokens` has been traced (one per padded shape)."""
        return self._compiled.traces

    def __call__(self, *, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        """TRL's reward-function call: one score per (prompt, completion) pair.

        Args:
          prompts, completions: aligned ``[B]`` lists of strings, or of message lists
            (``[{"role": ..., "content": ...}, ...]``, TRL's conversational format).
          **kwargs: ignored (``completion_ids``, dataset columns, ...).

        Returns:
          ``B`` Python floats.
        """
        return self.score_ids(self.encode(prompts=prompts, completions=completions)).tolist()

    def texts(self, *, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """The ``B`` strings that are tokenized and scored (templated, or concatenated)."""
        return [text for text, _ in self._texts(prompts, completions)]

    def encode(self, *, prompts: Sequence[Any], completions: Sequence[Any]) -> list[list[int]]:
        """The ``B`` token-id rows that are scored, each at most ``max_length`` long (the
        last ``max_length`` tokens of a longer one)."""
        texts = self._texts(prompts, completions)
        rows: list[list[int]] = [[] for _ in texts]
        for templated in (True, False):  # at most two tokenizer calls
            index = [i for i, (_, t) in enumerate(texts) if t == templated]
            if index:
                special = False if templated else self.add_special_tokens
                ids = self.tokenizer([texts[i][0] for i in index], add_special_tokens=special)["input_ids"]
                for i, row in zip(index, ids):
                    rows[i] = list(row)[-self.max_length :]
        return rows

    def _texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[tuple[str, bool]]:
        """``(text, templated)`` per row."""
        if isinstance(prompts, (str, bytes)) or isinstance(completions, (str, bytes)):
            raise TypeError("RewardModel: `prompts` and `completions` must be lists (one entry per row), not strings.")
        if len(prompts) != len(completions):
            raise ValueError(
                f"RewardModel: got {len(prompts)} prompts and {len(completions)} completions; they "
                f"must be aligned, one prompt per completion."
            )
        return [self._text(p, c) for p, c in zip(prompts, completions)]

    def _text(self, prompt: Any, completion: Any) -> tuple[str, bool]:
        has_template = _has_chat_template(self.tokenizer)
        if isinstance(prompt, str) and isinstance(completion, str):
            if not (has_template if self.chat_template is None else self.chat_template):
                return prompt + completion, False
        elif self.chat_template is False or not has_template:
            raise ValueError(
                "RewardModel: message-list prompts or completions need a chat template, but "
                + ("chat_template=False." if self.chat_template is False else "the tokenizer has none.")
            )
        messages = _messages(prompt, "user") + _messages(completion, "assistant")
        return self.tokenizer.apply_chat_template(messages, tokenize=False), True

    def score_ids(self, ids: Sequence[Sequence[int]]) -> np.ndarray:
        """``[B]`` float32 scores of unpadded token-id rows (each truncated from the left to
        ``max_length``), in ``batch_size`` chunks of bucketed shapes (see the module).

        Raises:
          ValueError: an empty row, or an id outside ``[0, vocab_size)`` (a tokenizer that
            does not fit the model).
        """
        rows = [np.asarray(row, np.int64).reshape(-1)[-self.max_length :] for row in ids]
        if not rows:
            return np.zeros((0,), np.float32)
        lengths = np.array([len(row) for row in rows])
        if (lengths == 0).any():
            raise ValueError(
                f"RewardModel: row(s) {np.flatnonzero(lengths == 0).tolist()[:8]} have no tokens; an "
                f"empty text cannot be scored."
            )
        vocab = self.model.config.vocab_size
        bad = [i for i, row in enumerate(rows) if row.min() < 0 or row.max() >= vocab]
        if bad:
            row = rows[bad[0]]
            raise ValueError(
                f"RewardModel: row {bad[0]} holds token id(s) outside [0, {vocab}) (min {row.min()}, "
                f"max {row.max()}): the tokenizer does not fit the model."
            )
        pad = self.model.config.pad_token_id
        fill = pad if pad is not None and 0 <= pad < vocab else 0
        order = np.argsort(-lengths, kind="stable")  # longest first: similar lengths share a chunk
        pending = []
        for start in range(0, len(rows), self.batch_size):
            chunk = order[start : start + self.batch_size]
            count = min(self.batch_size, 1 << (len(chunk) - 1).bit_length())  # next power of two
            width = min(self.max_length, self.length_bucket * math.ceil(lengths[chunk].max() / self.length_bucket))
            tokens = np.full((count, width), fill, np.int32)  # [R, L], left-padded
            mask = np.zeros((count, width), bool)
            mask[len(chunk) :, -1] = True  # filler rows: one real token, a finite (discarded) score
            for j, i in enumerate(chunk):
                tokens[j, width - lengths[i] :] = rows[i]
                mask[j, width - lengths[i] :] = True
            pending.append((chunk, self._compiled.fn(self.model, self.params, self.head, tokens, mask)))
        scores = np.empty(len(rows), np.float32)
        for chunk, out in pending:
            scores[chunk] = np.asarray(out)[: len(chunk)]
        return scores


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _messages(turn: Any, role: str) -> list[dict[str, Any]]:
    """A string as one message of ``role``; a message list as it is."""
    if isinstance(turn, str):
        return [{"role": role, "content": turn}]
    if isinstance(turn, dict):
        return [turn]
    return list(turn)
