"""Training jobs: start ``traceprop train`` in the background, read its state from disk, cancel it.

State lives on disk (run.json, progress.jsonl, launch.json), never in module globals, so a
closed browser tab neither kills nor orphans a training job and every user sees the same runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from traceprop_engine import constants as C
from traceprop_engine.errors import TracepropError
from traceprop_engine.run import RunManifest, pid_alive, read_progress

from .config import REPO, AppConfig, sanitize_name
from .launch import LaunchSpec

LAUNCH_FILE = "launch.json"  # written by the app next to run.json: pid + command of a launched job
SLOT_LOCK = ".job-slot.lock"  # in the runs root: flock'ed while a session takes the one job slot
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,119}")


class JobError(TracepropError, RuntimeError):
    """A training job cannot be started or cancelled."""


@dataclass(frozen=True)
class JobState:
    """What a launched (or listed) run is doing, read from disk."""

    run_dir: Path
    status: str  # starting | running | completed | failed | cancelled | missing
    pid: int | None = None
    step: int = 0
    total: int = 0
    loss: float | None = None
    eta_s: float | None = None
    examples_per_s: float | None = None
    error: str = ""
    log_tail: str = ""

    @property
    def running(self) -> bool:
        return self.status in ("starting", C.STATUS_RUNNING)

    @property
    def fraction(self) -> float:
        return min(self.step / self.total, 1.0) if self.total else 0.0


def process_alive(pid: int | None) -> bool:
    """True while ``pid`` runs (see :func:`traceprop_engine.run.pid_alive`)."""
    return bool(pid) and pid_alive(int(pid))


def log_tail(run_dir: Path, n: int = 40) -> str:
    p = Path(run_dir) / C.LOG_FILE
    if not p.exists():
        return ""
    lines = p.read_text(errors="replace").replace("\r", "\n").splitlines()
    return "\n".join(line for line in lines[-n:] if line.strip())


def job_state(run_dir: str | os.PathLike) -> JobState:
    """The state of a run from its files (launch.json, run.json, progress.jsonl, train.log)."""
    run_dir = Path(run_dir)
    launch = {}
    if (run_dir / LAUNCH_FILE).exists():
        try:
            launch = json.loads((run_dir / LAUNCH_FILE).read_text())
        except json.JSONDecodeError:
            launch = {}
    pid = launch.get("pid")
    status, error = "missing", ""
    if (run_dir / C.MANIFEST_FILE).exists():
        try:
            # a run whose process is gone already reads as failed (run.process_gone)
            m = RunManifest.load(run_dir)
            status, error = m.status or C.STATUS_FAILED, m.error
            pid = m.pid or pid
        except TracepropError as e:
            status, error = C.STATUS_FAILED, str(e)
    elif launch:
        alive = process_alive(pid)
        if alive:
            status = "starting"
        elif launch.get("cancelled"):
            status, error = C.STATUS_CANCELLED, "cancelled before training started"
        else:
            status = C.STATUS_FAILED
            error = "the training process exited before it created the run (see the log)"
    prog = read_progress(run_dir, last=1)
    last = prog[-1] if prog else {}
    tail = log_tail(run_dir) if status in (C.STATUS_FAILED, C.STATUS_CANCELLED) else ""
    return JobState(
        run_dir=run_dir,
        status=status,
        pid=pid,
        step=int(last.get("step", 0)),
        total=int(last.get("total", 0)),
        loss=last.get("loss"),
        eta_s=last.get("eta_s"),
        examples_per_s=last.get("examples_per_s"),
        error=error,
        log_tail=tail,
    )


def active_job(cfg: AppConfig) -> JobState | None:
    """The user run that is training now (one job at a time), or None."""
    root = cfg.runs_root
    candidates = [
        p
        for p in root.iterdir()
        if p.is_dir() and ((p / LAUNCH_FILE).exists() or (p / C.MANIFEST_FILE).exists())
    ]
    for p in sorted(candidates, key=lambda q: q.stat().st_mtime, reverse=True):
        s = job_state(p)
        if s.running:
            return s
    return None


def launched_runs(root: Path) -> list[Path]:
    """Run directories the app launched whose process never wrote a run.json (it failed or was
    cancelled while starting, or is starting now), newest first: listed so they can be seen and
    deleted."""
    if not Path(root).is_dir():
        return []
    found = [
        p
        for p in Path(root).iterdir()
        if p.is_dir() and (p / LAUNCH_FILE).is_file() and not (p / C.MANIFEST_FILE).exists()
    ]
    return sorted(found, key=lambda p: (p / LAUNCH_FILE).stat().st_mtime, reverse=True)


def check_run_name(name: str) -> str:
    """The run name as typed (stripped), or "" for none.

    Raises:
        JobError: the name is not a plain folder name (letters, digits, '.', '_', '-'; no '/').
    """
    name = (name or "").strip()
    if name and not RUN_NAME.fullmatch(name):
        raise JobError(
            f"run name {name!r}: use letters, digits, '.', '_' and '-' only (no '/' or spaces), "
            "starting with a letter or digit, at most 120 characters"
        )
    return name


def new_run_dir(cfg: AppConfig, name: str = "") -> Path:
    base = sanitize_name(check_run_name(name), default="") if name else ""
    base = base or time.strftime("run-%Y%m%d-%H%M%S")
    p = cfg.runs_root / base
    i = 2
    while p.exists():
        p = cfg.runs_root / f"{base}-{i}"
        i += 1
    return p


@contextlib.contextmanager
def job_slot(cfg: AppConfig):
    """Hold the exclusive lock on the app's one job slot (an ``flock`` on ``RUNS/.job-slot.lock``),
    so two sessions pressing Start together cannot both see a free slot and both train."""
    cfg.runs_root.mkdir(parents=True, exist_ok=True)
    fd = os.open(cfg.runs_root / SLOT_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def start_job(cfg: AppConfig, spec: LaunchSpec, name: str = "") -> JobState:
    """Start ``traceprop train`` in its own process group, logging to RUN/train.log.

    The check for a running job and everything written for the new one happen under
    :func:`job_slot`, so of concurrent starts exactly one trains.

    Raises:
        JobError: another job is running, the run name is not a plain folder name, or the spec
            is invalid.
    """
    check_run_name(name)
    errs = spec.errors()
    if errs:
        raise JobError("; ".join(errs))
    with job_slot(cfg):
        running = active_job(cfg)
        if running is not None:
            raise JobError(
                f"a training job is already running ({running.run_dir.name}); "
                "wait for it or cancel it first"
            )
        return _spawn(spec, new_run_dir(cfg, name))


def _spawn(spec: LaunchSpec, run_dir: Path) -> JobState:
    run_dir.mkdir(parents=True)
    cmd = spec.command(run_dir)
    proc = spawn_logged(cmd, run_dir / C.LOG_FILE, {"TQDM_MININTERVAL": "1"})
    (run_dir / LAUNCH_FILE).write_text(
        json.dumps({"pid": proc.pid, "command": cmd, "started": time.time()}, indent=2)
    )
    return job_state(run_dir)


def cancel_job(run_dir: str | os.PathLike) -> bool:
    """SIGTERM the job's process group (training stops at the next step, status 'cancelled').

    Returns:
        True if a signal was sent, False if the job was not running.
    """
    s = job_state(run_dir)
    if not s.running or not s.pid:
        return False
    if s.status == "starting":  # no run.json yet to say so: the launch record does
        _mark_cancelled(Path(run_dir))
    try:
        os.killpg(os.getpgid(s.pid), signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True


def _mark_cancelled(run_dir: Path) -> None:
    p = run_dir / LAUNCH_FILE
    try:
        launch = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        launch = {}
    launch["cancelled"] = time.time()
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(launch, indent=2))
    os.replace(tmp, p)


def wait_job(run_dir: str | os.PathLike, timeout_s: float = 120.0, poll_s: float = 0.2) -> JobState:
    """Poll until the job is no longer running (or the timeout passes)."""
    end = time.monotonic() + timeout_s
    s = job_state(run_dir)
    while s.running and time.monotonic() < end:
        time.sleep(poll_s)
        s = job_state(run_dir)
    return s


def spawn_logged(cmd: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start a background job of the app (a training run, a counterfactual check) in its own
    session (so Cancel can signal its whole process group), output to ``log_path``, unbuffered."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=str(REPO),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=full_env,
        )
    # the job's state is read from its files, not from this handle: a thread reaps the child
    # when it ends, so no zombie is left in the server's process table (issue 29, defect 7)
    threading.Thread(target=proc.wait, name=f"traceprop-reap-{proc.pid}", daemon=True).start()
    return proc
