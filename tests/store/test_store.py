"""The store reader validates on open and says what is wrong."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
from helpers import facts_data, fast_settings

from traceprop_engine import ModelMismatchError, SchemaVersionError, Store, StoreError
from traceprop_engine.training.loop import train


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    data = facts_data(tmp_path_factory.mktemp("data"))
    return train(fast_settings(data, tmp_path_factory.mktemp("runs") / "r"))


def test_round_trip(run):
    with Store(run) as s:
        assert s.status == "completed" and s.n_records > 0
        assert s.layers[0].record_shape == (4, 4)
        x = s.sketches(0)
        assert x.shape == (s.n_records, 4, 4) and x.dtype == np.float32
        # the sum of squared norms kept for K-FAC calibration equals the data's
        assert np.isclose(s.sq_norm_sum(0), float((x.astype(np.float64) ** 2).sum()), rtol=1e-6)
        assert s.projection(0, "in").shape == (4, s.layers[0].d_in)
        assert s.manifest["run_id"]


def test_missing_store(tmp_path):
    with pytest.raises(StoreError, match="no store at"):
        Store(tmp_path / "nothing.h5")


def test_not_hdf5_and_truncated(run, tmp_path):
    (tmp_path / "x.h5").write_text("hello")
    with pytest.raises(StoreError, match="not a readable HDF5 file"):
        Store(tmp_path / "x.h5")
    data = (run / "store.h5").read_bytes()
    (tmp_path / "t.h5").write_bytes(data[: len(data) // 3])
    with pytest.raises(StoreError):
        Store(tmp_path / "t.h5")


def test_other_schema_version(run, tmp_path):
    p = tmp_path / "old.h5"
    shutil.copy(run / "store.h5", p)
    with h5py.File(p, "a") as f:
        f.attrs["schema_version"] = 99
    with pytest.raises(SchemaVersionError, match="schema version 99"):
        Store(p)


def test_foreign_hdf5(tmp_path):
    with h5py.File(tmp_path / "f.h5", "w") as f:
        f["x"] = [1, 2]
    with pytest.raises(StoreError, match="not a Traceprop store"):
        Store(tmp_path / "f.h5")


def test_inconsistent_record_count(run, tmp_path):
    p = tmp_path / "c.h5"
    shutil.copy(run / "store.h5", p)
    with h5py.File(p, "a") as f:
        f.attrs["n_records"] = 10**6
    with pytest.raises(StoreError, match="holds .* records, the store says"):
        Store(p)


def test_model_mismatch(run):
    with Store(run) as s:
        names = [layer.name for layer in s.layers]
        widths = [(layer.d_in, layer.d_out) for layer in s.layers]
        s.check_model(names, widths)
        widths[0] = (widths[0][0] + 1, widths[0][1])
        with pytest.raises(ModelMismatchError, match="does not match the store"):
            s.check_model(names, widths)
