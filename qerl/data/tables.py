"""Problem tables through Hugging Face `datasets`: a hub id, or a local file or folder of jsonl/json/parquet/csv.

`open_table` finds and loads the table with `datasets`' own loaders and cache (so a hub dataset downloaded once loads
offline with HF_DATASETS_OFFLINE=1); `table_examples` turns its rows into `Example`s by two column names and an
answer preset. Every failure a user can cause is one line naming the dataset, and the column or row at fault.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qerl.data.example import Example
from qerl.data.rewards import extract_answer

if TYPE_CHECKING:  # the core imports `datasets` only when a table is actually read
    import datasets

__all__ = ["ANSWER_FORMATS", "FILE_LOADERS", "open_table", "table_examples", "table_label"]

# How a gold answer is written in the answer column: GSM8K's worked solution ending "#### 42", MATH's solution with
# the answer in \boxed{} (or "The answer is: ..."), or the bare answer. "auto" picks one from the first row.
ANSWER_FORMATS = ("auto", "gsm8k", "math", "plain")
# Column names tried, in order, when question_field / answer_field are not set: GSM8K, MATH and TRL layouts.
QUESTION_COLUMNS = ("question", "problem", "prompt")
ANSWER_COLUMNS = ("answer", "solution")
# File suffix -> the `datasets` packaged loader that reads it.
FILE_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _is_local(name: str) -> bool:
    """A path rather than a hub id: it exists, or it is spelled like a path (a hub id is `owner/name` or `name`)."""
    return (Path(name).expanduser().exists() or name.startswith((".", "/", "~"))
            or Path(name).suffix.lower() in FILE_LOADERS or name.count("/") > 1)


def table_label(name: str, config: str | None, split: str, short: bool = False) -> str:
    """How errors name a table: the file itself, or `name[/config]:split` for a hub dataset or a folder.
    `short`: the form example ids use, `folder/file` for a file (ids stay readable and machine-independent)."""
    path = Path(name).expanduser()
    if path.is_file():
        return f"{path.parent.name}/{path.name}" if short else str(path)
    if short and path.is_dir():
        name = path.resolve().name
    return f"{name}{f'/{config}' if config else ''}:{split}"


def open_table(name: str, config: str | None = None, split: str = "train") -> datasets.Dataset:
    """One split of a table: a local file (its only split, whatever `split` says), a local folder (its files named
    by split, e.g. train.jsonl / test.jsonl, as `datasets` infers them) or a hub dataset (from the local `datasets`
    cache when cached and offline or unreachable).
    """
    try:
        import datasets
    except ImportError as e:  # a bare GPU machine may lack it; the generated task does not need it
        raise ImportError(f"reading {name!r} needs the `datasets` package: pip install datasets") from e

    path = Path(name).expanduser()
    if path.is_file():
        return _open_file(datasets, path)
    if _is_local(name):
        if not path.exists():
            raise FileNotFoundError(f"data file or folder {name} does not exist")
        return _open(datasets, name, lambda: datasets.load_dataset(str(path), config, split=split))
    return _open_hub(datasets, name, config, split)


def _open_file(datasets: Any, path: Path) -> datasets.Dataset:
    loader = FILE_LOADERS.get(path.suffix.lower())
    if loader is None:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use one of "
                         f"{', '.join(sorted(FILE_LOADERS))} (or a folder of them, or a hub dataset id)")
    if loader in ("json", "csv"):
        _check_utf8(path)  # pyarrow's decode error names neither the file nor the line
    _check_has_rows(path, loader)  # `datasets` says StopIteration, or "corresponds to no data"
    # A single file is one split; `datasets` calls it "train" whatever it holds.
    return _open(datasets, str(path), lambda: datasets.load_dataset(loader, data_files=str(path), split="train"))


def _open(datasets: Any, label: str, load: Any) -> datasets.Dataset:
    """A local table, without `datasets`' progress bars and error logs (noise for a file read in a second, and they
    would come before our one-line error, which says the same with the file's name)."""
    was_enabled = datasets.is_progress_bar_enabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        return load()
    except (FileNotFoundError, ConnectionError, ImportError):
        raise
    except Exception as e:  # pyarrow and pandas parse errors have many types; each becomes one line naming the file
        reason = _bad_json_line(Path(label)) or _innermost(e)
        raise ValueError(f"{label}: {reason}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
        if was_enabled:
            datasets.enable_progress_bars()


def _innermost(e: BaseException) -> str:
    """The message of the error at the bottom of the chain: `datasets` wraps the parser's own error (which names
    the problem) in "An error occurred while generating the dataset"."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    return " ".join(str(e).split()) or type(e).__name__


def _check_has_rows(path: Path, loader: str) -> None:
    """ValueError naming the file when it holds no rows: empty, blank, a CSV header alone, a parquet of 0 rows."""
    if loader == "parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_metadata(path).num_rows
        except Exception:  # noqa: BLE001 - not a parquet file: the loader's own error says so
            return
        if rows == 0:
            raise ValueError(f"{path}: the parquet file has no rows")
        return
    lines = 0
    with path.open(encoding="utf-8") as f:
        for line in f:
            lines += bool(line.strip())
            if lines > 1:
                return
    if lines == 0:
        raise ValueError(f"{path}: the file is empty (no rows)")
    if loader == "csv":
        raise ValueError(f"{path}: only a header line, no rows")


def _check_utf8(path: Path) -> None:
    """ValueError naming file:line and the byte if a text data file is not UTF-8."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} "
                                 "of the line)") from None


def _bad_json_line(path: Path) -> str | None:
    """The first line of a JSON Lines file that is not a JSON object (pyarrow names only a byte position)."""
    if not path.is_file() or path.suffix.lower() != ".jsonl":
        return None
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return f"line {lineno}: invalid JSON ({e.msg} at column {e.colno})"
            if not isinstance(row, dict):
                return f"line {lineno}: expected a JSON object, got {type(row).__name__}"
    return None


def _open_hub(datasets: Any, name: str, config: str | None, split: str) -> datasets.Dataset:
    where = f"{name!r}" + (f" (config {config!r})" if config else "")
    try:
        return datasets.load_dataset(name, config, split=split)
    except ConnectionError:
        # `datasets` falls back to its cache by itself when the hub is unreachable: reaching here means not cached.
        fetch = f"python -c \"import datasets; datasets.load_dataset({name!r}{f', {config!r}' if config else ''})\""
        raise ConnectionError(
            f"hub dataset {where} is not in the local datasets cache ({datasets.config.HF_DATASETS_CACHE}) and the "
            f"hub is unreachable: fetch it once where the hub is reachable with `{fetch}` (then copy that cache "
            f"here, or point HF_DATASETS_CACHE at it), or save it to a file (Dataset.to_parquet) and name that file "
            f"instead"
        ) from None
    except FileNotFoundError:
        raise FileNotFoundError(f"no hub dataset {where} (a local path must exist; a hub id is owner/name)") from None
    except ValueError as e:  # unknown split or config: `datasets` names the ones that exist
        raise ValueError(f"hub dataset {where}: {' '.join(str(e).split())}") from None


def _column(table: Any, label: str, field: str | None, key: str, candidates: tuple[str, ...]) -> str:
    columns = list(table.column_names)
    shown = ", ".join(repr(c) for c in columns)
    if field is not None:
        if field not in columns:
            raise ValueError(f"{label}: no column {field!r} ({key}); its columns are {shown}")
        return field
    for candidate in candidates:
        if candidate in columns:
            return candidate
    raise ValueError(f"{label}: no {key.removesuffix('_field')} column (looked for "
                     f"{', '.join(repr(c) for c in candidates)}); its columns are {shown}: set {key}")


def _detect_format(answer: str) -> str:
    if "####" in answer:
        return "gsm8k"
    if "\\boxed{" in answer or "The answer is:" in answer:
        return "math"
    return "plain"


def _gold(answer: Any, answer_format: str, column: str) -> str:
    """The bare gold answer from one answer cell; ValueError (without location) when it has none."""
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"column {column!r} holds {type(answer).__name__}, expected text or a number")
    text = str(answer).strip()
    if not text:
        raise ValueError(f"empty answer in column {column!r}")
    if answer_format == "plain":
        return text
    if answer_format == "gsm8k":
        if "####" not in text:
            raise ValueError(f"no gold answer: column {column!r} has no '#### <answer>'")
        gold = text.rsplit("####", 1)[1].strip().replace(",", "")
    else:  # math: the parser that reads the policy's answers, so gold and prediction are read alike
        if "\\boxed{" not in text and "The answer is:" not in text:
            raise ValueError(f"no gold answer: column {column!r} has no \\boxed{{...}} or 'The answer is: ...'")
        gold = (extract_answer(text) or "").strip()
    if not gold:
        raise ValueError(f"no gold answer: the {'#### line' if answer_format == 'gsm8k' else 'boxed answer'} "
                         f"in column {column!r} is empty")
    return gold


def table_examples(table: Any, label: str, question_field: str | None = None, answer_field: str | None = None,
                   answer_format: str = "auto", id_prefix: str | None = None) -> list[Example]:
    """Every row of `table` as an Example: ids `id_prefix:row` (default the label; rows count from 1), `source` the
    answer format. Errors name `label` and the row."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {', '.join(ANSWER_FORMATS)}, got {answer_format!r}")
    question_col = _column(table, label, question_field, "question_field", QUESTION_COLUMNS)
    answer_col = _column(table, label, answer_field, "answer_field", ANSWER_COLUMNS)
    if len(table) == 0:
        raise ValueError(f"{label}: no rows")
    questions, answers = table[question_col], table[answer_col]  # column reads, not one dict per row
    # Every column, for the reward functions that read one (TRL's form gets them as keyword arguments)
    columns = {name: list(table[name]) for name in table.column_names}
    if answer_format == "auto":  # decided by the first row, then enforced on all
        answer_format = _detect_format(str(answers[0]))
    examples = []
    for row, (question, answer) in enumerate(zip(questions, answers), start=1):
        try:
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"column {question_col!r} holds {question!r}, expected non-empty text")
            gold = _gold(answer, answer_format, answer_col)
            examples.append(Example(f"{id_prefix or label}:{row}", question.strip(), gold, answer_format,
                                    columns={name: values[row - 1] for name, values in columns.items()}))
        except ValueError as e:
            # a JSON-lines file's row is its line: name it as file:line, as every other qerl error does
            where = f"{label}:{row}" if str(label).endswith(".jsonl") else f"{label} row {row}"
            raise ValueError(f"{where}: {e}") from None
    return examples
