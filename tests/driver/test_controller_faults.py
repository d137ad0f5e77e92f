"""The driver's controller never blocks a step on profd: a circuit breaker around the
coordinator, a per-step budget, a GCS probe, and a background thread that cannot keep the
driver from exiting. (Against a real coordinator and a real GCS: bench/driver_faults.py and
tests/e2e/test_lifecycle.py.)"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

from profd.core.protocol import DriverAck
from profd.driver.controller import Controller, ControllerConfig, Link

from helpers import wait_until

FAST = ControllerConfig(
    delivery_timeout_s=0.1, step_grace_s=0.05, backoff_initial_s=0.2, backoff_max_s=0.4
)


class Caller:
    """A coordinator stand-in: records calls; can be slow or failing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.delay = 0.0
        self.fail: Exception | None = None

    def call(self, method: str, *args: Any, timeout: float) -> Any:
        self.calls.append((method, args))
        if self.fail is not None:
            raise self.fail
        if self.delay:
            time.sleep(min(self.delay, timeout))
            if self.delay > timeout:
                raise TimeoutError("no answer")
        return DriverAck(args[0])


def timed_step(ctl: Controller, n: int) -> float:
    t0 = time.perf_counter()
    with ctl.step(n):
        pass
    return time.perf_counter() - t0


def test_healthy_calls_go_through_on_the_background_thread() -> None:
    caller = Caller()
    ctl = Controller(lambda: caller, config=FAST)
    for n in range(5):
        timed_step(ctl, n)
    assert [a[0] for _, a in caller.calls] == [0, 1, 2, 3, 4]
    assert ctl.link is Link.CLOSED and ctl.last_reply.step == 4
    ctl.close()


def test_no_coordinator_costs_nothing_and_it_is_found_later() -> None:
    found: dict[str, Any] = {"caller": None}
    ctl = Controller(lambda: found["caller"], config=FAST)
    timed_step(ctl, 1)
    assert ctl.link is Link.OPEN
    worst = max(timed_step(ctl, n) for n in range(2, 200))
    assert worst < 0.05
    found["caller"] = caller = Caller()  # profd up, after the job started
    wait_until(lambda: timed_step(ctl, 300) is not None and ctl.link is Link.CLOSED, 5)
    timed_step(ctl, 301)
    assert ("controller_step", (301, FAST.delivery_timeout_s, None)) in caller.calls
    # the reconnect probe announced the driver's latest step
    assert any(m == "controller_step" and a[1] == 0.0 for m, a in caller.calls)
    ctl.close()


def test_a_slow_coordinator_costs_one_budget_then_nothing() -> None:
    caller = Caller()
    caller.delay = 5.0
    ctl = Controller(lambda: caller, config=FAST)
    first = timed_step(ctl, 1)
    assert FAST.step_budget_s * 0.9 <= first < FAST.step_budget_s + 0.2
    assert ctl.link is Link.OPEN and "no answer within" in ctl.history[-1].why
    assert max(timed_step(ctl, n) for n in range(2, 100)) < 0.05
    caller.delay = 0.0  # it recovers: the background probe closes the circuit
    wait_until(lambda: timed_step(ctl, 200) is not None and ctl.link is Link.CLOSED, 15)
    assert [c.to for c in ctl.history][-1] is Link.CLOSED
    ctl.close()


def test_a_failing_coordinator_opens_the_circuit_at_once() -> None:
    caller = Caller()
    caller.fail = RuntimeError("actor died")
    ctl = Controller(lambda: caller, config=FAST)
    assert timed_step(ctl, 1) < 0.1
    assert ctl.link is Link.OPEN and "actor died" in ctl.history[0].why
    ctl.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_gone_gcs_is_noticed_before_the_budget_runs_out() -> None:
    hang = threading.Event()

    class Hanging:
        def call(self, method: str, *args: Any, timeout: float) -> Any:
            hang.wait(timeout)  # a Ray call whose GCS is gone

    config = ControllerConfig(delivery_timeout_s=5.0)
    address = f"127.0.0.1:{_closed_port()}"
    ctl = Controller(lambda: Hanging(), config=config, gcs_address=lambda: address)
    took = timed_step(ctl, 1)
    hang.set()
    assert took < 0.5, took  # not the 5.25 s budget
    assert ctl.link is Link.OPEN and "does not answer" in ctl.history[0].why
    ctl.close()


def test_a_call_stuck_in_ray_never_keeps_the_driver_from_exiting() -> None:
    """The driver of the issue hung for good; its process must still end."""
    code = textwrap.dedent(
        """
        import time
        from profd.driver.controller import Controller, ControllerConfig

        def lookup():
            time.sleep(3600)  # ray.get_actor with the GCS gone

        ctl = Controller(lookup, config=ControllerConfig(delivery_timeout_s=0.2))
        for n in range(50):
            with ctl.step(n):
                pass
        print("done", flush=True)
        """
    )
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert time.monotonic() - t0 < 20


def test_the_gcs_watcher_opens_the_circuit_though_the_coordinator_still_answers() -> None:
    """With its GCS gone a cluster is going down, even while the coordinator actor answers:
    the driver stops announcing within a watch period, without waiting on any call."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    caller = Caller()
    config = FAST.model_copy(update={"gcs_watch_s": 0.05})
    ctl = Controller(lambda: caller, config=config, gcs_address=lambda: address)
    timed_step(ctl, 1)
    assert ctl.link is Link.CLOSED
    server.close()  # the GCS process is gone
    wait_until(lambda: timed_step(ctl, 2) is not None and ctl.link is Link.OPEN, 5)
    assert "does not answer" in ctl.history[-1].why
    calls = len(caller.calls)
    assert max(timed_step(ctl, n) for n in range(3, 50)) < 0.05
    assert len(caller.calls) == calls  # nothing sent while the GCS is away
    ctl.close()
