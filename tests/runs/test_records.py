"""The records of a training run: metrics.jsonl, samples.jsonl, TensorBoard, plots,
progress, Weights & Biases and the summary (jaxrl_llm.runs.records)."""

import errno
import io
import json
import math
import struct
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from jaxrl_llm.rewards.combine import RewardResult
from jaxrl_llm.rollouts import Rollouts, ScoredRound
from jaxrl_llm.runs import records

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def step_metrics(step: int, *, offset: float = 0.0) -> dict[str, float]:
    """A trainer-like metrics dict; ``reward_format`` is NaN on even steps (applied to no row)."""
    return {
        "reward": step / 10 + offset,
        "reward_std": 0.1,
        "reward_accuracy": step / 20,
        "reward_format": math.nan if step % 2 == 0 else 0.5,
        "kl_exact": step * 1e-3,
        "kl_k3": step * 2e-3,
        "completion_length": 10.0 + step,
        "entropy": 1.0 - step / 100,
        "step_seconds": 2.0,
    }


def quiet_recorder(run_dir, **options) -> records.RunRecorder:
    options = {"total_steps": 10, "tensorboard": False, "plot_every": 0, "progress": False, **options}
    return records.RunRecorder(run_dir, **options)


def strict_json(line: str) -> dict:
    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    return json.loads(line, parse_constant=refuse)


def read_tensorboard(directory: Path, *, purge: bool = True) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from the event files, read in name order the way TensorBoard
    reads them: a session START at step k drops the points of steps >= k read before it."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    paths = sorted(directory.glob("events.out.tfevents.*"))
    assert paths, f"no event files in {directory}"
    for path in paths:
        data, offset = path.read_bytes(), 0
        while offset < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            if purge and event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                scalars = {tag: [(s, v) for s, v in points if s < event.step] for tag, points in scalars.items()}
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
        assert offset == len(data), f"{path.name} ends inside a record"
    return scalars


def test_metrics_lines_are_what_was_logged(tmp_path):
    logged = {
        0: {"reward": 0.5, "reward_format": math.nan, "kl_exact": 1e-3},
        1: {
            "reward": 0.75,
            "reward_format": 1.0,
            "kl_exact": math.inf,
            "eval_greedy_accuracy": 0.25,
            "eval_pass@4": np.float32(0.5),
        },
    }
    with quiet_recorder(tmp_path) as recorder:
        for step, metrics in logged.items():
            recorder.log(step, metrics)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [strict_json(line) for line in lines]  # NaN and inf are null, never NaN / Infinity
    assert rows == [
        {"step": 0, "reward": 0.5, "reward_format": None, "kl_exact": 1e-3},
        {
            "step": 1,
            "reward": 0.75,
            "reward_format": 1.0,
            "kl_exact": None,
            "eval_greedy_accuracy": 0.25,
            "eval_pass@4": 0.5,
        },
    ]
    # Step first, then the metrics as given.
    assert [list(row) for row in rows] == [["step", *metrics] for metrics in logged.values()]
    assert records.read_metrics(tmp_path) == rows == recorder.rows


def test_log_refuses_steps_out_of_order_and_non_numbers(tmp_path):
    with quiet_recorder(tmp_path) as recorder:
        recorder.log(0, {"reward": 1.0})
        with pytest.raises(ValueError, match="not after the last step recorded, 0"):
            recorder.log(0, {"reward": 1.0})
        with pytest.raises(ValueError, match="'answer' must be a number"):
            recorder.log(1, {"answer": "42"})
        with pytest.raises(ValueError, match="own key"):
            recorder.log(1, {"step": 1.0})
    with pytest.raises(RuntimeError, match="closed"):
        recorder.log(1, {"reward": 1.0})
    with pytest.raises(ValueError, match="past `total_steps`"):
        quiet_recorder(tmp_path, start_step=11)


def test_resume_keeps_the_lines_before_start_step(tmp_path):
    with quiet_recorder(tmp_path) as recorder:
        for step in range(6):
            recorder.log(step, step_metrics(step))
            if step % 2 == 0:
                recorder.log_samples(step, [{"prompt": "p", "completion": f"c{step}"}])
    with open(tmp_path / "metrics.jsonl", "a") as file:  # killed while writing step 6
        file.write('{"step": 6, "reward": 0.')
    assert [row["step"] for row in records.read_metrics(tmp_path)] == list(range(6))

    with quiet_recorder(tmp_path, start_step=3) as recorder:
        assert [row["step"] for row in records.read_metrics(tmp_path)] == [0, 1, 2]
        assert [row["step"] for row in records.read_samples(tmp_path)] == [0, 2]
        assert not list(tmp_path.glob(".*.tmp"))  # rewritten through a temporary file, left behind none
        for step in range(3, 5):
            recorder.log(step, step_metrics(step, offset=100.0))
        recorder.log_samples(4, [{"prompt": "p", "completion": "again"}])
    rows = records.read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]
    assert [row["reward"] for row in rows[3:]] == [100.3, 100.4]  # the continued run's, not the killed one's
    assert [(row["step"], row["completion"]) for row in records.read_samples(tmp_path)] == [
        (0, "c0"),
        (2, "c2"),
        (4, "again"),
    ]

    with quiet_recorder(tmp_path):  # a fresh run starts empty records
        pass
    assert records.read_metrics(tmp_path) == records.read_samples(tmp_path) == []


def test_only_the_last_line_may_be_cut_short(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward": 1.0}\n{"step": 1, "rew\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2: not JSON"):
        records.read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 0, "reward": 1.0}\n{"step": 1, "note": "\xe2')  # mid-character
    assert records.read_metrics(tmp_path) == [{"step": 0, "reward": 1.0}]


def test_tensorboard_scalars_and_purge_on_resume(tmp_path):
    with quiet_recorder(tmp_path, tensorboard=True) as recorder:
        for step in range(6):
            metrics = step_metrics(step)
            if step == 4:
                metrics.update({"eval_greedy_accuracy": 0.5, "eval_pass@4": 0.75, "eval_seconds": 1.0})
            recorder.log(step, metrics)
    # Continued from a checkpoint after 3 steps, in the same second as the first writer.
    with quiet_recorder(tmp_path, tensorboard=True, start_step=3) as recorder:
        for step in range(3, 8):
            recorder.log(step, step_metrics(step, offset=100.0))

    directory = tmp_path / "tensorboard"
    assert len(list(directory.glob("events.out.tfevents.*"))) == 2
    scalars = read_tensorboard(directory)
    assert {"train/reward", "train/reward_format", "train/kl_exact", "time/step_seconds"} <= set(scalars)
    assert [step for step, _ in scalars["train/reward"]] == list(range(8))  # each step once
    assert [value for _, value in scalars["train/reward"]] == pytest.approx(
        [step / 10 for step in range(3)] + [step / 10 + 100.0 for step in range(3, 8)]
    )
    assert [step for step, _ in scalars["train/reward_format"]] == [1, 3, 5, 7]  # NaN steps left out
    # The evaluation of the discarded step 4 is purged too.
    assert all(not scalars[tag] for tag in ("eval/greedy_accuracy", "eval/pass_at_4", "time/eval_seconds"))
    raw = read_tensorboard(directory, purge=False)  # in the files, hidden by the restart event
    assert [step for step, _ in raw["train/reward"]] == [*range(6), *range(3, 8)]
    assert [step for step, _ in raw["eval/pass_at_4"]] == [4]


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
    """tensorboardX's package imports torch where it is installed (this suite's environment),
    two seconds of every run's start, only to accept torch tensors; a recorder logs floats and
    leaves torch unimported, and a later ``import torch`` works."""
    code = (
        "import sys; from jaxrl_llm.runs import records\n"
        "with records.RunRecorder(sys.argv[1], total_steps=2, plot_every=0, progress=False) as recorder:\n"
        "    recorder.log(0, {'reward': 0.5}); recorder.log(1, {'reward': 0.75})\n"
        "print('torch' in sys.modules)\n"
        "import torch; print(torch.ones(1).item())"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "1.0"]
    assert read_tensorboard(tmp_path / "tensorboard")["train/reward"] == [(0, 0.5), (1, 0.75)]


def test_a_failed_tensorboard_write_raises_in_the_step_that_made_it(tmp_path, monkeypatch):
    # Not in a writer thread of its own, whose traceback would follow the run's message.
    from tensorboardX import record_writer

    in_threads = []
    monkeypatch.setattr(threading, "excepthook", in_threads.append)
    with quiet_recorder(tmp_path, tensorboard=True) as recorder:
        recorder.log(0, step_metrics(0))

        def disk_full(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(record_writer.RecordWriter, "write", disk_full)
        with pytest.raises(OSError, match="No space left on device"):
            recorder.log(1, step_metrics(1))
        monkeypatch.undo()
    assert in_threads == [] and [t for t in threading.enumerate() if "EventLogger" in type(t).__name__] == []
    assert [step for step, _ in read_tensorboard(tmp_path / "tensorboard")["train/reward"]] == [0]


def test_tensorboard_tags():
    assert records.tensorboard_tag("reward") == "train/reward"
    assert records.tensorboard_tag("eval_greedy_accuracy") == "eval/greedy_accuracy"
    assert records.tensorboard_tag("eval_pass@16") == "eval/pass_at_16"
    assert records.tensorboard_tag("rollout_seconds") == "time/rollout_seconds"
    assert records.tensorboard_tag("eval_seconds") == "time/eval_seconds"
    assert records.tensorboard_tag("tokens_per_second") == "time/tokens_per_second"


def test_plot_is_redrawn_every_plot_every_steps(tmp_path):
    path = tmp_path / "metrics.png"
    with quiet_recorder(tmp_path, plot_every=2) as recorder:
        recorder.log(0, {"reward": 0.0, "entropy": 1.0})  # no KL, clip fraction, ...: panels say so
        assert not path.exists()
        recorder.log(1, {"reward": 0.5, "entropy": 0.9, "eval_greedy_accuracy": 0.25})
        first = path.read_bytes()
        assert first.startswith(PNG_SIGNATURE)
        recorder.log(2, {"reward": 1.0, "entropy": 0.8})
        assert path.read_bytes() == first
        recorder.log(3, {"reward": 0.7, "entropy": 0.7})
        second = path.read_bytes()
        assert second.startswith(PNG_SIGNATURE) and second != first
        recorder.log(4, {"reward": 0.2, "entropy": 0.6})
    assert path.read_bytes().startswith(PNG_SIGNATURE) and path.read_bytes() != second  # drawn at close
    assert not list(tmp_path.glob(".*.tmp"))


def test_plot_of_a_full_run(tmp_path):
    rows = [{"step": step, **records.json_ready(step_metrics(step))} for step in range(4)]
    rows[-1].update({"eval_greedy_accuracy": 0.5, "eval_pass@1": 0.4, "eval_pass@8": 0.9, "clip_fraction": 0.1})
    records.plot_metrics(rows, tmp_path / "plot.png", title="run")
    assert (tmp_path / "plot.png").read_bytes().startswith(PNG_SIGNATURE)


def test_the_accuracy_band_is_the_wilson_interval_of_each_evaluation_and_of_the_one_before(tmp_path):
    rows = [
        {"step": 0, "reward": 0.1},
        {"step": 4, "reward": 0.3, "eval_greedy_accuracy": 0.5, "eval_examples": 8.0},
        {"step": 9, "reward": 0.6, "eval_greedy_accuracy": 1.0, "eval_examples": 200.0},
        {"step": 10, "reward": 0.6, "eval_greedy_accuracy": 0.9},  # no count: no interval
    ]
    before = {"eval_greedy_accuracy": 0.25, "eval_examples": 20.0, "step": 7}
    steps, accuracies, low, high = records.accuracy_points(rows, before=before)
    np.testing.assert_array_equal(steps, [-1, 4, 9])
    np.testing.assert_array_equal(accuracies, [0.25, 0.5, 1.0])
    z = 1.959964  # Wilson's interval from its formula: (p + z²/2n ± z √(p(1-p)/n + z²/4n²)) / (1 + z²/n)
    for p, n, lo, hi in zip(accuracies, [20, 8, 200], low, high, strict=True):
        half = z * np.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
        np.testing.assert_allclose([lo, hi], (np.array([p - half, p + half]) + z**2 / (2 * n)) / (1 + z**2 / n))
    assert high[-1] == pytest.approx(1.0) and 0.98 < low[-1] < 0.99  # 200 of 200: the interval is below 1, not a point
    assert records.accuracy_points(rows[:1], before=None)[0].shape == (0,)
    # Plotted with the evaluation before and no evaluation yet in the rows: the panel is drawn.
    records.plot_metrics(rows[:1], tmp_path / "plot.png", before=before)
    assert (tmp_path / "plot.png").read_bytes().startswith(PNG_SIGNATURE)


def scored_round() -> ScoredRound:
    """P = 3 prompts, G = 2 completions each; a text prompt, a chat one and another."""
    prompts = ["1 + 1 =", [{"role": "user", "content": "2 + 2?"}], "3 + 3 ="]
    rows = 6
    rollouts = Rollouts(
        prompt_tokens=np.zeros((3, 4), np.int32),
        prompt_mask=np.ones((3, 4), bool),
        completion_tokens=np.zeros((rows, 4), np.int32),
        completion_mask=np.ones((rows, 4), bool),
        logprobs=np.zeros((rows, 4), np.float32),
        lengths=np.array([3, 4, 2, 4, 1, 2], np.int32),
        truncated=np.array([0, 1, 0, 1, 0, 0], bool),
        rewards=np.array([1.5, 0.0, 1.0, -0.2, 0.0, 0.0], np.float32),
    )
    result = RewardResult(
        total=np.array([1.5, 0.0, 1.0, 0.0, 0.0, 0.0], np.float32),
        values={
            "accuracy": np.array([1.0, 0.0, 1.0, 0.0, 0.0, 0.0], np.float32),
            "format": np.array([0.5, np.nan, np.nan, 0.0, 0.0, 0.0], np.float32),
        },
        errors={},
    )
    return ScoredRound(
        prompts=prompts,
        rollouts=rollouts,
        result=result,
        completions=["2", "11 wrong", "4", "5", "6", "6"],
        truncated_prompts=0,
        reward_seconds=0.0,
    )


def test_sample_rows_take_the_first_prompts_groups(tmp_path):
    rows = records.sample_rows(scored_round(), step=7, max_prompts=2)
    chat = [{"role": "user", "content": "2 + 2?"}]
    assert rows == [
        {
            "step": 7,
            "prompt": "1 + 1 =",
            "completion": "2",
            "reward": 1.5,
            "rewards": {"accuracy": 1.0, "format": 0.5},
            "length": 3,
            "truncated": False,
        },
        {
            "step": 7,
            "prompt": "1 + 1 =",
            "completion": "11 wrong",
            "reward": 0.0,
            "rewards": {"accuracy": 0.0, "format": None},
            "length": 4,
            "truncated": True,
        },
        {
            "step": 7,
            "prompt": chat,
            "completion": "4",
            "reward": 1.0,
            "rewards": {"accuracy": 1.0, "format": None},
            "length": 2,
            "truncated": False,
        },
        {
            "step": 7,
            "prompt": chat,
            "completion": "5",
            "reward": 0.0,
            "rewards": {"accuracy": 0.0, "format": 0.0},
            "length": 4,
            "truncated": True,
        },
    ]
    assert all(type(row["length"]) is int and type(row["reward"]) is float for row in rows)
    assert len(records.sample_rows(scored_round(), step=0, max_prompts=10)) == 6
    assert records.sample_rows(scored_round(), step=0, max_prompts=0) == []

    with quiet_recorder(tmp_path) as recorder:
        recorder.log_samples(7, rows)
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert [list(strict_json(line))[0] for line in lines] == ["step"] * 4
    assert records.read_samples(tmp_path) == rows


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_only_on_a_terminal(tmp_path):
    pipe = io.StringIO()
    with quiet_recorder(tmp_path, progress=None, stream=pipe) as recorder:
        for step in range(3):
            recorder.log(step, step_metrics(step))
    assert pipe.getvalue() == ""

    terminal = Terminal()
    with quiet_recorder(tmp_path, progress=None, stream=terminal, start_step=3) as recorder:  # resumed: from 3
        for step in range(3, 5):
            recorder.log(step, step_metrics(step))
        recorder.write("checkpoint saved")
    shown = terminal.getvalue()
    assert "5/10" in shown and "reward=0.4" in shown and "kl=0.004" in shown and "step_s=2" in shown
    assert "checkpoint saved" in shown
    assert "3/10" in shown  # the bar starts where the run left off


class FakeWandb:
    """What RunRecorder uses of the wandb module: init, run.log, run.finish."""

    def __init__(self):
        self.inits, self.logged, self.finished = [], [], 0
        self.module = types.ModuleType("wandb")
        self.module.init = self.init

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return types.SimpleNamespace(
            log=lambda metrics, step: self.logged.append((step, dict(metrics))), finish=self.finish
        )

    def finish(self):
        self.finished += 1


def test_wandb_receives_each_steps_metrics(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake.module)
    with quiet_recorder(tmp_path, wandb_project="digits", wandb_config={"lr": 1e-5}) as recorder:
        recorder.log(0, {"reward": 0.5, "reward_format": math.nan})
        recorder.log(1, {"reward": 0.75, "eval_greedy_accuracy": 0.5})
    (init,) = fake.inits
    assert init["project"] == "digits" and init["config"] == {"lr": 1e-5} and init["resume"] == "allow"
    assert fake.logged == [(0, {"reward": 0.5}), (1, {"reward": 0.75, "eval_greedy_accuracy": 0.5})]
    assert fake.finished == 1

    with quiet_recorder(tmp_path, wandb_project="digits", start_step=1):  # continued: the same wandb run
        pass
    assert fake.inits[1]["id"] == init["id"]
    with quiet_recorder(tmp_path, wandb_project="digits"):  # a fresh run: a new one
        pass
    assert fake.inits[2]["id"] != init["id"]


def test_wandb_not_installed_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        quiet_recorder(tmp_path / "run", wandb_project="digits")
    assert not (tmp_path / "run").exists()  # checked before anything is written


def test_summary_table(tmp_path):
    with quiet_recorder(tmp_path) as recorder:
        for step in range(12):
            metrics = step_metrics(step)
            if step in (5, 11):
                metrics.update({"eval_greedy_accuracy": step / 20, "eval_seconds": 6.0})
            recorder.log(step, metrics)
    text = recorder.summary()
    assert text == records.summarize(records.read_metrics(tmp_path))
    lines = {line.split()[0]: line.split()[1:] for line in text.splitlines()}
    assert "12 train steps recorded (steps 0 to 11)" in text
    assert "time in steps 0:00:36: train steps 0:00:24, evaluation 0:00:12" in text
    assert lines["reward"][:2] == ["0.2", "0.9"]  # means of steps 0-4 and 7-11
    assert lines["reward_format"][:2] == ["0.5", "0.5"]  # nulls left out
    assert lines["kl_exact"][:2] == ["0.002", "0.009"]
    assert lines["eval_greedy_accuracy"][:2] == ["0.25", "0.55"]
    assert "at steps 5 and 11" in text
    assert records.summarize([]) == "No train steps recorded."
