"""Launch: a tracked fine-tune in a background process, with live progress and Cancel."""

from __future__ import annotations

from pathlib import Path

import streamlit as st
from services import config, jobs, launch, text

from traceprop_engine.errors import TracepropError

cfg = config.AppConfig.from_env()
st.title("Launch a tracked fine-tune")

DATA_CHOICES = {
    "facts": "Bundled generated facts set (causal LM)",
    "classification": "Bundled generated classification set",
    "upload": "Upload files",
    "path": text.md_escape(f"A path under {cfg.data_root}"),
}
MODEL_CHOICES = {
    "tiny": "tiny (GPT-NeoX built from a config)",
    "minilm": "minilm (packaged encoder, classification)",
    "dir": "a local Hugging Face directory",
}


@st.fragment(run_every=1.0)
def _progress(run_dir: str) -> None:
    s = jobs.job_state(Path(run_dir))
    st.subheader(text.md_escape(f"Job {s.run_dir.name}"))
    if s.running:
        eta = f", ETA {s.eta_s:.0f} s" if s.eta_s is not None else ""
        loss = f", loss {s.loss:.4f}" if s.loss is not None else ""
        st.progress(s.fraction, text=f"{s.status}: step {s.step}/{s.total or '?'}{loss}{eta}")
        if st.button("Cancel", key="launch_cancel"):
            jobs.cancel_job(s.run_dir)
            st.info("Cancel requested: the job stops at the next step.")
    elif s.status == "completed":
        st.progress(
            1.0,
            text=f"completed: {s.step} steps, final loss {s.loss if s.loss is not None else '?'}",
        )
        st.success(
            text.md_escape(f"Training finished: {s.run_dir.name} is listed on the Runs page.")
        )
        if st.button("Make it the active run", key="launch_activate"):
            st.session_state["runs_active"] = str(s.run_dir.resolve())
            st.rerun()
    else:
        msg = f"Training {s.status}" + (f": {s.error}" if s.error else "")
        (st.warning if s.status == "cancelled" else st.error)(text.md_escape(msg))
        if s.log_tail:
            st.caption("Last lines of train.log")
            st.code(s.log_tail, language=None)


running = jobs.active_job(cfg)
if running is not None:
    st.session_state["launch_run"] = str(running.run_dir)
    st.info("A training job is running; a second launch waits until it ends (one job at a time).")

if started := st.session_state.pop("launch_started", None):  # said once, after the rerun
    st.success(text.md_escape(started[0]))
    (st.warning if "Dominated by" in started[1] else st.info)(text.md_escape(started[1]))
for note in st.session_state.pop("launch_prefill_notes", []):  # "Re-launch" on the Runs page
    st.info(text.md_escape("Prefilled from the run: " + note))
# the form's defaults live in the session state, so "Re-launch with these settings" (which sets
# them) and a widget's own default never disagree (Streamlit warns when both are given)
for key, value in {
    "launch_lora": 0,
    "launch_epochs": 2,
    "launch_lr": 3e-3,
    "launch_batch": 8,
    "launch_maxlen": 64,
    "launch_tiny_layers": 2,
    "launch_tiny_width": 64,
    "launch_seed": 0,
    "launch_scope": "all",
    "launch_k_in": launch.LaunchSpec.k_in,
    "launch_k_out": launch.LaunchSpec.k_out,
    "launch_rank": launch.LaunchSpec.rank,
    "launch_cov": True,
}.items():
    st.session_state.setdefault(key, value)
# enter_to_submit=False: Enter in a field does not start training; only the Start button does
with st.form("launch_form", enter_to_submit=False):
    st.markdown("**Data**")
    data_kind = st.radio(
        "Training data",
        list(DATA_CHOICES),
        format_func=DATA_CHOICES.get,
        key="launch_data_kind",
        horizontal=True,
    )
    uploads = st.file_uploader(
        "Data files (.jsonl .json .csv .parquet .txt) — when given, these are trained on "
        "(instead of a bundled set)",
        accept_multiple_files=True,
        key="launch_uploads",
    )
    data_path = st.text_input(
        "Data path (relative to the data root) — used when 'A path' is chosen",
        key="launch_data_path",
    )
    eval_path = st.text_input(
        "Eval data path (optional; otherwise 10% of the data is held out)", key="launch_eval_path"
    )
    st.markdown("**Model**")
    c1, c2, c3 = st.columns(3)
    model_kind = c1.selectbox(
        "Model",
        list(MODEL_CHOICES),
        format_func=MODEL_CHOICES.get,
        key="launch_model",
        help=launch.help_for("model"),
    )
    model_dir = c2.text_input("Model directory (under the data root)", key="launch_model_dir")
    task = c3.selectbox(
        "Task", ["causal-lm", "classification"], key="launch_task", help=launch.help_for("task")
    )
    c1, c2, c3, c4 = st.columns(4)
    lora_rank = c1.number_input(
        "LoRA rank (0 = full)", 0, 256, key="launch_lora", help=launch.help_for("lora_rank")
    )
    epochs = c2.number_input("Epochs", 1, 100, key="launch_epochs", help=launch.help_for("epochs"))
    lr = c3.number_input(
        "Learning rate", 0.0, 1.0, format="%.5f", key="launch_lr", help=launch.help_for("lr")
    )
    batch = c4.number_input(
        "Batch size", 1, 1024, key="launch_batch", help=launch.help_for("batch_size")
    )
    c1, c2, c3, c4 = st.columns(4)
    max_length = c1.number_input(
        "Max length (tokens)", 8, 4096, key="launch_maxlen", help=launch.help_for("max_length")
    )
    tiny_layers = c2.number_input(
        "Tiny model layers", 1, 24, key="launch_tiny_layers", help=launch.help_for("tiny_layers")
    )
    tiny_width = c3.number_input(
        "Tiny model width",
        8,
        2048,
        step=8,
        key="launch_tiny_width",
        help=launch.help_for("tiny_width"),
    )
    seed = c4.number_input("Seed", 0, 2**31 - 1, key="launch_seed", help=launch.help_for("seed"))
    st.markdown("**Tracking**")
    c1, c2, c3, c4, c5, c6 = st.columns(6)
    scope = c1.text_input(
        "Scope (all, last-block or a regex)", key="launch_scope", help=launch.help_for("scope")
    )
    k_in = c2.number_input("k in", 1, 1024, key="launch_k_in", help=launch.help_for("k_in"))
    k_out = c3.number_input("k out", 1, 1024, key="launch_k_out", help=launch.help_for("k_out"))
    rank = c4.number_input(
        "Factor rank",
        0,
        64,
        key="launch_rank",
        help=launch.help_for("rank"),
    )
    sketch = c5.selectbox(
        "Sketch", ["factored", "dense"], key="launch_sketch", help=launch.help_for("sketch")
    )
    covariance = c6.checkbox(
        "K-FAC covariance", key="launch_cov", help=launch.help_for("covariance")
    )
    with st.expander("Measured quality, overhead and bytes of tracking configurations"):
        table = launch.measured_configurations()
        if table.is_empty():
            st.caption("No measured table (benchmarks/results/pareto.json) in this checkout.")
        else:
            st.dataframe(table, hide_index=True)
            st.caption(
                "LDS: linear datamodeling score on two held-out data sets (higher is better); "
                "overhead: extra time per training step on the default tiny model, CPU; a "
                "configuration is on the front when no other one is better on all three."
            )
    name = st.text_input("Run name (optional)", key="launch_name")
    submitted = st.form_submit_button("Start training", type="primary")

    if submitted:
        errors: list[str] = []
        data = eval_data = None
        data_note = ""
        try:
            data_kind, data_note = launch.choose_data(
                data_kind, [f.name for f in uploads or []], data_path
            )
            if data_kind in ("facts", "classification"):
                data, eval_data = config.sample_dataset(cfg, data_kind)
            elif data_kind == "upload":
                data = config.save_uploads(cfg, [(f.name, f.getvalue()) for f in uploads or []])
            else:
                data = config.safe_path(cfg.data_root, data_path)
        except TracepropError as e:
            errors.append(str(e))
        if eval_path.strip():
            try:
                eval_data = config.safe_path(cfg.data_root, eval_path)
            except TracepropError as e:
                errors.append(f"eval data: {e}")
        model = model_kind
        if model_kind == "dir":
            try:
                model = str(config.safe_path(cfg.data_root, model_dir))
            except TracepropError as e:
                errors.append(f"model directory: {e}")
        if data_kind == "classification" and task != "classification":
            errors.append("the classification set needs task 'classification' (and model minilm)")
        if data is not None and not errors:
            spec = launch.LaunchSpec(
                data=data,
                eval_data=eval_data,
                model=model,
                task=task,
                lora_rank=int(lora_rank),
                epochs=int(epochs),
                lr=float(lr),
                batch_size=int(batch),
                max_length=int(max_length),
                scope=scope.strip() or "all",
                k_in=int(k_in),
                k_out=int(k_out),
                rank=int(rank),
                sketch=sketch,
                covariance=covariance,
                seed=int(seed),
                tiny_layers=int(tiny_layers),
                tiny_width=int(tiny_width),
            )
            errors += spec.errors()
            if not errors:  # read the files now: a malformed row is refused before any job
                try:
                    launch.check_data(data, task)
                    if eval_data is not None:
                        launch.check_data(eval_data, task, what="eval data")
                except TracepropError as e:
                    errors.append(str(e))
                    if data_kind == "upload":  # nothing kept of refused files
                        config.discard_uploads(cfg, data)
            if not errors:
                try:
                    job = jobs.start_job(cfg, spec, name)
                except TracepropError as e:
                    errors.append(str(e))
                else:
                    st.session_state["launch_run"] = str(job.run_dir)
                    note = launch.assess_configuration(spec)
                    st.session_state["launch_started"] = (
                        f"Started {job.run_dir.name}. {data_note}.",
                        note,
                    )
                    st.rerun()  # the whole page again: the sidebar now follows the new job
        for e in errors:
            st.error(text.md_escape(e))

if st.session_state.get("launch_run"):
    _progress(st.session_state["launch_run"])
