"""Reading prompt files: every format gives the same rows; every broken file is a clear error naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl.data.files import read_rows
from flowrl.errors import ConfigError

ROWS = [
    {"prompt": "What is 2+2?", "answer": "4"},
    {"prompt": "Wie viel ist 3·3?", "answer": "9"},
]


def write(path: Path, fmt: str, rows: list[dict]) -> Path:
    """``rows`` written as ``fmt`` to ``path`` with that extension."""
    target = path.with_suffix("." + fmt)
    if fmt == "jsonl":
        target.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    elif fmt == "json":
        target.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    elif fmt == "csv":
        import csv

        with target.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), target)
    return target


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_every_format_reads_the_same_rows(tmp_path, fmt):
    assert read_rows(str(write(tmp_path / "p", fmt, ROWS))) == ROWS


def test_jsonl_skips_blank_lines_and_keeps_nested_values(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": [{"role": "user", "content": "hi"}], "meta": {"k": 1}}\n\n  \n{"prompt": "b"}\n')
    assert read_rows(str(path)) == [{"prompt": [{"role": "user", "content": "hi"}], "meta": {"k": 1}}, {"prompt": "b"}]


BAD = [
    ("missing.jsonl", None, "does not exist"),
    ("empty.jsonl", b"", "holds no rows"),
    ("blank.jsonl", b"\n \n", "holds no rows"),
    ("latin1.jsonl", '{"prompt": "caf\u00e9"}\n'.encode("latin-1"), r"is not UTF-8 text .*line 1.*re-encode"),
    ("broken.jsonl", b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"\n', r"malformed on line 3, column"),
    ("scalar.jsonl", b'{"prompt": "a"}\n[1, 2]\n', r"line 2 is a JSON list, not an object"),
    ("broken.json", b'[{"prompt": "a"},', r"malformed JSON at line 1"),
    ("object.json", b'{"prompt": "a"}', r"holds a JSON dict, not a list of objects"),
    ("empty.json", b"[]", "holds no rows"),
    ("items.json", b'[{"prompt": "a"}, 3]', r"record 1 is a JSON int"),
    ("empty.csv", b"", "holds no rows"),
    ("prompts.txt", b"a\n", r"extension '\.txt'; use one of"),
    ("bad.parquet", b"not parquet at all", "not a readable Parquet file"),
]


@pytest.mark.parametrize(("name", "content", "match"), BAD, ids=[b[0] for b in BAD])
def test_bad_files_are_clear_errors_naming_the_file(tmp_path, name, content, match):
    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow")
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=match) as info:
        read_rows(str(path))
    assert name in str(info.value)


def test_a_directory_is_not_a_prompt_file(tmp_path):
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        read_rows(str(tmp_path / "d.jsonl"))


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError("no pyarrow")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    monkeypatch.setattr("importlib.import_module", lambda name: no_pyarrow(name))
    path = tmp_path / "p.parquet"
    path.write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"pip install 'flowrl\[data\]'"):
        read_rows(str(path))
