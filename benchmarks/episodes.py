r"""Multi-turn rollouts: the KV cache continued across turns against TRL's re-prefill.

Both methods run the same episodes: the same prompts, ``G`` rows each, greedy, every turn
``--filler`` tokens and a tool call, each call answered by a ``--result-len``-character
tool result, ``--turns`` tool-calling rounds (the turn after the last round calls a tool
too and ends the episode: ``EpisodeConfig.max_turns``), so ``turns + 1`` model turns:

* **continued**: :func:`jaxrl_llm.episodes.sampling.sample_episodes`. The prompts are
  prefilled once; after a tool call, the end-of-turn id, the tool result and the template
  ids go into the existing KV cache (``models.extend``), and the next turn decodes on.
* **re-prefilled** (TRL's loop, with this library's sampler): each turn is a fresh
  :func:`jaxrl_llm.sampling.sample` call (greedy, ``max_new_tokens`` the rows' remaining
  budget) whose prompt is the whole conversation so far as ids (prompt, earlier turns,
  tool results), prefilled from scratch; the tool results' ids are then appended on the
  host. Turns are parsed and tools run with the library's pieces, all rows' calls at once.
  The first turn samples ``G`` rows of each prompt (one prefill per prompt).

The policy is :func:`scripted_policy`: the real decoder at the shape's full size, whose
weights make it a bigram model over the script's few tokens, so its episodes are known
and both methods must produce the same ids (checked on every run). Its layers compute at
full cost but add nothing to the residual stream (zero output projections), except the
last layer's MLP, which holds the bigram table.

Shapes: ``tiny`` (``grpo_step.py``'s: 4 layers, d_model 256, vocab 512; 8 prompts x 4)
and ``qwen05b`` (Qwen2.5-0.5B's: 24 layers, hidden 896, 14 / 2 heads of 64, MLP 4864,
vocab 151,936, tied embeddings, q/k/v biases; 2 prompts x 2), float32; ``--batch``
changes the prompts and rows. ``--system N`` puts a system message of ``N`` tokens before
every prompt, as a tool-calling template's preamble does (Qwen2.5's, with one small tool's
schema, is about 190 tokens): the re-prefilled method reads it again every turn. Times are the
median of ``--repeats`` calls (default 5 at ``tiny``, 1 at ``qwen05b``) after one
untimed call (compilation excluded), the two methods' calls interleaved; episodes/s and
generated (model) tokens/s are per rollout of the whole batch, and the speedup is the
continued method's throughput over the re-prefilled one's.

    python benchmarks/episodes.py [--shapes tiny,qwen05b] [--batch PxG] [--turns 4] [--filler 32]
                                  [--result-len 14] [--system 0] [--repeats R]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from grpo_step import CONFIG as TINY_CONFIG
from layer_scan import qwen25_05b

from jaxrl_llm import models, sampling
from jaxrl_llm.episodes import conversation, parsing, tools
from jaxrl_llm.episodes import sampling as episode_sampling
from jaxrl_llm.episodes.config import EpisodeConfig
from jaxrl_llm.tasks import base, build_char_tokenizer

SHAPES = {
    "tiny": dict(config=lambda: TINY_CONFIG, prompts=8, group=4, repeats=5),
    "qwen05b": dict(config=qwen25_05b, prompts=2, group=2, repeats=1),  # ~40 s a rollout on 2 CPU cores
}
LOOKUP_CALL = '{"name": "lookup", "arguments": {"key": 7}}'
TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}<|assistant|>{{ m.content }}"
    "{%- for c in m.tool_calls or [] -%}<tool_call>{{ c.function | tojson }}</tool_call>{%- endfor -%}<eos>"
    "{%- else -%}<|{{ m.role }}|>{{ m.content }}<eos>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
"""A hermes-style template: ``<tool_call>`` blocks, one end-of-turn ``<eos>`` per message."""
LOOKUP_GAIN = 20.0  # the lookup table's gate pre-activation: silu(20) = 20 up to 4e-8


def scripted_policy(
    config: models.ModelConfig,
    transitions: Mapping[int, Mapping[int, float]],
    *,
    tokens: Sequence[int] | None = None,
    default: Mapping[int, float] | None = None,
    noise: float = 0.0,
    seed: int = 0,
) -> tuple[models.Model, models.Params]:
    r"""A decoder of ``config``'s shape that is a bigram model over a script's tokens: after
    reading token ``t`` its next-token logits are ``transitions[t]`` (``{next id: logit}``,
    0 for every other id), or ``default`` for a script token not in ``transitions``.

    Token ``tokens[i]`` (default: the ids in ``transitions`` and ``default``, sorted)
    embeds as :math:`e_i`, the unit vector on hidden dim ``i``; other ids embed as 0, so
    the last token read must be one of the script's. Without noise, every layer's
    attention and MLP write nothing (``o_proj``, ``down_proj`` zero) but compute at full
    cost, except the last layer's MLP: a lookup table from :math:`e_i` (unit ``i``'s gate
    and up projections) to :math:`r_i - e_i`, where :math:`r_i` holds row ``i``'s logits :math:`l_i` on the
    script's dims and :math:`s_i` on a spare dim ``n = len(tokens)``, with
    :math:`s_i^2 = R^2 - |l_i|^2` and :math:`R = \max_i |l_i|`. The final RMS norm, scaled
    by :math:`R / \sqrt{H}`, then gives back :math:`r_i`, and the output layer reads dim
    ``i`` as token ``tokens[i]``'s logit (``lm_head``, or the embedding when tied), so the
    rest of the vocabulary gets 0. ``noise > 0`` draws the other weights as ``noise``
    times normal draws (from ``seed + 1``; the embedding's one-hot rows added to its
    draws): every logit then depends a little on the whole context. The norms (1 in the
    layers), the lookup and ``lm_head`` are exact.

    Needs ``hidden_size > len(tokens)`` and ``intermediate_size >= len(tokens)``.
    """
    default = dict(default or {})
    if tokens is None:
        tokens = sorted(
            {int(t) for t in transitions} | {int(n) for row in transitions.values() for n in row} | set(default)
        )
    tokens = [int(t) for t in tokens]
    n, hidden, vocab = len(tokens), config.hidden_size, config.vocab_size
    if not (hidden > n and config.intermediate_size >= n and max(tokens) < vocab):
        raise ValueError(
            f"scripted_policy: {n} script tokens need hidden_size > {n}, intermediate_size >= {n} and ids < "
            f"vocab_size; got {hidden}, {config.intermediate_size}, {vocab}."
        )
    dim = {token: i for i, token in enumerate(tokens)}
    logits = np.zeros((n, n), np.float64)  # [i, j]: logit of tokens[j] after tokens[i]
    for token in tokens:
        for nxt, logit in transitions.get(token, default).items():
            logits[dim[token], dim[int(nxt)]] = logit
    scale = float(np.linalg.norm(logits, axis=1).max()) or 1.0
    residual = np.zeros((n, hidden), np.float64)  # [i, H]: r_i
    residual[:, :n] = logits
    residual[:, n] = np.sqrt(np.maximum(scale**2 - np.sum(logits**2, axis=1), 0.0))

    model, shapes = models.abstract(config)
    leaves, tree = jax.tree.flatten(shapes)
    if noise:
        keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
        leaves = [np.array(noise * jax.random.normal(k, s.shape), np.float32) for k, s in zip(keys, leaves)]
    else:
        leaves = [np.zeros(s.shape, np.float32) for s in leaves]
    params = jax.tree.unflatten(tree, leaves)
    rows, columns = np.asarray(tokens), np.arange(n)
    params["embed_tokens"][...][rows, columns] += 1.0
    if not config.tie_word_embeddings:
        params["lm_head"][...] = np.zeros((hidden, vocab), np.float32)
        params["lm_head"][...][columns, rows] = 1.0
    for index, layer in params["layers"].items():
        layer["input_layernorm"][...] = np.ones(hidden, np.float32)
        layer["post_attention_layernorm"][...] = np.ones(hidden, np.float32)
        if index == config.num_layers - 1:  # the lookup (rms_norm(e_i) = sqrt(H) e_i), free of noise
            gate, up = np.zeros((2, hidden, config.intermediate_size), np.float32)
            gate[columns, columns] = LOOKUP_GAIN / math.sqrt(hidden)
            up[columns, columns] = 1.0 / (LOOKUP_GAIN * math.sqrt(hidden))
            down = np.zeros((config.intermediate_size, hidden), np.float32)
            down[:n] = residual - np.eye(n, hidden)
            for name, kernel in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                layer["mlp"][name][...] = kernel
    params["norm"][...] = np.full(hidden, scale / math.sqrt(hidden), np.float32)
    params = jax.tree.map(lambda x, s: jnp.asarray(x, s.dtype), params, shapes)
    return model, params


@dataclasses.dataclass(frozen=True)
class Workload:
    """One batch of scripted episodes: the policy, its tokenizer and the episodes' settings."""

    model: models.Model
    params: models.Params
    tokenizer: Any
    prompts: list  # [P] conversations
    group: int  # G rows per prompt
    turns: int  # tool-calling rounds (EpisodeConfig.max_turns)
    budget: int  # max_new_tokens: the whole episode after its prompt
    tools: tuple[Callable, ...]

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id


def workload(
    config: models.ModelConfig, *, prompts: int, group: int, turns: int, filler: int, result_len: int, system: int = 0
) -> Workload:
    """``prompts`` user prompts (digits, 8-14 of them), after a system message of ``system``
    digits if ``system > 0``, and the policy that answers each with ``filler`` distinct
    filler tokens then a ``lookup`` call, every turn; the tool's result has ``result_len``
    digits."""
    tokenizer = build_char_tokenizer("0123456789")
    fillers = [f"<f{i}>" for i in range(filler)]
    tokenizer.add_tokens(
        ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>", "</tool_call>", LOOKUP_CALL, *fillers]
    )
    tokenizer.chat_template = TEMPLATE
    ids = tokenizer.convert_tokens_to_ids
    turn = ["<|assistant|>", *fillers, "<tool_call>", LOOKUP_CALL, "</tool_call>", "<eos>"]
    transitions = {ids(a): {ids(b): 20.0} for a, b in zip(turn[:-1], turn[1:])}
    model, params = scripted_policy(config, transitions)
    rng = np.random.default_rng(0)
    preamble = [{"role": "system", "content": "".join(map(str, rng.integers(0, 10, system)))}] if system else []
    conversations = [
        [*preamble, {"role": "user", "content": "".join(map(str, rng.integers(0, 10, 8 + 2 * (p % 4))))}]
        for p in range(prompts)
    ]

    def lookup(key: int) -> str:
        """Looks a key up.

        Args:
            key: The key.
        """
        return "".join(str((key + i) % 10) for i in range(result_len))

    tool_suffix = 3 + result_len  # <|tool|> result <eos> <|assistant|>
    episode = (turns + 1) * len(turn[1:]) + turns * tool_suffix
    return Workload(model, params, tokenizer, conversations, group, turns, -(-episode // 16) * 16, (lookup,))


class Done(NamedTuple):
    """What both methods return, per episode: ``[B]`` lists and arrays."""

    ids: list  # [B] completion ids: turns, tool results and template ids
    model_tokens: np.ndarray  # [B] int32: the model's tokens
    turns: np.ndarray  # [B] int32: the model's turns


def continued(work: Workload) -> Done:
    """The episodes by :func:`episode_sampling.sample_episodes` (the cache continued)."""
    episodes = episode_sampling.sample_episodes(
        work.model,
        work.params,
        work.tokenizer,
        work.prompts,
        jax.random.key(0),
        num_samples=work.group,
        eos_ids=(work.eos_id,),
        pad_id=work.tokenizer.pad_token_id,
        sampling_config=sampling.SamplingConfig(max_new_tokens=work.budget, temperature=0.0),
        tools=work.tools,
        config=EpisodeConfig(max_turns=work.turns),
    )
    return Done(episodes.completion_ids, episodes.model_tokens, episodes.turns)


def reprefilled(work: Workload) -> Done:
    """The same episodes by TRL's loop: every turn a fresh :func:`sampling.sample` of the
    whole conversation so far, the tool results' ids appended on the host."""
    tok, group, pad = work.tokenizer, work.group, work.tokenizer.pad_token_id
    rendered = [conversation.render_prompt(tok, p, work.tools) for p in work.prompts]
    batch = len(rendered) * group
    completions: list[list[int]] = [[] for _ in range(batch)]
    model_tokens, turns, rounds = np.zeros(batch, np.int32), np.zeros(batch, np.int32), np.zeros(batch, np.int32)
    toolbox = {t.__name__: t for t in work.tools}
    going = list(range(batch))
    first = True
    while going:
        if first:  # G rows of each prompt, the prompt prefilled once
            tokens, mask = base.left_pad(rendered, pad_id=pad)
        else:
            tokens, mask = base.left_pad([rendered[b // group] + completions[b] for b in going], pad_id=pad)
        out = sampling.sample(
            work.model,
            work.params,
            tokens,
            mask,
            jax.random.key(0),
            num_samples=group if first else 1,
            max_new_tokens=max(work.budget - len(completions[b]) for b in going),
            temperature=0.0,
            eos_ids=(work.eos_id,),
            pad_id=pad,
        )
        first = False
        ids, lengths = jax.device_get((out.completion_tokens, out.lengths))
        calling = {}
        for slot, b in enumerate(going):
            turn = ids[slot, : lengths[slot]].tolist()
            completions[b] += turn
            model_tokens[b] += len(turn)
            turns[b] += 1
            if not turn or turn[-1] != work.eos_id or rounds[b] >= work.turns:
                continue
            parsed = parsing.parse_turn(tok.decode(turn[:-1], skip_special_tokens=False), call_format="hermes")
            if parsed.calls and len(completions[b]) < work.budget:
                calling[b] = parsed.calls
        jobs = [(b, call) for b, calls in calling.items() for call in calls]
        results = tools.call_tools([(toolbox, call) for _, call in jobs], timeout=30.0)
        going = []
        for b in calling:
            messages = [
                {"role": "tool", "name": r.name, "content": r.content}
                for (row, _), r in zip(jobs, results, strict=True)
                if row == b
            ]
            suffix = conversation.tool_suffix_ids(tok, messages, end_of_turn=work.eos_id)
            if len(completions[b]) + len(suffix) <= work.budget:
                completions[b] += suffix
                rounds[b] += 1
                going.append(b)
    return Done(completions, model_tokens, turns)


def compare(work: Workload, *, repeats: int) -> tuple[dict[str, float], Done]:
    """Median seconds of each method on ``work``, and their episodes, checked equal.

    ``timing.median_seconds``'s rule (one untimed call, then the median of ``repeats``
    timed calls), with the methods' calls interleaved, round by round: on a machine shared
    with other work, a neighbour's load then falls on both methods alike."""
    done = {name: method(work) for name, method in METHODS.items()}  # compilation
    times = {name: [] for name in METHODS}
    for _ in range(repeats):
        for name, method in METHODS.items():
            start = time.perf_counter()
            done[name] = method(work)
            times[name].append(time.perf_counter() - start)
    first, *others = done.values()
    for other in others:
        if other.ids != first.ids or not (
            np.array_equal(other.model_tokens, first.model_tokens) and np.array_equal(other.turns, first.turns)
        ):
            raise AssertionError("the methods' episodes differ: the comparison would not be fair")
    return {name: float(np.median(t)) for name, t in times.items()}, first


METHODS = {"continued": continued, "re-prefilled": reprefilled}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="tiny,qwen05b")
    parser.add_argument("--turns", type=int, default=4, help="tool-calling rounds per episode")
    parser.add_argument("--filler", type=int, default=32, help="filler tokens per turn, before the tool call")
    parser.add_argument("--result-len", type=int, default=14, help="characters (tokens) of each tool result")
    parser.add_argument(
        "--system", type=int, default=0, help="tokens of a system message before each prompt (a tool preamble's)"
    )
    parser.add_argument("--batch", default=None, help="prompts x rows per prompt, e.g. 4x4 (default: the shape's)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (default: the shape's)")
    args = parser.parse_args(argv)

    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}, float32, greedy; {args.turns} tool-calling rounds of "
        f"{args.filler} filler tokens + a call, tool results of {args.result_len} characters, a system message of "
        f"{args.system} tokens"
    )
    header = (
        f"{'shape':<8} {'batch':>5} {'method':<13} {'rounds/turns':>12} {'tokens (model/all)':>18} {'median s':>9} "
        f"{'episodes/s':>10} {'gen tokens/s':>12} {'speedup':>8}"
    )
    print(header)
    print("-" * len(header))
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        prompts, group = map(int, args.batch.split("x")) if args.batch else (shape["prompts"], shape["group"])
        work = workload(
            shape["config"](),
            prompts=prompts,
            group=group,
            turns=args.turns,
            filler=args.filler,
            result_len=args.result_len,
            system=args.system,
        )
        times, done = compare(work, repeats=args.repeats or shape["repeats"])
        batch, generated = len(done.ids), int(done.model_tokens.sum())
        per_episode = f"{generated / batch:.0f} / {np.mean([len(ids) for ids in done.ids]):.0f}"
        for method, seconds in times.items():
            print(
                f"{name:<8} {f'{len(work.prompts)}x{work.group}':>5} {method:<13} "
                f"{f'{args.turns}/{np.mean(done.turns):.0f}':>12} {per_episode:>18} {seconds:>9.3f} "
                f"{batch / seconds:>10.1f} {generated / seconds:>12.0f} {times['re-prefilled'] / seconds:>7.2f}x"
            )


if __name__ == "__main__":
    main()
