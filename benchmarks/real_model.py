r"""Learning matched against TRL on a real model: jaxrl_llm and TRL 1.16's ``GRPOTrainer`` train
SmolLM2-135M-Instruct with GRPO on the same task, seeds and settings; one table and one plot.

jaxrl_llm runs the README's main job as its users run it, ``jaxrl-llm train --config default``,
with ``--conventions trl`` (TRL's group std and its epsilon) and the shared reward
``real_model_reward.correct``; TRL runs ``trl_real_model.py`` in ``.venv-trl`` (its docstring
lists the settings, ``default.toml``'s in TRL's names). Neither evaluates while it trains
(``--train.eval-every 0``); afterwards both trained models, and the model before training, are
evaluated by the same code, ``jaxrl-llm eval``: greedy accuracy on the task's 200 held-out sums,
with its Wilson 95% interval. The prompts TRL trains on are the first ``steps x 8 x 4`` of the
task's train stream (``task.examples("train", ...)``), the stream jaxrl_llm draws from; each
library shuffles and samples them with its own seed. Processes run one after another, never
two at once; ``--resume`` keeps the runs an earlier invocation finished (the JSON is written after
each) and runs the rest. Each library's wall time is its training process's, start to exit (loading the
model included), and its peak RSS that process's (``wait4``). This process imports no JAX.

Outputs (in ``--out``, default ``benchmarks/results``): ``real_model.md`` (the table),
``real_model.json`` (every number) and ``real_model.png`` (the reward curves of both, mean and
spread over the seeds, and the held-out accuracies). ``--report`` redraws them from the JSON.

    make model .venv-trl/.installed
    .venv/bin/python benchmarks/real_model.py [--seeds 0 1 2] [--steps 30] [--libraries jaxrl_llm,trl]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
REWARD = f"{HERE / 'real_model_reward.py'}:correct"
JAXRL_LLM = pathlib.Path(sys.executable).parent / "jaxrl-llm"
TRL_PYTHON = ROOT / os.environ.get("TRL_VENV", ".venv-trl") / "bin" / "python"
PROMPTS_PER_STEP = 8
SHARED = ["--config", "default", "--task.rewards", REWARD]  # the main job, scored by the shared reward


def timed(command: list[str], *, log: pathlib.Path) -> dict[str, float]:
    """Runs ``command`` to its end (output to ``log``); its wall time and peak RSS (``wait4``).
    Raises SystemExit naming the log when it fails."""
    started = time.perf_counter()
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(command[:3])} ... failed; see {log}")
    return {"wall_seconds": time.perf_counter() - started, "peak_rss_gb": usage.ru_maxrss / 2**20}


def evaluated(source: list[str], out: pathlib.Path) -> dict[str, float]:
    """``jaxrl-llm eval`` of a run directory or a model: greedy accuracy on the held-out sums."""
    timed([str(JAXRL_LLM), "eval", *source, "--out", str(out)], log=out.with_suffix(".log"))
    return json.loads(out.read_text())


def write_data(directory: pathlib.Path, rows: int) -> None:
    """The first ``rows`` prompts of the main job's train stream as JSONL (run in a child: it imports JAX)."""
    import numpy as np

    from jaxrl_llm import runs

    config = runs.load("default")
    task = runs.build.run_task(config)
    batch = task.examples("train", np.arange(rows), seed=0)
    lines = [json.dumps({"prompt": p, "answer": str(a)}) for p, a in zip(batch.prompts, batch.columns["answer"])]
    (directory / "train.jsonl").write_text("\n".join(lines) + "\n")


def run_jaxrl_llm(seed: int, steps: int, work: pathlib.Path) -> dict:
    run_dir = work / f"jaxrl_llm-{seed}"
    command = [str(JAXRL_LLM), "train", *SHARED, "--run-dir", str(run_dir), "--overwrite", "--conventions", "trl"]
    command += ["--train.eval-every", "0", "--train.seed", str(seed), "--steps", str(steps), "--progress", "off"]
    process = timed(command, log=work / f"jaxrl_llm-{seed}.log")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        **process,
        "steps": [
            {
                "step": r["step"],
                "seconds": r["step_seconds"],
                "reward": r["reward"],
                "completion_length": r.get("completion_length"),
            }
            for r in rows
        ],
        "after": evaluated(["--run-dir", str(run_dir)], work / f"jaxrl_llm-{seed}-eval.json"),
    }


def run_trl(seed: int, steps: int, work: pathlib.Path) -> dict:
    out = work / f"trl-{seed}"
    command = [str(TRL_PYTHON), str(HERE / "trl_real_model.py"), "--model", str(MODEL), "--data"]
    command += [str(work / "train.jsonl"), "--steps", str(steps), "--seed", str(seed), "--out", str(out)]
    process = timed(command, log=work / f"trl-{seed}.log")
    result = json.loads((out / "result.json").read_text())
    after = evaluated(["--model", str(out / "model"), *SHARED], work / f"trl-{seed}-eval.json")
    return {**process, "steps": result["steps"], "versions": result["versions"], "after": after}


RUNNERS = {"jaxrl_llm": run_jaxrl_llm, "trl": run_trl}


def spread(values: list[float], digits: int = 3) -> str:
    """``"mean ± sample std"`` of the seeds' values (the mean alone for one seed)."""
    mean = statistics.fmean(values)
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else f"{mean:.{digits}f}"


def _rows(before: float) -> list[tuple[str, object]]:
    """The table's rows: a label and, from one library's seeds, its cell."""

    def rewards(seeds, part: slice) -> str:
        return spread([statistics.fmean(x["reward"] for x in s["steps"][part]) for s in seeds])

    def step_times(seeds) -> str:
        return f"{statistics.median(x['seconds'] for s in seeds for x in s['steps'][1:]):.1f}"

    return [
        ("held-out greedy accuracy before (200 sums)", lambda seeds: f"{before:.3f}"),
        ("held-out greedy accuracy after, mean ± std", lambda seeds: spread([after(s) for s in seeds])),
        ("... each seed", lambda seeds: ", ".join(f"{after(s):.3f}" for s in seeds)),
        ("reward, mean of the first 5 steps", lambda seeds: rewards(seeds, slice(None, 5))),
        ("reward, mean of the last 5 steps", lambda seeds: rewards(seeds, slice(-5, None))),
        ("step time, median of steps 2 on (s)", step_times),
        ("first step (s)", lambda seeds: f"{statistics.fmean(s['steps'][0]['seconds'] for s in seeds):.1f}"),
        ("training process, wall (s)", lambda seeds: spread([s["wall_seconds"] for s in seeds], digits=0)),
        ("peak RSS (GiB)", lambda seeds: f"{max(s['peak_rss_gb'] for s in seeds):.2f}"),
    ]


def after(seed: dict) -> float:
    return seed["after"]["eval_greedy_accuracy"]


def table(results: dict) -> str:
    """The Markdown table of a finished run."""
    names = results["libraries"]
    lines = [
        f"SmolLM2-135M-Instruct (Q4_1 GGUF, float32), GRPO, {results['steps']} steps of 8 prompts x 8 completions, "
        f"seeds {', '.join(map(str, results['seeds']))}; {results['machine']}; {results['date']}.",
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for label, cell in _rows(results["before"]["eval_greedy_accuracy"]):
        lines.append(f"| {label} | " + " | ".join(cell(results["runs"][name]) for name in names) + " |")
    if {"jaxrl_llm", "trl"} <= set(names):
        ours, theirs = (
            statistics.fmean(s["wall_seconds"] for s in results["runs"][name]) for name in ("jaxrl_llm", "trl")
        )
        lines += ["", f"jaxrl_llm's training wall time is {ours / theirs:.2f} of TRL's ({theirs / ours:.1f}x faster)."]
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, (curves, accuracies) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for index, name in enumerate(results["libraries"]):
        seeds = results["runs"][name]
        rewards = np.array([[x["reward"] for x in s["steps"]] for s in seeds])  # [seeds, steps]
        steps = np.arange(1, rewards.shape[1] + 1)
        color = f"C{index}"
        curves.plot(steps, rewards.mean(0), color=color, label=f"{name} (mean of {len(seeds)} seeds)")
        curves.fill_between(steps, rewards.min(0), rewards.max(0), color=color, alpha=0.2)
        after = [s["after"]["eval_greedy_accuracy"] for s in seeds]
        accuracies.scatter([index] * len(after), after, color=color)
        accuracies.bar(index, np.mean(after), color=color, alpha=0.4)
    accuracies.axhline(results["before"]["eval_greedy_accuracy"], color="gray", linestyle="--", label="before")
    curves.set(xlabel="step", ylabel="reward (sampled, T = 1)", title="Reward per step (band: min to max)")
    curves.legend()
    accuracies.set(
        xticks=range(len(results["libraries"])),
        xticklabels=results["libraries"],
        ylabel="held-out greedy accuracy",
        title="After training (dots: seeds)",
        ylim=(0, 1),
    )
    accuracies.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def report(results: dict, out: pathlib.Path) -> None:
    (out / "real_model.json").write_text(json.dumps(results, indent=1))
    (out / "real_model.md").write_text(table(results) + "\n")
    plot(results, out / "real_model.png")
    print(table(results))


def resumed(done: dict, fresh: dict) -> dict:
    """``fresh`` with the finished runs of ``done``, an earlier invocation's JSON. SystemExit when
    the two differ in steps, machine or libraries, or when the seeds ``done`` ran do not begin
    ``fresh``'s."""
    for key in ("steps", "machine", "libraries"):
        if done[key] != fresh[key]:
            raise SystemExit(f"--resume: the earlier runs had {key} {done[key]!r}, these {fresh[key]!r}")
    for name, finished in done["runs"].items():
        if done["seeds"][: len(finished)] != fresh["seeds"][: len(finished)]:
            raise SystemExit(f"--resume: {name} ran seeds {done['seeds'][: len(finished)]}, not a prefix of --seeds")
    runs = {name: list(finished) for name, finished in done["runs"].items()}
    return {**fresh, "date": done["date"], "before": done["before"], "runs": runs}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--libraries", default="jaxrl_llm,trl")
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    parser.add_argument("--work", type=pathlib.Path, help="where runs and logs go (default: a temporary directory)")
    parser.add_argument("--report", type=pathlib.Path, help="redraw the table and plot of this JSON; run nothing")
    parser.add_argument(
        "--resume", action="store_true", help="keep the runs --out's real_model.json holds; run the rest"
    )
    parser.add_argument("--write-data", type=pathlib.Path, help=argparse.SUPPRESS)  # the child that imports JAX
    args = parser.parse_args(argv)
    if args.write_data:
        return write_data(args.write_data, args.steps * PROMPTS_PER_STEP * 4)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        return report(json.loads(args.report.read_text()), args.out)
    libraries = args.libraries.split(",")
    if unknown := set(libraries) - set(RUNNERS):
        parser.error(f"--libraries: unknown {', '.join(sorted(unknown))}; choose from {', '.join(RUNNERS)}")
    for needed, how in (
        (MODEL, "make model"),
        *([(TRL_PYTHON, "make .venv-trl/.installed")] if "trl" in libraries else []),
    ):
        if not needed.exists():
            raise SystemExit(f"{needed} is missing: run `{how}` first.")
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="real_model-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"Runs and logs in {work}", flush=True)
    subprocess.run([sys.executable, __file__, "--write-data", str(work), "--steps", str(args.steps)], check=True)
    results = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        "steps": args.steps,
        "seeds": args.seeds,
        "libraries": libraries,
        "runs": {name: [] for name in libraries},
    }
    if args.resume and (done := args.out / "real_model.json").exists():
        results = resumed(json.loads(done.read_text()), results)
    if "before" not in results:
        results["before"] = evaluated(["--model", str(MODEL), *SHARED], work / "before-eval.json")
    for index, seed in enumerate(args.seeds):
        for name in libraries:
            if index < len(results["runs"][name]):
                continue
            print(f"{name}, seed {seed}...", flush=True)
            results["runs"][name].append(RUNNERS[name](seed, args.steps, work))
            (args.out / "real_model.json").write_text(json.dumps(results, indent=1))  # what is done so far
    report(results, args.out)


if __name__ == "__main__":
    main()
