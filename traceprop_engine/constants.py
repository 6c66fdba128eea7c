"""On-disk names, in one place. The store format is documented in docs/store-format.md."""

from __future__ import annotations

from pathlib import Path

# The checkout (or source tree) this package sits in: sample runs and measured results live there.
REPO_ROOT = Path(__file__).resolve().parent.parent

SCHEMA_VERSION = 2
# 1: full sketches only; 2 adds rank-r factor storage (layers/NNN/U, V), still reads 1
READABLE_SCHEMA_VERSIONS = (1, 2)
STORE_FORMAT = "traceprop-store"

# run directory layout
STORE_FILE = "store.h5"
MANIFEST_FILE = "run.json"
PROGRESS_FILE = "progress.jsonl"
LOG_FILE = "train.log"
MODEL_DIR = "model"
INDEX_DIR = "index"

# the default preconditioner of an index (IndexSettings, CLI, app): auto, resolved per run
# (attribution/overview.py: resolve_settings) to K-FAC with cosine scores, EK-FAC on a pretrained
# classifier fine-tuned in full, identity on a run without statistics. Why: benchmarks/EVAL.md
# §1k (LoRA runs gain 0.02-0.07 LDS over identity) and §1r (EK-FAC above K-FAC on every
# pretrained classifier fine-tuned in full)
DEFAULT_PRECONDITIONER = "auto"

# a tracked run takes K-FAC statistics from at least this many batches (`traceprop train` lowers
# the stride of a short run: training/prepare.py short_run_track; an own loop is warned at
# Tracker.close). At stride 32 a 60-step LoRA run had two, the first with the B matrices at zero;
# stride 3 raised K-FAC-cosine's LDS on it from 0.572 / 0.635 to 0.596 / 0.642 (EVAL.md §1h)
MIN_COVARIANCE_BATCHES = 16

# free text: training examples with more loss tokens than this (median); a free-text run's records
# take TrackSettings.free_text_rank, and a query whose answer (loss tokens after a prompt) has at
# most this many scores against the first column or every column, whichever gives its scores the
# heavier tails; a free-text query (a loss on every token) scores every column at any length
# (capture/free_text.py, attribution/column_choice.py, attribution/model_side/test_side.py
# query_targets; benchmarks/EVAL.md §1x-§1aa)
FREE_TEXT_TARGETS = 16

# run status values (run.json "status" and the store's "status" attribute)
STATUS_RUNNING = "running"
STATUS_COMPLETED = "completed"
STATUS_FAILED = "failed"
STATUS_CANCELLED = "cancelled"

# what a run trained (store attribute MODEL_ORIGIN, written by the Tracker; absent in stores
# written before 2026-12-06): IndexSettings.weighting='auto' whitens every layer at the Fisher's
# own scale for a pretrained causal LM fine-tuned in full (benchmarks/EVAL.md §1p)
MODEL_ORIGIN = "model_origin"
ORIGIN_SCRATCH = "scratch"
ORIGIN_ADAPTER = "adapter"
ORIGIN_PRETRAINED_FULL = "pretrained-full"

# the per-example loss definition, part of the format
LOSS_DEFINITION = (
    "per-example loss = mean token cross-entropy over the example's target tokens "
    "(labels != -100; next-token shift for causal LM); classification: the example's "
    "cross-entropy; batch loss = mean of per-example losses, so hooks rescale dL/dy by "
    "the local batch size"
)

# HDF5 groups and datasets
G_EXAMPLES = "examples"
G_RECORDS = "records"
G_LAYERS = "layers"
G_TIMINGS = "timings"

EX_SOURCE = "source"
EX_ROW = "row"
EX_SHA256 = "sha256"
EX_SPLIT = "split"
EX_TEXT = "text"
EX_PROMPT = "prompt"
EX_COMPLETION = "completion"
EX_LABEL = "label"
EX_TOKEN_OFFSETS = "token_offsets"  # (n_examples + 1,) int64 into tokens / loss_mask
EX_TOKENS = "tokens"  # (total_tokens,) int32
EX_LOSS_MASK = "loss_mask"  # (total_tokens,) uint8
# the example table's UTF-8 string columns, in order
EX_STRING_COLUMNS = (EX_SOURCE, EX_SHA256, EX_SPLIT, EX_TEXT, EX_PROMPT, EX_COMPLETION, EX_LABEL)
EX_STRINGS_SHA256 = "strings_sha256"  # /examples attribute: sha256 of the string columns

REC_EXAMPLE = "example_index"
REC_STEP = "step"
REC_EPOCH = "epoch"
REC_LR = "lr"
REC_LOSS = "loss"
RECORD_FIELDS = (REC_EXAMPLE, REC_STEP, REC_EPOCH, REC_LR, REC_LOSS)
RECORD_DTYPES = {REC_EXAMPLE: "i8", REC_STEP: "i8", REC_EPOCH: "i4", REC_LR: "f4", REC_LOSS: "f4"}

L_SKETCH = "sketch"
L_U = "U"  # (n, k_out, r) factor with the singular values folded in
L_V = "V"  # (n, k_in, r) orthonormal columns; record = U @ V^T
L_OUTPUT_HEAD = "output_head"  # layer attribute: 1 for the layer producing the logits
# layer attribute: 1 where every record's first U column is the direction of P_out Σ_t g_t, sign
# included (an output head's records since 2026-12-07: attribution/score/lm_bias.py)
L_BIAS_COLUMN = "bias_column"
L_VOCAB_IDS = "vocab_ids"  # layer dataset: token ids of P_out's exact first rows (vocab_rows)
L_RANK = "rank"  # layer attribute: r (0 or absent: full sketches in L_SKETCH)
L_SCALE = "scale"  # (n,) f4, int8 factors: record = scale · U Vᵀ
L_FACTOR_DTYPE = "factor_dtype"  # layer attribute: "bfloat16" (uint16 bit patterns) or "float32"
L_P_IN = "P_in"
L_P_OUT = "P_out"
L_DENSE_INDEX = "dense_index"
L_DENSE_SIGN = "dense_sign"
L_COV_A = "A"
L_COV_S = "S"
L_SQNORM = "sketch_sq_norm_sum"

T_STEP_MS = "step_ms"

SPLIT_TRAIN = "train"
SPLIT_EVAL = "eval"
