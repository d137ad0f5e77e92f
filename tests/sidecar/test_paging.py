"""Paged listings: sessions and traces a page at a time, newest first, with cursors that hold
while new items arrive; filters before paging; the CLI's pages. Real uvicorn, a real
in-process coordinator (behind the sidecar's shared-reads cache) and real traces."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from profd.core.errors import RequestInvalid
from profd.core.paging import Listing, decode_cursor, encode_cursor, page_of

from helpers import start_agents, wait_terminal, wait_until

PROFD = [sys.executable, "-m", "profd.cli.main"]


@dataclass(frozen=True)
class Item:
    created_at: float
    ident: str


def key(x: Item) -> tuple[float, str]:
    return (x.created_at, x.ident)


def test_cursor_round_trips_and_foreign_cursors_are_refused() -> None:
    c = encode_cursor("sessions", (1712345678.123456, "20240405-abc"))
    assert re.fullmatch(r"[A-Za-z0-9_-]+", c)  # URL-safe, no padding
    assert decode_cursor("sessions", c) == (1712345678.123456, "20240405-abc")
    for bad in (
        "",
        "%%",
        "bm9wZQ",  # "nope"
        encode_cursor("traces", (1.0, "x")),  # another listing's cursor
        "WyJzZXNzaW9ucyIsIDEsIDJd",  # ["sessions", 1, 2]: an id that is not a string
        "A" * 600,
    ):
        with pytest.raises(RequestInvalid) as err:
            decode_cursor("sessions", bad)
        assert err.value.fields[0].field == "cursor"
    for limit in (0, -1, True, 1.5):
        with pytest.raises(RequestInvalid) as err:
            page_of([], key, "x", limit)  # type: ignore[arg-type]
        assert err.value.fields[0].field == "limit"


def test_pages_are_newest_first_and_stable_under_inserts() -> None:
    items = [Item(float(i // 2), f"id{i:03d}") for i in range(25)]  # created_at ties: by id
    expected = sorted(items, key=key, reverse=True)
    first, cursor, total = page_of(items, key, "x", 10)
    assert first == expected[:10] and total == 25 and cursor is not None
    items += [Item(100.0 + i, f"new{i}") for i in range(5)]  # arrive between the pages
    second, cursor, total = page_of(items, key, "x", 10, cursor)
    assert second == expected[10:20] and total == 30
    third, cursor, _ = page_of(items, key, "x", 10, cursor)
    assert third == expected[20:] and cursor is None  # last page
    newest, _, _ = page_of(items, key, "x", 3)
    assert [x.ident for x in newest] == ["new4", "new3", "new2"]


@pytest.mark.parametrize("bursts", [False, True])
@pytest.mark.parametrize("flat_max", [1000, 10, 0])
def test_a_listing_gives_page_ofs_pages_as_items_arrive_in_any_order(
    flat_max: int, bursts: bool
) -> None:
    """The coordinator's kept listings (sessions, traces by rank) page as page_of pages the
    same items, whatever order they came in (restored ones out of order), with every
    match's count and size; bad limits and cursors are refused the same way. Flat, grown
    past ``flat_max`` on the way (into sorted sublists), or sorted from the first item;
    added one by one, or in bursts of any size (``extend``, as the trace index lists)."""
    import random

    rng = random.Random(7)
    items = [Item(float(rng.randrange(40)), f"id{i:03d}") for i in range(120)]  # ties
    rng.shuffle(items)
    listing: Listing[Item] = Listing(key, size=lambda x: int(x.created_at), flat_max=flat_max)
    seen: list[Item] = []
    burst: list[Item] = []
    for n, item in enumerate(items):
        if bursts:
            burst.append(item)
            if rng.random() < 0.7 and n != len(items) - 1:
                continue
            listing.extend(burst)
            seen += burst
            burst = []
        else:
            listing.add(item)
            seen.append(item)
        if not bursts and n % 17 and n != len(items) - 1:
            continue
        for limit in (1, 7, 50, None):  # walk every page of what is there now
            cursor = None
            while True:
                got = listing.page("x", limit, cursor)
                assert got == page_of(seen, key, "x", limit, cursor)
                cursor = got[1]
                if cursor is None:
                    break
    assert len(listing) == 120 and listing.bytes == sum(int(x.created_at) for x in items)
    assert list(listing) == sorted(items, key=key)  # oldest first
    for limit in (0, -1, True, 1.5):
        with pytest.raises(RequestInvalid) as err:
            listing.page("x", limit)  # type: ignore[arg-type]
        assert err.value.fields[0].field == "limit"
    with pytest.raises(RequestInvalid) as err:
        listing.page("x", 5, encode_cursor("y", (1.0, "id001")))
    assert err.value.fields[0].field == "cursor"


@pytest.fixture
def url(make_sidecar) -> str:
    """A sidecar without a token, its reads shared for a second (as `profd up` runs it)."""
    return make_sidecar(token=None, read_cache_s=1.0).url


def make_sessions(url: str, n: int, first_step: int = 1000) -> list[str]:
    """``n`` sessions on one agent, each cancelled before the next (they would conflict)."""
    made = []
    for i in range(n):
        r = httpx.post(f"{url}/api/v1/sessions", json={"steps": [first_step + i]})
        assert r.status_code == 201, r.text
        sid = r.json()["session_id"]
        assert httpx.post(f"{url}/api/v1/sessions/{sid}/cancel").status_code == 200
        made.append(sid)
    return made


def pages(url: str, path: str, **params: Any) -> list[dict[str, Any]]:
    out, cursor = [], None
    while True:
        query = {**params, **({"cursor": cursor} if cursor else {})}
        body = httpx.get(f"{url}{path}", params=query).json()
        out.append(body)
        cursor = body["next_cursor"]
        if cursor is None:
            return out


def test_sessions_paged_newest_first_and_stable_under_inserts(url: str, local_coordinator) -> None:
    (agent,) = start_agents(local_coordinator, 1, "actor")
    try:
        made = make_sessions(url, 110)
        views = local_coordinator.call("list_sessions")  # the old call shape: every session
        assert [v.session_id for v in views] == made  # ... oldest first, as before
        newest = [
            v.session_id
            for v in sorted(views, key=lambda v: (v.created_at, v.session_id), reverse=True)
        ]
        default = httpx.get(f"{url}/api/v1/sessions").json()
        assert default["count"] == 50 and default["total"] == 110
        assert [s["session_id"] for s in default["data"]] == newest[:50]

        got = pages(url, "/api/v1/sessions", limit=50)
        assert [b["count"] for b in got] == [50, 50, 10] and {b["total"] for b in got} == {110}
        assert [s["session_id"] for b in got for s in b["data"]] == newest

        # New sessions arrive between two pages: the next page goes on where the first ended.
        first = httpx.get(f"{url}/api/v1/sessions", params={"limit": 40}).json()
        later = make_sessions(url, 3, first_step=5000)
        second = httpx.get(
            f"{url}/api/v1/sessions", params={"limit": 40, "cursor": first["next_cursor"]}
        ).json()
        assert [s["session_id"] for s in second["data"]] == newest[40:80]
        assert second["total"] == 113
        top = httpx.get(f"{url}/api/v1/sessions", params={"limit": 3}).json()
        assert [s["session_id"] for s in top["data"]] == later[::-1]
        last = httpx.get(f"{url}/api/v1/sessions", params={"limit": 500}).json()
        assert last["count"] == 113 and last["next_cursor"] is None

        r = httpx.get(f"{url}/api/v1/traces", params={"cursor": first["next_cursor"]})
        assert r.status_code == 422 and r.json()["fields"][0]["field"] == "cursor"
    finally:
        agent.close(timeout=10)


def record(owner: Any, url: str, steps: list[int]) -> str:
    """Two actors record ``steps`` (one trace per step and rank); the session id."""
    agents = start_agents(owner, 2, "actor")
    try:
        r = httpx.post(
            f"{url}/api/v1/sessions",
            json={"steps": steps, "roles": {"actor": {"all_ranks": True}}},
        )
        assert r.status_code == 201, r.text
        sid = r.json()["session_id"]
        wait_until(lambda: all(a.plan.windows for a in agents), 10, what="plans")
        for n in range(steps[0], steps[-1] + 2):
            for a in agents:
                with a.step(n), a.stage("work"):
                    torch.ones(4) @ torch.ones(4)
        assert wait_terminal(owner, sid).state.value == "done"
        return sid
    finally:
        for a in agents:
            a.close(timeout=10)


def test_traces_paged_after_filters_with_bytes_of_every_match(url: str, local_coordinator):
    sid = record(local_coordinator, url, [1, 2, 3, 4])
    every = local_coordinator.call("list_traces", sid)  # the old call shape: a list
    assert len(every) == 8
    newest = sorted(every, key=lambda t: (t.created_at, t.trace_id), reverse=True)

    got = pages(url, "/api/v1/traces", session_id=sid, limit=3)
    assert [b["count"] for b in got] == [3, 3, 2]
    assert [t["trace_id"] for b in got for t in b["data"]] == [t.trace_id for t in newest]
    assert {(b["total"], b["bytes"]) for b in got} == {(8, sum(t.bytes for t in every))}

    ranked = pages(url, "/api/v1/traces", session_id=sid, rank=1, limit=3)
    assert [b["count"] for b in ranked] == [3, 1]
    shown = [t for b in ranked for t in b["data"]]
    assert {t["rank"] for t in shown} == {1}
    assert [t["trace_id"] for t in shown] == [t.trace_id for t in newest if t.rank == 1]
    assert {b["bytes"] for b in ranked} == {sum(t.bytes for t in every if t.rank == 1)}
    role = every[0].role  # across sessions: the coordinator's kept listings by role, rank
    for params in ({}, {"rank": 1}, {"role": role}, {"role": role, "rank": 0}):
        want = [
            t for t in newest
            if t.rank == params.get("rank", t.rank) and t.role == params.get("role", t.role)
        ]  # fmt: skip
        got = pages(url, "/api/v1/traces", limit=3, **params)
        assert [t["trace_id"] for b in got for t in b["data"]] == [t.trace_id for t in want]
        assert {(b["total"], b["bytes"]) for b in got} == {(len(want), sum(t.bytes for t in want))}
    none = httpx.get(f"{url}/api/v1/traces", params={"role": "critic"}).json()
    assert none == {"data": [], "count": 0, "total": 0, "next_cursor": None, "bytes": 0}


def cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, HOME=str(tmp_path), PROFD_STATE_DIR=str(tmp_path / "state"), COLUMNS="250"
    )
    return subprocess.run(
        [*PROFD, *args], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )


def test_cli_shows_the_newest_page_and_how_to_see_more(
    url: str, local_coordinator, tmp_path: Path
) -> None:
    sid = record(local_coordinator, url, [1, 2])
    (agent,) = start_agents(local_coordinator, 1, "critic")
    try:
        made = [sid, *make_sessions(url, 4)]
    finally:
        agent.close(timeout=10)
    newest = made[::-1]

    r = cli(["sessions", "--url", url, "--limit", "2"], tmp_path)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "the newest 2 of 5 sessions; 3 more" in text, text
    assert f"`profd sessions --url {url} --limit 2 --all` for all" in text
    assert all(s in text for s in newest[:2]) and newest[2] not in text
    cursor = re.search(r"--cursor (\S+)` for the next page", text).group(1)

    r = cli(["sessions", "--url", url, "--limit", "2", "--cursor", cursor, "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert [s["session_id"] for s in json.loads(r.stdout)] == newest[2:4]
    assert "2 sessions after the cursor, 5 in all; more follow" in " ".join(r.stderr.split())

    r = cli(["sessions", "--url", url, "--all", "--json"], tmp_path)
    assert [s["session_id"] for s in json.loads(r.stdout)] == newest and not r.stderr

    r = cli(["traces", "--url", url, "--session", sid, "--limit", "1", "--json"], tmp_path)
    assert r.returncode == 0 and len(json.loads(r.stdout)) == 1
    assert "the newest 1 of 4 traces; 3 more" in " ".join(r.stderr.split())
    r = cli(["traces", "--url", url, "--all", "--json"], tmp_path)
    assert len(json.loads(r.stdout)) == 4

    dest = tmp_path / "all"
    r = cli(["traces", "--url", url, "--limit", "1", "--download", str(dest)], tmp_path)
    assert r.returncode == 0, r.stderr
    # every page, whatever --limit says; without --session, in the session's folder
    assert [p.name for p in dest.iterdir()] == [sid] and len(list((dest / sid).iterdir())) == 4
    assert "downloaded 4 file(s)" in r.stdout
