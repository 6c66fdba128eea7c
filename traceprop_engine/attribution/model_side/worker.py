"""A query worker: the runs' models in a process of their own.

A query has two halves. The test side (the query's tokens through the run's final model, one
backward with the capture hooks: :meth:`AttributionRun.test_side`) needs torch and transformers,
whose imports and the model's load take several seconds of one core; the ranking (index search,
exact re-rank, example scores) needs only numpy, FAISS and the store. :class:`QueryWorker`
starts ``python -m traceprop_engine.attribution.model_side.worker`` and sends it the model's half:
the caller's process never imports torch, and the worker's imports run on another core from the
start instead of sharing the caller's interpreter lock (the app's first page and first query,
``app/services/model_worker.py``).

Protocol: two pipes, one request at a time (a lock in the client). A request is ``(op,
run_dir, keywords)``; the reply ``("ok", value)``, ``("error", exception)`` for a
:class:`~traceprop_engine.errors.TracepropError` (re-raised in the caller as it was raised), or
``("crash", traceback)`` for anything else (:class:`WorkerUnavailable` in the caller, whose
fallback is to do the work itself). Every value is plain data (numpy, polars, dataclasses of
them). The worker opens each run once (again when its manifest changes) and exits when its
request pipe closes, i.e. when the caller exits, however it exits.

On start the worker imports torch, the engine's test side and ``transformers.modeling_utils``
(most of any Hugging Face model's first load), then loads the ``warm`` runs' models: a request
arriving later finds them done.

Ops: ``test_side`` (:class:`~traceprop_engine.attribution.result.TestSide`), ``model_answer``
(:class:`~traceprop_engine.attribution.model_side.answer.ModelAnswer`), ``token_contributions``
(:class:`~traceprop_engine.attribution.model_side.tokens.TokenContributions`), ``decode`` (token ids
to text pieces with the run's tokenizer, or None without one) and ``warm`` (the model, its tokenizer
and one query's backward, so the first real query pays none of it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import OrderedDict
from multiprocessing.connection import Connection
from pathlib import Path

from ... import constants as C
from ...errors import TracepropError

MAX_OPEN_RUNS = 8


class WorkerUnavailable(RuntimeError):
    """The worker is not running, died, timed out or failed unexpectedly: do the work here."""


# -- the client (the caller's process) -------------------------------------------------------------
class QueryWorker:
    """A handle on one worker process (start with :meth:`start`; thread-safe, one request at a
    time).

    Args:
        threads: torch's intra-op threads in the worker (one query runs one example: on a CPU
            more threads mostly add hand-offs).
        warm: run directories whose model the worker loads right after its imports, before any
            request (``warm`` op with no eval example).
        nice: added to the worker's scheduling niceness (POSIX ``nice``) before it imports
            anything: with fewer cores than busy processes, its start-up then takes the cycles
            the caller and its users leave (an app's first page), and all of them once the
            caller waits on it.
    """

    def __init__(self, threads: int = 1, warm: tuple[str, ...] = (), nice: int = 0) -> None:
        self.threads = max(1, int(threads))
        self.nice = max(0, int(nice))
        self.warm = tuple(str(Path(w).resolve()) for w in warm)
        self._proc: subprocess.Popen | None = None
        self._send: Connection | None = None
        self._recv: Connection | None = None
        self._lock = threading.Lock()
        self._closing = threading.Event()  # close() was called: a request in flight gives up

    def start(self) -> QueryWorker:
        """Start the process (returns at once: its imports run in the background)."""
        if self._proc is not None:
            return self
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        root = str(Path(__file__).resolve().parents[3])  # the engine's parent, importable there
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        cmd = [
            sys.executable,
            "-m",
            __name__,
            str(req_r),
            str(rep_w),
            "--threads",
            str(self.threads),
        ]
        for w in self.warm:
            cmd += ["--warm", w]
        if self.nice:
            cmd += ["--nice", str(self.nice)]
        try:
            self._proc = subprocess.Popen(
                cmd, pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL, env=env, close_fds=True
            )
        finally:
            os.close(req_r)
            os.close(rep_w)
        self._send = Connection(req_w, readable=False)
        self._recv = Connection(rep_r, writable=False)
        return self

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def call(self, op: str, run_dir: str | os.PathLike, timeout: float | None = None, **kw):
        """Run ``op`` on ``run_dir`` in the worker and return its value.

        Raises:
            TracepropError: what the op raised (bad query, run without a model...).
            WorkerUnavailable: no worker, it died or timed out (then it is stopped), or the op
                failed unexpectedly (the caller can do the work itself and see the error there).
        """
        with self._lock:
            if self._closing.is_set() or not self.alive or self._send is None or self._recv is None:
                raise WorkerUnavailable("the query worker is not running")
            try:
                self._send.send((op, str(Path(run_dir).resolve()), kw))
                deadline = None if timeout is None else time.monotonic() + timeout
                while not self._recv.poll(0.2):
                    if self._closing.is_set():
                        self._stop()
                        raise WorkerUnavailable("the query worker was closed during the request")
                    if not self.alive:
                        raise WorkerUnavailable(
                            f"the query worker exited ({self._proc.returncode})"
                        )
                    if deadline is not None and time.monotonic() > deadline:
                        self._stop()  # a late reply would answer the next request
                        raise WorkerUnavailable(f"the query worker took over {timeout:g} s")
                status, value = self._recv.recv()
            except (OSError, EOFError, pickle.PickleError) as e:
                self._stop()
                raise WorkerUnavailable(f"the query worker's pipe failed: {e}") from e
        if status == "ok":
            return value
        if status == "error":
            raise value
        raise WorkerUnavailable(f"the query worker failed on {op}:\n{value}")

    def _stop(self) -> None:
        for c in (self._send, self._recv):
            if c is not None:
                c.close()
        self._send = self._recv = None
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker (closing its request pipe ends it; killed if it has not exited
        within ``timeout`` s: it holds nothing that needs saving). A request in flight in
        another thread gives up within 0.2 s (``WorkerUnavailable``) instead of holding the
        close until its reply."""
        self._closing.set()
        with self._lock:
            if self._send is not None:
                self._send.close()
                self._send = None
            if self._proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=timeout)
            self._stop()

    def __enter__(self) -> QueryWorker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


# -- the worker (its own process) -------------------------------------------------------------------
class _Runs:
    """The worker's opened runs, each reopened when its manifest changes (at most
    :data:`MAX_OPEN_RUNS`, least recently used closed first)."""

    def __init__(self) -> None:
        self._open: OrderedDict[str, tuple[float, object]] = OrderedDict()

    def get(self, run_dir: str):
        from ..query import open_run

        manifest = Path(run_dir) / C.MANIFEST_FILE
        mtime = manifest.stat().st_mtime if manifest.exists() else 0.0
        hit = self._open.pop(run_dir, None)
        if hit is not None and hit[0] == mtime:
            self._open[run_dir] = hit
            return hit[1]
        if hit is not None:
            hit[1].close()
        run = open_run(run_dir)
        self._open[run_dir] = (mtime, run)
        while len(self._open) > MAX_OPEN_RUNS:
            self._open.popitem(last=False)[1][1].close()
        return run


def _warm(run, eval_example: int | None = None) -> None:
    run.model()
    s = run.settings()
    if s.uses_final_statistics:  # fitted and cached here, where torch is
        run.statistics(s, run.index_root(s))
    evals = run.eval_examples()["example_id"].to_list()
    ex = eval_example if eval_example is not None else (evals[0] if evals else None)
    if ex is not None:
        run.test_side(eval_example=int(ex))  # the first backward's one-time costs


def _decode(run, ids: list[int]) -> list[str] | None:
    tok = run.model().tokenizer
    return None if tok is None else [tok.decode([int(t)]) for t in ids]


def _ops():
    from .answer import model_answer
    from .tokens import token_contributions

    def contributions(run, sketches, example_id, settings: dict):
        from ...settings import IndexSettings

        return token_contributions(run, sketches, int(example_id), IndexSettings(**settings))

    return {
        "test_side": lambda run, **q: run.test_side(**q),
        "model_answer": model_answer,
        "token_contributions": contributions,
        "decode": _decode,
        "warm": _warm,
    }


def _portable(e: TracepropError) -> TracepropError:
    """``e`` if it survives a pickle round trip, else a TracepropError with its message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - an exception class with an unusual constructor
        return TracepropError(str(e))


def serve(recv: Connection, send: Connection, threads: int = 1, warm: tuple[str, ...] = ()) -> None:
    """Answer requests until the request pipe closes."""
    import torch

    torch.set_num_threads(threads)
    runs = _Runs()
    ops = _ops()  # torch and the engine's test side
    with contextlib.suppress(ImportError):  # most of any Hugging Face model's first load (≈ 1.6 s)
        import transformers.modeling_utils  # noqa: F401
    for w in warm:
        try:
            _warm(runs.get(w))
        except Exception:  # noqa: BLE001 - a request on that run will report it
            traceback.print_exc()
    while True:
        try:
            op, run_dir, kw = recv.recv()
        except EOFError:
            return
        try:
            reply = ("ok", ops[op](runs.get(run_dir), **kw))
        except TracepropError as e:
            reply = ("error", _portable(e))
        except Exception:  # noqa: BLE001 - reported to the caller, who redoes the work
            reply = ("crash", traceback.format_exc())
        try:
            send.send(reply)
        except OSError:  # the caller is gone
            return
        except Exception:  # noqa: BLE001 - a value that does not pickle
            send.send(("crash", traceback.format_exc()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Traceprop query worker (started by QueryWorker)")
    p.add_argument("request_fd", type=int)
    p.add_argument("reply_fd", type=int)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warm", action="append", default=[])
    p.add_argument("--nice", type=int, default=0)
    a = p.parse_args(argv)
    if a.nice:
        os.nice(a.nice)  # before the imports: they are most of the start-up
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the caller, whose exit ends us
    recv = Connection(a.request_fd, writable=False)
    send = Connection(a.reply_fd, readable=False)
    serve(recv, send, a.threads, tuple(a.warm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
