"""The FastAPI app factory. No Ray connection or settings are read at import time."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from profd.actors.runner import default_runner
from profd.api import metrics
from profd.api.client import BatchedReads, CoordinatorClient, RayCoordinatorClient, SharedReads
from profd.api.deps import ReadTokenDep
from profd.api.errors import error_responses
from profd.api.routes import agents, dashboard, sessions, stacks, status, traces, triggers
from profd.api.security import BodyLimit, HostCheck, allowed_host_names
from profd.api.summaries import SummaryCache
from profd.core.constants import __version__
from profd.core.errors import ProfdError, RequestInvalid
from profd.core.ray_env import connect_ray, ray_context
from profd.core.request import field_errors
from profd.core.settings import SidecarConfig

__all__ = ["create_app"]

log = logging.getLogger(__name__)


def create_app(
    config: SidecarConfig | None = None, client: CoordinatorClient | None = None
) -> FastAPI:
    """Build the sidecar app. Without ``client`` it connects to Ray when it starts."""
    config = config or SidecarConfig()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if client is None:
            connect_ray(config.ray_address)  # a no-op in the sidecar actor: Ray is up
            inner = BatchedReads(RayCoordinatorClient())
            app.state.client = SharedReads(inner, config.read_cache_s)
        else:
            app.state.client = client
        app.state.runner = default_runner()
        app.state.node_id = ray_context().node_id
        app.state.summaries = SummaryCache()  # its lock belongs to this loop
        if config.freeze_gc:
            gc.collect()
            gc.freeze()
        try:
            yield
        finally:
            await app.state.summaries.aclose()

    app = FastAPI(
        title="profd",
        version=__version__,
        description=_DESCRIPTION,
        lifespan=lifespan,
        # The Host check (security.HostCheck) answers before any route, on every route.
        responses=error_responses(400) if "*" not in config.allowed_hosts else None,
    )
    app.state.config = config
    app.state.client = client
    app.state.runner = None
    app.state.node_id = None
    app.state.metrics = metrics.new_registry()
    app.state.summaries = SummaryCache()
    # /healthz (in status.router) stays open for liveness probes; /api/v1/status guards itself.
    app.include_router(status.router)
    for router in (agents.router, sessions.router, stacks.router, traces.router, triggers.router):
        app.include_router(router, dependencies=[ReadTokenDep])
    app.include_router(metrics.router)
    app.include_router(dashboard.router)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    # Added last, so outermost: a request for another Host is refused before anything runs.
    app.add_middleware(
        HostCheck,
        allowed=allowed_host_names(config),
        any_ip=SidecarConfig.host_is_wildcard(config.host),
    )
    _install_error_handlers(app)
    _declare_security(app, config)
    return app


_DESCRIPTION = """Live, step-aligned profiling of PyTorch training on Ray.

* Changes (POST) need `Authorization: Bearer <token>` (the token file `profd up` prints).
  When the sidecar listens beyond loopback, every route needs it, except `/healthz`, the
  dashboard page `/` (which holds no data) and this schema.
* Every route answers only requests whose `Host` header names the sidecar (loopback names,
  the bind address, names the operator allowed with `profd up --allow-host NAME`); any other
  Host, or none, gets 400 `host_not_allowed` (a guard against DNS rebinding).
* Every error has one body: `{"error", "message", "fields": [{"field", "message", "type"}]}`;
  422 bad input, 409 conflict, 404 unknown id, 413 body too large, 401/403 token, 400 Host.
"""

#: Routes that stay open whatever the bind address (liveness probes).
OPEN_PATHS = frozenset({"/healthz"})


def _declare_security(app: FastAPI, config: SidecarConfig) -> None:
    """The OpenAPI schema says which operations need the bearer token, for this config:
    every change, and beyond loopback every route but :data:`OPEN_PATHS`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        if config.token:
            spec.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer", "description": "profd up token"}
            }
            for path, ops in spec["paths"].items():
                for method, op in ops.items():
                    read = method in ("get", "head")
                    if not read or (not config.loopback and path not in OPEN_PATHS):
                        op["security"] = [{"bearer": []}]
        app.openapi_schema = spec
        return spec

    app.openapi = openapi  # type: ignore[method-assign]


def _install_error_handlers(app: FastAPI) -> None:
    """One error body everywhere: ``{"error", "message", "fields": [{"field", "message"}]}``."""

    @app.exception_handler(ProfdError)
    async def _profd_error(_: Request, exc: ProfdError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = RequestInvalid.from_fields(field_errors(list(exc.errors())))
        return JSONResponse(err.body(), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI could not read the body (e.g. not UTF-8): bad input
            err = RequestInvalid.at("body", f"unreadable request body: {exc.detail}")
            return JSONResponse(err.body(), status_code=422)
        code = {
            401: "unauthorized",
            403: "forbidden",
            404: "not_found",
            405: "method_not_allowed",
            413: "payload_too_large",
        }
        body = {
            "error": code.get(exc.status_code, "http_error"),
            "message": str(exc.detail),
            "fields": [],
        }
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in the sidecar")
        body = {"error": "internal", "message": f"{type(exc).__name__}: {exc}", "fields": []}
        return JSONResponse(body, status_code=500)
