"""The dashboard in a real headless Chromium (Debian ``chromium`` + ``chromium-driver``,
driven by selenium), against a real uvicorn sidecar whose agents recorded a real session.

Missing browser: in CI (``CI`` set) the test fails, since ``.ci/run`` installs the browser;
elsewhere it is skipped with the command that installs it.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from profd.api import create_app
from profd.settings import SidecarConfig

from helpers import LoopClient, UvicornThread, start_agents, wait_terminal, wait_until

TOKEN = "dashboard-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1100",
)


def _browser() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    try:
        import selenium  # noqa: F401
    except ImportError:
        driver = None
    if browser and driver:
        return browser, driver
    why = "needs Debian chromium + chromium-driver and selenium (.ci/run installs them)"
    if os.environ.get("CI"):
        pytest.fail(f"dashboard test {why}; found browser={browser} driver={driver}")
    pytest.skip(f"{why}: apt-get install -y chromium chromium-driver")


@pytest.fixture
def chrome() -> Iterator[Any]:
    browser, driver = _browser()
    os.environ.setdefault("SE_OFFLINE", "true")  # never let selenium download a driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for flag in FLAGS:
        opts.add_argument(flag)
    drv = webdriver.Chrome(service=Service(driver), options=opts)
    drv.set_page_load_timeout(30)
    yield drv
    drv.quit()


@pytest.fixture
def recorded(local_coordinator) -> Iterator[tuple[str, Any, str]]:
    """A sidecar whose two actors recorded step 1 (two traces); a critic idles."""
    app = create_app(SidecarConfig(token=TOKEN), client=LoopClient(local_coordinator))
    actors = start_agents(local_coordinator, 2, "actor")
    critic = start_agents(local_coordinator, 1, "critic")[0]
    try:
        with UvicornThread(app) as srv:
            body = {"steps": [1], "roles": {"actor": {"all_ranks": True}}}
            r = httpx.post(f"{srv.url}/api/v1/sessions", json=body, headers=AUTH)
            sid = r.json()["session_id"]
            wait_until(lambda: all(a.plan.windows for a in actors), 10, what="plans")
            for a in actors:
                for n in (1, 2):
                    with a.step(n), a.stage("work"):
                        torch.ones(4) @ torch.ones(4)
            with critic.step(2):
                pass
            assert wait_terminal(local_coordinator, sid).state.value == "done"
            yield srv.url, local_coordinator, sid
    finally:
        for a in [*actors, critic]:
            a.close(timeout=10)


def rows(drv: Any, table: str) -> list[list[str]]:
    """The table's cells, read in one script call (the page re-renders as it polls)."""
    return drv.execute_script(
        "return [...document.querySelectorAll(`#${arguments[0]} tbody tr:not(.empty)`)]"
        ".map(tr => [...tr.cells].map(td => td.innerText.trim()));",
        table,
    )


def links(drv: Any) -> list[tuple[str, str]]:
    return [
        tuple(x)
        for x in drv.execute_script(
            "return [...document.querySelectorAll('#traces tbody a')]"
            ".map(a => [a.href, a.textContent]);"
        )
    ]


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def check_tables(chrome: Any, url: str, owner: Any, sid: str) -> None:
    """Agents, the recorded session and its traces, with working download links."""
    expected = [
        ("actor", "0", "alive", "2"),
        ("actor", "1", "alive", "2"),
        ("critic", "0", "alive", "2"),
    ]

    def agents_shown() -> list[list[str]] | None:
        shown = rows(chrome, "agents")
        return shown if [(r[0], r[1], r[5], r[6]) for r in shown] == expected else None

    agents = wait_until(agents_shown, 20, what=f"agents rendered as {expected}")
    assert all(r[3] for r in agents)  # node column filled
    (session,) = rows(chrome, "sessions")
    assert session[0] == sid and session[1] == "done" and "2/2 targets" in session[4]
    assert session[5] == "2"
    assert sorted((r[1], r[2], r[3]) for r in rows(chrome, "traces")) == [
        ("actor", "0", "1"),
        ("actor", "1", "1"),
    ]
    by_id = {t.trace_id: t for t in owner.call("get_session", sid).traces}
    shown = links(chrome)
    assert len(shown) == 2
    for href, text in shown:
        trace_id = href.split("/")[-2]
        assert href == f"{url}/api/v1/traces/{trace_id}/download"
        assert text == by_id[trace_id].file_name
    href = shown[0][0]
    size = chrome.execute_async_script(
        "const done = arguments[1];"
        "fetch(arguments[0]).then(r => r.arrayBuffer()).then(b => done(b.byteLength));",
        href,
    )
    assert size == by_id[href.split("/")[-2]].bytes


def check_form(chrome: Any, owner: Any, sid: str) -> None:
    """The form: refused without the token (the message shown), a session with it."""
    from selenium.webdriver.common.by import By

    chrome.find_element(By.ID, "f-steps").send_keys("40")
    chrome.find_element(By.ID, "f-role").send_keys("actor")
    chrome.find_element(By.ID, "f-ranks").send_keys("1")
    chrome.find_element(By.ID, "f-submit").click()
    result = chrome.find_element(By.ID, "form-result")
    wait_until(lambda: "HTTP 401" in result.text, 10, what="401 shown")
    assert "bearer token" in result.text and len(owner.call("list_sessions")) == 1

    # The token is typed into a password field and kept in sessionStorage only.
    field = chrome.find_element(By.ID, "token")
    assert field.get_attribute("type") == "password"
    field.send_keys(TOKEN)
    chrome.find_element(By.ID, "use-token").click()
    assert chrome.execute_script("return sessionStorage.getItem('profd-token')") == TOKEN
    assert field.get_attribute("value") == "" and TOKEN not in chrome.page_source
    chrome.find_element(By.ID, "f-submit").click()
    wait_until(lambda: "armed" in result.text, 10, what="session created")
    new_sid = result.get_attribute("data-session-id")
    assert new_sid and new_sid != sid
    view = owner.call("get_session", new_sid)
    assert view.steps == [40] and [(t.role, t.rank) for t in view.targets] == [("actor", 1)]
    wait_until(
        lambda: any(r[0] == new_sid and r[1] == "armed" for r in rows(chrome, "sessions")),
        10,
        what="new session listed",
    )


def test_dashboard_in_chromium(chrome, recorded, tmp_path: Path) -> None:
    url, owner, sid = recorded
    chrome.get(f"{url}/?interval=500")
    assert chrome.title == "profd dashboard"
    check_tables(chrome, url, owner, sid)
    check_form(chrome, owner, sid)

    ARTIFACTS.mkdir(exist_ok=True)
    shot = chrome.get_screenshot_as_png()
    (ARTIFACTS / "dashboard.png").write_bytes(shot)
    (tmp_path / "dashboard.png").write_bytes(shot)
    width, height = png_size(shot)
    assert width >= 1000 and height >= 700 and len(shot) > 30_000  # a rendered page, not blank
