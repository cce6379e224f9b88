"""The GRPO benchmark's FLOP counts against XLA's own count of the programs they describe.

``benchmarks/grpo_step.py`` divides its FLOP counts by the measured peak to get the floor
the speed target is judged on, so a wrong count would move the target. XLA's cost
analysis counts every operation of the lowered program; at these shapes the matmuls are
all but ~1% of it, so the two agree to a couple of percent when the count is right.
"""

import gzip
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import grpo_step as bench  # noqa: E402

from jaxrl_llm import models  # noqa: E402

BATCH = bench.PROMPTS * bench.GROUP
TOTAL = bench.PROMPT_LEN + bench.NEW_TOKENS


@pytest.fixture(scope="module")
def model_and_params():
    return models.init(bench.CONFIG, jax.random.key(0))


def xla_flops(fn, *args) -> float:
    return float(jax.jit(fn).lower(*args).cost_analysis()["flops"])


def teacher_forced_flops(model, params, *, group_size: int, backward: bool = False) -> float:
    tokens, mask = jnp.ones((BATCH, TOTAL), jnp.int32), jnp.ones((BATCH, TOTAL), bool)

    def logprobs(params):
        return models.completion_logprobs(model, params, tokens, mask, bench.NEW_TOKENS, group_size=group_size)

    if backward:
        return xla_flops(jax.grad(lambda params: jnp.sum(logprobs(params))), params)
    return xla_flops(logprobs, params)


def rollout_flops(model, params, *, prompts: int, cache_sizes: list[int]) -> float:
    """A prefill of ``prompts`` rows into a cache of ``cache_sizes[0]`` slots, then one
    decode step of all rows with each later cache size. A decode step's count is linear in
    its cache size (attention scores and values), so XLA counts the smallest and the
    largest, and a middle size checks the line."""
    prompt = jnp.ones((prompts, bench.PROMPT_LEN), jnp.int32)
    flops = xla_flops(
        lambda p: models.prefill(model, p, prompt, cache_size=cache_sizes[0], last_logits_only=True), params
    )

    def decode_flops(size: int) -> float:
        cache = models.init_cache(model, BATCH, size)._replace(index=jnp.asarray(size - 1, jnp.int32))
        return xla_flops(lambda p, c: models.decode_step(model, p, jnp.ones((BATCH,), jnp.int32), c), params, cache)

    sizes = cache_sizes[1:]
    low, high = min(sizes), max(sizes)
    at_low, at_high = decode_flops(low), decode_flops(high)
    slope = (at_high - at_low) / (high - low) if high > low else 0.0
    if high - low >= 2:
        middle = (low + high) // 2
        assert decode_flops(middle) == pytest.approx(at_low + slope * (middle - low), rel=1e-3)
    return flops + sum(at_low + slope * (size - low) for size in sizes)


def test_teacher_forced_counts_match_xla(model_and_params):
    model, params = model_and_params
    counted, executed = bench.step_flops(bench.CONFIG), bench.step_flops(bench.CONFIG, executed=True)
    assert counted["logprobs"] == pytest.approx(teacher_forced_flops(model, params, group_size=1), rel=0.02)
    assert executed["logprobs"] == pytest.approx(teacher_forced_flops(model, params, group_size=bench.GROUP), rel=0.02)
    # The update is forward + backward: 3x the forward's matmuls.
    assert counted["update"] == pytest.approx(
        teacher_forced_flops(model, params, group_size=1, backward=True), rel=0.03
    )
    # Without shared prompts the teacher-forced passes execute the model count.
    assert bench.step_flops(bench.CONFIG, executed=True, share_prompts=False)["logprobs"] == counted["logprobs"]


def test_rollout_counts_match_xla(model_and_params):
    model, params = model_and_params
    decode_steps = bench.NEW_TOKENS - 1
    # Model count: every sequence's prompt, each decode step attending to the positions so far.
    counted = rollout_flops(
        model, params, prompts=BATCH, cache_sizes=[bench.PROMPT_LEN + t for t in range(decode_steps + 1)]
    )
    assert bench.step_flops(bench.CONFIG)["rollout"] == pytest.approx(counted, rel=0.02)
    # Executed: each prompt prefilled once, every step attending to all cache slots.
    executed = rollout_flops(model, params, prompts=bench.PROMPTS, cache_sizes=[TOTAL] * (decode_steps + 1))
    assert bench.step_flops(bench.CONFIG, executed=True)["rollout"] == pytest.approx(executed, rel=0.02)


# --- Smoke runs of the memory benchmarks at small sizes ------------------------------------------


def test_loss_memory_prints_both_programs_and_they_agree(capsys):
    import loss_memory

    results = loss_memory.main(
        ["--tokens", "512", "--vocab", "2048", "--hidden", "32", "--chunk-size", "64", "--check-tokens", "96"]
    )
    out = capsys.readouterr().out
    assert "| naive: [T, V] float32 logits" in out and "| chunked: ops.chunked_token_logprobs, chunk 64 |" in out
    assert "| dL/dW |" in out  # the numerical check ran (it raises beyond its tolerance)
    assert all(
        parts["peak"] == parts["temp"] + parts["arguments"] + parts["outputs"] - parts["alias"]
        for parts in results.values()
    )
    assert results["chunked"]["temp"] < results["naive"]["temp"] / 2


def test_host_memory_measures_each_case(monkeypatch):
    # In this process, a few calls each: the growth per call is a number for every case (the
    # table runs each case in a fresh process), and an unknown case is named.
    import host_memory

    monkeypatch.setattr(host_memory, "WARM_UP", 1)
    for case in host_memory.CASES.values():
        assert np.isfinite(host_memory.measure(case, 2)), case
    with pytest.raises(ValueError, match="unknown case 'nope'; the cases are"):
        host_memory.measure("nope", 1)


def test_state_memory_prints_each_layout_and_fsdp_holds_an_eighth(capsys):
    import state_memory

    results = state_memory.main(["--tiny"])
    out = capsys.readouterr().out
    assert out.count("| 1x8x1 | fsdp |") == 2  # GRPO and PPO
    for rows in results.values():
        single = rows[0][2]["total"]
        fsdp8 = next(parts for mesh, preset, parts in rows if (mesh, preset) == ("1x8x1", "fsdp"))
        assert 1 / 8 <= fsdp8["total"] / single < 1.01 / 8


def test_layer_scan_prints_every_variant_with_the_same_gradients(capsys):
    import layer_scan

    results = layer_scan.main(
        [
            "--tiny",
            "--layers",
            "2",
            "--rows",
            "4",
            "--prompt-len",
            "4",
            "--completion-len",
            "4",
            "--group-size",
            "2",
            "--repeats",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert "| unrolled | no remat |" in out and "| scan | remat full |" in out
    assert set(results) == {"unrolled", "scan", "unrolled, remat full", "scan, remat full"}
    assert all(row["dg"] < 1e-4 and row["compile"] > 0 and row["step"] > 0 for row in results.values())


def test_compile_depth_prints_the_programs_asked_for_unrolled_and_scanned(capsys):
    import compile_depth

    # loss+grad is layer_scan.py's program, compiled unrolled and scanned by the test above.
    results = compile_depth.main(
        [
            "--tiny",
            "--depths",
            "2",
            "--programs",
            "sampler,logprobs",
            "--prompts",
            "2",
            "--group-size",
            "2",
            "--prompt-len",
            "4",
            "--completion-len",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert "| sampler | 2 |" in out and "| logprobs | 2 |" in out and "loss+grad" not in out
    assert set(results) == {(p, 2, s) for p in ("sampler", "logprobs") for s in (False, True)}
    assert all(row["compile"] > 0 and row["lower"] > 0 for row in results.values())


# --- The side-by-side run: jaxrl_llm's entry and the report --------------------------------------


def test_each_jax_library_gets_the_cache_through_its_own_setting(monkeypatch, tmp_path):
    # JAX_COMPILATION_CACHE_DIR reaching jaxrl_llm would keep JAX's 1 s threshold (a
    # directory set in JAX is the user's), and the warm start would load only the update.
    import side_by_side

    commands = []
    monkeypatch.setattr(side_by_side, "run_json", lambda name, command, *, env, **_: commands.append(env) or {})
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")
    for library in ("jaxrl_llm", "tunix", "trl"):
        side_by_side.run_script(library, [], tmp_path)
    ours, tunix, trl = commands
    assert ours["JAXRL_LLM_COMPILATION_CACHE"] == str(tmp_path) and "JAX_COMPILATION_CACHE_DIR" not in ours
    assert tunix["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path)
    assert trl["JAX_COMPILATION_CACHE_DIR"] == "/elsewhere"  # TRL compiles nothing: its environment as it is


def test_the_train_step_entry_reports_train_s_own_timings_and_the_report_derives_from_them(capsys):
    import side_by_side
    import train_step

    from jaxrl_llm import tasks

    tasks.check_task(train_step.WordParityTask(vocab_size=512, prompt_len=16))
    assert set(side_by_side.SHAPES) == set(train_step.SHAPES) - {"gpu"}  # gpu_side_by_side.py runs gpu
    result = train_step.main(
        ["--shape", "tiny", "--layers", "1", "--group-size", "2", "--new-tokens", "3", "--repeats", "2"]
    )
    assert capsys.readouterr().out.splitlines()[-1] == json.dumps(result)  # what side_by_side.py reads
    assert (result["layers"], result["group"], result["new_tokens"], result["prompts"]) == (1, 2, 3, 8)
    phases = result["phases"]
    assert all(len(phases[p]["all_s"]) == 2 and min(phases[p]["all_s"]) > 0 for p in (*side_by_side.PHASES, "step"))
    assert result["to_first_step_s"] > result["first_step_s"] > 0 and result["peak_rss_gb"] > 0

    peak, bandwidth = 1e11, 1e10
    derived = side_by_side.derived(result, peak, bandwidth)
    config = side_by_side.model_config("tiny", 1)
    update_flops = bench.step_flops(config, prompts=8, group=2, prompt_len=16, new_tokens=3)["update"]
    assert derived["update_mfu"] == pytest.approx(update_flops / (phases["update"]["median_s"] * peak))
    weights = 4 * sum(x.size for x in jax.tree.leaves(models.init(config, jax.random.key(0))[1]))
    assert weights == 4 * result["params"]
    assert not config.tie_word_embeddings  # decoding gathers 8 rows of the input embedding, not all of it
    streamed = weights - 4 * config.vocab_size * config.hidden_size
    assert derived["decode_bandwidth_share"] == pytest.approx(
        streamed * 2 / phases["rollout"]["median_s"] / bandwidth
    )  # 2 decode steps after the prefill's token

    result.update(derived)
    machine = {
        "cpu": "a CPU",
        "avx512": False,
        "cores": 2,
        "memory_gb": 24.0,
        "platform": "Linux",
        "matmul_peak_flops": peak,
        "matmul_peak_shape": "[8, 8] @ [8, 8]",
        "read_bandwidth_bytes_per_s": bandwidth,
    }
    peer = dict(result, library="peer", step_median_s=2 * result["step_median_s"])
    report = {
        "date": "2026-12-04T00:00:00+00:00",
        "machine": machine,
        "versions": {"jaxrl_llm": result["versions"]},
        "shapes": {"tiny": {"jaxrl_llm": result, "peer": peer}},
    }
    table = side_by_side.markdown(report)
    assert "2026-12-04" in table and "a CPU (2 cores)" in table and "100 GFLOP/s" in table
    rows = [line for line in table.splitlines() if line.startswith("| jaxrl_llm") or line.startswith("| peer")]
    assert rows[0].startswith(f"| jaxrl_llm | {result['step_median_s']:.3f} s |") and "| 1.00x |" in rows[0]
    assert "| 2.00x |" in rows[1] and f"{derived['update_mfu']:.0%}" in rows[0]


# --- The GPU side-by-side run: its stages and its report ------------------------------------------


def _json_line(library: str, phases: dict[str, list[float]], **fields) -> dict:
    """A script's JSON line at the gpu shape (``step_report.finish``'s fields) with these step times."""
    timings = {
        phase: {"median_s": float(np.median(times)), "min_s": min(times), "first_s": 99.0, "all_s": times}
        for phase, times in phases.items()
    }
    line = dict(
        library=library,
        shape="gpu",
        prompts=16,
        group=8,
        prompt_len=128,
        new_tokens=256,
        layers=24,
        params=494_032_768,
        precision="mixed",
        phases=timings,
        step_median_s=timings["step"]["median_s"],
        step_min_s=timings["step"]["min_s"],
    )
    return {**line, **fields}


def test_the_gpu_report_derives_its_table_from_the_stages_json_lines(tmp_path):
    import gpu_side_by_side as gpu
    import side_by_side

    jax_versions = {"jax": "0.11.2", "jaxlib": "0.11.2", "flax": "0.12.10", "optax": "0.2.8", "python": "3.12.3"}
    cold = _json_line(
        "jaxrl_llm",
        {
            "rollout": [0.66, 0.65, 0.67],
            "logprobs": [0.15, 0.14, 0.15],
            "update": [0.59, 0.57, 0.56],
            "step": [1.40, 1.36, 1.38],
        },
        versions=jax_versions,
        platform_version="PJRT C API\ncuda 13000",
        completion_length=255.5,
        first_step_s=131.6,
        to_first_step_s=151.0,
        peak_rss_gb=6.7,
        peak_device_gb=62.6,
    )
    warm = _json_line(
        "jaxrl_llm",
        {"rollout": [0.64], "logprobs": [0.14], "update": [0.52], "step": [1.30]},
        versions=jax_versions,
        completion_length=256.0,
        first_step_s=31.2,
        to_first_step_s=50.4,
        peak_rss_gb=6.9,
        peak_device_gb=60.1,
    )
    stacked = _json_line(
        "jaxrl_llm",
        {"rollout": [0.70, 0.72, 0.71], "logprobs": [0.15, 0.15, 0.16], "update": [0.5, 0.5, 0.5], "step": [1.4] * 3},
        versions=jax_versions,
        scan_layers=True,
        completion_length=256.0,
        first_step_s=40.0,
        to_first_step_s=60.0,
        peak_rss_gb=6.0,
        peak_device_gb=58.0,
    )
    trl = _json_line(
        "trl",
        {
            "rollout": [10.0, 10.1, 9.9],
            "logprobs": [0.18, 0.17, 0.19],
            "update": [0.52, 0.50, 0.51],
            "step": [10.7, 10.8, 10.6],
        },
        versions={"trl": "1.16.0", "torch": "2.11.0+cu130", "transformers": "5.17.0", "cuda": "13.0"},
        micro_batch=64,
        first_step_s=29.3,
        to_first_step_s=54.8,
        peak_rss_gb=3.4,
        peak_device_gb=51.1,
    )
    machine = {
        "gpu": "NVIDIA H200",
        "gpu_memory_gib": 139.8,
        "multiprocessors": 132,
        "driver": "580.159.04",
        "cuda_driver": "13.0",
        "cpu": "a CPU",
        "cores": 16,
        "matmul_peak_flops": 7.9e14,
        "matmul_shape": "[8192, 8192] @ [8192, 8192], bfloat16",
        "copy_bytes_per_s": 4.3e12,
    }
    ok = {"status": "ok", "seconds": 10.0, "note": ""}
    report = {
        "date": "2026-12-05T00:00:00+00:00",
        "dry_run": False,
        "shape": "gpu",
        "environment": {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"},
        "machine": machine,
        "stages": {
            **{name: ok for name in ("machine", "jaxrl_llm cold", "trl", "jaxrl_llm warm", "stacked cold")},
            "stacked warm": {"status": "failed", "seconds": 60.0, "note": "timed out after 60 s"},
        },
        "runs": {"jaxrl_llm cold": cold, "trl": trl, "jaxrl_llm warm": warm, "stacked cold": stacked},
    }
    gpu.write(report, tmp_path)
    page = (tmp_path / "gpu_side_by_side.md").read_text()
    assert json.loads((tmp_path / "gpu_side_by_side.json").read_text())["metrics"] == report["metrics"]
    rows = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[1:] for line in page.splitlines() if "|" in line}
    assert page.splitlines()[0] == "# GRPO step side by side on one GPU, 2026-12-05T00:00:00+00:00"
    assert "NVIDIA H200 (139.8 GiB, 132 multiprocessors), driver 580.159.04, CUDA 13.0 (driver)" in page
    assert "bf16 matmul peak 790 TFLOP/s" in page and "`XLA_PYTHON_CLIENT_MEM_FRACTION=0.9`" in page
    assert "jaxrl_llm: jax 0.11.2, jaxlib 0.11.2, flax 0.12.10, optax 0.2.8, python 3.12.3 (JAX's backend: PJRT" in page
    assert "trl: trl 1.16.0, torch 2.11.0+cu130, transformers 5.17.0, cuda 13.0" in page
    assert rows["|"] == ["jaxrl_llm", "jaxrl_llm, stacked layers", "TRL", "TRL / jaxrl_llm", "stacked / unrolled |"]

    # jaxrl_llm: the cold process's 3 timed steps and the warm one's pooled, by hand.
    assert rows["steady step (median)"][0] == "1.370 s (4 steps)"  # median of 1.40, 1.36, 1.38, 1.30
    assert rows["steady step (median)"][2] == "10.700 s (3 steps)"
    assert rows["steady step (median)"][3] == f"{10.7 / 1.37:.2f}x"  # 7.81x
    assert rows["rollout (generation and rewards)"][:3] == ["0.655 s", "0.710 s", "10.000 s"]
    assert rows["update (forward, backward, AdamW)"][0] == "0.565 s"
    assert rows["decode, per token step of 128 rows"][:3] == ["2.56 ms", "2.77 ms", "39.06 ms"]  # rollout / 256
    assert rows["rollout tokens/s"][:3] == [f"{128 * 255.5 / 0.655:,.0f}", f"{128 * 256 / 0.71:,.0f}", "3,277"]
    flops = bench.step_flops(side_by_side.model_config("gpu", 24), prompts=16, group=8, prompt_len=128, new_tokens=256)[
        "update"
    ]
    embedding = 151_936 * 896  # tied: the output layer runs at the 256 completion positions only
    weights_only = 6 * (494_032_768 - embedding) * 128 * 384 + 6 * embedding * 128 * 256
    assert 1.0 < flops / weights_only < 1.1  # and the attention scores and values
    rate = flops / 0.565
    assert rows["update, model TFLOP/s (% of the bf16 peak)"][0] == f"{rate / 1e12:.3g} ({rate / 7.9e14:.0%})"
    assert rows["update, model TFLOP/s (% of the bf16 peak)"][3] == f"{(flops / 0.51) / rate:.2f}x"
    assert rows["first step (compilation), cold cache"][:4] == ["131.6 s", "40.0 s", "29.3 s", "0.22x"]
    assert rows["first step, warm compilation cache"][:4] == ["31.2 s", "-", "-", "-"]
    assert rows["peak device memory"][:4] == ["62.6 GB", "58.0 GB", "51.1 GB", "0.82x"]  # the larger of cold and warm
    assert rows["peak host RSS"][0] == "6.9 GB"
    assert rows["stacked warm"] == ["failed", "60", "timed out after 60 s |"]

    # A report of a run where nothing finished still has its stages.
    empty = dict(report, machine=None, runs={}, stages={"machine": {"status": "skipped", "seconds": 0, "note": "x"}})
    assert gpu.markdown({**empty, "results": {}, "metrics": {}}).endswith("| machine | skipped | 0 | x |\n")


def test_the_gpu_run_skips_what_its_budget_leaves_no_time_for_and_reports_failures(tmp_path):
    import gpu_side_by_side as gpu
    import side_by_side

    report = gpu.main(["--dry-run", "--budget-s", "1", "--out", str(tmp_path)])
    assert list(report["stages"])[-2:] == [gpu.PROFILE, "micro-batched"]
    assert [s["status"] for s in report["stages"].values()] == ["skipped"] * 8 and report["results"] == {}
    assert (tmp_path / "gpu_side_by_side.md").read_text().count("| skipped | 0 | 1 s of the budget left |") == 8
    report = gpu.main(["--dry-run", "--only", "machine,trl", "--budget-s", "1", "--out", str(tmp_path)])
    assert [name for name, s in report["stages"].items() if s["note"] == "not in --only"] == [
        "jaxrl_llm cold", "jaxrl_llm warm", "stacked cold", "stacked warm", gpu.PROFILE, "micro-batched"
    ]  # fmt: skip

    # A process that started another (a compiler, say): both are killed, at once.
    sleeper = "import subprocess, time; print(subprocess.Popen(['sleep', '60']).pid, flush=True); time.sleep(60)"
    started = time.monotonic()
    with pytest.raises(side_by_side.ScriptFailed, match=r"sleeper failed \(timed out after 1 s\):\n\d+") as failed:
        side_by_side.run_json("sleeper", [sys.executable, "-c", sleeper], env=dict(os.environ), timeout=1)
    assert time.monotonic() - started < 30  # not when the child ends: it held the output pipes
    status = pathlib.Path(f"/proc/{str(failed.value).splitlines()[1]}/status")
    for _ in range(50):  # until it is gone, or a zombie its new parent has yet to reap
        if not status.exists() or "\nState:\tZ" in status.read_text():
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the sleeper's child outlived its timeout")
    with pytest.raises(side_by_side.ScriptFailed, match=r"exit 3"):
        side_by_side.run_json("exit", [sys.executable, "-c", "raise SystemExit(3)"], env=dict(os.environ))
    with pytest.raises(side_by_side.ScriptFailed, match="no JSON line"):
        side_by_side.run_json("no json", [sys.executable, "-c", "print('done')"], env=dict(os.environ))


def _trace(path: pathlib.Path, lines: dict[tuple[str, str], list[tuple[str, float, float]]]) -> None:
    """A Perfetto trace file: per (process, thread) line, events ``(name, start, duration)`` in us."""
    events, pids = [], {}
    for tid, ((process, thread), spans) in enumerate(lines.items()):
        pid = pids.setdefault(process, len(pids) + 1)
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": process}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}})
        events += [
            {"ph": "X", "name": n, "pid": pid, "tid": tid, "ts": t, "dur": d, "args": {"i": i}}
            for i, (n, t, d) in enumerate(spans)
        ]
    path.mkdir(parents=True)
    with gzip.open(path / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_the_trace_summary_sums_each_ops_own_time_on_the_device_line(tmp_path):
    import trace_summary

    gpu_ops = [  # a wrapper around two ops (own 10 us), a wait, and op A again
        ("wrapper", 0.0, 100.0), ("A", 10.0, 50.0), ("B", 60.0, 40.0), ("wait for it", 200.0, 500.0), ("A", 300.0, 30.0)
    ]  # fmt: skip
    _trace(
        tmp_path / "gpu" / "plugins",
        {
            ("/device:GPU:0", "XLA Ops"): gpu_ops,
            ("/device:GPU:0", "XLA Modules"): [("jit_update", 0.0, 100.0), ("jit_score", 300.0, 30.0)],
            ("/host:CPU", "python"): [("PjitFunction", 0.0, 900.0)],
        },
    )
    summary = trace_summary.summarize(tmp_path / "gpu")
    assert summary["source"] == ["/device:GPU:0 / XLA Ops"]
    assert summary["ops_ms"] == pytest.approx((10 + 50 + 40 + 30) / 1e3)  # the wait left out
    assert {op["name"]: op["count"] for op in summary["ops"]} == {"A": 2, "B": 1, "wrapper": 1}
    assert {op["name"]: op["ms"] * 1e3 for op in summary["ops"]} == pytest.approx({"A": 80, "B": 40, "wrapper": 10})
    assert [op["name"] for op in summary["ops"]] == ["A", "B", "wrapper"]
    assert summary["ops"][0]["share"] == pytest.approx(80 / 130)
    assert [m["name"] for m in summary["modules"]] == ["jit_update", "jit_score"]
    assert [m["share"] for m in summary["modules"]] == pytest.approx([100 / 130, 30 / 130])
    assert "| `A` | 0.08 | 2 | 61.5% |" in trace_summary.markdown(summary)

    # A CPU trace has no device line: the host's threads but Python's.
    _trace(
        tmp_path / "cpu",
        {
            ("/host:CPU", "python"): [("PjitFunction", 0.0, 900.0)],
            ("/host:CPU", "tf_XLAEigen/1"): [("fusion.1", 0.0, 20.0)],
            ("/host:CPU", "tf_XLAPjRtCpuClient/2"): [("fusion.2", 5.0, 5.0), ("Execute (wait for completion)", 0, 90)],
        },
    )
    summary = trace_summary.summarize(tmp_path / "cpu")
    assert summary["source"] == ["/host:CPU / tf_XLAEigen/1", "/host:CPU / tf_XLAPjRtCpuClient/2"]
    assert [(op["name"], op["ms"] * 1e3) for op in summary["ops"]] == [("fusion.1", 20.0), ("fusion.2", 5.0)]
    with pytest.raises(FileNotFoundError, match="create_perfetto_trace=True"):
        trace_summary.summarize(tmp_path / "nothing")


def test_update_program_counts_each_parts_equations_and_stacked_layers_write_fewer(capsys):
    import update_program

    unrolled = update_program.main(["--methods", "grpo"])["grpo"]
    stacked = update_program.main(["--methods", "grpo", "--scan-layers"])["grpo"]
    out = capsys.readouterr().out
    assert "| grpo |" in out and "2 layers unrolled" in out and "2 layers stacked" in out
    for row in (unrolled, stacked):
        assert sum(row[part] for part in update_program.PARTS) == row["equations"]
        assert row["optimizer"] > 0 and row["model"] > 0 and row["loss"] > 0 and row["compile"] > 0
    # Stacked, the layers are one scan body (traced once) and their params 9 leaves, not 18, for the optimizer.
    assert stacked["model"] < unrolled["model"] and stacked["optimizer"] < unrolled["optimizer"]
