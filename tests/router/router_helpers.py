"""Start `pagoda router` as a real process (``python -m pagoda_operator.router``) on 127.0.0.1, and talk to it."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from server_helpers import free_port  # noqa: E402  (tests/engine/)


@dataclass
class RouterProcess:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def request(
        self, method: str, path: str, body: Any = None, headers: Optional[dict] = None, raw: Optional[bytes] = None
    ) -> tuple[int, dict, Any]:
        """(status, headers, JSON body or text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        payload = response.read()
        conn.close()
        try:
            parsed: Any = json.loads(payload) if payload else None
        except ValueError:
            parsed = payload.decode()
        return response.status, dict(response.getheaders()), parsed

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` in the router's /metrics whose labels include ``labels``."""
        _, _, text = self.request("GET", "/metrics")
        total = 0.0
        for line in str(text).splitlines():
            if not (line.startswith(name + "{") or line.startswith(name + " ")):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def metric_when(self, name: str, expected: float, timeout: float = 10, **labels: str) -> float:
        """``metric`` once it equals ``expected``, or its last value after ``timeout`` seconds.

        A streamed answer is counted when the router's handler returns, which can be just after
        the client has read the last chunk: a read straight after the stream would race it.
        """
        deadline = time.monotonic() + timeout
        value = self.metric(name, **labels)
        while value != expected and time.monotonic() < deadline:
            time.sleep(0.05)
            value = self.metric(name, **labels)
        return value

    def stop(self, timeout: float = 15) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout)


def write_static_models(path: Path, models: Sequence[Mapping[str, Any]]) -> Path:
    """Write a static models file (``models: [...]``)."""
    path.write_text(yaml.safe_dump({"models": [dict(m) for m in models]}), encoding="utf-8")
    return path


def start_router(*args: str, log_path: Path, env: Optional[Mapping[str, str]] = None) -> RouterProcess:
    """``python -m pagoda_operator.router --host 127.0.0.1 --port FREE ARGS``, once its /health answers."""
    port = free_port()
    log = open(log_path, "w")  # noqa: SIM115 (the child owns it)
    command = [sys.executable, "-m", "pagoda_operator.router", "--host", "127.0.0.1", "--port", str(port), *args]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(env) if env else None)
    router = RouterProcess(process, port, log_path)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the router exited with {process.returncode}: {router.log()}")
        try:
            if router.request("GET", "/health")[0] == 200:
                return router
        except OSError:
            pass
        time.sleep(0.05)
    router.stop()
    raise RuntimeError(f"the router did not answer /health in 30 s: {router.log()}")


@contextmanager
def running_router(*args: str, log_path: Path, env: Optional[Mapping[str, str]] = None) -> Iterator[RouterProcess]:
    router = start_router(*args, log_path=log_path, env=env)
    try:
        yield router
    finally:
        router.stop()
