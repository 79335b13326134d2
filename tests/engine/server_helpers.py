"""Start real `pagoda serve` processes on 127.0.0.1 and talk to them over plain HTTP."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

CHAT_TEMPLATE = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"


def _read_response(response: http.client.HTTPResponse) -> tuple[int, dict, Any]:
    """(status, headers, body as JSON, or as text when it is not JSON, e.g. a Server-Sent Events stream)."""
    payload = response.read()
    try:
        parsed = json.loads(payload) if payload else None
    except json.JSONDecodeError:
        parsed = payload.decode()
    return response.status, dict(response.getheaders()), parsed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log_path: Optional[str] = None  # where its output goes, when not to a pipe
    host: str = "127.0.0.1"  # another loopback address (127.0.0.5) stands in for a pod's IP in the cluster tests

    def log(self) -> str:
        """Everything the server has logged so far (servers started with ``log_path``)."""
        assert self.log_path is not None, "start the server with log_path to read its log while it runs"
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def request(
        self, method: str, path: str, body: Any = None, headers: Optional[dict] = None, raw: Optional[bytes] = None
    ) -> tuple[int, dict, Any]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        result = _read_response(response)
        conn.close()
        return result

    def burst(self, path: str, bodies: list[Any]) -> list[tuple[int, dict, Any]]:
        """POST every body on its own connection, all sent back to back once every connection is
        open, so that the server reads them in (nearly) one event-loop iteration."""
        sockets = [socket.create_connection((self.host, self.port), timeout=120) for _ in bodies]
        for sock, body in zip(sockets, bodies):
            data = json.dumps(body).encode()
            head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            sock.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        results = []
        for sock in sockets:
            response = http.client.HTTPResponse(sock)
            response.begin()
            results.append(_read_response(response))
            sock.close()
        return results

    def metric(self, name: str) -> float:
        """Sum of all samples of one metric family line (``name{...} value``) in /metrics."""
        _, _, text = self.request("GET", "/metrics")
        total = 0.0
        for line in str(text).splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(timeout)


def start_server(
    *args: str, wait_ready: bool = True, log_path: Optional[str] = None, program: tuple[str, ...] = ("-m", "pagoda.cli")
) -> Server:
    """``pagoda serve ARGS`` on a free port (``--log-level warning`` unless ARGS set one), ready.

    ``program`` replaces ``-m pagoda.cli`` (a script that injects a fault, say); its output goes to a pipe, or
    to ``log_path`` so that tests can read it while the server runs."""
    port = free_port()
    level = () if "--log-level" in args else ("--log-level", "warning")
    output = open(log_path, "w") if log_path is not None else subprocess.PIPE  # noqa: SIM115 (the child owns it)
    process = subprocess.Popen(
        [sys.executable, *program, "serve", "--port", str(port), *level, *args],
        stdout=output,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server = Server(process, port, log_path)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = server.log() if log_path is not None else process.stdout.read()
            raise RuntimeError(f"pagoda serve exited with {process.returncode}: {output}")
        try:
            status, _, _ = server.request("GET", "/ready" if wait_ready else "/health")
            if status == 200:
                return server
        except OSError:
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError("pagoda serve did not become ready in 90 s")
