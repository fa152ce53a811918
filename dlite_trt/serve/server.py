"""Start and stop a real Triton Inference Server on a model repository.

Which server: a ``tritonserver`` on PATH (NVIDIA's container, a system install) with its own
backends; otherwise the Triton 2.51 binary that nvidia-pytriton's wheel bundles, with its Python
backend and the backend stub built for this Python version. For the bundled one the stub runs
this interpreter's environment: this Python's ``bin`` goes first on PATH (the stub finds its
environment there) and its ``libpython`` directory on LD_LIBRARY_PATH.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dlite_trt.errors import DLiteError

INSTALL_HINT = ("install a Triton server: `pip install 'dlite-trt[triton]'` (nvidia-pytriton bundles one), or put "
                "NVIDIA's `tritonserver` on PATH")


@dataclass(frozen=True)
class TritonBinary:
    path: Path
    backend_dir: Path | None  # None: the server's own default
    env: dict[str, str]
    source: str  # what the user is told

    def describe(self) -> str:
        return f"{self.source}: {self.path}"


def find_tritonserver(work: Path) -> TritonBinary:
    """A system ``tritonserver`` if there is one, else nvidia-pytriton's (backends laid out under ``work``)."""
    system = shutil.which("tritonserver")
    if system:
        return TritonBinary(Path(system), None, dict(os.environ), "tritonserver on PATH")
    try:
        import pytriton
    except ImportError as exc:
        raise DLiteError(f"no Triton Inference Server found; {INSTALL_HINT}.") from exc
    root = Path(pytriton.__file__).parent / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise DLiteError(f"nvidia-pytriton has no Python backend stub for Python {version}; use Python 3.8-3.13 "
                         "or a system tritonserver.")
    backends = work / "backends"
    python = backends / "python"
    python.mkdir(parents=True, exist_ok=True)
    for f in (root / "backends" / "python").iterdir():
        (python / f.name).unlink(missing_ok=True)
        (python / f.name).symlink_to(f)
    (python / stub.name).unlink(missing_ok=True)
    (python / stub.name).symlink_to(stub)
    env = dict(os.environ)
    libs = [sysconfig.get_config_var("LIBDIR"), str(Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs")]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in [*libs, env.get("LD_LIBRARY_PATH", "")] if p)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return TritonBinary(root / "bin" / "tritonserver", backends, env, "Triton 2.51 bundled with nvidia-pytriton")


@dataclass
class TritonServer:
    """``with TritonServer(repo, ...) as server:`` starts the server and waits until it is ready."""

    repo: Path
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "127.0.0.1"
    log_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)  # added to the server's (and its backend stubs') environment
    process: subprocess.Popen | None = field(default=None, init=False)
    binary: TritonBinary | None = field(default=None, init=False)
    _work: tempfile.TemporaryDirectory | None = field(default=None, init=False, repr=False)

    @property
    def http_url(self) -> str:
        return f"{_url_host(self.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{_url_host(self.host)}:{self.grpc_port}"

    def start(self, timeout: float = 180.0) -> TritonServer:
        for option, port in (("--http-port", self.http_port), ("--grpc-port", self.grpc_port),
                             ("--metrics-port", self.metrics_port)):
            if not port_free(self.host, port):
                raise DLiteError(f"port {port} on {self.host} is in use (another server?); pass another {option}.")
        self._work = tempfile.TemporaryDirectory(prefix="dlite-triton-")
        work = Path(self._work.name)
        self.binary = find_tritonserver(work)
        cmd = [str(self.binary.path), f"--model-repository={self.repo}", f"--http-port={self.http_port}",
               f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
               f"--http-address={self.host}", f"--grpc-address={self.host}", "--exit-on-error=true",
               "--strict-readiness=true", "--log-verbose=0"]
        if self.binary.backend_dir is not None:
            cmd.append(f"--backend-directory={self.binary.backend_dir}")
        self.log_path = self.log_path or work / "tritonserver.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 - the server writes it for its whole life
        # its own process group: stopping it reaches every backend stub it started
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.binary.env | self.env,
                                        start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                problem = f"tritonserver exited with code {self.process.returncode} while starting"
                break
            if self.ready():
                return self
            time.sleep(0.25)
        else:
            problem = f"tritonserver was not ready after {timeout:.0f} s"
        log = self.log_tail()  # before stop() removes the work directory that holds the log
        self.stop()
        raise DLiteError(f"{problem}:\n{log}")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server (it unloads its models, ends its backend stubs and frees their
        shared memory), then SIGKILL to its whole process group for anything left."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            _kill_group(self.process.pid)  # stubs that outlived the server
        if self._work is not None:
            self._work.cleanup()
            self._work = None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now (connections in TIME_WAIT do not count, as
    for any server that sets SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise DLiteError(f"--host {host}: cannot listen there ({exc.strerror or exc}); pass an address of this "
                             "machine (127.0.0.1, 0.0.0.0 for every interface).") from exc
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (for tests and scripts that start servers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def group_members(pgid: int) -> list[int]:
    """Live processes in a process group (from /proc), zombies excluded."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members
