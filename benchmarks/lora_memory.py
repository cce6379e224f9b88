r"""GRPO's memory with LoRA against full training, at Qwen2.5 shapes: the train state, the
compiled update, a measured run, and TRL+PEFT beside it.

Four parts (``--parts``), each printed as a Markdown table:

* ``state`` (nothing allocated): the bytes of the GRPO train state (beta 0.04, so a
  reference) at the Qwen2.5-0.5B, 1.5B, 7B and 14B shapes, from
  ``jax.eval_shape(training.init_state, ...)``: **full** training of bfloat16 params
  (the params, AdamW's two float32 moments and float32 master copy,
  :func:`jaxrl_llm.training.optim.in_float32`, and the reference: in ``train`` the
  caller's params themselves, a params-sized buffer either way) against **LoRA** rank 16
  on all seven linear layers (``models.LoraConfig(rank=16, alpha=32)``): the bfloat16
  base (``fixed.base``), float32 adapters, their moments, and the reference (adapters of
  zeros: the base itself, no copy of its weights).
  The same LoRA state over an int8 base (``model.quantization="int8"``: the seven
  projections a byte per weight with a float32 scale per output channel,
  :mod:`jaxrl_llm.models.quantize`; embeddings and output layer in bfloat16).
* ``compiled`` (nothing run): ``memory_analysis()`` of the update ``training.train``
  compiles (``make_train_step``'s ``update``, the state donated, the fixed params (reference
  and base) passed beside it), lowered on abstract arguments of a batch of
  2 prompts x 4 completions, each row 512 tokens (prompt 256 + completion 256), with
  ``remat="full"`` and ``scan_layers=True`` (stacked layers), bfloat16 compute,
  on XLA's CPU backend: argument, output, aliased (donated) and temporary bytes, and the
  peak they imply, argument + output - alias + temp. Also ``score`` (the policy's and the
  reference's log-probs), the other program of a step.
* ``run``: GRPO through ``training.train`` as a user calls it, at the 0.5B shape with
  random weights (``models.init``), bfloat16 params and compute, 2 prompts x 2
  completions, prompt 32, completion 32, ``TrainConfig``'s defaults otherwise (learning rate
  1e-6): full training against LoRA r16. One process per measurement (this script run
  again with ``--one``): its peak resident memory (``VmHWM`` of ``/proc/self/status``,
  read at its end) and the median step time after the first (compilation).
* ``trl``: the same work in TRL's ``GRPOTrainer`` (``benchmarks/trl_lora_step.py`` in
  ``.venv-trl``, with ``peft``): ``peft_config=LoraConfig(r=16, lora_alpha=32,
  target_modules="all-linear")`` against full training, the model loaded in bfloat16.

    python benchmarks/lora_memory.py [--parts state,compiled,run,trl] [--shapes 0.5B,1.5B,7B,14B]
                                     [--compiled-shapes 7B,14B] [--repeats 2]

The ``compiled`` part at 7B and 14B lowers and compiles on the CPU (a few minutes each on
2 cores). ``$TRL_VENV`` names another TRL venv than ``.venv-trl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import state_memory
import step_report

from jaxrl_llm import algorithms, models, sampling, training

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
BF16 = jnp.bfloat16
QWEN = {  # the Qwen2.5 models' config.json numbers; 0.5B from state_memory
    "0.5B": state_memory.QWEN2_5_0_5B,
    "1.5B": dataclasses.replace(
        state_memory.QWEN2_5_0_5B,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
    ),
    "7B": dataclasses.replace(
        state_memory.QWEN2_5_0_5B,
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
    ),
    "14B": dataclasses.replace(
        state_memory.QWEN2_5_0_5B,
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=13824,
        num_layers=48,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}
LORA = models.LoraConfig(rank=16, alpha=32, targets="all-linear")
ALGORITHM = algorithms.GRPO  # kl_coef 0.04: the state keeps a reference
COLUMNS = ("base", "adapters", "optimizer", "reference", "other")
"""State columns: the trained (full) or frozen (LoRA) weights, LoRA's adapters, the
optimizer's state, the reference, and the rest (counters, PRNG key, running baseline)."""
COMPILED_BATCH = dict(prompts=2, group=4, prompt_len=256, new_tokens=256)  # 8 rows x 512 tokens
RUN_BATCH = dict(prompts=2, group=2, prompt_len=32, new_tokens=32)
GB = 1e9


def bfloat16(config: models.ModelConfig) -> models.ModelConfig:
    """``config`` with bfloat16 params and compute."""
    return dataclasses.replace(config, param_dtype=BF16, dtype=BF16)


def train_config(*, prompts: int, group: int, prompt_len: int, new_tokens: int) -> training.TrainConfig:
    return training.TrainConfig(
        num_prompts=prompts,
        group_size=group,
        sampling=sampling.SamplingConfig(max_new_tokens=new_tokens, max_prompt_length=prompt_len),
        optimizer=training.OptimizerConfig(learning_rate=1e-6),
    )


def lora_model_and_adapters(model: models.Model, lora: models.LoraConfig):
    """The LoRA model of ``model`` and its abstract adapters (``lora.adapted``,
    ``lora.abstract_adapters``): nothing allocated."""
    lora_model = models.lora.adapted(model, lora)
    return lora_model, models.lora.abstract_adapters(lora_model)


def abstract_state(
    config: models.ModelConfig, lora: models.LoraConfig | None, run: training.TrainConfig, **options
) -> tuple[models.Model, training.TrainState, training.FixedParams]:
    """The (LoRA) model, with execution ``options``, and ``jax.eval_shape`` of its GRPO state
    and fixed params at step 0, as ``train`` builds them (full: the reference is the caller's
    params, not a copy)."""
    model, params = models.abstract(dataclasses.replace(config, scan_layers=options.pop("scan_layers", False)))
    if options:
        model = models.with_options(model, **options)
    if lora is None:
        state = jax.eval_shape(lambda p: training.init_state(model, p, ALGORITHM, run), params)
        return model, state, jax.eval_shape(lambda p: training.fixed_params(p, ALGORITHM, run), params)
    lora_model, adapters = lora_model_and_adapters(model, lora)
    state = jax.eval_shape(lambda a: training.init_state(lora_model, a, ALGORITHM, run), adapters)
    fixed = jax.eval_shape(lambda a, base: training.fixed_params(a, ALGORITHM, run, base=base), adapters, params)
    return lora_model, state, fixed


def tree_bytes(tree) -> int:
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def layer_bytes(params) -> int:
    """Bytes of the decoder layers' leaves of ``params``."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return sum(math.prod(x.shape) * x.dtype.itemsize for path, x in leaves if "layers" in jax.tree_util.keystr(path))


def state_breakdown(state: training.TrainState, fixed: training.FixedParams) -> dict[str, int]:
    """Bytes of ``state`` and ``fixed`` by :data:`COLUMNS`, and their ``total``."""
    lora = fixed.base is not None
    parts = {
        "base": tree_bytes(fixed.base if lora else state.params),
        "adapters": tree_bytes(state.params) if lora else 0,
        "optimizer": tree_bytes(state.opt_state),
        "reference": tree_bytes(fixed.reference),
    }
    total = tree_bytes(state) + tree_bytes(fixed)
    parts["other"] = total - sum(parts.values())
    return {**parts, "total": total}


def state_rows(shapes: dict[str, models.ModelConfig]) -> list[dict]:
    """One row per (shape, full or LoRA): parameter counts and :func:`state_breakdown`."""
    run = train_config(**COMPILED_BATCH)
    rows = []
    for name, config in shapes.items():
        for lora, quantization in ((None, None), (LORA, None), (LORA, "int8")):
            _, state, fixed = abstract_state(dataclasses.replace(config, quantization=quantization), lora, run)
            weights = fixed.base if lora else state.params
            method = (
                "full" if lora is None else f"LoRA r{lora.rank}" + (f", {quantization} base" if quantization else "")
            )
            rows.append(
                dict(
                    shape=name,
                    method=method,
                    params=sum(math.prod(x.shape) for x in jax.tree.leaves(weights)),
                    trained=sum(math.prod(x.shape) for x in jax.tree.leaves(state.params)),
                    **state_breakdown(state, fixed),
                )
            )
    return rows


def compiled_rows(
    shapes: dict[str, models.ModelConfig], lora: models.LoraConfig | None = LORA, *, scans: tuple[bool, ...] = (True,)
) -> list[dict]:
    """``memory_analysis()`` of ``score`` and of the donating ``update`` that ``train``
    compiles, per shape and ``scan_layers`` of ``scans``, with ``remat="full"``, at
    :data:`COMPILED_BATCH`."""
    b = COMPILED_BATCH
    run = train_config(**b)
    rows = []
    for name, config in shapes.items():
        for scan in scans:
            model, state, fixed = abstract_state(config, lora, run, remat="full", scan_layers=scan)
            step = training.make_train_step(model, ALGORITHM, run, total_steps=1)
            rows_, i32 = b["prompts"] * b["group"], jnp.int32
            spec = jax.ShapeDtypeStruct
            batch = training.Batch(
                prompt_tokens=spec((b["prompts"], b["prompt_len"]), i32),
                prompt_mask=spec((b["prompts"], b["prompt_len"]), bool),
                completion_tokens=spec((rows_, b["new_tokens"]), i32),
                completion_mask=spec((rows_, b["new_tokens"]), bool),
                sampling_logp=spec((rows_, b["new_tokens"]), jnp.float32),
                rewards=spec((rows_,), jnp.float32),
                prompts_drawn=spec((), i32),
            )
            scored, _ = jax.eval_shape(step.score, state, fixed, batch)
            # What train compiles (loop._compile): update donating the state, the fixed params beside it.
            programs = {
                "score": (jax.jit(step.score), (state, fixed, batch)),
                "update": (jax.jit(step.update, donate_argnums=0), (state, fixed, scored)),
            }
            for program, (fn, args) in programs.items():
                started = time.perf_counter()
                compiled = fn.lower(*args).compile()
                seconds = time.perf_counter() - started
                m = compiled.memory_analysis()
                rows.append(
                    dict(
                        shape=name,
                        method="full" if lora is None else f"LoRA r{lora.rank}",
                        layers="scanned" if scan else "unrolled",
                        program=program,
                        argument=m.argument_size_in_bytes,
                        output=m.output_size_in_bytes,
                        alias=m.alias_size_in_bytes,
                        temp=m.temp_size_in_bytes,
                        peak=m.argument_size_in_bytes
                        + m.output_size_in_bytes
                        - m.alias_size_in_bytes
                        + m.temp_size_in_bytes,
                        compile_s=seconds,
                        layer_weights=layer_bytes(fixed.base if lora else state.params),
                    )
                )
                print(
                    f"  compiled {program} at {name} (scan_layers={scan}) in {seconds:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
    return rows


def vm_hwm_bytes() -> int:
    """This process's peak resident memory: ``VmHWM`` of ``/proc/self/status`` (kB)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_one(method: str, repeats: int) -> dict:
    """GRPO through ``training.train`` at the 0.5B shape, full or LoRA: its step times and
    this process's peak RSS (one JSON line)."""
    from train_step import WordParityTask

    config = bfloat16(QWEN["0.5B"])
    model, params = models.init(config, jax.random.key(0))
    run = train_config(**RUN_BATCH)
    task = WordParityTask(vocab_size=config.vocab_size, prompt_len=RUN_BATCH["prompt_len"])
    _, history = training.train(
        model, params, ALGORITHM, run, steps=1 + repeats, task=task, lora=LORA if method == "lora" else None
    )
    steps = [row["step_seconds"] for row in history]
    return dict(
        library="jaxrl_llm",
        method=method,
        first_step_s=steps[0],
        step_median_s=statistics.median(steps[1:]),
        steps_s=steps,
        peak_rss_bytes=vm_hwm_bytes(),
        versions=step_report.versions("jax", "jaxlib", "flax", "optax"),
    )


def subprocess_json(command: list[str]) -> dict:
    """Runs ``command`` (one measurement) and returns its last output line, a JSON object."""
    print("$", " ".join(command), file=sys.stderr, flush=True)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(command, cwd=HERE, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_rows(repeats: int) -> list[dict]:
    return [
        subprocess_json([sys.executable, str(HERE / "lora_memory.py"), "--one", method, "--repeats", str(repeats)])
        for method in ("full", "lora")
    ]


def trl_rows(repeats: int) -> list[dict] | str:
    """TRL's full and PEFT LoRA runs (``trl_lora_step.py``), or why they could not run."""
    python = ROOT / os.environ.get("TRL_VENV", ".venv-trl") / "bin" / "python"
    if not python.exists():
        return f"unmeasured: no {python} (build it: make .venv-trl/.installed, then pip install peft there)"
    return [
        subprocess_json([str(python), str(HERE / "trl_lora_step.py"), "--method", method, "--repeats", str(repeats)])
        for method in ("full", "lora")
    ]


def gb(n: int) -> str:
    return f"{n / GB:.2f}"


def print_state(rows: list[dict]) -> None:
    print(
        "\n### Train state, GRPO (beta 0.04: with a reference), bfloat16 base; GB = 1e9 bytes (jax.eval_shape of "
        "init_state, nothing allocated)\n"
    )
    print("| shape | method | params | trained | base | adapters | optimizer | reference | other | total GB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| Qwen2.5-{r['shape']} | {r['method']} | {r['params'] / 1e6:,.0f}M | {r['trained'] / 1e6:,.1f}M | "
            + " | ".join(gb(r[c]) for c in COLUMNS[:-1])
            + f" | {r['other']} B | {gb(r['total'])} |"
        )


def print_compiled(rows: list[dict]) -> None:
    b = COMPILED_BATCH
    print(
        f"\n### Compiled programs, LoRA r{LORA.rank} all-linear, bfloat16 base and compute, remat='full', "
        f"scan_layers=True; {b['prompts']} prompts x {b['group']} completions, prompt {b['prompt_len']} + "
        f"completion {b['new_tokens']} tokens; XLA CPU memory_analysis(), GB = 1e9 bytes\n"
    )
    print(
        "| shape | layers | program | arguments | outputs | aliased (donated) | temporaries | peak | "
        "layer weights | compile s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| Qwen2.5-{r['shape']} | {r['layers']} | {r['program']} | {gb(r['argument'])} | {gb(r['output'])} | "
            f"{gb(r['alias'])} | {gb(r['temp'])} | {gb(r['peak'])} | {gb(r['layer_weights'])} | {r['compile_s']:.0f} |"
        )
    print(
        "\npeak = arguments + outputs - aliased + temporaries. The layers are stored stacked and scanned; the "
        "frozen base is read one layer at a time inside the rematerialised scan body (XLA's CPU backend computes a "
        "bfloat16 matmul through a float32 copy of its weight: one layer's, not the base's). 24 GB = 24 GiB = "
        "25.77e9 bytes:"
    )
    for r in rows:
        if r["program"] == "update":
            verdict = "fits" if r["peak"] < 24 * 2**30 else "does not fit"
            print(
                f"- {r['shape']} {r['layers']} update: peak {r['peak'] / 2**30:.2f} GiB, {verdict} in 24 GiB "
                f"(headroom {(24 * 2**30 - r['peak']) / 2**30:.2f} GiB)"
            )


def print_runs(title: str, rows: list[dict] | str) -> None:
    b = RUN_BATCH
    print(
        f"\n### {title}: GRPO at the Qwen2.5-0.5B shape (random weights, bfloat16), {b['prompts']} prompts x "
        f"{b['group']} completions, prompt {b['prompt_len']}, completion {b['new_tokens']}\n"
    )
    if isinstance(rows, str):
        print(rows)
        return
    print("| library | method | peak RSS GB | step median s | first step s | steps timed | versions |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        versions = ", ".join(f"{k} {v}" for k, v in r["versions"].items())
        print(
            f"| {r['library']} | {r['method']} | {gb(r['peak_rss_bytes'])} | {r['step_median_s']:.2f} | "
            f"{r['first_step_s']:.1f} | {len(r['steps_s']) - 1} | {versions} |"
        )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="state,compiled,run,trl", help="comma-separated: state,compiled,run,trl")
    parser.add_argument("--shapes", default=",".join(QWEN), help=f"state part's shapes, of {', '.join(QWEN)}")
    parser.add_argument("--compiled-shapes", default="7B,14B", help="compiled part's shapes")
    parser.add_argument("--compiled-int8", default="14B", help="compiled part's shapes over an int8 base ('' for none)")
    parser.add_argument(
        "--unrolled", default="7B", help="compiled part: shapes also compiled with scan_layers=False ('' for none)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed steps after the first (run and trl parts)")
    parser.add_argument("--one", choices=("full", "lora"), help=argparse.SUPPRESS)  # one run part measurement
    args = parser.parse_args(argv)
    if args.one:
        result = run_one(args.one, args.repeats)
        print(json.dumps(result))
        return result
    parts = args.parts.split(",")
    if bad := [p for p in parts if p not in ("state", "compiled", "run", "trl")]:
        parser.error(f"--parts: unknown {bad}")
    pick = lambda names: {n: bfloat16(QWEN[n]) for n in names.split(",") if n}  # noqa: E731
    cpu = platform.processor() or platform.machine()
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    lib = step_report.versions("jax", "jaxlib", "flax", "optax")
    print(
        f"{datetime.date.today()}, {cpu}, {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB; "
        + ", ".join(f"{k} {v}" for k, v in lib.items())
    )
    report = {}
    if "state" in parts:
        report["state"] = state_rows(pick(args.shapes))
        print_state(report["state"])
    if "compiled" in parts:
        unrolled = [n for n in args.unrolled.split(",") if n]
        int8 = {
            f"{n} int8": dataclasses.replace(c, quantization="int8")
            for n, c in pick(args.compiled_int8).items()
            if args.compiled_int8
        }
        report["compiled"] = (
            compiled_rows(pick(args.compiled_shapes))
            + compiled_rows(int8)
            + compiled_rows(pick(",".join(unrolled)) if unrolled else {}, scans=(False,))
        )
        print_compiled(report["compiled"])
    if "run" in parts:
        report["run"] = run_rows(args.repeats)
        print_runs("jaxrl_llm, training.train", report["run"])
    if "trl" in parts:
        report["trl"] = trl_rows(args.repeats)
        print_runs("TRL GRPOTrainer, PEFT LoRA", report["trl"])
    return report


if __name__ == "__main__":
    main()
