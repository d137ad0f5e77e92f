"""The sidecar actor: serves the FastAPI app with uvicorn on a thread of a Ray actor.

Running inside a detached actor lets ``profd up`` return while the API keeps serving, and
gives the app a Ray connection without any set-up of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from profd.core.settings import SidecarConfig

__all__ = ["SidecarServer"]

log = logging.getLogger(__name__)


class SidecarServer:
    def __init__(self, config: SidecarConfig | dict, start_timeout_s: float = 30.0) -> None:
        import uvicorn

        from profd.api import create_app

        self.config = config if isinstance(config, SidecarConfig) else SidecarConfig(**config)
        app = create_app(self.config)
        uv = uvicorn.Config(
            app,
            host=self.config.host,
            port=self.config.port,
            log_level="warning",
            lifespan="on",
            access_log=False,
        )
        self._server = uvicorn.Server(uv)
        self._thread = threading.Thread(target=self._server.run, name="profd-sidecar", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"sidecar could not listen on {self.config.host}:{self.config.port} "
                    "(port in use?)"
                )
            time.sleep(0.02)
        sock = self._server.servers[0].sockets[0]
        self._port = int(sock.getsockname()[1])
        log.info("profd sidecar listening on http://%s:%d", self.config.host, self._port)

    def ping(self) -> str:
        from profd.core.constants import __version__

        return __version__

    def address(self) -> dict[str, Any]:
        # a wildcard bind is reached locally through loopback
        local = "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "") else self.config.host
        return {"host": self.config.host, "port": self._port, "url": f"http://{local}:{self._port}"}

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
