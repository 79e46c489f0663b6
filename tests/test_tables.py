"""Data through Hugging Face `datasets`: local parquet/CSV/JSONL with their own column names, a hub id served from a
`datasets` cache made here (offline), and the one-line errors for an uncached dataset and a missing column."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qerl.config import load_settings
from qerl.data.problems import fingerprint, load_dataset
from tests.patience import patience

datasets = pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["Wie viel ist 2 + 3?", "Wie viel ist 10 - 4?", "Wie viel ist 6 * 7?"]
GOLDS = ["5", "6", "42"]


def test_parquet_csv_and_jsonl_with_their_own_column_names(tmp_path):
    import pandas as pd

    # Parquet: bare integer answers under a column name with spaces and an umlaut.
    parquet = tmp_path / "aufgaben.parquet"
    pd.DataFrame({"Aufgabe Text": QUESTIONS, "Lösung": [5, 6, 42]}).to_parquet(parquet)
    # CSV: GSM8K-style worked answers ("#### 1,234" with a thousands comma), in different columns.
    csv = tmp_path / "worked.csv"
    pd.DataFrame({"q.text": QUESTIONS, "worked": ["2 + 3 = 5\n#### 5", "#### 6", "so 6 * 7\n#### 4,2"]}).to_csv(csv)
    # JSONL: MATH-style answers in \boxed{}, the last box counts.
    jsonl = tmp_path / "boxed.jsonl"
    jsonl.write_text("".join(json.dumps({"input": q, "target": f"not \\boxed{{0}} but \\boxed{{{g}}}"}) + "\n"
                             for q, g in zip(QUESTIONS, GOLDS)))

    cases = [(parquet, "Aufgabe Text", "Lösung", "plain"), (csv, "q.text", "worked", "gsm8k"),
             (jsonl, "input", "target", "math")]
    for path, question_field, answer_field, preset in cases:
        for answer_format in ("auto", preset):  # the preset is detected from the first row, or named
            examples = load_dataset(str(path), question_field=question_field, answer_field=answer_field,
                                    answer_format=answer_format)
            assert [(e.question, e.gold, e.source) for e in examples] == [(q, g, preset) for q, g in
                                                                         zip(QUESTIONS, GOLDS)], path
            assert [e.id for e in examples] == [f"{tmp_path.name}/{path.name}:{i}" for i in (1, 2, 3)]
    # The usual subset draw applies to tables too.
    assert load_dataset(str(parquet), n=2, seed=1, question_field="Aufgabe Text", answer_field="Lösung") == \
        load_dataset(str(parquet), n=2, seed=1, question_field="Aufgabe Text", answer_field="Lösung")


def test_every_column_of_a_row_goes_with_its_example(tmp_path):
    """What TRL-form rewards get as keyword arguments: the row's columns as the file holds them, beside the example's
    parsed gold; the generated arithmetic task's row is its question and answer."""
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text("".join(json.dumps({"question": q, "answer": f"#### {g}", "topic": t, "level": i}) + "\n"
                             for i, (q, g, t) in enumerate(zip(QUESTIONS, GOLDS, ["add", "sub", "mul"]))))
    examples = load_dataset(str(jsonl))
    assert [e.columns for e in examples] == [{"question": q, "answer": f"#### {g}", "topic": t, "level": i}
                                             for i, (q, g, t) in enumerate(zip(QUESTIONS, GOLDS, ["add", "sub", "mul"]))]
    assert examples[0].gold == "5" and "columns" not in repr(examples[0])
    ex = load_dataset("arithmetic", split="train", n=1)[0]
    assert ex.columns == {"question": ex.question, "answer": ex.gold}


def test_folder_of_split_files_and_unknown_split(tmp_path):
    for split, rows in (("train", zip(QUESTIONS[:2], GOLDS[:2])), ("test", [(QUESTIONS[2], GOLDS[2])])):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps({"question": q, "answer": f"#### {g}"}) + "\n"
                                                         for q, g in rows))
    assert [e.gold for e in load_dataset(str(tmp_path), split="train")] == GOLDS[:2]
    assert [e.gold for e in load_dataset(str(tmp_path), split="test")] == GOLDS[2:]
    with pytest.raises(ValueError, match="validation.*'train', 'test'"):
        load_dataset(str(tmp_path), split="validation")


def test_missing_column_names_the_column_and_the_columns_that_exist(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("Frage,Antwort\nWie viel ist 1 + 1?,2\n")
    with pytest.raises(ValueError) as error:
        load_dataset(str(path), question_field="question_text", answer_field="Antwort")
    assert str(error.value) == f"{path}: no column 'question_text' (question_field); its columns are 'Frage', 'Antwort'"
    # Unset fields fall back to the usual names; when none is there the error says which key to set.
    with pytest.raises(ValueError, match=r"no question column \(looked for 'question', 'problem', 'prompt'\); its "
                                         r"columns are 'Frage', 'Antwort': set question_field"):
        load_dataset(str(path))


def test_bad_rows_and_files_are_one_line_errors(tmp_path):
    gsm8k = tmp_path / "g.jsonl"
    gsm8k.write_text('{"question": "Q", "answer": "#### 1"}\n{"question": "Q2", "answer": "no marker"}\n')
    with pytest.raises(ValueError, match=rf"^{gsm8k}:2: no gold answer: column 'answer' has no '#### <answer>'$"):
        load_dataset(str(gsm8k))
    broken = tmp_path / "b.jsonl"
    broken.write_text('{"question": "Q", "answer": "1"}\n{"question": "Q2", "answer": \n')
    with pytest.raises(ValueError, match=rf"^{broken}: line 2: invalid JSON"):
        load_dataset(str(broken))
    with pytest.raises(ValueError, match=r"unsupported file type '\.txt'"):
        (tmp_path / "x.txt").write_text("hi")
        load_dataset(str(tmp_path / "x.txt"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dataset(str(tmp_path / "absent.parquet"))


def test_fingerprint_follows_the_data(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"question": "Q", "answer": "1"}\n')
    settings = load_settings(ROOT / "params/tiny.yaml", [f"data.name={path}"])
    first = fingerprint(settings.data)
    assert first == fingerprint(settings.data) and first["rows"] == 1
    path.write_text('{"question": "Q", "answer": "2"}\n')
    os.utime(path, (1, 1))  # a different mtime even on coarse-grained file systems
    assert fingerprint(settings.data)["fingerprint"] != first["fingerprint"]
    generated = fingerprint(settings.eval, knobs=settings.data)
    assert generated["name"] == "arithmetic" and generated != fingerprint(settings.eval, knobs=load_settings(
        ROOT / "params/tiny.yaml", ["data.digits=3"]).data)


# --- hub ids, offline, from a datasets cache made here ---------------------------------------------------------------


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A `datasets` cache holding 'openai/gsm8k' config 'main' exactly as `load_dataset('openai/gsm8k', 'main')` leaves
    it after a download (`<namespace>___<name>/<config>/<version>/<revision>/gsm8k-<split>.arrow`), built here by
    `datasets`' own JSON builder from two small files."""
    from datasets.packaged_modules.json.json import Json

    root = tmp_path_factory.mktemp("hf")
    files = {}
    for split, rows in (("train", zip(QUESTIONS[:2], GOLDS[:2])), ("test", [(QUESTIONS[2], GOLDS[2])])):
        files[split] = str(root / f"{split}.jsonl")
        Path(files[split]).write_text("".join(json.dumps({"question": q, "answer": f"Rechnung\n#### {g}"}) + "\n"
                                              for q, g in rows))
    cache = root / "cache"
    builder = Json(cache_dir=str(cache), dataset_name="gsm8k", config_name="main", config_id="main",
                   hash="e53f048856ff4f594e959d75785d2c2d37b678ee", data_files=files)
    builder.download_and_prepare()
    (cache / "gsm8k").rename(cache / "openai___gsm8k")  # the hub builder's namespaced folder
    return cache


def stages(*args: str, cache: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """`python -m qerl.flows.stages ...` offline, with `cache` as the datasets cache (read when `datasets` is imported)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache),
           "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "qerl.flows.stages", *args,
                           "--params", str(ROOT / "params/tiny.yaml")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=patience(300))


def test_hub_id_loads_offline_from_the_datasets_cache(hub_cache, tmp_path):
    proc = stages("prepare", "-S", "data.name=openai/gsm8k", "-S", "data.config=main", "-S", "data.n=null",
                  "-S", "eval.name=openai/gsm8k", "-S", "eval.config=main", "-S", "eval.n=null",
                  "--out", "prepared", cache=hub_cache, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {split: [json.loads(line) for line in (tmp_path / "prepared" / f"{split}.jsonl").open()]
            for split in ("train", "test")}
    assert [(r["problem"], r["answer"], r["id"]) for r in rows["train"]] == [
        (q, g, f"openai/gsm8k/main:train:{i}") for i, (q, g) in enumerate(zip(QUESTIONS[:2], GOLDS[:2]), start=1)]
    assert [r["answer"] for r in rows["test"]] == GOLDS[2:]


def test_uncached_hub_dataset_offline_is_one_line_naming_it_and_how_to_fetch_it(hub_cache, tmp_path):
    proc = stages("prepare", "-S", "data.name=someone/absent", "-S", "data.config=v2", "--out", "prepared",
                  cache=hub_cache, tmp_path=tmp_path)
    assert proc.returncode == 2  # bad input, as every one-line error
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m qerl.flows.stages: error: hub dataset 'someone/absent' (config 'v2') is not in the "
                           f"local datasets cache ({hub_cache})")
    assert "datasets.load_dataset('someone/absent', 'v2')" in last
    assert not (tmp_path / "prepared").exists()


def test_files_without_rows_are_one_line_naming_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from qerl.data.tables import open_table

    files = {"empty.jsonl": "", "blank.jsonl": "\n \n", "empty.csv": "", "header.csv": "question,answer\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    pq.write_table(pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
                   tmp_path / "empty.parquet")
    expected = {"empty.jsonl": "the file is empty (no rows)", "blank.jsonl": "the file is empty (no rows)",
                "empty.csv": "the file is empty (no rows)", "header.csv": "only a header line, no rows",
                "empty.parquet": "the parquet file has no rows"}
    for name, reason in expected.items():
        with pytest.raises(ValueError) as info:
            open_table(str(tmp_path / name))
        assert str(info.value) == f"{tmp_path / name}: {reason}"


def test_a_broken_csv_names_the_parsers_reason_not_the_wrapper(tmp_path):
    from qerl.data.tables import open_table

    table = tmp_path / "broken.csv"
    table.write_text('question,answer\n"What is 1 + 1?,2\n')
    with pytest.raises(ValueError) as info:
        open_table(str(table))
    assert str(info.value) == f"{table}: Error tokenizing data. C error: EOF inside string starting at row 1"
