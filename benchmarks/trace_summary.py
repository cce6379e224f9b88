"""Where a traced program's time goes: a ``jax.profiler`` trace summed by op.

``jax.profiler.trace(dir, create_perfetto_trace=True)`` writes ``perfetto_trace.json.gz``
under ``dir`` (Chrome trace events). :func:`summarize` sums its complete events (``ph ==
"X"``) by name on the lines that run the programs' ops:

* on a GPU (or TPU), the device's ``XLA Ops`` line (one event per HLO op or fusion as it ran
  on the device), and its ``XLA Modules`` line for the time per compiled program;
* on a CPU, where no device line exists, every host thread but the Python one (XLA's
  per-thunk events, e.g. ``ynn_fusion`` or a fusion's name).

Waits (events named "... wait ...": a thread blocked on others' work) are left out.
Times are each event's own (its duration less its nested events'), so an executor's event
around the ops it runs does not count them twice. Every line's total is kept too, so a trace
whose lines are named otherwise still says where its time went. Nothing here imports JAX.

    python benchmarks/trace_summary.py TRACE_DIR [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re

TRACE_FILE = "perfetto_trace.json.gz"
OPS_LINE, MODULES_LINE = "XLA Ops", "XLA Modules"
HOST_PYTHON_LINE = "python"
WAIT = re.compile("wait", re.IGNORECASE)  # a thread waiting for others' work ("... (wait for completion)")


def trace_file(trace_dir: str | pathlib.Path) -> pathlib.Path:
    """The newest ``perfetto_trace.json.gz`` under ``trace_dir``.

    Raises:
      FileNotFoundError: there is none (a trace written without ``create_perfetto_trace``).
    """
    found = sorted(pathlib.Path(trace_dir).rglob(TRACE_FILE), key=lambda path: path.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no {TRACE_FILE} under {trace_dir}: trace with create_perfetto_trace=True")
    return found[-1]


def self_times(events: list[dict]) -> list[float]:
    """Each event's own time in microseconds (its ``dur`` less that of the events nested in
    it), for the events of one line: a wrapper (an executor's "execute" around the ops it
    runs) keeps only the time no op accounts for."""
    order = sorted(range(len(events)), key=lambda i: (events[i]["ts"], -events[i].get("dur", 0.0)))
    own = [events[i].get("dur", 0.0) for i in range(len(events))]
    open_ = []  # indices of the events enclosing the current one, innermost last
    for i in order:
        start = events[i]["ts"]
        while open_ and events[open_[-1]]["ts"] + events[open_[-1]].get("dur", 0.0) <= start:
            open_.pop()
        if open_:
            own[open_[-1]] -= events[i].get("dur", 0.0)
        open_.append(i)
    return own


def _totals(events: list[dict], own: list[float]) -> list[dict]:
    """``[{name, ms, count, share}]`` of ``events`` (own times ``own``) summed by name,
    largest first; ``share`` is of these events' total."""
    ms, count, example = collections.Counter(), collections.Counter(), {}
    for event, time in zip(events, own, strict=True):
        if WAIT.search(event["name"]):
            continue
        ms[event["name"]] += time / 1e3  # trace events are in microseconds
        count[event["name"]] += 1
        example.setdefault(event["name"], json.dumps(event.get("args", {}))[:300])
    total = sum(ms.values()) or 1.0
    return [
        dict(name=name, ms=t, count=count[name], share=t / total, args=example[name]) for name, t in ms.most_common()
    ]


def summarize(trace_dir: str | pathlib.Path, *, top: int = 20) -> dict:
    """The trace's time by op (see the module docstring).

    Returns ``{"file", "source", "ops_ms", "ops": [top ops], "modules": [programs],
    "lines": [every (process, thread) line's total]}``: ``source`` names the lines the
    ops were summed over, ``ops_ms`` their total; each op ``{name, ms, count, share, args}``
    (``args``: its first event's arguments, shapes or HLO text where the profiler records
    them, cut to 300 characters).
    """
    path = trace_file(trace_dir)
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes, threads = {}, {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            processes[event["pid"]] = event["args"]["name"]
        elif event.get("ph") == "M" and event.get("name") == "thread_name":
            threads[event["pid"], event["tid"]] = event["args"]["name"]
    by_line = collections.defaultdict(list)
    for event in events:
        if event.get("ph") == "X":
            by_line[
                processes.get(event["pid"], str(event["pid"])), threads.get((event["pid"], event["tid"]), "")
            ].append(event)

    own = {line: self_times(found) for line, found in by_line.items()}
    source = [line for line in by_line if line[0].startswith("/device:") and line[1] == OPS_LINE]
    if not source:
        source = [line for line in by_line if line[0].startswith("/host:") and line[1] != HOST_PYTHON_LINE]
    modules = [line for line in by_line if line[1] == MODULES_LINE]

    def totals(lines: list[tuple]) -> list[dict]:
        return _totals([e for line in lines for e in by_line[line]], [t for line in lines for t in own[line]])

    return dict(
        file=str(path),
        source=[f"{process} / {thread}" for process, thread in source],
        ops_ms=sum(t for line in source for e, t in zip(by_line[line], own[line]) if not WAIT.search(e["name"])) / 1e3,
        ops=totals(source)[:top],
        modules=totals(modules)[:top],
        lines=sorted(
            (
                dict(process=process, thread=thread, ms=sum(e.get("dur", 0.0) for e in found) / 1e3, count=len(found))
                for (process, thread), found in by_line.items()
            ),
            key=lambda line: -line["ms"],
        ),
    )


def markdown(summary: dict, *, title: str = "Time by op") -> str:
    """``summary``'s top ops (and programs, where the trace has them) as Markdown tables."""
    out = [f"{title}: {summary['ops_ms']:.1f} ms of ops on {', '.join(summary['source']) or 'no line'}", ""]
    out += ["| op | ms | calls | share |", "|---|---:|---:|---:|"]
    out += [f"| `{op['name'][:80]}` | {op['ms']:.2f} | {op['count']} | {op['share']:.1%} |" for op in summary["ops"]]
    if summary["modules"]:
        out += ["", "| program | ms | runs | share |", "|---|---:|---:|---:|"]
        out += [f"| `{m['name'][:80]}` | {m['ms']:.2f} | {m['count']} | {m['share']:.1%} |" for m in summary["modules"]]
    return "\n".join(out)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir", type=pathlib.Path)
    parser.add_argument("--top", type=int, default=20, help="ops to list")
    args = parser.parse_args(argv)
    summary = summarize(args.trace_dir, top=args.top)
    print(markdown(summary))
    return summary


if __name__ == "__main__":
    main()
