"""`dlite-trt serve`: an engine behind an OpenAI-compatible server (the default) or a real Triton
Inference Server, until Ctrl-C.

The OpenAI frontend is the default: it is what agents speak (/v1/chat/completions, streaming),
it needs nothing beyond the base install, and it is where in-flight batching and prefix reuse
live. `--frontend triton` serves the KServe v2 / generate endpoints from Triton (the `triton` extra).
"""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path

import click

from dlite_trt.cli.inputs import VERIFY_DRAFTS, check_engine_dir
from dlite_trt.cli.serve_options import ENGINE, INSTANCES, MAX_BATCH, THREADS
from dlite_trt.serve.tool_parsers import PARSERS as TOOL_PARSERS

TRITON_ONLY = ("grpc_port", "metrics_port", "instances", "max_batch", "repo")
OPENAI_ONLY = ("served_model_name", "speculative", "verify_drafts", "kv_cache_gb", "prefix_cache", "max_queue",
               "default_temperature", "max_body_mb", "max_prompt_chars", "max_stops", "max_stop_chars",
               "shutdown_timeout", "enable_auto_tool_choice", "tool_call_parser", "chat_template", "api_key")


@click.command("serve")
@ENGINE
@click.option("--frontend", type=click.Choice(["openai", "triton"]), default="openai", show_default=True,
              help="openai: the OpenAI API with in-flight batching and prefix reuse; triton: a Triton server.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the server binds.")
@click.option("--port", "--http-port", "port", default=8000, show_default=True, type=click.IntRange(1, 65535),
              help="HTTP port (the OpenAI API, or Triton's KServe v2 and /generate).")
@click.option("--served-model-name", help="The model's name in the API [default: the target's name]. (openai)")
@click.option("--speculative", type=click.Choice(["dlite-ngram", "dlite", "ngram", "none"]), default="dlite-ngram",
              show_default=True,
              help="How each step drafts: DLite with n-gram prompt lookup's proposals where it has one (greedy "
                   "batches; the fastest on agent traffic, docs/serving.md), DLite alone, n-gram lookup, or not "
                   "at all (the baselines). (openai)")
@VERIFY_DRAFTS
@click.option("--kv-cache-gb", default=4.0, show_default=True, type=click.FloatRange(min=0.0, min_open=True),
              help="KV memory: the running batch's cache plus finished sequences kept for reuse. (openai)")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="Keep finished sequences' KV entries and reuse them for prompts that start the same. (openai)")
@click.option("--max-queue", default=256, show_default=True, type=click.IntRange(min=1),
              help="Requests waiting to join the batch before new ones get 503. (openai)")
@click.option("--default-temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="Temperature of requests that give none (0: greedy, the target's own output). (openai)")
@click.option("--max-body-mb", default=8.0, show_default=True, type=click.FloatRange(min=0.0, min_open=True),
              help="Largest request body (MiB); a larger one gets 413 before it is read. (openai)")
@click.option("--max-prompt-chars", type=click.IntRange(min=1),
              help="Longest prompt text (all messages' text), refused before it is tokenized [default: "
                   "--max-seq-len x the longest token's characters, the most that can ever fit]. (openai)")
@click.option("--max-stops", default=16, show_default=True, type=click.IntRange(min=0),
              help="Most stop strings a request may give. (openai)")
@click.option("--max-stop-chars", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Longest stop string (characters). (openai)")
@click.option("--shutdown-timeout", default=5.0, show_default=True, type=click.FloatRange(min=0.0),
              help="Seconds requests in flight get to finish after Ctrl-C; meanwhile new ones get 503. (openai)")
@click.option("--api-key", envvar="DLITE_TRT_API_KEY", show_envvar=True,
              help="Answer /v1 requests only with the header Authorization: Bearer KEY (vLLM's --api-key); "
                   "/health and /metrics stay open. (openai)")
@click.option("--tool-call-parser", type=click.Choice(sorted(TOOL_PARSERS)),
              help="Read tool calls from the output in this format: hermes (Hermes, Qwen2.5/3, the bundled SmolLM2 "
                   "tools template), llama3_json (Llama 3.x). (openai)")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help="Let the model decide whether to call a tool (tool_choice auto); needs --tool-call-parser. (openai)")
@click.option("--chat-template", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="A Jinja chat template file to use instead of the tokenizer's (e.g. one that renders tools: "
                   "dlite_trt/bundled/templates/smollm2_tools.jinja for SmolLM2). (openai)")
@click.option("--grpc-port", default=8001, show_default=True, type=click.IntRange(1, 65535),
              help="Port of the gRPC endpoint. (triton)")
@click.option("--metrics-port", default=8002, show_default=True, type=click.IntRange(1, 65535),
              help="Port of Triton's Prometheus metrics. (triton)")
@INSTANCES
@MAX_BATCH
@THREADS
@click.option("--repo", type=click.Path(path_type=Path, file_okay=False),
              help="Write the model repository here (default: a temporary directory, removed on exit). (triton)")
@click.pass_context
def command(ctx: click.Context, engine: Path, frontend: str, host: str, port: int, threads: int | None,
            **options) -> None:
    """Serve an engine until Ctrl-C: an OpenAI-compatible API (default) or a Triton server.

    OpenAI: GET /v1/models, POST /v1/completions and /v1/chat/completions (streaming), GET /health
    and /metrics (Prometheus); requests join the running engine batch at step boundaries, and a
    prompt that starts like an earlier sequence prefills only the rest. Triton: `tritonserver` on
    PATH, else the one nvidia-pytriton bundles (`pip install 'dlite-trt[triton]'`); models `dlite`
    (batched) and `dlite_stream` (streaming, decoupled)."""
    other = TRITON_ONLY if frontend == "openai" else OPENAI_ONLY
    given = [name for name in other if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise click.UsageError(f"{flags}: not an option of --frontend {frontend}; drop it or pick the other frontend")
    if options["enable_auto_tool_choice"] and not options["tool_call_parser"]:
        raise click.UsageError("--enable-auto-tool-choice needs --tool-call-parser NAME")
    check_engine_dir(engine)
    options["chat_template_text"] = _chat_template(options["chat_template"]) if options["chat_template"] else None
    from dlite_trt.serve.server import port_free

    if not port_free(host, port):
        raise click.ClickException(f"{host}:{port} is in use (another server?); pass another --port")
    _stop_on_signals()
    if frontend == "openai":
        _serve_openai(engine, host, port, threads, options)
    else:
        _serve_triton(engine, host, port, threads, options)


def _stop_on_signals() -> None:
    """Ctrl-C and `kill` stop the server cleanly even when it was started with SIGINT ignored or
    blocked (a background job of a non-interactive shell, or a parent that blocked them)."""
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def _chat_template(path: Path) -> str:
    """--chat-template's text, compiled once here: a broken template is the operator's error at
    startup, not a 400 blamed on every client's request."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        text = path.read_text(encoding="utf-8")
        ImmutableSandboxedEnvironment().from_string(text)  # what transformers renders it with
    except UnicodeDecodeError as exc:
        raise click.BadParameter(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); save the "
                                 "template as UTF-8.", param_hint="--chat-template") from exc
    except TemplateSyntaxError as exc:
        raise click.BadParameter(f"{path} is not a valid Jinja template: {exc.message} (line {exc.lineno}); "
                                 "fix it, or leave --chat-template out to use the tokenizer's.",
                                 param_hint="--chat-template") from exc
    return text


def _serve_openai(engine: Path, host: str, port: int, threads: int | None, options: dict) -> None:
    import uvicorn

    from dlite_trt.engine.load import load_engine
    from dlite_trt.serve.limits import MIB, ServerLimits
    from dlite_trt.serve.openai_server import DrainingServer, OpenAIFrontend, ToolSettings, create_app
    from dlite_trt.serve.scheduler import Scheduler

    loaded = load_engine(engine, threads=threads, preload=("prefill", "step", "decode"),
                         verify_drafts=options["verify_drafts"])
    name = options["served_model_name"] or Path(loaded.generator.manifest.target_name).name
    scheduler = Scheduler(loaded.generator, speculative=options["speculative"],
                          kv_budget_bytes=int(options["kv_cache_gb"] * 2**30),
                          prefix_cache=options["prefix_cache"], max_queue=options["max_queue"])
    limits = ServerLimits(max_body_bytes=int(options["max_body_mb"] * MIB), max_prompt_chars=options["max_prompt_chars"],
                          max_stops=options["max_stops"], max_stop_chars=options["max_stop_chars"],
                          shutdown_timeout=options["shutdown_timeout"], api_key=options["api_key"])
    tools = ToolSettings(options["tool_call_parser"], options["enable_auto_tool_choice"],
                         options["chat_template_text"])
    frontend = OpenAIFrontend(loaded, scheduler, name, options["default_temperature"], limits, tools)
    # after the drain (DrainingServer), what is still running gets a second to end
    server = DrainingServer(uvicorn.Config(create_app(frontend), host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=1), frontend)
    click.echo(f"serving {engine} as {name!r} (speculative: {options['speculative']}) at http://{host}:{port}/v1\n"
               f"  curl http://{host}:{port}/v1/completions -H 'Content-Type: application/json' "
               f"-d '{{\"model\": \"{name}\", \"prompt\": \"def main():\", \"max_tokens\": 32}}'\n"
               "Ctrl-C stops it.")
    # uvicorn installs its own SIGINT/SIGTERM handlers while it runs: a graceful shutdown
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    click.echo("stopped")


def _serve_triton(engine: Path, host: str, port: int, threads: int | None, options: dict) -> None:
    from dlite_trt.serve.server import TritonServer
    from dlite_trt.serve.triton_repo import write_repository

    with tempfile.TemporaryDirectory(prefix="dlite-repo-") as tmp:
        repo = options["repo"] or Path(tmp) / "repo"
        write_repository(engine, repo, instances=options["instances"], max_batch=options["max_batch"],
                         streaming=True, threads=threads)
        server = TritonServer(repo, http_port=port, grpc_port=options["grpc_port"],
                              metrics_port=options["metrics_port"], host=host)
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
