"""``GET /``: the dashboard, one self-contained page (inline CSS and JS, no CDN, no build).

The page holds no data and no token: its script polls the JSON API and sends the bearer token
the operator types in (kept in the tab's ``sessionStorage``). A Content-Security-Policy allows
exactly the page's own inline script and style (by hash) and requests to this origin only.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

__all__ = ["page", "router"]

router = APIRouter(include_in_schema=False)


def _hashes(html: str, tag: str) -> str:
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
    return " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() + "'"
        for b in blocks
    )


@lru_cache(maxsize=1)
def page() -> tuple[str, dict[str, str]]:
    """The page and its security headers (read once from the package data)."""
    html = resources.files("profd.api").joinpath("static/dashboard.html").read_text("utf-8")
    csp = (
        f"default-src 'none'; script-src {_hashes(html, 'script')}; "
        f"style-src {_hashes(html, 'style')}; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    headers = {
        "Content-Security-Policy": csp,
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }
    return html, headers


@router.get("/", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    """Agents, sessions and traces, live; a form to start a session."""
    html, headers = page()
    return HTMLResponse(html, headers=headers)
