"""A kill in the middle of a flush tears a chunk (half new, half old; its checksum fails):
the flushed rows in it are read back, checked against the writer's CRC, and a resume rewrites
the chunk (store/torn_tail.py). The tear is made by hand from two real flushes of a real store,
byte for byte what a write stopped between pages leaves."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from traceprop_engine import Store, StoreError
from traceprop_engine import constants as C
from traceprop_engine.store.torn_tail import TAIL_NAMES, TAIL_TABLE
from traceprop_engine.store.writer import StoreWriter

N1, N2 = 37, 53  # records at the flush before the kill, and those the torn write held


def _layers():
    full = SimpleNamespace(
        name="blk.0", kind="linear", d_in=8, d_out=8, k_in=4, k_out=3,
        P_in=None, P_out=None, record_shape=(3, 4),
    )  # fmt: skip
    factored = SimpleNamespace(
        name="blk.1", kind="linear", d_in=8, d_out=8, k_in=5, k_out=6, rank=2,
        factor_dtype="int8", P_in=None, P_out=None, record_shape=(6, 5),
    )  # fmt: skip
    return [full, factored]


def _batch(rng, n0, n):
    arrays = [
        rng.normal(size=(n, 3, 4)).astype(np.float32),
        rng.normal(size=(n, 11, 2)).astype(np.float32),
    ]
    meta = {
        C.REC_EXAMPLE: np.arange(n0, n0 + n),
        C.REC_STEP: np.arange(n0, n0 + n) // 4,
        C.REC_EPOCH: np.arange(n0, n0 + n) // 20 + 1,
        C.REC_LR: np.full(n, 1e-3, np.float32),
        C.REC_LOSS: rng.random(n).astype(np.float32),
    }
    return arrays, meta


GROWN = ("layers/000/sketch", "layers/001/U", "layers/001/V", "layers/001/scale")
GROWN += tuple(f"{C.G_RECORDS}/{n}" for n in C.RECORD_FIELDS)


def make_torn(tmp_path):
    """``(torn store, the store as flushed at N1)``: every record dataset's chunk torn in the
    middle of the rows the killed flush added."""
    rng = np.random.default_rng(0)
    path = tmp_path / "store.h5"
    w = StoreWriter(path, _layers(), {"run_id": "torn"}, "factored")
    for n0 in range(0, N1, 10):  # several flushes, the last one short
        w.append(*_batch(rng, n0, min(10, N1 - n0)))
    flushed = tmp_path / "flushed.h5"
    shutil.copy(path, flushed)
    w.append(*_batch(rng, N1, N2 - N1))
    w._f.close()  # the killed process wrote no more (its handle never closed the store)
    new = path.read_bytes()
    raw = bytearray(flushed.read_bytes())
    with h5py.File(flushed, "r") as old_f, h5py.File(path, "r") as new_f:
        for name in GROWN:
            a = old_f[name].id.get_chunk_info_by_coord((0,) * old_f[name].ndim)
            b = new_f[name].id.get_chunk_info_by_coord((0,) * new_f[name].ndim)
            assert (a.byte_offset, a.size) == (b.byte_offset, b.size)  # rewritten in place
            row = old_f[name].dtype.itemsize * int(np.prod(old_f[name].shape[1:]))
            cut = a.byte_offset + (N1 * row + N2 * row) // 2  # stopped inside the new rows
            raw[a.byte_offset : cut] = new[a.byte_offset : cut]
    out = tmp_path / "torn.h5"
    out.write_bytes(bytes(raw))
    return out, flushed


def test_a_torn_chunk_fails_its_checksum_but_its_flushed_rows_read_back(torn):
    path, flushed = torn
    with h5py.File(path, "r") as f:
        for name in GROWN:  # the premise: each chunk is torn (HDF5 alone cannot read it)
            with pytest.raises(OSError, match="filter returned failure"):
                f[name][:1]
    with Store(flushed) as want, Store(path) as got:
        assert got.is_partial and got.n_records == N1
        # killed before it closed: no digest ever, not a lost one (and nothing read to say so)
        assert got.verify_content()["status"] == "unrecorded"
        rec_w, rec_g = want.records(), got.records()
        for name in C.RECORD_FIELDS:
            np.testing.assert_array_equal(rec_g[name], rec_w[name])
        np.testing.assert_array_equal(got.sketches(0), want.sketches(0))
        np.testing.assert_array_equal(got.sketches(0, 5, 9), want.sketches(0, 5, 9))
        for a, b in zip(got.factors(1), want.factors(1), strict=True):
            np.testing.assert_array_equal(a, b)
        rows = np.array([0, 3, 20, N1 - 1])
        np.testing.assert_array_equal(got.sketches_at(0, rows), want.sketches_at(0, rows))
        for a, b in zip(got.factors_at(1, rows), want.factors_at(1, rows), strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(
            got.stored_rows(1, C.L_U, np.s_[2:N1]), want.stored_rows(1, C.L_U, np.s_[2:N1])
        )


def test_a_torn_chunk_whose_flushed_rows_changed_stays_damaged(torn):
    path, _ = torn
    with h5py.File(path, "r") as f:
        info = f[f"{C.G_RECORDS}/{C.REC_LOSS}"].id.get_chunk_info_by_coord((0,))
    raw = bytearray(path.read_bytes())
    raw[info.byte_offset + 4 * 7] ^= 0x40  # record 7's loss, below n_records
    path.write_bytes(bytes(raw))
    with Store(path) as s, pytest.raises(StoreError, match="records table is damaged"):
        s.records()


def test_a_store_without_the_crc_stays_damaged(torn):
    path, _ = torn
    with h5py.File(path, "r+") as f:  # the step column's CRCs lost
        names = json.loads(f[TAIL_TABLE].attrs[TAIL_NAMES])
        f[TAIL_TABLE][names.index(f"/{C.G_RECORDS}/{C.REC_STEP}")] = 0
    with Store(path) as s, pytest.raises(StoreError, match="records table is damaged"):
        s.records()
    with Store(path) as s:  # the other datasets' tails still read
        assert s.sketches(0).shape[0] == N1


@pytest.mark.parametrize("keep", [N1, N1 - 5])
def test_reopening_a_torn_store_rewrites_the_chunk_and_appends(torn, keep):
    path, flushed = torn
    with Store(flushed) as want:
        before = want.records(), want.sketches(0), want.factors(1)
        sq = [float(want.sq_norm_sum(i)) for i in range(2)]
    w = StoreWriter.reopen(path, keep, sq)
    rng = np.random.default_rng(1)
    arrays, meta = _batch(rng, keep, 20)
    w.append(arrays, meta)
    w.close(C.STATUS_COMPLETED)
    with h5py.File(path, "r") as f:  # HDF5 alone reads every chunk again
        for name in GROWN:
            assert f[name].shape[0] == keep + 20 and f[name][:].shape[0] == keep + 20
    with Store(path) as s:
        assert not s.is_partial and s.n_records == keep + 20
        assert s.verify_content()["status"] == "ok"
        rec = s.records()
        for name in C.RECORD_FIELDS:
            np.testing.assert_array_equal(rec[name][:keep], before[0][name][:keep])
            np.testing.assert_array_equal(rec[name][keep:], meta[name])
        np.testing.assert_array_equal(s.sketches(0)[:keep], before[1][:keep])
        np.testing.assert_array_equal(s.sketches(0)[keep:], arrays[0])
        u, v = s.factors(1)
        np.testing.assert_array_equal(u[:keep], before[2][0][:keep])
        np.testing.assert_array_equal(v[:keep], before[2][1][:keep])


@pytest.fixture()
def torn(tmp_path):
    return make_torn(tmp_path)


@pytest.fixture()
def lagging(tmp_path):
    """``(store, the store as flushed at N1)``: killed while writing the metadata of the flush
    to N2, after the root's ``n_records`` (N2) but before ``V``'s new length (still N1)."""
    rng = np.random.default_rng(0)
    path = tmp_path / "store.h5"
    w = StoreWriter(path, _layers(), {"run_id": "lagging"}, "factored")
    w.append(*_batch(rng, 0, N1))
    flushed = tmp_path / "flushed.h5"
    shutil.copy(path, flushed)
    w.append(*_batch(rng, N1, N2 - N1))
    w._f.close()
    with h5py.File(path, "r+") as f:
        f["layers/001/V"].resize(N1, axis=0)
    return path, flushed


def test_a_dataset_shorter_than_n_records_after_a_kill_counts_its_rows(lagging):
    path, flushed = lagging
    with Store(flushed) as want, Store(path) as got:
        assert got.is_partial and got.n_records == N1  # not refused: every dataset holds N1
        assert str(N1) in got.describe_partial()
        np.testing.assert_array_equal(got.records()[C.REC_LOSS], want.records()[C.REC_LOSS])
        for a, b in zip(got.factors(1), want.factors(1), strict=True):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(StoreError, match=rf"holds {N1} complete records .*V holds {N1}"):
        StoreWriter.reopen(path, N2, [0.0, 0.0])
    w = StoreWriter.reopen(path, N1, [0.0, 0.0])
    w.close(C.STATUS_CANCELLED)
    with Store(path) as s:
        assert s.n_records == N1 and s.verify_content()["status"] == "ok"


def test_a_shorter_dataset_whose_rows_fail_their_crc_is_refused(lagging):
    path, _ = lagging
    with h5py.File(path, "r+") as f:  # a changed row below N1, its chunk's checksum made anew
        f["layers/001/U"][3, 0, 0] += 1
    with pytest.raises(StoreError, match="do not match the CRC"):
        Store(path)


def test_the_crcs_take_no_new_file_space_at_each_flush(tmp_path):
    """The CRC table is rewritten in place: an attribute rewritten at each flush took new file
    space each time (213 KB over these 400 flushes; a 40 KB one, 80 MB over 2000)."""
    path = tmp_path / "store.h5"
    rng = np.random.default_rng(0)
    w = StoreWriter(path, _layers(), {"run_id": "grow"}, "factored")
    for n0 in range(3):  # every chunk allocated
        w.append(*_batch(rng, n0, 1))
    size = path.stat().st_size
    for n0 in range(3, 403):
        w.append(*_batch(rng, n0, 1))
    assert path.stat().st_size - size < 4096
    w.close(C.STATUS_COMPLETED)
