"""Tests of traceprop_engine.training.data: real files in every format, lineage, hashes, errors, split."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import polars as pl
import pytest

from traceprop_engine.errors import ConfigError, DataError
from traceprop_engine.training.data import hash_files, load_examples, sha256_file, split_eval
from traceprop_engine.training.examples import Example


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_sha(row: dict) -> str:
    text = json.dumps(row, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return sha(text.encode("utf-8"))


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------------------------- formats


def test_jsonl_rows_keep_editor_line_numbers_across_blank_lines(tmp_path):
    line1 = '{"prompt": "Q: Colour of Velmora?\\nA:", "completion": " teal", "extra": 1}'
    line4 = '{"prompt": "", "completion": " café"}'
    write(tmp_path / "facts.jsonl", f"{line1}\n\n   \n{line4}\n")

    examples, root = load_examples(tmp_path / "facts.jsonl")

    assert root == tmp_path
    assert [(e.source, e.row) for e in examples] == [("facts.jsonl", 1), ("facts.jsonl", 4)]
    assert examples[0].prompt == "Q: Colour of Velmora?\nA:"
    assert examples[0].completion == " teal"
    assert examples[0].layout == "prompt_completion"
    assert examples[0].full_text() == "Q: Colour of Velmora?\nA: teal"
    assert examples[0].key == "facts.jsonl:1"
    assert examples[0].sha256 == sha(line1.encode("utf-8"))
    assert examples[1].prompt == ""  # an empty prompt is allowed
    assert examples[1].sha256 == sha(line4.encode("utf-8"))


def test_jsonl_crlf_and_bom_are_not_part_of_the_record_hash(tmp_path):
    line1, line2 = '{"text": "one"}', '{"text": "two"}'
    write(tmp_path / "a.jsonl", b"\xef\xbb\xbf" + f"{line1}\r\n{line2}".encode())

    examples, _ = load_examples(tmp_path / "a.jsonl")

    assert [e.text for e in examples] == ["one", "two"]
    assert [e.sha256 for e in examples] == [sha(line1.encode()), sha(line2.encode())]


def test_txt_one_example_per_non_empty_line(tmp_path):
    write(tmp_path / "notes.txt", "first line\n\n  \nsecond line \n")

    examples, _ = load_examples(tmp_path / "notes.txt")

    assert [(e.row, e.text, e.layout) for e in examples] == [
        (1, "first line", "text"),
        (4, "second line ", "text"),
    ]
    assert examples[1].sha256 == sha(b"second line ")
    assert examples[1].full_text() == "second line "


def test_csv_rows_count_data_rows_after_the_header(tmp_path):
    write(
        tmp_path / "data.csv",
        'prompt,completion,note\nQ: a?,yes,x\n"Q: multi\nline?"," no",y\n',
    )

    examples, _ = load_examples(tmp_path / "data.csv")

    assert [(e.row, e.prompt, e.completion) for e in examples] == [
        (1, "Q: a?", "yes"),
        (2, "Q: multi\nline?", " no"),
    ]
    assert examples[0].sha256 == canonical_sha(
        {"prompt": "Q: a?", "completion": "yes", "note": "x"}
    )
    assert examples[1].sha256 == canonical_sha(
        {"prompt": "Q: multi\nline?", "completion": " no", "note": "y"}
    )


def test_parquet_classification_labels_become_strings(tmp_path):
    frame = pl.DataFrame({"text": ["good kettle", "bad lamp", "fine é"], "label": [1, 0, 1]})
    frame.write_parquet(tmp_path / "reviews.parquet")

    examples, _ = load_examples(tmp_path / "reviews.parquet", task="classification")

    assert [(e.row, e.text, e.label, e.layout) for e in examples] == [
        (1, "good kettle", "1", "text_label"),
        (2, "bad lamp", "0", "text_label"),
        (3, "fine é", "1", "text_label"),
    ]
    assert examples[2].sha256 == canonical_sha({"text": "fine é", "label": 1})


def test_causal_lm_ignores_a_label_field(tmp_path):
    write(tmp_path / "a.jsonl", '{"text": "hello", "label": "positive"}\n')

    (example,), _ = load_examples(tmp_path / "a.jsonl")

    assert example.label is None
    assert example.layout == "text"


def test_directory_is_read_recursively_in_relative_path_order(tmp_path):
    write(tmp_path / "b.jsonl", '{"text": "b1"}\n')
    write(tmp_path / "a" / "z.txt", "az1\naz2\n")
    write(tmp_path / "a" / "c.csv", "text\nac1\n")
    write(tmp_path / "README.md", "not data")
    write(tmp_path / ".hidden.jsonl", '{"text": "hidden"}\n')
    write(tmp_path / ".cache" / "x.jsonl", '{"text": "hidden too"}\n')

    examples, root = load_examples(str(tmp_path))

    assert root == tmp_path
    assert [(e.key, e.text) for e in examples] == [
        ("a/c.csv:1", "ac1"),
        ("a/z.txt:1", "az1"),
        ("a/z.txt:2", "az2"),
        ("b.jsonl:1", "b1"),
    ]


def test_hash_files_matches_hashlib(tmp_path):
    body_a, body_b = b'{"text": "x"}\n', b"line one\nline two\n"
    write(tmp_path / "a.jsonl", body_a)
    write(tmp_path / "sub" / "b.txt", body_b)
    examples, root = load_examples(tmp_path)

    hashes = hash_files(root, [e.source for e in examples])

    assert hashes == {"a.jsonl": sha(body_a), "sub/b.txt": sha(body_b)}
    assert sha256_file(tmp_path / "sub" / "b.txt") == sha(body_b)


def test_hash_files_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="cannot read data file"):
        hash_files(tmp_path, ["gone.jsonl"])


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("name", "body", "task", "expected"),
    [
        (
            "a.jsonl",
            '{"text": "ok"}\n\n{"text": "a" "b"}\n',
            "causal-lm",
            "a.jsonl:3: invalid JSON (Expecting ',' delimiter",
        ),
        ("a.jsonl", '["text"]\n', "causal-lm", "a.jsonl:1: expected a JSON object"),
        ("a.jsonl", '{"prompt": "Q"}\n', "causal-lm", "a.jsonl:1: required field 'completion'"),
        (
            "a.jsonl",
            '{"prompt": "Q", "completion": "  "}\n',
            "causal-lm",
            "a.jsonl:1: field 'completion' is empty",
        ),
        ("a.jsonl", '{"text": ""}\n', "causal-lm", "a.jsonl:1: field 'text' is empty"),
        ("a.jsonl", '{"text": 5}\n', "causal-lm", "a.jsonl:1: field 'text' must be a string"),
        ("a.jsonl", '{"text": null}\n', "causal-lm", "a.jsonl:1: field 'text' is null"),
        (
            "a.jsonl",
            '{"prompt": 1, "completion": "x"}\n',
            "causal-lm",
            "a.jsonl:1: field 'prompt' must be a string",
        ),
        (
            "a.jsonl",
            '{"question": "Q", "answer": "A"}\n',
            "causal-lm",
            "a.jsonl:1: unknown field layout (fields found: 'question', 'answer')",
        ),
        ("a.jsonl", '{"text": "x"}\n', "classification", "a.jsonl:1: required field 'label'"),
        (
            "a.jsonl",
            '{"text": "x", "label": 0.5}\n',
            "classification",
            "a.jsonl:1: field 'label' must be a string or an integer",
        ),
        (
            "a.jsonl",
            '{"prompt": "x", "completion": "y"}\n',
            "classification",
            "a.jsonl:1: unknown field layout",
        ),
        (
            "data.csv",
            "prompt,completion\nQ,A\nQ2,\n",
            "causal-lm",
            "data.csv:3: field 'completion' is empty",
        ),
        ("data.csv", "text\nok\nx,y\n", "causal-lm", "data.csv:3: the row has 2 field(s)"),
        ("data.csv", "\n", "causal-lm", "data.csv:1: a CSV file needs a header row"),
        (
            "data.csv",
            'text\n"unterminated\n',
            "causal-lm",
            "data.csv:2: malformed CSV (unexpected end of data)",
        ),
        ("notes.txt", "hello\n", "classification", "notes.txt: a .txt file holds text only"),
    ],
)
def test_row_errors_name_file_and_line(tmp_path, name, body, task, expected):
    write(tmp_path / name, body)

    with pytest.raises(DataError) as info:
        load_examples(tmp_path / name, task=task)

    assert expected in str(info.value)


def test_error_in_a_directory_names_the_relative_path(tmp_path):
    write(tmp_path / "facts" / "a.jsonl", '{"text": "ok"}\n{"text": 1,}\n')

    with pytest.raises(DataError, match=r"facts/a\.jsonl:2: invalid JSON"):
        load_examples(tmp_path)


def test_non_utf8_file_names_line_and_byte_offset(tmp_path):
    body = b'{"text": "ok"}\n{"text": "caf\xe9"}\n'
    write(tmp_path / "a.jsonl", body)

    with pytest.raises(DataError) as info:
        load_examples(tmp_path / "a.jsonl")

    message = str(info.value)
    assert "a.jsonl:2: not valid UTF-8" in message
    offset = body.index(b"\xe9")  # 28: the byte after '{"text": "caf' on line 2
    assert f"byte 0xe9 at byte offset {offset}" in message


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match="data path does not exist: .*nope"):
        load_examples(tmp_path / "nope")


def test_single_file_with_unsupported_extension(tmp_path):
    write(tmp_path / "data.json", "[]")

    with pytest.raises(DataError, match=r"unsupported file type '\.json'; use one of \.jsonl"):
        load_examples(tmp_path / "data.json")


def test_directory_without_supported_files(tmp_path):
    write(tmp_path / "README.md", "hi")

    with pytest.raises(DataError, match="contains no supported data files .*found only: README.md"):
        load_examples(tmp_path)


def test_empty_data_set_lists_what_was_looked_for(tmp_path):
    write(tmp_path / "a.jsonl", "\n\n")
    write(tmp_path / "b.txt", "")

    with pytest.raises(DataError) as info:
        load_examples(tmp_path)

    message = str(info.value)
    assert "no examples found" in message
    assert "'prompt' + 'completion', or 'text'" in message
    assert "files read: a.jsonl, b.txt" in message


def test_mixed_layouts_across_files(tmp_path):
    write(tmp_path / "a.jsonl", '{"prompt": "Q", "completion": "A"}\n')
    write(tmp_path / "b.txt", "plain text\n")

    with pytest.raises(DataError) as info:
        load_examples(tmp_path)

    message = str(info.value)
    assert "b.txt:1: layout 'text' differs from layout 'prompt_completion' of a.jsonl:1" in message


def test_unknown_task(tmp_path):
    write(tmp_path / "a.jsonl", '{"text": "x"}\n')

    with pytest.raises(ConfigError, match="'causal-lm', 'classification'"):
        load_examples(tmp_path / "a.jsonl", task="regression")


def test_example_needs_one_layout():
    with pytest.raises(DataError, match="x:1: an example needs"):
        Example("x", 1, "0" * 64, text="t", prompt="p", completion="c")
    with pytest.raises(DataError, match="x:1: an example needs both"):
        Example("x", 1, "0" * 64, prompt="p")


# ---------------------------------------------------------------------------------- split


def _examples(n: int) -> list[Example]:
    return [Example("a.txt", i, sha(str(i).encode()), text=f"t{i}") for i in range(1, n + 1)]


def test_split_is_deterministic_ordered_and_disjoint():
    examples = _examples(50)

    train, held_out = split_eval(examples, 0.2, seed=3)
    train2, held_out2 = split_eval(examples, 0.2, seed=3)
    _, held_out_other = split_eval(examples, 0.2, seed=4)

    assert (train, held_out) == (train2, held_out2)
    assert len(held_out) == 10 and len(train) == 40
    assert {e.key for e in train} | {e.key for e in held_out} == {e.key for e in examples}
    assert [e.row for e in train] == sorted(e.row for e in train)
    assert [e.row for e in held_out] == sorted(e.row for e in held_out)
    assert held_out_other != held_out


def test_split_fraction_zero_and_limits():
    examples = _examples(3)

    assert split_eval(examples, 0.0, seed=0) == (examples, [])
    train, held_out = split_eval(examples, 0.01, seed=0)  # a positive fraction holds out >= 1
    assert (len(train), len(held_out)) == (2, 1)
    with pytest.raises(DataError, match="leaves none for training"):
        split_eval(examples[:1], 0.5, seed=0)
    with pytest.raises(ConfigError, match=r"in \[0, 1\)"):
        split_eval(examples, 1.0, seed=0)


def test_task_enum_from_settings_is_accepted(tmp_path):
    from traceprop_engine.settings import Task

    write(tmp_path / "a.jsonl", '{"text": "x", "label": 2}\n')

    (example,), _ = load_examples(tmp_path / "a.jsonl", task=Task.CLASSIFICATION)

    assert example.label == "2"
