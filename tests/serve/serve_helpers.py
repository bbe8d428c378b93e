"""Real servers on loopback for the serve tests: uvicorn in a background thread, and ``/metrics`` parsed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from sparseety.serve import ServeConfig, create_app

MODEL = "smollm2-135m"


class LiveServer:
    """A uvicorn server on 127.0.0.1 in a daemon thread; ``url`` is its base address."""

    def __init__(self, app) -> None:
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    @property
    def state(self):
        return self.app.state.serve


@contextmanager
def live_server(engine, **settings) -> Iterator[LiveServer]:
    """Start a server for ``ServeConfig(model=MODEL, **settings)`` on ``engine``; stop it afterwards."""
    server = LiveServer(create_app(ServeConfig(model=MODEL, **settings), engine)).start()
    try:
        yield server
    finally:
        server.stop()


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` parsed by prometheus-client: ``{"name{label=value,...}": value}`` for every sample."""
    import httpx2 as httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples
