"""What the GRPO-step scripts share: their flags, the versions they report, and their
ending (the phase table, the first-step line and the JSON line ``side_by_side.py`` reads).
Standard library only: ``train_step.py``, ``trl_grpo_step.py`` and ``tunix_grpo_step.py``
each run in their own venv."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import resource
import statistics
import sys

PRECISIONS = {
    "float32": "float32 weights and compute",
    "mixed": "float32 weights, bfloat16 compute (TRL's bf16=True)",
}


def parse(
    description: str, shapes: dict[str, dict], argv=None, *, precision: bool = False, flags: tuple = ()
) -> tuple[argparse.Namespace, dict]:
    """``(args, shape)`` of the flags every script takes: ``--shape`` (a key of ``shapes``,
    each with ``prompts``, ``group``, ``prompt_len``, ``new_tokens``), ``--repeats`` and the
    overrides ``--layers``, ``--group-size`` and ``--new-tokens``; ``args.group_size`` and
    ``args.new_tokens`` hold the shape's values unless overridden. With ``precision``, also
    ``--precision`` (a key of :data:`PRECISIONS`; default the shape's ``precision``, else
    ``float32``); ``flags``: more ``(name, add_argument keywords)`` of the script's own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shape", choices=sorted(shapes), default="tiny")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps after the warm-up")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--group-size", type=int, default=None, help="completions per prompt (default: the shape's)")
    parser.add_argument("--new-tokens", type=int, default=None, help="completion tokens (default: the shape's)")
    if precision:
        parser.add_argument("--precision", choices=sorted(PRECISIONS), default=None, help="default: the shape's")
    for name, keywords in flags:
        parser.add_argument(name, **keywords)
    args = parser.parse_args(argv)
    for flag in ("repeats", "layers", "group_size", "new_tokens"):
        if (value := getattr(args, flag)) is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1; got {value}")
    shape = shapes[args.shape]
    args.group_size = args.group_size or shape["group"]
    args.new_tokens = args.new_tokens or shape["new_tokens"]
    if precision:
        args.precision = args.precision or shape.get("precision", "float32")
    return args, shape


def versions(*names: str) -> dict[str, str]:
    """The installed versions of the distributions ``names`` (those installed) and Python's."""
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {**found, "python": platform.python_version()}


def peak_rss_gb() -> float:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def finish(results: dict, steps: list[dict[str, float]], *, warmup: int, phases: tuple[str, ...]) -> dict:
    """Prints each phase's median, minimum, share of the step and first-step time over
    ``steps`` (one dict of seconds per step, ``step`` and ``since_start`` among them; the
    first ``warmup`` not counted), the first step's line and ``results`` completed with
    them as one JSON line; returns ``results``."""
    first, timed = steps[0], steps[warmup:]
    header = f"{'phase':<12} {'median s':>9} {'min s':>8} {'share':>7} {'first s':>9}"
    print(header)
    print("-" * len(header))
    step_s = statistics.median(step["step"] for step in timed)
    results["phases"] = {}
    for phase in phases:
        times = [step[phase] for step in timed]
        label = "  reference" if phase == "reference" else phase  # a part of logprobs
        print(
            f"{label:<12} {statistics.median(times):>9.4f} {min(times):>8.4f} "
            f"{statistics.median(times) / step_s:>6.0%} {first[phase]:>9.3f}"
        )
        results["phases"][phase] = {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "first_s": first[phase],
            "all_s": times,
        }
    peak = peak_rss_gb()
    print(
        f"first step (compilation included) {first['step']:.2f} s, {first['since_start']:.2f} s from the "
        f"process's start; peak RSS {peak:.2f} GB"
    )
    results.update(
        first_step_s=first["step"],
        to_first_step_s=first["since_start"],
        step_median_s=step_s,
        step_min_s=min(step["step"] for step in timed),
        peak_rss_gb=peak,
    )
    print(json.dumps(results))
    sys.stdout.flush()
    return results
