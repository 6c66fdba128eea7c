"""One training example and where it came from: :class:`Example`, its field layouts and tasks.

Every :class:`Example` carries its source file (relative to the data root, POSIX separators),
its 1-based row and a sha256 of its raw record, so an attribution can be traced back to the
exact line a person can open in an editor, and an audit can re-verify it later. How each file
format is read and hashed is described in :mod:`.readers`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DataError

LAYOUT_PROMPT_COMPLETION = "prompt_completion"
LAYOUT_TEXT = "text"
LAYOUT_TEXT_LABEL = "text_label"
LAYOUTS = (LAYOUT_PROMPT_COMPLETION, LAYOUT_TEXT, LAYOUT_TEXT_LABEL)

TASK_CAUSAL_LM = "causal-lm"
TASK_CLASSIFICATION = "classification"
TASKS = (TASK_CAUSAL_LM, TASK_CLASSIFICATION)

SUPPORTED_SUFFIXES = (".jsonl", ".csv", ".parquet", ".txt")

ACCEPTED_LAYOUTS = {  # what each task reads, for error messages
    TASK_CAUSAL_LM: "'prompt' + 'completion', or 'text'",
    TASK_CLASSIFICATION: "'text' + 'label'",
}


@dataclass(frozen=True)
class Example:
    """One training (or evaluation) example and where it came from.

    Attributes:
        source: Path of the data file relative to the data root, with POSIX separators.
        row: 1-based row: the editor line number for ``.jsonl``/``.txt``, the data row after
            the header for ``.csv``/``.parquet``.
        sha256: Hex sha256 of the raw record (see the module docstring for what is hashed).
        text: The text, for the ``text`` and ``text_label`` layouts.
        prompt: The prompt, for the ``prompt_completion`` layout (may be empty).
        completion: The completion, for the ``prompt_completion`` layout.
        label: The classification label, always a string.
    """

    source: str
    row: int
    sha256: str
    text: str | None = None
    prompt: str | None = None
    completion: str | None = None
    label: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) != (self.completion is None):
            raise DataError(
                f"{self.key}: an example needs both 'prompt' and 'completion', or neither "
                "(then 'text'); got only one of them."
            )
        if (self.prompt is None) == (self.text is None):
            raise DataError(
                f"{self.key}: an example needs either 'prompt' + 'completion' or 'text', "
                "not both and not neither."
            )

    @property
    def key(self) -> str:
        """``"source:row"``, unique within a data set."""
        return f"{self.source}:{self.row}"

    @property
    def layout(self) -> str:
        """``"prompt_completion"``, ``"text"`` or ``"text_label"``."""
        if self.prompt is not None:
            return LAYOUT_PROMPT_COMPLETION
        if self.label is not None:
            return LAYOUT_TEXT_LABEL
        return LAYOUT_TEXT

    def full_text(self) -> str:
        """The whole text the model sees: ``prompt + completion``, or ``text``."""
        if self.prompt is not None:
            return self.prompt + (self.completion or "")
        return self.text or ""
