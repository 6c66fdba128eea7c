"""The datasets of one tracked layer in a new store: its attributes, its empty resizable record
datasets (a full record, or rank-r factors ``U``, ``V`` and an int8 record's scale) and its
projections. Names and layout: docs/store-format.md; :class:`~.writer.StoreWriter` creates them.
"""

from __future__ import annotations

import h5py
import numpy as np

from .. import constants as C
from .format import FACTOR_STORAGE, chunk_rows


def create_factors(g: h5py.Group, layer, compression: str | None):
    """A factored layer's empty rank-r datasets, ``U (n, k_out, r)``, ``V (n, k_in, r)``
    (and an int8 record's scale), and their attributes: ``([U, V(, scale)], k_out, dtype)``."""
    rank = int(layer.rank)
    fdt = str(getattr(layer, "factor_dtype", "float32"))
    g.attrs[C.L_RANK] = rank
    g.attrs[C.L_FACTOR_DTYPE] = fdt
    pair = []
    for name, rows in ((C.L_U, layer.k_out), (C.L_V, layer.k_in)):
        pair.append(
            g.create_dataset(
                name,
                shape=(0, rows, rank),
                maxshape=(None, rows, rank),
                dtype=FACTOR_STORAGE[fdt],
                chunks=(chunk_rows(rows * rank), rows, rank),
                compression=compression,
                fletcher32=True,
            )
        )
    if fdt == "int8":
        pair.append(
            g.create_dataset(
                C.L_SCALE,
                shape=(0,),
                maxshape=(None,),
                dtype="f4",
                chunks=(chunk_rows(layer.k_out * rank),),  # as U's chunks
                fletcher32=True,
            )
        )
    return pair, layer.k_out, fdt


def bias_column(layer) -> bool:
    """Whether ``layer``'s (a capture ``TrackedLayer``'s) records start from the summed output
    gradient, so their first ``U`` column is the direction of ``P_out Σ_t g_t`` with its sign
    (``capture/sketch.py full_factors``): factors of the full ``G`` by half a step (no power
    iteration, no input-side start)."""
    rank = int(getattr(layer, "rank", 0))
    return (
        rank > 0
        and bool(getattr(layer, "full_factor", False))
        and int(getattr(layer, "power_iters", 0)) == 0
        and not (rank == 1 and getattr(layer, "input_start", False))
    )


def create_layer(g: h5py.Group, layer, sketch: str, compression: str | None):
    """One layer's attributes, its empty resizable record datasets and its projections.

    Returns what :meth:`.writer.StoreWriter.append` writes records into: the ``sketch`` dataset, or for rank-r
    factors ``([U, V(, scale)], k_out, factor dtype)``.
    """
    g.attrs.update(
        name=layer.name,
        kind=layer.kind,
        sketch=sketch,
        d_in=layer.d_in,
        d_out=layer.d_out,
        k_in=layer.k_in,
        k_out=layer.k_out,
        dense_k=getattr(layer, "dense_k", 0),
    )
    if getattr(layer, "output_head", False):
        g.attrs[C.L_OUTPUT_HEAD] = 1
        if bias_column(layer):
            g.attrs[C.L_BIAS_COLUMN] = 1
    if int(getattr(layer, "rank", 0)):
        sketch_ds = create_factors(g, layer, compression)
    else:
        shape = tuple(layer.record_shape)
        sketch_ds = g.create_dataset(
            C.L_SKETCH,
            shape=(0, *shape),
            maxshape=(None, *shape),
            dtype="f4",
            chunks=(chunk_rows(int(np.prod(shape))), *shape),
            compression=compression,
            fletcher32=True,
        )
    # Fletcher-32 here too: a flipped byte in a projection fails the read (it moves scores)
    if layer.P_in is not None:
        g.create_dataset(C.L_P_IN, data=layer.P_in.numpy(), fletcher32=True)
    if layer.P_out is not None:
        g.create_dataset(C.L_P_OUT, data=layer.P_out.numpy(), fletcher32=True)
    if getattr(layer, "vocab_ids", None) is not None:
        g.create_dataset(C.L_VOCAB_IDS, data=layer.vocab_ids.astype(np.int64), fletcher32=True)
    if getattr(layer, "dense_index", None) is not None:
        g.create_dataset(
            C.L_DENSE_INDEX,
            data=layer.dense_index.numpy().astype(np.int32),
            compression="gzip",
            fletcher32=True,
        )
        g.create_dataset(
            C.L_DENSE_SIGN,
            data=(layer.dense_sign.numpy() > 0).astype(np.int8),
            compression="gzip",
            fletcher32=True,
        )
        g.attrs["dense_nnz"] = int(layer.dense_index.shape[0])
    return sketch_ds
