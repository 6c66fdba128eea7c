"""``traceprop info`` and ``traceprop runs``: describe one run directory, list many."""

from __future__ import annotations

import json
from pathlib import Path

from .. import constants as C
from ..errors import TracepropError


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
    from ..run import read_manifest
    from ..store.sharded import open_run_store
    from ..store.sizes import run_store_bytes

    m = read_manifest(a.run)
    if a.json:
        print(json.dumps(m, indent=2, default=str))
        return 0
    print(f"run {m.get('run_id')}  status {m.get('status')}  created {m.get('created')}")
    d = m.get("data", {})
    print(
        f"data {d.get('root')}  ({d.get('n_train')} train / {d.get('n_eval')} eval, {len(d.get('files', {}))} files)"
    )
    mo = m.get("model", {})
    print(
        f"model {mo.get('source')}  task {mo.get('task')}  params {mo.get('parameters')} (trainable {mo.get('trainable')})"
    )
    if (Path(a.run) / C.STORE_FILE).exists() or m.get("shards"):
        with open_run_store(a.run, m) as st:
            size = run_store_bytes(a.run)
            shards = f", {len(m['shards'])} shards" if m.get("shards") else ""
            print(
                f"store ({size / 1e6:.2f} MB{shards}): {st.n_records} records, {len(st.layers)} layers, dim {st.dim}, status {st.status}"
            )
            if st.is_partial:
                print(f"note: {st.describe_partial()}")
    from ..evaluate.pareto import describe

    cfg = m.get("config") or {}
    print(describe(cfg.get("track") if isinstance(cfg, dict) else None))
    if m.get("error"):
        print(f"error: {m['error']}")
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
    from ..run import list_runs, read_manifest

    runs = list_runs(a.root)
    if not runs:
        print(f"no runs under {a.root}")
        return 0
    for r in runs:
        try:
            m = read_manifest(r)
        except TracepropError as e:  # one damaged run.json must not hide the others
            print(f"{r.name:<32} {'unreadable':<10} {e}")
            continue
        model = m.get("model") if isinstance(m.get("model"), dict) else {}
        print(f"{r.name:<32} {str(m.get('status', '?')):<10} {model.get('source', '?')}")
    return 0
