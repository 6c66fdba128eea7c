"""``traceprop info`` and ``traceprop runs``: describe one run directory, list many."""

from __future__ import annotations

import json
from pathlib import Path

from .. import constants as C
from ..errors import RunError, TracepropError


def add_info(sub) -> None:
    p = sub.add_parser(
        "info",
        help="describe a run: status, data, model, tracked layers, store",
        description="Print a run's status, data (files, counts), model, tracked layers and store summary; "
        "a partial store (cancelled or failed run) is reported as such. --json prints the whole manifest.",
    )
    p.add_argument("run", help="run directory")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(func=_cmd_info)


def _cmd_info(a) -> int:
    from ..run import RunManifest
    from ..store.sharded import open_run_store
    from ..store.sizes import run_store_bytes, stored_bytes_per_record

    m = RunManifest.load(a.run)
    if a.json:
        print(json.dumps(m.raw, indent=2, default=str))
        return 0
    print(f"run {m.run_id}  status {m.status}  created {m.created or None}")
    d = m.data
    print(f"data {d.root}  ({d.n_train} train / {d.n_eval} eval, {len(d.files)} files)")
    mo = m.model
    print(f"model {mo.source}  task {mo.task}  params {mo.parameters} (trainable {mo.trainable})")
    run_bytes = None
    if (Path(a.run) / C.STORE_FILE).exists() or m.shards:
        with open_run_store(a.run, m.shards) as st:
            run_bytes = stored_bytes_per_record(st.layers)
            size = run_store_bytes(a.run)
            shards = f", {len(m.shards)} shards" if m.shards else ""
            print(
                f"store ({size / 1e6:.2f} MB{shards}): {st.n_records} records, {len(st.layers)} layers, dim {st.dim}, status {st.status}"
            )
            if st.is_partial:
                print(f"note: {st.describe_partial()}")
    from ..evaluate.pareto import describe

    print(describe(m.config.get("track"), run_bytes=run_bytes))
    if m.error:
        print(f"error: {m.error}")
    return 0


def add_runs(sub) -> None:
    p = sub.add_parser(
        "runs",
        help="list the runs under a folder",
        description="List run directories (folders with a run.json) under ROOT, newest first, with their status "
        "and model. A run whose process died without updating its status is shown as failed.",
    )
    p.add_argument("root", nargs="?", default="runs", help="folder holding run directories")
    p.set_defaults(func=_cmd_runs)


def _cmd_runs(a) -> int:
    from ..run import RunManifest, list_runs

    root = Path(a.root)
    if not root.is_dir():  # "no runs" would read as an empty folder
        what = "is not a folder" if root.exists() else "does not exist"
        raise RunError(
            f"{root} {what}: pass the folder that holds your run directories (traceprop runs ROOT)"
        )
    runs = list_runs(root)
    if not runs:
        print(f"no runs under {a.root}")
        return 0
    for r in runs:
        try:
            m = RunManifest.load(r)
        except TracepropError as e:  # one damaged run.json must not hide the others
            print(f"{r.name:<32} {'unreadable':<10} {e}")
            continue
        print(f"{r.name:<32} {str(m.status or '?'):<10} {m.model.source or '?'}")
    return 0
