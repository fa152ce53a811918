"""`dlite-trt serve --frontend openai` as a child process: started, waited for, scraped, stopped
(SIGINT). The replay benchmark and the tests drive real servers through it."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from dlite_trt.errors import DLiteError
from dlite_trt.serve.server import free_port


class OpenAIServerProcess:
    def __init__(self, engine: Path, *args: str, model: str = "model", threads: int | None = None,
                 env: dict[str, str] | None = None, start_timeout: float = 300.0) -> None:
        self.port, self.model = free_port(), model
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dlite_trt.cli", "serve", "--engine", str(engine), "--port", str(self.port),
               "--served-model-name", model, *(["--threads", str(threads)] if threads else []), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        self.log: list[str] = []
        deadline = time.monotonic() + start_timeout
        while not any("Ctrl-C stops it" in line for line in self.log):
            line = self.proc.stdout.readline()
            if (not line and self.proc.poll() is not None) or time.monotonic() > deadline:
                self.proc.kill()
                raise DLiteError(f"the server did not start ({' '.join(cmd)}):\n{''.join(self.log)}")
            self.log.append(line)
        threading.Thread(target=self._drain, daemon=True).start()
        while True:  # the banner comes just before uvicorn binds its port
            try:
                if self.get("/health")[0] == 200:
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.status, r.read().decode()

    def post(self, path: str, body: dict | str | bytes, timeout: float = 600) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def abandon(self, path: str, body: dict, count: int, after_s: float = 0.0, after: Any = None) -> None:
        """``count`` requests sent at once, each on its own connection, whose clients hang up without
        reading anything after ``after_s`` seconds, or once ``after()`` returns."""
        data = json.dumps(body).encode()
        conns = []
        for _ in range(count):
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            conn.request("POST", path, data, {"Content-Type": "application/json"})
            conns.append(conn)
        if after is not None:
            after()
        else:
            time.sleep(after_s)
        for conn in conns:
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics: 'name{labels}' -> value."""
        out = {}
        for line in self.get("/metrics")[1].splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> int:
        """SIGINT, as Ctrl-C; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=60)

    def __enter__(self) -> OpenAIServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
