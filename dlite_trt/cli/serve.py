"""`dlite-trt serve`: a real Triton Inference Server running an engine, until Ctrl-C."""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path

import click

from dlite_trt.cli.inputs import check_engine_dir
from dlite_trt.cli.serve_options import ENGINE, INSTANCES, MAX_BATCH, THREADS


@click.command("serve")
@ENGINE
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the HTTP and gRPC endpoints bind.")
@click.option("--http-port", default=8000, show_default=True, type=click.IntRange(1, 65535),
              help="Port of the HTTP endpoint (KServe v2 and /generate).")
@click.option("--grpc-port", default=8001, show_default=True, type=click.IntRange(1, 65535),
              help="Port of the gRPC endpoint.")
@click.option("--metrics-port", default=8002, show_default=True, type=click.IntRange(1, 65535),
              help="Port of Triton's Prometheus metrics.")
@INSTANCES
@MAX_BATCH
@THREADS
@click.option("--repo", type=click.Path(path_type=Path, file_okay=False),
              help="Write the model repository here (default: a temporary directory, removed on exit).")
def command(engine: Path, host: str, http_port: int, grpc_port: int, metrics_port: int, instances: int,
          max_batch: int | None, threads: int | None, repo: Path | None) -> None:
    """Serve an engine from a real Triton Inference Server until Ctrl-C.

    Uses `tritonserver` on PATH when there is one (NVIDIA's container); otherwise the Triton
    2.51 server bundled with nvidia-pytriton (`pip install 'dlite-trt[triton]'`). Models:
    `dlite` (batched) and `dlite_stream` (streaming, decoupled)."""
    check_engine_dir(engine)
    from dlite_trt.serve.server import TritonServer
    from dlite_trt.serve.triton_repo import write_repository

    with tempfile.TemporaryDirectory(prefix="dlite-repo-") as tmp:
        repo = repo or Path(tmp) / "repo"
        write_repository(engine, repo, instances=instances, max_batch=max_batch, streaming=True, threads=threads)
        server = TritonServer(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, host=host)
        # Ctrl-C and `kill` stop it cleanly even when it was started with SIGINT ignored or blocked
        # (a background job of a non-interactive shell, or a parent that blocked them): both are
        # handled here explicitly rather than inherited
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            server.start()
            click.echo(f"serving {engine} with {server.binary.describe()} (pid {server.process.pid})\n"
                       f"  HTTP http://{server.http_url}  gRPC {server.grpc_url}  models: dlite, dlite_stream\n"
                       f"  curl -X POST http://{server.http_url}/v2/models/dlite/generate "
                       "-d '{\"text_input\": \"def main():\", \"max_tokens\": 32}'\n"
                       "Ctrl-C stops it.")
            while server.process.poll() is None:
                time.sleep(0.5)
            raise click.ClickException(f"tritonserver exited with code {server.process.returncode}:\n"
                                       f"{server.log_tail()}")
        except KeyboardInterrupt:
            click.echo("stopping the server")
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            server.stop()


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt
