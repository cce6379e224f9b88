r"""jaxrl_llm's GRPO step against TRL's on one GPU, prepared to run in one call on a machine
with no network: a Markdown table, a JSON report and a log, written from whatever finished
within the time budget.

The work is the ``gpu`` shape of ``train_step.py`` and ``trl_grpo_step.py``: a
Qwen2.5-0.5B-shaped model with random weights, 16 prompts x 8 completions, prompt 128 tokens,
completion 256 (no row ends early), GRPO with beta 0.04, float32 weights with bfloat16 compute
on both sides (``--precision mixed``: ``ModelConfig(param_dtype=float32, dtype=bfloat16)`` and
TRL's ``bf16=True``). jaxrl_llm runs through :func:`jaxrl_llm.training.train` with its defaults
(one minibatch of 128); TRL's ``GRPOTrainer`` with plain ``generate`` and its backward pass in
two micro-batches of 64 (the same gradient). Both libraries run with this interpreter (TRL from
its wheels on ``PYTHONPATH``, ``make gpu-wheels``), one process at a time, offline.

Stages, each a process of its own with a timeout (the least of its cap and what is left of
``--budget-s``; a stage with under a minute left is skipped), in this order:

1. ``machine``: the GPU (name, memory, multiprocessors), driver and CUDA versions, the CPU, and,
   in PyTorch, the bfloat16 matmul peak (the best of ``[8192, 8192] @ [8192, 8192]`` products,
   random data) and the device-to-device copy rate;
2. ``jaxrl_llm cold``: ``train_step.py`` with a fresh persistent compilation cache;
3. ``trl``: ``trl_grpo_step.py`` (skipped where this interpreter cannot import ``trl``);
4. ``jaxrl_llm warm``: ``train_step.py`` again, the cache now filled by 2;
5. with ``--stacked`` (the default), ``stacked cold`` and ``stacked warm``: 2 and 4 with the
   stacked layers' layout (``--scan-layers``, ``ModelConfig.scan_layers``), in a cache of their own;
6. with ``--profile`` (the default), ``jaxrl_llm profile``: two steady steps traced by
   ``jax.profiler`` (``train_step.py --profile``) on the warm cache, their time by op
   (``trace_summary.py``) under the table; never pooled into the step times;
7. with ``--micro-batches`` (the default), ``micro-batched``: jaxrl_llm with the update in two
   micro-batches (``TrainConfig.micro_batch_size``, half the rows), as TRL's backward pass runs,
   the column that says whether the same split brings its peak memory to TRL's.

``--only NAME,...`` runs only the named stages (the rest are skipped): a second call on a warm
machine, e.g. ``--only "jaxrl_llm profile"`` when the budget ran out before it.

The JAX processes run with ``JAX_PLATFORMS=cuda`` (no silent fall back to the CPU) and
``XLA_PYTHON_CLIENT_MEM_FRACTION=0.9`` unless set (the allocator's share of the GPU: JAX's
default, 0.75, leaves about 60 GB of an 80 GB card, near this step's peak).

Columns, per library: the steady step (median over the timed steps of the cold and warm
processes pooled) and its rollout / log-probs / update split (``side_by_side.py``'s phases);
the decode time per token step of the ``P x G`` rows (the rollout's time over the completion's
tokens, prefill and rewards included) and the rollout's tokens/s; the update's model FLOP rate
(``grpo_step.step_flops``: every matmul of the forward and backward pass over all rows) and its
share of the measured bf16 peak; the first step (compilation) with a cold and a warm cache, and
the time from the process's start to the end of that step; peak device memory (JAX's
``peak_bytes_in_use``, torch's ``max_memory_allocated``) and peak host RSS; and the ratios
TRL / jaxrl_llm and stacked / unrolled.

    python3 benchmarks/gpu_side_by_side.py [--out benchmarks/results] [--budget-s 450] [--no-stacked]
                                           [--no-profile] [--only STAGES] [--repeats 3] [--dry-run]
                                           [--python-trl PYTHON]

Outputs (in ``--out``): ``gpu_side_by_side.md``, ``gpu_side_by_side.json`` (every stage's
status and JSON line, the machine, the derived columns; rewritten after each stage) and
``gpu_side_by_side.log`` (each stage's command and output). ``--report gpu_side_by_side.json``
writes the table of a finished run again. ``--dry-run`` runs the same stages on the CPU at the
``tiny`` shape (a check of the pipeline, not a measurement).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

import side_by_side
import step_report
import trace_summary

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(1, str(ROOT))  # jaxrl_llm from this checkout, installed or not (as the stages get it)
NAME = "gpu_side_by_side"
MIN_STAGE_S = 60.0  # a stage with less of the budget left is skipped
MICRO_BATCH = {"gpu": 64, "tiny": 16}  # half of each shape's rows, as TRL's script splits its backward pass
PROFILE = "jaxrl_llm profile"  # the traced stage: its step times carry the profiler's overhead, never pooled
PHASES = ("rollout", "logprobs", "update", "step")
ROWS = {  # table column -> (cold stage, warm stage)
    "jaxrl_llm": ("jaxrl_llm cold", "jaxrl_llm warm"),
    "jaxrl_llm, stacked layers": ("stacked cold", "stacked warm"),
    "jaxrl_llm, micro-batches": ("micro-batched", None),
    "TRL": ("trl", None),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """One process of the run: ``library`` (a key of ``side_by_side.LIBRARIES``, or
    ``machine``) with ``flags``, for at most ``cap_s`` seconds; ``cache`` names its
    persistent compilation cache (stages with the same name share one)."""

    name: str
    library: str
    flags: tuple[str, ...] = ()
    cap_s: float
    cache: str | None = None
    profile: bool = False  # traced: ``--profile`` into a directory of its own


def stages(
    *, shape: str, repeats: int, stacked: bool, profile: bool, micro_batches: bool, matmul_size: int
) -> list[Stage]:
    """The run's stages in order (the module's docstring)."""
    common = ("--shape", shape, "--precision", "mixed")
    cold, warm = (*common, "--repeats", str(repeats)), (*common, "--repeats", str(max(1, repeats // 2)))
    found = [
        Stage(name="machine", library="machine", flags=("--machine", "--matmul-size", str(matmul_size)), cap_s=90),
        Stage(name="jaxrl_llm cold", library="jaxrl_llm", flags=cold, cap_s=240, cache="unrolled"),
        Stage(name="trl", library="trl", flags=(*common, "--repeats", str(repeats)), cap_s=200),
        Stage(name="jaxrl_llm warm", library="jaxrl_llm", flags=warm, cap_s=150, cache="unrolled"),
    ]
    if stacked:
        found += [
            Stage(name="stacked cold", library="jaxrl_llm", flags=(*cold, "--scan-layers"), cap_s=200, cache="stacked"),
            Stage(name="stacked warm", library="jaxrl_llm", flags=(*warm, "--scan-layers"), cap_s=120, cache="stacked"),
        ]
    if profile:
        traced = (*common, "--repeats", "2")
        found.append(Stage(name=PROFILE, library="jaxrl_llm", flags=traced, cap_s=120, cache="unrolled", profile=True))
    if micro_batches:  # TRL's memory-saving split: the update in two micro-batches (the same gradient)
        split = ("--micro-batch-size", str(MICRO_BATCH[shape]))
        found.append(Stage(name="micro-batched", library="jaxrl_llm", flags=(*warm, *split), cap_s=150, cache="micro"))
    return found


# --- The machine stage (PyTorch; no JAX in this process) -------------------------------------------


def nvidia_smi() -> dict:
    """The driver's version and the CUDA version it supports, as ``nvidia-smi`` prints them."""
    try:
        query = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        banner = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return {"nvidia_smi": f"unavailable ({error})"}
    driver, memory = (field.strip() for field in query.splitlines()[0].split(",", 1))
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", banner)
    return {"driver": driver, "memory_smi": memory, "cuda_driver": cuda.group(1) if cuda else None}


def best_rate(fn, work: float, *, sync, rounds: int = 3, calls: int = 10) -> float:
    """The best of ``rounds`` rates of ``work`` units per second over ``calls`` calls of ``fn``
    (three untimed calls first; ``sync`` waits for the device)."""
    for _ in range(3):
        fn()
    sync()
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = max(best, work * calls / (time.perf_counter() - start))
    return best


def machine(*, matmul_size: int) -> dict:
    """What this runs on, measured now with PyTorch: the GPU torch sees (or none), the driver
    and CUDA versions, the CPU, the bfloat16 matmul peak (FLOP/s of ``[n, n] @ [n, n]``,
    ``n = matmul_size``) and the device-to-device copy rate (bytes read and written per second)."""
    import torch

    cpu_name, _ = side_by_side.cpu()
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpu": None,
    }
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_memory_gib=props.total_memory / 2**30,
            multiprocessors=props.multi_processor_count,
            **nvidia_smi(),
        )
    n = matmul_size
    info["matmul_peak_flops"] = matmul_rate(torch, n, device=device, sync=sync)
    info["matmul_shape"] = f"[{n}, {n}] @ [{n}, {n}], bfloat16"
    info["copy_bytes_per_s"] = copy_rate(torch, (1 << 30) if device == "cuda" else (1 << 26), device=device, sync=sync)
    return info


def matmul_rate(torch, n: int, *, device: str, sync) -> float:
    """FLOP/s of ``[n, n] @ [n, n]`` in bfloat16 on random data (:func:`best_rate`)."""
    a, b, product = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(3))
    return best_rate(lambda: torch.matmul(a, b, out=product), 2.0 * n**3, sync=sync)


def copy_rate(torch, size: int, *, device: str, sync) -> float:
    """Bytes read and written per second by a copy of ``size`` bytes on ``device``."""
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return best_rate(lambda: target.copy_(source), 2.0 * size, sync=sync)


# --- Running the stages --------------------------------------------------------------------------


def child_environment(*, dry_run: bool) -> dict[str, str]:
    """What every stage's process gets over this one's environment: the repository on
    ``PYTHONPATH`` (no install needed), everything offline, unbuffered output."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        "PYTHONPATH": path,
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    return env if dry_run else {**env, "JAX_PLATFORMS": "cuda"}


def jax_environment(*, dry_run: bool) -> dict[str, str]:
    """The JAX stages' allocator setting (empty on a dry run): a value already set wins."""
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    return {} if dry_run else {"XLA_PYTHON_CLIENT_MEM_FRACTION": fraction}


def imports_trl(python: str, env: dict[str, str]) -> bool:
    """Whether ``python``, with ``env``, finds ``trl`` (without importing it)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('trl') is None)"
    return subprocess.run([python, "-c", probe], env={**os.environ, **env}, capture_output=True).returncode == 0


def run(args: argparse.Namespace) -> dict:
    """Runs the stages within the budget, rewriting the report after each; returns it."""
    shape = "tiny" if args.dry_run else "gpu"
    budget = args.budget_s or (900.0 if args.dry_run else 450.0)
    env = child_environment(dry_run=args.dry_run)
    jax_env = jax_environment(dry_run=args.dry_run)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "dry_run": args.dry_run,
        "shape": shape,
        "budget_s": budget,
        "command": [pathlib.Path(sys.executable).name, *sys.argv],
        "environment": jax_env,
        "machine": None,
        "stages": {},
        "runs": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    caches: dict[str, pathlib.Path] = {}
    deadline = time.monotonic() + budget
    with open(args.out / f"{NAME}.log", "w") as log:
        try:
            for stage in stages(
                shape=shape,
                repeats=args.repeats,
                stacked=args.stacked,
                profile=args.profile,
                micro_batches=args.micro_batches,
                matmul_size=args.matmul_size or (512 if args.dry_run else 8192),
            ):
                report["stages"][stage.name] = status = run_stage(
                    stage, report, args=args, env=env, jax_env=jax_env, caches=caches, deadline=deadline, log=log
                )
                print(f"[{time.strftime('%H:%M:%S')}] {stage.name}: {status['status']} {status['note']}", flush=True)
                (args.out / f"{NAME}.json").write_text(json.dumps(report, indent=1) + "\n")
        finally:
            for cache in caches.values():
                shutil.rmtree(cache, ignore_errors=True)
    return report


def run_stage(
    stage: Stage, report: dict, *, args, env: dict, jax_env: dict, caches: dict, deadline: float, log
) -> dict:
    """Runs ``stage`` (its JSON line into ``report``), or skips it; its status."""
    left, machine_seen = deadline - time.monotonic(), report["machine"]
    skip = None
    if args.only and stage.name not in args.only:
        skip = "not in --only"
    elif left < MIN_STAGE_S:
        skip = f"{max(left, 0):.0f} s of the budget left"
    elif stage.library == "trl" and not imports_trl(args.python_trl, env):
        skip = f"{args.python_trl} cannot import trl (make gpu-wheels, then the install line)"
    elif stage.library == "trl" and not args.dry_run and machine_seen is not None and machine_seen["gpu"] is None:
        skip = "torch sees no GPU"
    if skip:
        return {"status": "skipped", "seconds": 0.0, "note": skip}
    timeout = min(stage.cap_s, left)
    print(f"\n=== [{time.strftime('%H:%M:%S')}] {stage.name} (timeout {timeout:.0f} s)", file=log, flush=True)
    if stage.cache is not None and stage.cache not in caches:
        caches[stage.cache] = pathlib.Path(tempfile.mkdtemp(prefix=f"jaxrl-llm-{stage.cache}-cache-"))
    started = time.monotonic()
    flags = list(stage.flags)
    if stage.profile:
        trace_dir = tempfile.mkdtemp(prefix="jaxrl-llm-trace-")
        flags += ["--profile", trace_dir]
    try:
        if stage.library == "machine":
            command = [args.python_trl, str(pathlib.Path(__file__).resolve()), *stage.flags]
            result = side_by_side.run_json(stage.name, command, env={**os.environ, **env}, timeout=timeout, log=log)
            report["machine"] = result
        else:
            result = side_by_side.run_script(
                stage.library,
                flags,
                caches.get(stage.cache),
                python=pathlib.Path(args.python_trl if stage.library == "trl" else sys.executable),
                timeout=timeout,
                env={**env, **(jax_env if stage.library == "jaxrl_llm" else {})},
                log=log,
            )
            report["runs"][stage.name] = result
    except side_by_side.ScriptFailed as failed:
        note = f"{failed.reason}: {failed.last_line[:200]}" if failed.last_line else failed.reason
        return {"status": "failed", "seconds": time.monotonic() - started, "note": note}
    finally:
        if stage.profile:
            shutil.rmtree(trace_dir, ignore_errors=True)
    return {"status": "ok", "seconds": time.monotonic() - started, "note": ""}


# --- The report -----------------------------------------------------------------------------------


def results(report: dict) -> dict[str, dict]:
    """Each column's result from the stages that finished: a JAX library's cold and warm
    processes pooled (``side_by_side.pool``), or the one that finished (a warm one alone
    counts no cold first step)."""
    found = {}
    for column, (cold_stage, warm_stage) in ROWS.items():
        cold, warm = report["runs"].get(cold_stage), report["runs"].get(warm_stage) if warm_stage else None
        if cold is not None:
            found[column] = side_by_side.pool(cold, warm)
        elif warm is not None:
            found[column] = dict(
                warm,
                first_step_s=None,
                to_first_step_s=None,
                warm_first_step_s=warm["first_step_s"],
                warm_to_first_step_s=warm["to_first_step_s"],
            )
    return found


def update_flops(result: dict) -> float:
    """Model FLOPs of ``result``'s update (``grpo_step.step_flops``; this imports JAX, so it
    runs after every stage)."""
    from grpo_step import step_flops

    return step_flops(
        side_by_side.model_config(result["shape"], result["layers"]),
        prompts=result["prompts"],
        group=result["group"],
        prompt_len=result["prompt_len"],
        new_tokens=result["new_tokens"],
    )["update"]


def metrics(result: dict, *, flops: float | None, peak: float | None) -> dict:
    """The table's numbers of one column: phase medians (s), decode time per token step (ms),
    rollout tokens/s, update FLOP/s and its share of ``peak``, first steps, memory."""
    median = {phase: result["phases"][phase]["median_s"] for phase in PHASES}
    update_rate = flops / median["update"] if flops else None
    return {
        "timed_steps": len(result["phases"]["step"]["all_s"]),
        **{f"{phase}_s": seconds for phase, seconds in median.items()},
        "decode_ms": 1000 * median["rollout"] / result["new_tokens"],
        "tokens_per_s": result["prompts"]
        * result["group"]
        * result.get("completion_length", result["new_tokens"])
        / median["rollout"],
        "update_tflops": update_rate / 1e12 if update_rate else None,
        "update_peak_share": update_rate / peak if update_rate and peak else None,
        **{k: result.get(k) for k in ("first_step_s", "warm_first_step_s", "to_first_step_s", "warm_to_first_step_s")},
        "peak_device_gb": result.get("peak_device_gb"),
        "peak_rss_gb": result["peak_rss_gb"],
    }


def cell(value: float | None, unit: str = "", digits: int | None = 2) -> str:
    """``value`` with ``digits`` decimals (``None``: 3 significant digits) and ``unit``; ``-`` for none."""
    if value is None:
        return "-"
    return f"{value:.3g}{unit}" if digits is None else f"{value:,.{digits}f}{unit}"


def ratio(numerator, denominator) -> str:
    return f"{numerator / denominator:.2f}x" if numerator is not None and denominator else "-"


TABLE = (  # label, metric, unit, digits
    ("steady step (median)", "step_s", " s", 3),
    ("rollout (generation and rewards)", "rollout_s", " s", 3),
    ("log-probs (reference pass)", "logprobs_s", " s", 3),
    ("update (forward, backward, AdamW)", "update_s", " s", 3),
    ("decode, per token step of all rows", "decode_ms", " ms", 2),
    ("rollout tokens/s", "tokens_per_s", "", 0),
    ("update, model TFLOP/s", "update_tflops", "", None),
    ("first step (compilation), cold cache", "first_step_s", " s", 1),
    ("first step, warm compilation cache", "warm_first_step_s", " s", 1),
    ("process start to end of first step, cold", "to_first_step_s", " s", 1),
    ("process start to end of first step, warm", "warm_to_first_step_s", " s", 1),
    ("peak device memory", "peak_device_gb", " GB", 1),
    ("peak host RSS", "peak_rss_gb", " GB", 1),
)


def markdown(report: dict) -> str:
    """The report as a Markdown page: the work, the machine, the versions, the table and the
    stages' status."""
    found, columns = report["results"], report["metrics"]
    title = "GRPO step side by side on one GPU" if not report["dry_run"] else "Dry run on the CPU (tiny shape)"
    lines = [f"# {title}, {report['date']}", ""]
    if report["dry_run"]:
        lines += ["A check of the pipeline at the `tiny` shape on the CPU, not a measurement of a GPU.", ""]
    if found:
        first = next(iter(found.values()))
        trl = found.get("TRL", {})
        lines += [
            f"Work: `{report['shape']}` shape, {first['params'] / 1e6:.1f}M params ({first['layers']} layers), random "
            f"weights; {first['prompts']} prompts x {first['group']} completions, prompt {first['prompt_len']}, "
            f"completion {first['new_tokens']}; GRPO, beta 0.04; "
            f"{step_report.PRECISIONS[first.get('precision', 'float32')]}. jaxrl_llm: `training.train` with its "
            f"defaults; TRL: `GRPOTrainer`, plain `generate`"
            + (f", micro-batches of {trl['micro_batch']}" if "micro_batch" in trl else "")
            + ".",
            "",
        ]
    m = report.get("machine")
    if m:
        gpu = (
            f"{m['gpu']} ({m['gpu_memory_gib']:.1f} GiB, {m['multiprocessors']} multiprocessors), driver "
            f"{m.get('driver', '?')}, CUDA {m.get('cuda_driver', '?')} (driver)"
            if m["gpu"]
            else "no GPU (torch sees none)"
        )
        lines += [
            f"Machine: {gpu}; {m['cpu']}, {m['cores']} cores. bf16 matmul peak "
            f"{m['matmul_peak_flops'] / 1e12:.3g} TFLOP/s ({m['matmul_shape']}, torch), device copy "
            f"{m['copy_bytes_per_s'] / 1e12:.3g} TB/s (read + write).",
            "",
        ]
    versions = {}  # by library: the stacked column's are jaxrl_llm's
    for result in found.values():
        named = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
        backend = " ".join((result.get("platform_version") or "").split())
        if backend not in ("", "cpu"):
            named += f" (JAX's backend: {backend})"
        versions.setdefault(result["library"], named)
    if versions:
        lines += ["Versions: " + "; ".join(f"{library}: {named}" for library, named in versions.items()) + ".", ""]
    if report.get("flops_error"):
        lines += [report["flops_error"], ""]
    if report.get("environment"):
        lines += ["JAX processes: " + ", ".join(f"`{k}={v}`" for k, v in report["environment"].items()) + ".", ""]
    if found:
        names = list(found)
        header = names + (["TRL / jaxrl_llm"] if {"TRL", "jaxrl_llm"} <= set(found) else [])
        stacked = {"jaxrl_llm, stacked layers", "jaxrl_llm"} <= set(found)
        header += ["stacked / unrolled"] if stacked else []
        lines += ["| | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
        for label, key, unit, digits in TABLE:
            values = {name: columns[name][key] for name in names}
            cells = [cell(values[name], unit, digits) for name in names]
            if key == "step_s":
                cells = [f"{c} ({columns[n]['timed_steps']} steps)" for c, n in zip(cells, names)]
            if key == "update_tflops":
                cells = [
                    c if columns[n]["update_peak_share"] is None else f"{c} ({columns[n]['update_peak_share']:.0%})"
                    for c, n in zip(cells, names)
                ]
                label = label + (" (% of the bf16 peak)" if m else "")
            if key == "decode_ms":
                label = f"decode, per token step of {first['prompts'] * first['group']} rows"
            if "TRL / jaxrl_llm" in header:
                cells.append(ratio(values["TRL"], values["jaxrl_llm"]))
            if stacked:
                cells.append(ratio(values["jaxrl_llm, stacked layers"], values["jaxrl_llm"]))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    traced = report["runs"].get(PROFILE, {}).get("profile")
    if traced:
        lines += [
            f"## Where jaxrl_llm's steady steps spend their time ({PROFILE}: "
            f"{report['runs'][PROFILE]['repeats']} steps traced, `train_step.py --profile`)",
            "",
            trace_summary.markdown(traced, title="Own time by op"),
            "",
        ]
    lines += ["| stage | status | seconds | note |", "|---|---|---|---|"]
    for name, status in report["stages"].items():
        note = status["note"].replace("|", "\\|")
        lines.append(f"| {name} | {status['status']} | {status['seconds']:.0f} | {note} |")
    return "\n".join(lines) + "\n"


def write(report: dict, out: pathlib.Path) -> dict:
    """Derives each column (:func:`results`, :func:`metrics`), writes the JSON and the table
    into ``out``, prints the table; returns the report."""
    peak = (report.get("machine") or {}).get("matmul_peak_flops")
    report["results"] = results(report)
    try:
        flops = {column: update_flops(result) for column, result in report["results"].items()}
    except Exception as error:  # noqa: BLE001 -- the table is still written, without the FLOP rates
        flops, report["flops_error"] = {}, f"no FLOP counts here: {error!r}"
    report["metrics"] = {
        column: metrics(result, flops=flops.get(column), peak=peak) for column, result in report["results"].items()
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{NAME}.md").write_text(page := markdown(report))
    print(page, flush=True)
    return report


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results", help="where the three files go")
    parser.add_argument("--budget-s", type=float, default=None, help="for all stages (default 450; dry run 900)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per cold process and TRL's (warm: half)")
    parser.add_argument(
        "--stacked", action=argparse.BooleanOptionalAction, default=True, help="also the stacked layers' layout"
    )
    parser.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"last, '{PROFILE}': two steady steps traced, the time by op",
    )
    parser.add_argument(
        "--micro-batches",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="last, 'micro-batched': the update in two micro-batches, as TRL's, for its memory",
    )
    parser.add_argument("--only", type=lambda names: set(names.split(",")), default=None,
                        help="run only these stages (comma-separated names, e.g. 'jaxrl_llm profile')")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="the stages on the CPU at the tiny shape")
    parser.add_argument("--python-trl", default=sys.executable, help="the interpreter of TRL and the machine stage")
    parser.add_argument("--matmul-size", type=int, default=None, help="n of the n^3 peak (default 8192; dry run 512)")
    parser.add_argument("--machine", action="store_true", help="only print the machine's description as JSON")
    parser.add_argument("--report", type=pathlib.Path, help="write the table of this JSON report again")
    args = parser.parse_args(argv)
    if args.repeats < 1 or (args.budget_s is not None and args.budget_s <= 0):
        parser.error("--repeats must be >= 1 and --budget-s > 0")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    if args.machine:
        print(json.dumps(machine(matmul_size=args.matmul_size or 8192)))
        return {}
    if args.report is not None:
        return write(json.loads(args.report.read_text()), args.out)
    return write(run(args), args.out)


if __name__ == "__main__":
    main()
