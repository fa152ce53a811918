"""A peer method in a worker process of its own, so that a library that crashes fails its peer and
not the bench.

`dlite-trt bench` runs other libraries beside our methods (bench/peers.py). Their native code can
die: llama-cpp-python built from source with ggml's AMX backend segfaults on its first generate on
some CPUs, and in the bench's process that ends the whole run. So each peer method runs in a worker
process (``PeerWorker``), started when the peer's model is first needed; the worker loads the model
once and serves the bench's requests over two pipes, one message (a pickled tuple) at a time:

    bench -> worker   ("init", peer, payload)                 once: what ``open_runs`` loads
                      ("start", prompt ids)                    a new session (the last one is dropped)
                      ("generate", appended ids, max_new)      the turn's new tokens, then a generation
    worker -> bench   ("log", line)                            a line for the bench's log (model builds)
                      ("ok",)                                  the session is open
                      ("event", StepEvent, stage seconds)      one library step, sent as soon as it is made
                      ("done", stage seconds)                  the generation is complete
                      ("error", exception, traceback)          the library raised: this peer is out

Events go out as the library makes them and the bench times their arrival (``metrics.measure``), so
TTFT and TPOT stay real (a pipe adds tens of microseconds a step); the stage seconds are the
library's own ``StageTimer`` figures, added to the bench's timer. A session's KV cache lives in the
worker between its turns, as it lived in the bench before.

What the worker prints (its stdout and stderr, where ``faulthandler`` writes the Python stack of a
crash in native code) goes to a third pipe, of which the bench keeps the last lines. When the worker
dies (its reply pipe ends, or its request pipe breaks) or its library raises, ``PeerFailed`` names
the peer, the exit code or signal, what the worker was doing, those lines and what to do.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import subprocess
import sys
import threading
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from dlite_trt.bench.live import Run
from dlite_trt.errors import DLiteError
from dlite_trt.runtime.session import SamplingParams, StepEvent
from dlite_trt.runtime.stats import StageTimer

Log = Callable[[str], None]
OpenRuns = Callable[[Any, Log], Callable[[Sequence[int]], Run]]  # (init payload, log) -> (prompt -> a session)

OUTPUT_TAIL_LINES = 30  # of the worker's output, kept for the message when it dies
STOP_TIMEOUT_S = 10.0  # for a worker whose pipes are closed to exit before it is killed
# test hook: a peer name; that peer's worker segfaults (a real SIGSEGV) on its first generate, as
# llama-cpp-python with AMX does. Read by the worker only; nothing sets it but the tests.
CRASH_FOR_TESTS = "DLITE_TRT_TEST_PEER_CRASH"


class PeerFailed(DLiteError):
    """A peer's worker process died, or its library raised: that peer is out of the run, the rest go on."""


class PeerWorker:
    """The bench's end of one peer's worker process: started by the first ``start``, stopped by
    ``close`` (or when this object goes). ``entry`` ("module:function") is the worker's main, which
    calls ``serve``; ``init`` is the payload its ``open_runs`` gets. ``hint`` says what to do when
    the peer fails."""

    def __init__(self, peer: str, library: str, entry: str, init: Any, *, hint: str, log: Log) -> None:
        self.peer, self.library, self.entry, self.init = peer, library, entry, init
        self.hint, self.log = hint, log
        self.proc: subprocess.Popen | None = None
        self.failure: PeerFailed | None = None
        self.output: deque[str] = deque(maxlen=OUTPUT_TAIL_LINES)
        self.doing = "starting"
        self._requests: IO[bytes] | None = None
        self._replies: IO[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._sessions = 0
        self._stop: weakref.finalize | None = None

    # ------------------------------------------------------------------ requests

    def start(self, prompt: Sequence[int]) -> None:
        """A new session on ``prompt`` (the worker drops its last one); the first loads the model."""
        if self.proc is None:
            self._spawn()
        self._sessions += 1
        self.doing = "loading its model" if self._sessions == 1 else "opening a session"
        self._send(("start", [int(t) for t in prompt]))
        reply = self._receive()
        if reply[0] != "ok":
            raise self._fail(f"answered {reply[0]!r} to a new session (a protocol error in bench/peer_process.py)")

    def generate(self, appended: Sequence[int], max_new_tokens: int, timer: StageTimer) -> Iterator[StepEvent]:
        """The session's ``appended`` tokens, then a generation of ``max_new_tokens``: the library's
        steps as they arrive, their stage seconds added to ``timer``. Closed early, the rest of the
        generation is read and dropped (the worker is ready for the next request)."""
        self.doing = "generating"
        self._send(("generate", [int(t) for t in appended], int(max_new_tokens)))
        finished = False
        try:
            while True:
                reply = self._receive()
                if reply[0] == "done":
                    _add_stages(timer, reply[1])
                    finished = True
                    return
                if reply[0] != "event":
                    raise self._fail(f"answered {reply[0]!r} within a generation (a protocol error in "
                                     "bench/peer_process.py)")
                _add_stages(timer, reply[2])
                yield reply[1]
        finally:
            if not finished and self.failure is None:  # closed at a yield: read up to its end
                try:
                    while self._receive()[0] != "done":
                        pass
                except PeerFailed:  # kept in self.failure: the next request raises it
                    pass

    def close(self) -> None:
        """Stop the worker: its request pipe closes and it exits (killed after ``STOP_TIMEOUT_S``)."""
        if self._stop is not None:
            self._stop()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    # ------------------------------------------------------------------ the process

    def _spawn(self) -> None:
        module, function = self.entry.split(":")
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", f"from {module} import {function}; {function}()", str(request_r), str(reply_w)],
                pass_fds=(request_r, reply_w), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT)
        except OSError:
            os.close(request_w)
            os.close(reply_r)
            raise
        finally:  # the worker's ends: only it holds them, so its death ends the reply pipe
            os.close(request_r)
            os.close(reply_w)
        self._requests, self._replies = os.fdopen(request_w, "wb"), os.fdopen(reply_r, "rb")
        self._reader = threading.Thread(target=_keep_tail, args=(self.proc.stdout, self.output),
                                        name=f"peer-{self.peer}-output", daemon=True)
        self._reader.start()
        self._stop = weakref.finalize(self, _stop_worker, self.proc, self._requests, self._replies)
        self._send(("init", self.peer, self.init))

    def _send(self, message: tuple) -> None:
        if self.failure is not None:
            raise self.failure
        try:
            pickle.dump(message, self._requests, protocol=pickle.HIGHEST_PROTOCOL)
            self._requests.flush()
        except OSError:  # BrokenPipeError: it is gone
            raise self._died() from None

    def _receive(self) -> tuple:
        """The next reply that is not a log line (those go to the bench's log)."""
        if self.failure is not None:
            raise self.failure
        while True:
            try:
                reply = pickle.load(self._replies)
            except (EOFError, pickle.UnpicklingError, OSError):  # its end of the pipe closed: it is gone
                raise self._died() from None
            if reply[0] == "log":
                self.log(reply[1])
            elif reply[0] == "error":
                raise self._fail(f"raised {reply[1]}", reply[2].rstrip().splitlines()[-OUTPUT_TAIL_LINES:])
            else:
                return reply

    def _died(self) -> PeerFailed:
        try:
            code = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # its pipe closed, yet it runs: end it
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(timeout=STOP_TIMEOUT_S)  # the rest of its output
        if code < 0:
            how = f"was killed by signal {-code} ({_signal_name(-code)})"
        else:
            how = f"exited with code {code}"
        return self._fail(how, list(self.output), what="its output")

    def _fail(self, how: str, lines: Sequence[str] | None = None, what: str = "the traceback") -> PeerFailed:
        """The peer's failure (kept: every later request raises it); the worker is stopped."""
        shown = "." if lines is None else f"; the last lines of {what}:" + (
            "".join(f"\n    | {line}" for line in lines) if lines else "\n    (none)")
        self.failure = PeerFailed(f"peer {self.peer} failed: its worker process ({self.library}, pid {self.pid}) "
                                  f"{how} while {self.doing}{shown}\n{self.hint}")
        self.close()
        return self.failure


def _keep_tail(stream: IO[bytes], tail: deque[str]) -> None:
    """The worker's output lines, as a terminal leaves them (a progress bar's last state), cut to 400
    characters each."""
    for line in stream:
        tail.append(line.decode(errors="replace").rstrip().rsplit("\r", 1)[-1][:400])


def _stop_worker(proc: subprocess.Popen, requests: IO[bytes], replies: IO[bytes]) -> None:
    """Both pipes closed: a waiting worker reads their end and exits, a writing one gets EPIPE."""
    for pipe in (requests, replies):
        try:
            pipe.close()
        except OSError:  # a request still buffered for a dead worker: nothing to deliver it to
            pass
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def _add_stages(timer: StageTimer, seconds: dict[str, float]) -> None:
    for stage, s in seconds.items():
        timer.seconds[stage] += s


# --------------------------------------------------------------------------------------------- worker


def serve(open_runs: OpenRuns) -> None:
    """The worker's loop, called by its entry function (``PeerWorker.entry``) with what opens its
    peer's sessions: reads requests from the pipe named by ``sys.argv[1]``, answers on ``sys.argv[2]``,
    and returns when the bench closes the request pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the bench's; its exit closes our pipes
    faulthandler.enable()  # a crash in native code prints the Python stack: the bench shows its last lines
    requests, replies = os.fdopen(int(sys.argv[1]), "rb"), os.fdopen(int(sys.argv[2]), "wb")

    def send(message: tuple) -> None:
        pickle.dump(message, replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()

    try:
        _, peer, payload = pickle.load(requests)
        open_run = None
        run: Run | None = None
        while True:
            try:
                request = pickle.load(requests)
            except EOFError:  # the bench is done with this peer (or gone)
                return
            try:
                if request[0] == "start":
                    open_run = open_run or open_runs(payload, lambda line: send(("log", line)))
                    run = None  # the last session's state goes before the next is made
                    run = open_run(request[1])
                    send(("ok",))
                elif request[0] == "generate":
                    _, appended, max_new_tokens = request
                    if os.environ.get(CRASH_FOR_TESTS) == peer:
                        _segfault()
                    if run is None:
                        raise DLiteError("a generate request before any session (a protocol error in "
                                         "bench/peer_process.py)")
                    if appended:
                        run.extend([appended])
                    timer, sent = StageTimer(), {}
                    for event in run.stream(SamplingParams(max_new_tokens=max_new_tokens), timer):
                        send(("event", event, _new_stages(timer, sent)))
                    send(("done", _new_stages(timer, sent)))
                else:
                    raise DLiteError(f"unknown request {request[0]!r} (a protocol error in bench/peer_process.py)")
            except BrokenPipeError:
                raise
            except Exception as exc:  # noqa: BLE001 (sent to the bench, which fails this peer with it)
                send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    except BrokenPipeError:  # the bench closed its end while we wrote: it is done with us
        return


def _new_stages(timer: StageTimer, sent: dict[str, float]) -> dict[str, float]:
    """The stage seconds ``timer`` added since the last call (``sent``: what was sent so far)."""
    out = {stage: s - sent.get(stage, 0.0) for stage, s in timer.seconds.items() if s != sent.get(stage, 0.0)}
    sent.update(timer.seconds)
    return out


def _segfault() -> None:
    """``CRASH_FOR_TESTS``: a real SIGSEGV (a read of address 0), without a core file."""
    import ctypes
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    print("peer_process: crashing as DLITE_TRT_TEST_PEER_CRASH asks", file=sys.stderr, flush=True)
    ctypes.string_at(0)
