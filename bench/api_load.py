"""Load on the HTTP sidecar as users make it: dashboards and scripts reading a store of past
sessions while sessions are created, recorded and cancelled on agents that train.

A server process runs ``profd up``'s stack (default, ``--ray``): a local Ray on 127.0.0.1, the
coordinator and sidecar actors started by ``start_services`` with the config ``profd up``
builds (token file in the state directory, SQLite store, reads shared for
``read_cache_s``), and ``--agents`` training processes (Ray actors, ``profd.attach`` once each,
a small MLP step in stages every 0.5 s). Before the coordinator starts, its state directory is
given ``--past`` finished sessions (copies of sessions recorded for real, with their parts,
history and trace files; see ``bench/_api_stack.py``), which it restores at start.
``--in-process`` serves the same app and coordinator in one process without Ray (agents as
threads there): the sidecar's own cost, reported separately.

This process runs ``--clients`` concurrent clients (asyncio + aiohttp, one keep-alive
connection each) for ``--duration`` seconds after ``--warmup`` seconds not counted, at
``--client-nice`` (default: the sidecar's own, 15 as Ray gives its workers; 0 with
``--in-process``). Users' clients run on other machines; clients on these 2 cores at
niceness 0 preempt the sidecar at every wake-up (measured: 695 involuntary switches a
second, 40 % of its ready time waiting for a core), and the bench would time the clients'
priority, not the sidecar:

* ``--churn`` writers (with the token) create a session on 1 random rank (4 ranks one time in
  five) for the next step, follow it to its end (``GET /sessions/{id}`` every 0.5 s, as
  ``profd profile --wait`` does) and cancel one in four once armed; one session per
  ``--churn-interval`` seconds each at most.
  A 409 (a target busy with another live session, or a cancel that came after the end) is
  the API's correct answer: counted as ``conflicts_409``, not as an error.
* the others read, one request every ``--interval`` seconds each (random phase), drawn by
  :data:`MIX` (in ``_api_clients.py``): a past session (any of ``--past``), a live one,
  pages of sessions and of traces (following ``next_cursor`` half the time; traces also by
  session or by rank), a summary (half of them of one of the 8 newest past sessions, half of
  any), the agents, the status, ``/metrics`` and ``/healthz``.

Latency is measured per request in the client; an error is any other non-2xx answer, a
timeout (10 s) or a connection failure. ``uncached_share`` is the share of requests the
sidecar cannot answer from what it holds, as the client can tell: reads are shared by
(route, arguments) for ``read_cache_s`` after a first request and dropped by any change
(``SharedReads``), summaries of finished sessions are kept for the 32 last asked
(``SummaryCache``); the bench replays both rules on the requests it sends. Per-route p50/p99,
and the p99 of each 10-s window (median and range) as the run's spread. Targets: 0 errors,
p99 <= 50 ms.

    python bench/api_load.py [--clients 100] [--duration 60] [--interval 0.5] [--churn 4]
        [--churn-interval 1] [--agents 16] [--past 1000] [--client-nice 15] [--in-process]

Last line: ``RESULT mode=ray clients=100 requests=... errors=... p50_ms=... p99_ms=...
p99_without_summaries_ms=... churn_to_end_p50_ms=...
p99_window_median_ms=... p99_window_range_ms=...-... rps=... uncached_share=...
churn_sessions=... conflicts_409=... past_sessions=1000 agents=16 client_nice=15
targets=met|missed
load_start=... load=...`` (load: the 1-minute load average, os.getloadavg()).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _api_clients import Reader, Shared, Tally, churner

TARGET_P99_MS = 50.0
#: The niceness Ray gives its workers (``RAY_worker_niceness``), the sidecar's among them.
RAY_WORKER_NICE = 15
WINDOW_S = 10.0
NOISE = (b"STAGE:", b"USDT:")  # torch.profiler's own lines on stderr, one per window


# -- the server process --------------------------------------------------------------------------
def serve(args: argparse.Namespace) -> None:
    import _api_stack

    stop = threading.Event()

    def until_eof() -> None:  # the load generator closes our stdin when done (or dies)
        while os.read(0, 4096):  # unbuffered: no lock held at interpreter shutdown
            pass
        stop.set()

    threading.Thread(target=until_eof, daemon=True).start()

    def ready(info: dict[str, Any]) -> None:
        tmp = args.serve.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(args.serve)

    run = _api_stack.serve_in_process if args.in_process else _api_stack.serve_ray
    out = run(args.workdir, args.agents, args.past, ready, stop)
    seconds = out.get("server_seconds")
    if seconds:
        print(
            f"server side: n={len(seconds)} p50={pct(seconds, 0.5):.2f} ms "
            f"p99={pct(seconds, 0.99):.2f} ms",
            flush=True,
        )
    print(f"agents stepped {out['agent_steps']} steps in all", flush=True)


def _forward(stream: Any) -> None:
    """The server's stderr without torch.profiler's per-window lines."""
    for line in stream:
        if not line.startswith(NOISE):
            sys.stderr.buffer.write(line)
            sys.stderr.flush()


async def load(url: str, info: dict[str, Any], args: argparse.Namespace) -> Tally:
    shared = Shared(info, args.agents, info["read_cache_s"])
    tally = Tally(time.monotonic() + args.warmup, 0.0)
    tally.end = tally.start + args.duration
    tasks = [
        churner(url, info["token"], shared, tally, tally.end, args.churn_interval, i)
        for i in range(args.churn)
    ]
    tasks += [
        Reader(i, shared, tally).run(url, tally.end, args.interval)
        for i in range(args.clients - args.churn)
    ]
    await asyncio.gather(settle(tally), lag_monitor(tally), *tasks)
    return tally


async def settle(tally: Tally) -> None:
    """Near the end of the warm-up, when every client holds its connection: freeze this
    process's heap, so the load generator's own full collections do not count as latency."""
    await asyncio.sleep(max(0.0, tally.start - time.monotonic() - 0.5))
    gc.collect()
    gc.freeze()


async def lag_monitor(tally: Tally, period: float = 0.005) -> None:
    """How late this process's event loop wakes up: the clients' own share of the latency
    (a CPU-starved load generator shows up here, not as server time)."""
    while time.monotonic() < tally.end:
        t0 = time.perf_counter()
        await asyncio.sleep(period)
        late = time.perf_counter() - t0 - period
        if tally.counts(time.monotonic() - late):
            tally.lag.append(max(0.0, late))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def report(tally: Tally, info: dict[str, Any], args: argparse.Namespace, load0: float) -> None:
    every = [(t, s) for vs in tally.latencies.values() for t, s in vs]
    secs = [s for _, s in every]
    _print_routes(tally)
    windows = []
    for w in range(int(args.duration // WINDOW_S)):
        lo = tally.start + w * WINDOW_S
        chunk = [s for t, s in every if lo <= t < lo + WINDOW_S]
        if chunk:
            windows.append(pct(chunk, 0.99))
    errors = sum(tally.errors.values())
    conflicts = sum(tally.conflicts.values())
    churned = sum(tally.sessions.values())
    _print_outcomes(tally, info)
    p99 = pct(secs, 0.99)
    others = [x for route, vs in tally.latencies.items() if route != "GET summary" for _, x in vs]
    met = errors == 0 and p99 <= TARGET_P99_MS
    fields = {
        "mode": info["mode"],
        "clients": args.clients,
        "requests": len(secs),
        "errors": errors,
        "p50_ms": f"{pct(secs, 0.5):.2f}",
        "p99_ms": f"{p99:.2f}",
        # the other routes apart: a summary not yet kept parses its session's trace files
        "p99_without_summaries_ms": f"{pct(others, 0.99):.2f}" if others else "-",
        "churn_to_end_p50_ms": f"{pct(tally.to_end, 0.5):.0f}" if tally.to_end else "-",
        "p99_window_median_ms": f"{sorted(windows)[len(windows) // 2]:.1f}" if windows else "-",
        "p99_window_range_ms": f"{min(windows):.1f}-{max(windows):.1f}" if windows else "-",
        "rps": f"{len(secs) / args.duration:.0f}",
        "uncached_share": f"{1 - tally.cached / max(1, len(secs)):.2f}",
        "churn_sessions": churned,
        "conflicts_409": conflicts,
        "past_sessions": len(info["past_ids"]),
        "agents": args.agents,
        "client_nice": os.nice(0),
        "targets": "met" if met else "missed",
        "load_start": f"{load0:.2f}",
        "load": f"{os.getloadavg()[0]:.2f}",
    }
    print("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


def _print_routes(tally: Tally) -> None:
    print(
        f"{'route':20s} {'n':>6s} {'p50 ms':>8s} {'p99 ms':>8s} {'max ms':>8s} {'cached':>7s}"
        f" {'body KB':>8s}"
    )
    for route, vs in sorted(tally.latencies.items()):
        s = [x for _, x in vs]
        print(
            f"{route:20s} {len(s):6d} {pct(s, 0.5):8.2f} {pct(s, 0.99):8.2f} "
            f"{max(s) * 1000:8.2f} {tally.cached_by.get(route, 0) / len(s):7.0%}"
            f" {tally.body_bytes.get(route, 0) / len(s) / 1024:8.1f}"
        )


def _print_outcomes(tally: Tally, info: dict[str, Any]) -> None:
    """Errors, conflicts, the clients' own lag, the churn sessions' ends and the store."""
    for why, n in sorted(tally.errors.items()):
        print(f"error x{n}: {why}")
    for route, n in sorted(tally.conflicts.items()):
        print(f"409 x{n}: {route} (busy target / already over: the API's correct answer)")
    if tally.lag:
        print(
            f"client event-loop lag p50={pct(tally.lag, 0.5):.2f} ms "
            f"p99={pct(tally.lag, 0.99):.2f} ms max={max(tally.lag) * 1000:.2f} ms"
        )
    churned = sum(tally.sessions.values())
    ends = ", ".join(f"{k} {v}" for k, v in sorted(tally.sessions.items()))
    if tally.to_end:
        print(
            f"churn sessions: {churned} ({ends}); created to end p50 "
            f"{pct(tally.to_end, 0.5):.0f} ms"
        )
    for why, n in sorted(tally.reasons.items()):
        print(f"churn session x{n}: {why}")
    print(
        f"store: {len(info['past_ids'])} past sessions, {info['past_traces']} traces "
        f"(recorded and copied in {info['seed_s']} s); coordinator start with them "
        f"{info['restore_s']} s ({info['restored']} restored)"
    )


def _start_server(args: argparse.Namespace, tmp: str, info_file: Path) -> subprocess.Popen:
    """This script again as the server process (its stdin closed: it stops)."""
    cmd = [sys.executable, __file__, "--serve", str(info_file), "--workdir", tmp]
    cmd += ["--agents", str(args.agents), "--past", str(args.past)]
    cmd += ["--in-process"] if args.in_process else []
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    server = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    threading.Thread(target=_forward, args=(server.stderr,), daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between reads")
    parser.add_argument("--churn", type=int, default=4, help="clients creating sessions")
    parser.add_argument("--churn-interval", type=float, default=1.0)
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--past", type=int, default=1000, help="past sessions in the store")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds not measured")
    parser.add_argument(
        "--client-nice",
        type=int,
        help="the clients' niceness (default: the sidecar's own: Ray's workers' 15, or 0 "
        "with --in-process)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--ray", action="store_true", help="as `profd up` serves (the default)")
    mode.add_argument(
        "--in-process",
        action="store_true",
        help="app and coordinator in one process, no Ray (the sidecar's own cost)",
    )
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    if not 0 <= args.churn <= args.clients or args.agents < 4:
        parser.error("--churn must be between 0 and --clients, and --agents at least 4")
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="profd-api-load-") as tmp:
        info_file = Path(tmp) / "served.json"
        server = _start_server(args, tmp, info_file)
        try:
            deadline = time.monotonic() + 600
            while not info_file.exists():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the sidecar did not start")
                time.sleep(0.2)
            info = json.loads(info_file.read_text())
            print(
                f"sidecar {info['url']} ({info['mode']}): {args.clients} clients "
                f"({args.churn} creating sessions on {args.agents} agents), "
                f"{len(info['past_ids'])} past sessions, {args.duration:.0f} s after "
                f"{args.warmup:.0f} s of warm-up",
                flush=True,
            )
            # The server side is started: only this process (the clients) is reniced.
            nice = args.client_nice
            if nice is None:
                nice = 0 if args.in_process else RAY_WORKER_NICE
            os.nice(nice - os.nice(0))
            tally = asyncio.run(load(info["url"], info, args))
        finally:
            server.stdin.close()  # the server stops on end of input
            try:
                server.wait(120)
            except subprocess.TimeoutExpired:
                server.kill()
    report(tally, info, args, load0)


if __name__ == "__main__":
    main()
