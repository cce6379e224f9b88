"""TRL's agent example (``examples/scripts/grpo_agent.py``, TRL 1.16), unchanged: its SQL tool,
which times itself out with ``signal.alarm`` (so it must run in the main thread, as TRL runs
it), and its three reward functions, against a small BioGRID-like database the test builds,
through ``training.train`` and through ``jaxrl-llm train``.

The functions below are TRL's, as published there (Apache-2.0, the HuggingFace Team), only
without the dataset download; the model is a scripted one that always calls the tool."""

import json
import pathlib
import re
import signal
import sqlite3
import textwrap
from contextlib import contextmanager

import numpy as np
import pytest

from jaxrl_llm import algorithms, cli, models, runs, tasks, training
from jaxrl_llm.episodes import EpisodeConfig
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.tasks import build_char_tokenizer
from tests.episodes.test_sampling import TEMPLATE, chain, scripted_model


# ---------------------------------------------------------------- TRL's grpo_agent.py, unchanged
def query_reward(completions, answer, **kwargs):
    """
    Reward query strategy:
    - Penalize more than 2 queries
    - Penalize generic queries (LIMIT 1 / PRAGMA)
    - Reward usage of WHERE
    - Reward evidence supporting the final answer
    """
    rewards = []

    for completion, ans in zip(completions, answer, strict=False):
        reward = 0.0
        sql_queries = []
        tool_results = []

        # collect all SQL queries and tool results
        for turn in completion:
            if turn.get("tool_calls"):
                for call in turn["tool_calls"]:
                    sql = call["function"]["arguments"].get("sql_command", "").lower()
                    sql_queries.append(sql)
            if turn.get("role") == "tool" and turn.get("content"):
                tool_results.append(turn["content"])

        # --- penalize too many queries ---
        if len(sql_queries) > 3:
            reward -= 1.5

        # --- check query quality ---
        where_count = 0
        for q in sql_queries:
            if "limit 1" in q:
                reward -= 1.0
            if " where " not in q:
                reward -= 0.5
            else:
                where_count += 1
        reward += min(where_count, 3) * 0.4  # small bonus for WHERE usage

        # --- evidence check: do queries support the answer? ---
        combined_results = []
        error_detected = False

        for res in tool_results:
            if isinstance(res, dict) and "error" in res:
                error_detected = True
            elif isinstance(res, list):
                combined_results.extend(res)

        # if error detected, penalize heavily
        if error_detected:
            reward -= 2.0
        elif len(sql_queries) == 0:
            reward -= 1.5
        else:
            has_hits = len(combined_results) > 0
            correct_answer = ans.lower()
            if (has_hits and correct_answer == "yes") or (not has_hits and correct_answer == "no"):
                reward += 2.0
            else:
                reward -= 1.5

        rewards.append(reward)

    return rewards


def correctness_reward(completions, answer, **kwargs):
    """
    Reward Yes/No correctness.
    Model must provide final answer enclosed in stars — *yes* or *no*.
    Does not reward informal yes/no buried in text.
    """
    rewards = []
    for completion, ans in zip(completions, answer, strict=False):
        raw = completion[-1]["content"].lower()

        # detect form *yes* or *no*
        match = re.search(r"\*(yes|no)\*", raw)
        guess = match.group(1) if match else None

        reward = 0.0

        if guess is None:
            reward -= 0.5  # invalid format
        elif guess == ans.lower():
            reward += 0.6  # correct under required format
        else:
            reward -= 1.0  # wrong answer

        rewards.append(reward)

    return rewards


def structure_reward(completions, **kwargs):
    """
    Reward proper assistant structure.
    Encourages a logical sequence: tool call + response + optional extra content.
    """
    rewards = []

    for completion in completions:
        has_call = False
        has_response = False
        has_other = False

        for turn in completion:
            role = turn.get("role")
            if role == "assistant" and turn.get("tool_calls"):
                has_call = True
            elif role == "tool":
                has_response = True
            else:
                content = turn.get("content")
                if content and content.strip() not in ["", "<think>"]:
                    has_other = True

        # Reward sequences
        if has_call and has_response:
            if has_other:
                reward = 0.1
            else:
                reward = 0.05  # still positive even without extra text
        elif has_call and not has_response:
            reward = -0.15
        else:
            reward = 0.0  # neutral if no call

        rewards.append(reward)

    return rewards


class TimeoutError(Exception):
    """Raised when a function call times out."""

    pass


@contextmanager
def timeout(seconds):
    """Context manager that raises TimeoutError if execution exceeds time limit."""

    def timeout_handler(signum, frame):
        raise TimeoutError(f"Operation timed out after {seconds} seconds")

    signal.signal(signal.SIGALRM, timeout_handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)


def query_biogrid(sql_command: str) -> list[tuple]:
    """
    Execute a read-only SQL command on the BioGRID database.

    BioGRID is a curated biological database that compiles protein, genetic, and chemical interactions from multiple organisms. It provides researchers with experimentally verified interaction data to support studies in systems biology and functional genomics.

    Args:
        sql_command: The SQL command to execute.

    Returns:
        A list of tuples containing the query results.
    """
    with timeout(5):
        conn = sqlite3.connect("file:biogrid.db?mode=ro", uri=True)
        cursor = conn.cursor()
        try:
            cursor.execute(sql_command)
            results = cursor.fetchall()
        finally:
            conn.close()
    return results


# ---------------------------------------------------------------- the test's database and model
SQL = "SELECT * FROM interactions WHERE Alt_IDs_Interactor_A LIKE '%JNKK%'"
HIT = "entrez gene/locuslink:JNKK(gene name synonym)"
CALL = json.dumps({"name": "query_biogrid", "arguments": {"sql_command": SQL}})


def build_database(directory):
    conn = sqlite3.connect(directory / "biogrid.db")
    conn.execute("CREATE TABLE interactions (Alt_IDs_Interactor_A TEXT, Alt_IDs_Interactor_B TEXT)")
    conn.executemany(
        "INSERT INTO interactions VALUES (?, ?)",
        [(HIT, "entrez gene/locuslink:MAPK8"), ("TP53", "MDM2")],
    )
    conn.commit()
    conn.close()


def agent_tokenizer():
    tok = build_char_tokenizer("0123456789+= ")
    tok.add_tokens(["<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>", "</tool_call>", CALL])
    tok.chat_template = TEMPLATE
    return tok


def agent_model(tok):
    """Calls the tool in every turn."""
    return scripted_model(chain(CALL, {"<tool_call>": 20.0}), tok=tok)


def examples():
    questions = ["Does the gene JNKK interact with MAPK8?", "Does the gene TP53 interact with BRCA1?"]
    return [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in zip(questions, ["yes", "no"])]


@pytest.fixture
def in_a_directory_with_the_database(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    build_database(tmp_path)
    return tmp_path


def test_grpo_agent_trains_through_training_train(in_a_directory_with_the_database):
    tok = agent_tokenizer()
    model, params = agent_model(tok)
    task = tasks.from_records(
        examples(), tokenizer=tok, reward_fns=[correctness_reward, structure_reward, query_reward]
    )
    config = training.TrainConfig(
        num_prompts=2,
        group_size=2,
        sampling=SamplingConfig(max_new_tokens=180, max_prompt_length=64),
        episodes=EpisodeConfig(max_turns=1),
    )
    ends = []
    _, history = training.train(
        model, params, algorithms.get("grpo"), config, steps=1, task=task, tools=[query_biogrid], callback=ends.append
    )
    (metrics,) = history
    assert metrics["tools/call_frequency"] >= 1 and metrics["tools/failure_frequency"] == 0  # signal worked
    messages = ends[0].collected.first_round.messages
    results = [m["content"] for episode in messages for m in episode if m["role"] == "tool"]
    assert results and all(r == [(HIT, "entrez gene/locuslink:MAPK8")] for r in results)  # a list: kept, as by TRL
    for name in ("correctness_reward", "structure_reward", "query_reward"):
        assert np.isfinite(metrics[f"reward_{name}"])
    assert metrics["reward_structure_reward"] == pytest.approx(0.05)  # a call and its response, nothing else


def test_grpo_agent_trains_through_the_command_line(in_a_directory_with_the_database, capsys):
    root = in_a_directory_with_the_database
    tok = agent_tokenizer()
    model, params = agent_model(tok)
    models.save_pretrained(root / "agent-model", model, params, tokenizer=tok)
    (root / "biogrid_qa.jsonl").write_text("".join(json.dumps(row) + "\n" for row in examples()))
    here = pathlib.Path(__file__).resolve()  # TRL's functions, named by file as a user names theirs
    rewards = ", ".join(f'"{here}:{name}"' for name in ("correctness_reward", "structure_reward", "query_reward"))
    (root / "agent.toml").write_text(
        textwrap.dedent(f"""\
            steps = 1
            samples_every = 1

            [model]
            path = "agent-model"

            [task]
            name = "jsonl"
            path = "biogrid_qa.jsonl"
            rewards = [{rewards}]
            tools = ["{here}:query_biogrid"]

            [train]
            num_prompts = 2
            group_size = 2
            max_new_tokens = 180
            max_prompt_length = 64
            max_turns = 1
            eval_every = 0
            """)
    )
    assert cli.main(["train", "--config", "agent.toml", "--run-dir", "run", "--progress", "off"]) == 0
    (metrics,) = runs.read_metrics(root / "run")
    assert metrics["tools/call_frequency"] >= 1 and metrics["tools/failure_frequency"] == 0
    assert metrics["reward_structure_reward"] == pytest.approx(0.05)
    samples = [json.loads(line) for line in (root / "run" / "samples.jsonl").read_text().splitlines()]
    assert any(HIT in str(m["content"]) for s in samples for m in s["messages"] if m["role"] == "tool")
