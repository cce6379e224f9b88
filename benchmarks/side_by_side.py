r"""jaxrl_llm's GRPO step against TRL's and Tunix's, in one run on one machine: a Markdown
table, a JSON file and a scaling plot (``make bench`` runs it last).

Each library runs as its users run it, in its own virtual environment, one process per
measurement, one after the other (never two at once):

* ``jaxrl_llm``: ``train_step.py``, :func:`jaxrl_llm.training.train` with its defaults;
* ``trl``: ``trl_grpo_step.py`` (``.venv-trl``: TRL 1.16's ``GRPOTrainer``, plain ``generate``);
* ``tunix``: ``tunix_grpo_step.py`` (``.venv-tunix``: google-tunix 0.1.7's ``GRPOLearner``).

The three scripts do the same work (their docstrings say where the libraries' own choices
differ) and end with one JSON line, which this collects. For the JAX libraries each
measurement runs twice with one fresh persistent compilation cache: the first process
starts cold (its first step compiles), the second finds the cache warm; the step medians
pool both (the "first step" column is the cold one's). TRL compiles nothing. jaxrl_llm
caches every program it compiles (``jaxrl_llm.compilation_cache``), Tunix only those
that take JAX's default 1 s, as each library's users get them.

Per shape (``tiny``, ``qwen05b``; see ``train_step.py``) the table gives each library's
median step and its rollout / log-probs / update split, the first step and the time from
the process's start to its end (cold and warm), the peak resident memory, and each
peer's time over jaxrl_llm's. Under it, the machine's float32 matmul peak and memory read
bandwidth, measured in the same run, and against them each library's update MFU (the
update's model FLOPs, ``grpo_step.step_flops``, over its time at the peak) and its
decoding's weight stream (the rollout reads every weight once per decode step: the bytes
of the weights decoding reads, all but an untied input embedding, times the library's
decode steps over the rollout's time, as a share of the bandwidth; a lower bound on the
rate, since the prefill and the rewards are in the rollout's time too).

``--scaling`` adds the step time against completion length (64, 128, 256, 512; group 4)
and group size (2, 4, 8, 16; completion 64) at ``qwen05b``'s width with ``--scaling-layers``
layers, for jaxrl_llm and ``--scaling-peer``: a table and ``scaling.png``.

    python benchmarks/side_by_side.py [--shapes tiny,qwen05b] [--libraries jaxrl_llm,trl,tunix]
                                      [--repeats 3] [--scaling] [--out benchmarks/results]

Outputs (in ``--out``): ``side_by_side.md``, ``side_by_side.json`` and, with ``--scaling``,
``scaling.png``; ``--report side_by_side.json`` writes the table and plot of a finished
run again, without running anything. A library whose environment is missing stops the run with the command
that builds it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np

# This process imports no JAX and allocates little while it runs the libraries: Linux
# carries a parent's peak RSS into the ``ru_maxrss`` of the processes it starts.

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
LIBRARIES = {  # name -> (script, interpreter, how to build its environment)
    "jaxrl_llm": ("train_step.py", pathlib.Path(sys.executable), "make install"),
    "trl": (
        "trl_grpo_step.py",
        ROOT / os.environ.get("TRL_VENV", ".venv-trl") / "bin" / "python",
        "make .venv-trl/.installed",
    ),
    "tunix": (
        "tunix_grpo_step.py",
        ROOT / os.environ.get("TUNIX_VENV", ".venv-tunix") / "bin" / "python",
        "make .venv-tunix/.installed",
    ),
}
SHAPES = ("tiny", "qwen05b")  # the CPU shapes of train_step.SHAPES (and the peers' scripts)
JAX_LIBRARIES = {"jaxrl_llm": "JAXRL_LLM_COMPILATION_CACHE", "tunix": "JAX_COMPILATION_CACHE_DIR"}
"""The libraries that compile with JAX -> the setting their users point its persistent cache with."""
SCALING = {"new_tokens": (64, 128, 256, 512), "group_size": (2, 4, 8, 16)}
PHASES = ("rollout", "logprobs", "update")


class ScriptFailed(SystemExit):
    """A script exited non-zero, ran past its timeout or printed no JSON line (``reason``);
    the message says which, with the end of its output (``last_line``: its last line)."""

    def __init__(self, name: str, reason: str, output: str):
        super().__init__(f"{name} failed ({reason}):\n{output}")
        self.reason = reason
        self.last_line = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "")


def run_json(name: str, command: list[str], *, env: dict[str, str], timeout: float | None = None, log=None) -> dict:
    """The JSON line that ends the output of ``command`` (run in ``benchmarks/`` with the
    environment ``env``; after ``timeout`` seconds it and every process it started are
    killed). Its output goes to the text file ``log`` if given; else the lines before the JSON
    go to stdout. Raises :class:`ScriptFailed` (naming ``name``)."""
    print("$", " ".join(command), file=log or sys.stdout, flush=True)
    pipe = subprocess.PIPE
    with subprocess.Popen(
        command, cwd=HERE, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
            failure = f"exit {process.returncode}" if process.returncode else None
        except subprocess.TimeoutExpired:  # the whole process group, compilers and workers too
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            failure = f"timed out after {timeout:.0f} s"
    lines = stdout.splitlines()
    if failure is None and not (lines and lines[-1].startswith("{")):
        failure = "no JSON line at the end of its output"
    if log is not None:
        print(stdout, stderr, sep="\n", file=log, flush=True)
    if failure is not None:
        raise ScriptFailed(name, failure, f"{stdout[-3000:]}\n{stderr[-5000:]}")
    if log is None:
        print("\n".join(lines[:-1]), flush=True)
    return json.loads(lines[-1])


def run_script(
    library: str,
    flags: list[str],
    cache_dir: pathlib.Path | None,
    *,
    python: pathlib.Path | None = None,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    log=None,
) -> dict:
    """One process of ``library``'s script with ``flags``, run by ``python`` (default: the
    library's environment's), with ``env`` over this process's environment and ``cache_dir``
    as the persistent compilation cache; its JSON line (:func:`run_json`)."""
    script, default_python, _ = LIBRARIES[library]
    environment = dict(os.environ)
    environment.pop("XLA_FLAGS", None)  # each library with its own defaults
    if cache_dir is not None and library in JAX_LIBRARIES:
        # Each JAX library through the setting its users set. JAX_COMPILATION_CACHE_DIR would
        # also reach jaxrl_llm, which then keeps JAX's own 1 s threshold for what it writes (a
        # directory set in JAX is the user's), and its warm start would load only the update.
        environment.pop("JAX_COMPILATION_CACHE_DIR", None)
        environment[JAX_LIBRARIES[library]] = str(cache_dir)
    environment.update(env or {})
    command = [str(python or default_python), str(HERE / script), *flags]
    return run_json(library, command, env=environment, timeout=timeout, log=log)


def pool(cold: dict, warm: dict | None) -> dict:
    """A JAX library's result from a cold and a warm process that shared one compilation
    cache: the cold one's, with the timed steps of both pooled and the warm one's first step
    and peak memory beside the cold one's (the cold one's alone without ``warm``)."""
    pooled = copy.deepcopy(cold)
    if warm is None:
        return pooled
    for phase, timing in pooled["phases"].items():
        timing["all_s"] += warm["phases"][phase]["all_s"]
        timing["median_s"], timing["min_s"] = float(np.median(timing["all_s"])), min(timing["all_s"])
    pooled.update(
        repeats=len(pooled["phases"]["step"]["all_s"]),
        step_median_s=pooled["phases"]["step"]["median_s"],
        step_min_s=pooled["phases"]["step"]["min_s"],
        warm_first_step_s=warm["first_step_s"],
        warm_to_first_step_s=warm["to_first_step_s"],
        peak_rss_gb=max(cold["peak_rss_gb"], warm["peak_rss_gb"]),
    )
    if cold.get("peak_device_gb") is not None and warm.get("peak_device_gb") is not None:
        pooled["peak_device_gb"] = max(cold["peak_device_gb"], warm["peak_device_gb"])
    return pooled


def measure(library: str, flags: list[str], *, repeats: int) -> dict:
    """``library``'s result for ``flags``: for a JAX library a cold and a warm process
    sharing a fresh compilation cache, pooled; for TRL one process."""
    if library not in JAX_LIBRARIES:
        return run_script(library, [*flags, "--repeats", str(repeats)], None)
    cache_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"{library}-xla-cache-"))
    try:
        cold = run_script(library, [*flags, "--repeats", str(repeats)], cache_dir)
        warm = run_script(library, [*flags, "--repeats", str(max(1, repeats // 2))], cache_dir)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return pool(cold, warm)


def read_bandwidth() -> float:
    """Bytes per second of reading a 1 GiB float32 array once (a sum), the best of XLA's
    and NumPy's."""
    import jax
    import jax.numpy as jnp
    from timing import median_seconds

    array = jnp.ones((1 << 28,), jnp.float32)
    seconds = median_seconds(jax.jit(jnp.sum), array, repeats=5)
    host = np.ones((1 << 28,), np.float32)
    host_seconds = median_seconds(np.sum, host, repeats=5)
    return array.nbytes / min(seconds, host_seconds)


def cpu() -> tuple[str, str]:
    """This machine's CPU model and its feature flags (Linux's ``/proc/cpuinfo``; elsewhere
    what ``platform`` knows and no flags)."""
    name, flags = platform.processor() or platform.machine(), ""
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
        name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        flags = next(line.split(":", 1)[1] for line in info.splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    return name, flags


def machine() -> dict:
    """What this ran on, measured now: CPU, cores, memory, float32 matmul peak, read bandwidth."""
    cpu_name, flags = cpu()
    from grpo_step import matmul_peak_flops
    from layer_scan import qwen25_05b

    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    peak, peak_shape = matmul_peak_flops(qwen25_05b(), 768)
    return {
        "cpu": cpu_name,
        "avx512": "avx512f" in flags.split(),
        "cores": os.cpu_count(),
        "memory_gb": memory_gb,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "matmul_peak_flops": peak,
        "matmul_peak_shape": peak_shape,
        "read_bandwidth_bytes_per_s": read_bandwidth(),
    }


def measure_machine() -> dict:
    """:func:`machine` in a process of its own: its gigabyte arrays would otherwise count
    in every later process's peak RSS (Linux carries ``ru_maxrss`` across ``fork`` and
    ``exec``)."""
    return run_json("machine", [sys.executable, str(HERE / "side_by_side.py"), "--machine"], env=dict(os.environ))


def model_config(shape: str, layers: int):
    from train_step import SHAPES as CONFIGS

    return dataclasses.replace(CONFIGS[shape]["config"](), num_layers=layers)


def derived(result: dict, peak: float, bandwidth: float) -> dict:
    """The update's MFU and the decoding's weight stream of one library's result."""
    from grpo_step import step_flops

    config = model_config(result["shape"], result["layers"])
    flops = step_flops(
        config,
        prompts=result["prompts"],
        group=result["group"],
        prompt_len=result["prompt_len"],
        new_tokens=result["new_tokens"],
    )
    streamed = result["params"] - (0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size)
    weight_bytes = 4 * streamed  # float32; an untied input embedding is only gathered from
    decode_steps = result.get("decode_steps", result["new_tokens"] - 1)  # the prefill draws the first token
    rollout_s, update_s = result["phases"]["rollout"]["median_s"], result["phases"]["update"]["median_s"]
    return {
        "update_model_flops": flops["update"],
        "update_mfu": flops["update"] / (update_s * peak),
        "step_flop_floor_s": sum(flops.values()) / peak,
        "decode_weight_stream_bytes_per_s": weight_bytes * decode_steps / rollout_s,
        "decode_bandwidth_share": weight_bytes * decode_steps / rollout_s / bandwidth,
    }


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"# Side by side: GRPO step, {report['date']}",
        "",
        f"Machine: {m['cpu']} ({m['cores']} cores{', AVX-512' if m['avx512'] else ''}), "
        f"{m['memory_gb']:.0f} GB, {m['platform']}; float32 matmul peak "
        f"{m['matmul_peak_flops'] / 1e9:.0f} GFLOP/s ({m['matmul_peak_shape']}), memory read "
        f"{m['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s. Versions: "
        + "; ".join(
            f"{lib}: " + ", ".join(f"{k} {v}" for k, v in versions.items())
            for lib, versions in report["versions"].items()
        )
        + ".",
        "",
    ]
    for shape, results in report["shapes"].items():
        first = next(iter(results.values()))
        lines += [
            f"## {shape}: {first['prompts']} prompts x {first['group']} completions, prompt "
            f"{first['prompt_len']}, completion {first['new_tokens']}, {first['layers']} layers, "
            f"{first['params'] / 1e6:.1f}M params",
            "",
            "| library | step (median) | rollout / log-probs / update | x jaxrl_llm | first step (cold) | "
            "from start (cold / warm) | peak RSS | update MFU | decode weight stream |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        ours = results.get("jaxrl_llm", {}).get("step_median_s")
        for library, r in results.items():
            split = " / ".join(f"{r['phases'][p]['median_s']:.2f}" for p in PHASES)
            ratio = f"{r['step_median_s'] / ours:.2f}x" if ours else "-"
            warm = f" / {r['warm_to_first_step_s']:.1f} s" if "warm_to_first_step_s" in r else ""
            lines.append(
                f"| {library} | {r['step_median_s']:.3f} s | {split} | {ratio} | {r['first_step_s']:.1f} s "
                f"| {r['to_first_step_s']:.1f} s{warm} | {r['peak_rss_gb']:.2f} GB | "
                f"{r['update_mfu']:.0%} | {r['decode_bandwidth_share']:.0%} of bandwidth |"
            )
        lines.append("")
    if report.get("scaling"):
        lines += scaling_markdown(report["scaling"])
    return "\n".join(lines) + "\n"


def scaling_markdown(scaling: dict) -> list[str]:
    lines = [f"## Scaling at qwen05b's width, {scaling['layers']} layers (step median, s)", ""]
    for axis, values in SCALING.items():
        libraries = list(scaling["results"])
        lines += [
            f"| {axis} | "
            + " | ".join(libraries)
            + " | "
            + " | ".join(f"{peer} / jaxrl_llm" for peer in libraries[1:])
            + " |",
            "|---" * (2 * len(libraries)) + "|",
        ]
        for value in values:
            times = [scaling["results"][lib][axis][str(value)]["step_median_s"] for lib in libraries]
            lines.append(
                f"| {value} | "
                + " | ".join(f"{t:.3f}" for t in times)
                + " | "
                + " | ".join(f"{t / times[0]:.2f}x" for t in times[1:])
                + " |"
            )
        lines.append("")
    return lines


def plot_scaling(scaling: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(SCALING), figsize=(10, 4))
    for ax, (axis, values) in zip(axes, SCALING.items()):
        for library, by_axis in scaling["results"].items():
            ax.plot(values, [by_axis[axis][str(v)]["step_median_s"] for v in values], marker="o", label=library)
        ax.set_xscale("log", base=2)
        ax.set_xticks(values, [str(v) for v in values])
        ax.set_xlabel({"new_tokens": "completion tokens (group 4)", "group_size": "group size (completion 64)"}[axis])
        ax.set_ylabel("step time (s)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    figure.suptitle(f"GRPO step at Qwen2.5-0.5B's width, {scaling['layers']} layers, 2 prompts")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--libraries", default=",".join(LIBRARIES), help=f"comma-separated, of {', '.join(LIBRARIES)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per cold process (half in the warm one)")
    parser.add_argument("--scaling", action="store_true", help="also the completion-length and group-size curves")
    parser.add_argument("--scaling-layers", type=int, default=2)
    parser.add_argument("--scaling-peer", default="tunix", choices=[lib for lib in LIBRARIES if lib != "jaxrl_llm"])
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    parser.add_argument("--machine", action="store_true", help="only print the machine's description as JSON")
    parser.add_argument("--report", type=pathlib.Path, help="write the table and plot of this JSON report again")
    args = parser.parse_args(argv)
    if args.machine:
        print(json.dumps(machine()))
        return {}
    if args.report is not None:
        return write(json.loads(args.report.read_text()), args.out)
    shapes, libraries = args.shapes.split(","), args.libraries.split(",")
    if bad := [s for s in shapes if s not in SHAPES]:
        parser.error(f"--shapes: unknown {bad}; choose from {', '.join(SHAPES)}")
    if bad := [lib for lib in libraries if lib not in LIBRARIES]:
        parser.error(f"--libraries: unknown {bad}; choose from {', '.join(LIBRARIES)}")
    if args.repeats < 1 or args.scaling_layers < 1:
        parser.error("--repeats and --scaling-layers must be >= 1")
    needed = set(libraries) | ({"jaxrl_llm", args.scaling_peer} if args.scaling else set())
    if missing := [f"{lib}: {LIBRARIES[lib][2]}" for lib in needed if not LIBRARIES[lib][1].exists()]:
        parser.error("missing environments; build them first: " + "; ".join(missing))

    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": measure_machine(),
        "versions": {},
        "shapes": {},
    }
    for shape in shapes:
        report["shapes"][shape] = {}
        for library in libraries:
            result = measure(library, ["--shape", shape], repeats=args.repeats)
            report["shapes"][shape][library] = result
            report["versions"][library] = result["versions"]
    if args.scaling:
        results = {}
        for library in ("jaxrl_llm", args.scaling_peer):
            results[library] = {axis: {} for axis in SCALING}
            for axis, values in SCALING.items():
                for value in values:
                    flags = [
                        "--shape",
                        "qwen05b",
                        "--layers",
                        str(args.scaling_layers),
                        f"--{axis.replace('_', '-')}",
                        str(value),
                    ]
                    results[library][axis][str(value)] = run_script(library, [*flags, "--repeats", "2"], None)
        report["scaling"] = {"layers": args.scaling_layers, "results": results}

    return write(report, args.out)


def write(report: dict, out: pathlib.Path) -> dict:
    """Derives each result's MFU and weight stream, writes the JSON, the table and the
    plot into ``out``, prints the table; returns the report."""
    peak, bandwidth = report["machine"]["matmul_peak_flops"], report["machine"]["read_bandwidth_bytes_per_s"]
    for results in report["shapes"].values():  # now that every library has run (this imports JAX)
        for result in results.values():
            result.update(derived(result, peak, bandwidth))
    out.mkdir(parents=True, exist_ok=True)
    (out / "side_by_side.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "side_by_side.md").write_text(markdown(report))
    if report.get("scaling"):
        plot_scaling(report["scaling"], out / "scaling.png")
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
