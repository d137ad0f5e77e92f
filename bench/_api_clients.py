"""``bench/api_load.py``'s clients: readers of the mixed routes, churn writers creating
sessions on real agents, and what a client can tell of the sidecar's caches (``CacheModel``)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict, deque
from typing import Any

#: Reader routes and their weights (percent of reads).
MIX = {
    "GET session (past)": 25,
    "GET session (live)": 10,
    "GET sessions page": 15,
    "GET traces page": 15,
    "GET summary": 4,
    "GET agents": 10,
    "GET status": 8,
    "GET metrics": 6,
    "GET healthz": 7,
}
#: The sidecar's caches, as its code has them (api/client.py, api/summaries.py).
SUMMARY_CACHE_SIZE = 32
HOT_SESSIONS = 8
#: A request not answered in this long is an error.
REQUEST_TIMEOUT_S = 10.0
#: How often a churn writer looks at its session (as `profd profile --wait` does).
FOLLOW_S = 0.5


# -- what the client can tell of the sidecar's caches -------------------------------------------
class CacheModel:
    """Replays ``SharedReads`` (a read held ``ttl_s`` from the request that asked for it, all
    dropped by a change) and ``SummaryCache`` (the last 32 summaries of finished sessions) on
    the requests sent, to count the ones the sidecar has to work for."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.held: dict[tuple[Any, ...], float] = {}
        self.changed = 0.0
        self.summaries: OrderedDict[str, None] = OrderedDict()

    def read(self, key: tuple[Any, ...] | None) -> bool:
        """Whether this read is answered from what is held; ``None``: never shared."""
        if key is None:
            return False
        now = time.monotonic()
        at = self.held.get(key)
        if at is not None and now - at < self.ttl_s and at >= self.changed:
            return True
        self.held[key] = now
        return False

    def summary(self, session_id: str, finished: bool) -> bool:
        if session_id in self.summaries:
            self.summaries.move_to_end(session_id)
            return True
        if finished:
            self.summaries[session_id] = None
            while len(self.summaries) > SUMMARY_CACHE_SIZE:
                self.summaries.popitem(last=False)
        return False

    def change(self) -> None:
        self.changed = time.monotonic()


class Tally:
    """Latencies, errors, 409s and cache hits of requests that started after ``start``."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.latencies: dict[str, list[tuple[float, float]]] = {}
        self.errors: dict[str, int] = {}
        self.conflicts: dict[str, int] = {}
        self.cached = 0
        self.cached_by: dict[str, int] = {}
        self.body_bytes: dict[str, int] = {}  # route -> bytes of the bodies it answered
        self.lag: list[float] = []
        self.sessions: dict[str, int] = {}  # churn sessions by how they ended
        self.to_end: list[float] = []  # churn session: created to terminal, seconds
        self.reasons: dict[str, int] = {}  # churn sessions that ended otherwise, why

    def counts(self, t0: float) -> bool:
        return self.start <= t0 < self.end

    def add(
        self, route: str, t0: float, seconds: float, status: str, cached: bool, size: int = 0
    ) -> None:
        if not self.counts(t0):
            return
        self.latencies.setdefault(route, []).append((t0, seconds))
        self.body_bytes[route] = self.body_bytes.get(route, 0) + size
        self.cached += cached
        self.cached_by[route] = self.cached_by.get(route, 0) + cached
        if status == "409":
            self.conflicts[route] = self.conflicts.get(route, 0) + 1
        elif status != "ok":
            key = f"{route}: {status}"
            self.errors[key] = self.errors.get(key, 0) + 1


class Shared:
    """What the clients share: the past sessions, the live ones, the cache model."""

    def __init__(self, info: dict[str, Any], agents: int, ttl_s: float) -> None:
        self.past: list[str] = info["past_ids"]
        self.hot = self.past[-HOT_SESSIONS:]
        self.live: deque[str] = deque(maxlen=32)
        self.agents = agents
        self.cache = CacheModel(ttl_s)
        #: In one process the agents share torch.profiler (process-wide): one live churn
        #: session at a time there, on one rank.
        self.one_at_a_time = asyncio.Lock() if info["mode"] == "in-process" else None


async def timed(
    client: Any,
    tally: Tally,
    route: str,
    path: str,
    *,
    method: str = "GET",
    key: tuple[Any, ...] | None = None,
    cached: bool | None = None,
    shared: Shared,
    body: bool | str = False,
    **kw: Any,
) -> Any:
    """One request; when 2xx its JSON body (``body``: parsed; ``"page"``: a page's fields
    only, which follow its ``data``; else ``{}``: the client does not pay for parsing what it
    does not read, on the cores the server uses), ``409`` for a conflict, else ``None``. The
    time is until the whole body was read."""
    import aiohttp
    import orjson

    if cached is None:
        cached = shared.cache.read(key) if method == "GET" else False
    t0 = time.monotonic()
    p0 = time.perf_counter()
    try:
        async with client.request(method, path, **kw) as r:
            status, data = r.status, await r.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.add(route, t0, time.perf_counter() - p0, type(exc).__name__, cached)
        return None
    seconds = time.perf_counter() - p0
    if method != "GET":
        shared.cache.change()
    if status == 409:
        tally.add(route, t0, seconds, "409", cached)
        return 409
    ok = 200 <= status < 300
    why = "ok" if ok else f"HTTP {status} {data[:160]!r}"
    tally.add(route, t0, seconds, why, cached, len(data))
    if not ok:
        return None
    if body == "page":
        return orjson.loads(b"{" + data[data.rindex(b'"count":') :])
    return orjson.loads(data) if body else {}


def client_session(url: str, headers: dict[str, str] | None = None) -> Any:
    """One client's keep-alive connection. aiohttp, not httpx: on this 2-core machine the
    clients share the cores with the server they measure, and httpx spent about 1.9 ms of CPU
    a request here against aiohttp's 0.45 ms (measured on one small local route)."""
    import aiohttp

    return aiohttp.ClientSession(
        base_url=url, headers=headers, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    )


# -- readers ----------------------------------------------------------------------------------
class Reader:
    """One dashboard or script: one request per ``interval``, drawn from :data:`MIX`."""

    def __init__(self, index: int, shared: Shared, tally: Tally) -> None:
        self.rng = random.Random(index)
        self.shared = shared
        self.tally = tally
        self.session_cursor: str | None = None
        self.trace_walk: tuple[dict[str, Any], str] | None = None  # (filters, cursor)

    async def one(self, client: Any, route: str) -> None:
        rng, sh, tally = self.rng, self.shared, self.tally
        if route == "GET session (live)" and not sh.live:
            route = "GET session (past)"
        if route == "GET session (past)":
            sid = rng.choice(sh.past)
            await timed(
                client, tally, route, f"/api/v1/sessions/{sid}", key=("get_session", sid), shared=sh
            )
        elif route == "GET session (live)":
            sid = rng.choice(sh.live)
            await timed(
                client, tally, route, f"/api/v1/sessions/{sid}", key=("get_session", sid), shared=sh
            )
        elif route == "GET sessions page":
            await self.sessions_page(client, route)
        elif route == "GET traces page":
            await self.traces_page(client, route)
        elif route == "GET summary":
            sid = rng.choice(sh.hot) if rng.random() < 0.5 else rng.choice(sh.past)
            cached = sh.cache.summary(sid, finished=True)
            await timed(
                client, tally, route, f"/api/v1/sessions/{sid}/summary", cached=cached, shared=sh
            )
        else:
            path, key = {
                "GET agents": ("/api/v1/agents", ("list_agents",)),
                "GET status": ("/api/v1/status", ("status",)),
                "GET metrics": ("/metrics", ("metrics",)),
                "GET healthz": ("/healthz", None),  # pings are shared only while in flight
            }[route]
            await timed(client, tally, route, path, key=key, shared=sh)

    async def sessions_page(self, client: Any, route: str) -> None:
        cursor = self.session_cursor if self.rng.random() < 0.5 else None
        params = {"limit": 50, **({"cursor": cursor} if cursor else {})}
        body = await timed(
            client,
            self.tally,
            route,
            "/api/v1/sessions",
            params=params,
            key=("list_sessions", 50, cursor),
            shared=self.shared,
            body="page",
        )
        if isinstance(body, dict):
            self.session_cursor = body.get("next_cursor")

    async def traces_page(self, client: Any, route: str) -> None:
        rng = self.rng
        if self.trace_walk is not None and rng.random() < 0.5:
            filters, cursor = self.trace_walk
        else:
            cursor = None
            pick = rng.random()
            if pick < 1 / 3:
                filters = {}
            elif pick < 2 / 3:
                filters = {"session_id": rng.choice(self.shared.past)}
            else:
                filters = {"role": "actor", "rank": rng.randrange(self.shared.agents)}
        params = {**filters, "limit": 50, **({"cursor": cursor} if cursor else {})}
        key = (
            "list_traces",
            filters.get("session_id"),
            filters.get("role"),
            filters.get("rank"),
            50,
            cursor,
        )
        body = await timed(
            client,
            self.tally,
            route,
            "/api/v1/traces",
            params=params,
            key=key,
            shared=self.shared,
            body="page",
        )
        if isinstance(body, dict):
            nxt = body.get("next_cursor")
            self.trace_walk = (filters, nxt) if nxt else None

    async def run(self, url: str, deadline: float, interval: float) -> None:
        routes, weights = list(MIX), list(MIX.values())
        async with client_session(url) as client:
            await asyncio.sleep(self.rng.uniform(0, interval))
            while time.monotonic() < deadline:
                start = time.monotonic()
                await self.one(client, self.rng.choices(routes, weights)[0])
                await asyncio.sleep(max(0.0, interval - (time.monotonic() - start)))


# -- churn ------------------------------------------------------------------------------------
async def churner(
    url: str, token: str, shared: Shared, tally: Tally, deadline: float, interval: float, i: int
) -> None:
    """Create a session on real agents, follow it to its end (cancel one in four once armed)."""
    rng = random.Random(1000 + i)
    headers = {"Authorization": f"Bearer {token}"}
    async with client_session(url, headers) as client:
        await asyncio.sleep(rng.uniform(0, interval))
        n = 0
        while time.monotonic() < deadline:
            start = time.monotonic()
            if shared.one_at_a_time is None:
                await one_session(client, shared, tally, rng, n, deadline)
            else:
                async with shared.one_at_a_time:
                    await one_session(client, shared, tally, rng, n, deadline)
            n += 1
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - start)))


async def one_session(
    client: Any, shared: Shared, tally: Tally, rng: random.Random, n: int, deadline: float
) -> None:
    wide = shared.one_at_a_time is None and rng.random() < 0.2
    ranks = rng.sample(range(shared.agents), 4 if wide else 1)
    body = {"next_steps": 1, "roles": {"actor": {"ranks": sorted(ranks)}}}
    view = await timed(
        client,
        tally,
        "POST sessions",
        "/api/v1/sessions",
        method="POST",
        json=body,
        shared=shared,
        body=True,
    )
    if isinstance(view, dict):
        await follow(client, shared, tally, view["session_id"], n % 4 == 3, deadline)


async def follow(
    client: Any, shared: Shared, tally: Tally, sid: str, cancel: bool, deadline: float
) -> None:
    created = time.monotonic()
    shared.live.append(sid)
    route = "GET session (live)"
    while time.monotonic() < deadline:
        view = await timed(
            client,
            tally,
            route,
            f"/api/v1/sessions/{sid}",
            key=("get_session", sid),
            shared=shared,
            body=True,
        )
        if isinstance(view, dict):
            if view["state"] in ("done", "partial", "failed", "cancelled", "expired"):
                if tally.counts(created):
                    tally.sessions[view["state"]] = tally.sessions.get(view["state"], 0) + 1
                    if view["state"] not in ("done", "cancelled"):
                        why = f"{view['state']}: {view['reason'][:200]}"
                        tally.reasons[why] = tally.reasons.get(why, 0) + 1
                    tally.to_end.append(time.monotonic() - created)
                return
            if cancel and any(p["armed_at"] for p in view["targets"]):
                cancel = False
                await timed(
                    client,
                    tally,
                    "POST cancel",
                    f"/api/v1/sessions/{sid}/cancel",
                    method="POST",
                    shared=shared,
                )
        await asyncio.sleep(FOLLOW_S)
    if tally.counts(created):
        tally.sessions["live at the end"] = tally.sessions.get("live at the end", 0) + 1


# -- the run ----------------------------------------------------------------------------------
