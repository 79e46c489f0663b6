"""Hostile params files and `-S` values (issue #62): YAML bombs, recursion, deep nesting, huge scalars, wrong encodings,
garbage, the wrong file. Each is refused by `qerl train` in one line naming the file and line (or the flag), exit 2,
within seconds and before anything loads; a file too large for params is refused by its size, unread."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from qerl.config import ConfigError, load_settings

DEADLINE_S = 5.0  # the promise for any params file under 1 MB (the fixed loader takes milliseconds)


class Overran(BaseException):
    """Raised into the test by its deadline: a BaseException, so no `except Exception` in the command swallows it."""


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail a call that runs past `seconds` (before the fix a bomb ran for minutes, filling memory), instead of
    waiting for it: SIGALRM interrupts the Python loop that walks the expansion."""
    def overran(signum, frame):
        raise Overran(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, overran)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def laughs(levels: int, alias: str = "{k}: *a{prev}") -> str:
    """"Billion laughs": anchor a0 is one value, each next one names the one before ten times (10^levels in all)."""
    lines = ["a0: &a0 {lol: lol}"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} {{" + ", ".join(alias.format(k=f"k{j}", prev=i - 1) for j in range(10)) + "}")
    return "\n".join(lines) + "\n"


def merge_laughs(levels: int) -> str:
    """The same through merge keys, which PyYAML copies (flatten_mapping) rather than shares."""
    lines = ["a0: &a0 {lol: lol}"]
    lines += [f"a{i}: &a{i} {{<<: [{', '.join([f'*a{i - 1}'] * 10)}], own{i}: 1}}" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def nested_blocks(depth: int) -> str:
    return "lora:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(depth)) + "  " * (depth + 1) + "x: 1\n"


def first_bad_byte(data: bytes) -> tuple[int, int]:
    """The line and value of the first byte that is not UTF-8."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return data.count(b"\n", 0, e.start) + 1, data[e.start]
    raise AssertionError("the garbage happens to be UTF-8")


GARBAGE = random.Random(0).randbytes(4096)  # seeded: the same bytes every run

# name -> (the file's bytes, its line: what follows "qerl: error: <file>" in the one line)
HOSTILE = {
    "billion laughs (9 levels)": (laughs(9), ":5: more than 10,000 values once aliases are expanded (alias *a3 "
                                             "expands to 4,221); a params file holds a few hundred (is it a YAML bomb?)"),
    "billion laughs by merge keys": (merge_laughs(9), ":5: more than 10,000 values once aliases are expanded (alias "
                                                     "*a3 expands to 3,555); a params file holds a few hundred (is it "
                                                     "a YAML bomb?)"),
    "self-referencing mapping": ("a: &a {b: *a}\n", ":1: alias *a is inside the node it names (a structure without "
                                                    "end); write the values out"),
    "self-referencing list": ("lora:\n  target_modules: &t [q_proj, *t]\n",
                              ":2: alias *t is inside the node it names (a structure without end); write the values "
                              "out"),
    "many values, no alias": ("lora:\n  target_modules: [" + "q, " * 20_000 + "]\n",
                              ":2: more than 10,000 values once aliases are expanded; a params file holds a few "
                              "hundred (is it a YAML bomb?)"),
    "deep flow nesting": ("lora:\n  target_modules: " + "[" * 50 + "]" * 50 + "\n",
                          ":2: nested more than 16 levels deep; a params file nests sections, keys and their values "
                          "(3 levels)"),
    "deep block nesting": (nested_blocks(30), ":17: nested more than 16 levels deep; a params file nests sections, "
                                              "keys and their values (3 levels)"),
    "huge string scalar": ("model:\n  dtype: " + "x" * 200_000 + "\n",
                           ":2: model.dtype = '" + "x" * 199 + "... (200,002 characters): expected one of 'auto', "
                           "'float32', 'bfloat16', 'float16'"),
    "huge integer": ("lora:\n  rank: " + "1" * 5000 + "\n",
                     ":2: invalid YAML: cannot read '" + "1" * 199 + "... (5,002 characters): Exceeds the limit "
                     "(4300 digits) for integer string conversion: value has 5000 digits"),
    "huge key": ("lora:\n  " + "k" * 1000 + ": 1\n",  # YAML's limit for a key: 1024 characters
                 ":2: unknown key 'lora." + "k" * 194 + "... (1,007 characters) (known: rank, alpha, dropout, "
                 "target_modules, use_rslora, train_norms)"),
    "non-UTF-8 byte": (b"lora:\n  rank: 8\ndata:\n  system_prompt: caf\xe9\n",
                       ":4: not UTF-8 text (byte 0xe9); save the file as UTF-8"),
    "UTF-16 (PowerShell's >)": ("lora:\n  rank: 8\n".encode("utf-16"), ":1: not UTF-8 text (byte 0xff); save the "
                                                                      "file as UTF-8"),
    "binary garbage": (GARBAGE, ":{}: not UTF-8 text (byte 0x{:02x}); save the file as UTF-8".format(
        *first_bad_byte(GARBAGE))),
    "control characters": (b"lora:\n  rank: 8\x00\x01\n", ":2: invalid YAML: character #x0000 is not allowed in "
                                                          "YAML text"),
    "a Python tag": ("model: !!python/object/apply:os.system [echo hi]\n",
                     ":1: invalid YAML: could not determine a constructor for the tag "
                     "'tag:yaml.org,2002:python/object/apply:os.system'"),
    "two documents": ("lora: {rank: 8}\n---\nlora: {rank: 4}\n",
                      ":2: invalid YAML: expected a single document in the stream; but found another document"),
    "undefined alias": ("lora:\n  rank: *nope\n", ":2: invalid YAML: found undefined alias 'nope'"),
    # Counts that size a step's memory: 2 x 10^11 completions (group_size: 100000000000) grew a Python list of the
    # prompts for two minutes until the kernel killed the process; prompts_per_step: 10^9, a MemoryError (exit 1)
    "a huge group size": ("rollout:\n  prompts_per_step: 2\n  group_size: 100000000000\n",
                          ":3: rollout.group_size = 100000000000: 2 prompts x 100000000000 completions = "
                          "200,000,000,000 a step, past the 65,536 qerl draws in one (a large run draws 512 x 16 = "
                          "8,192); lower group_size or prompts_per_step"),
    "a huge prompt count": ("rollout:\n  prompts_per_step: 1000000000\n  group_size: 8\n",
                            ":2: rollout.prompts_per_step = 1000000000: 1000000000 prompts x 8 completions = "
                            "8,000,000,000 a step, past the 65,536 qerl draws in one (a large run draws 512 x 16 = "
                            "8,192); lower prompts_per_step or group_size"),
    # 10^9 samples per question: a MemoryError (exit 1) after the model loaded, a minute on
    "a huge sample count": ("eval:\n  temperature: 1.0\n  num_samples: 1000000000\n",
                            ":3: eval.num_samples = 1000000000: must be <= 4096"),
    "a top-level list": ("- lora\n- rank: 8\n", ": expected a mapping of sections at the top level, got list"),
    "a top-level scalar": ("rank 8\n", ": expected a mapping of sections at the top level, got str"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_params_file_is_one_line_exit_2_within_seconds(tmp_path, qerl_here, name):
    content, message = HOSTILE[name]
    params = tmp_path / "params.yaml"
    params.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert params.stat().st_size < 1_000_000
    start = time.perf_counter()
    with deadline(DEADLINE_S), pytest.raises(ConfigError) as info:
        load_settings(params)
    assert time.perf_counter() - start < DEADLINE_S
    assert str(info.value) == f"{params}{message}"
    code, out, err = qerl_here("train", "--params", params, "--out", tmp_path / "run")  # the command's line
    assert (code, out, err) == (2, "", f"qerl: error: {params}{message}")
    assert not (tmp_path / "run").exists()


def test_a_100_mb_file_is_refused_by_its_size_unread(tmp_path, monkeypatch):
    params = tmp_path / "params.yaml"
    with params.open("wb") as f:
        f.truncate(100 * 2**20)  # sparse: written in no time, and on disk it takes nothing
    read = []
    real_open = Path.open
    monkeypatch.setattr(Path, "open", lambda self, *a, **k: read.append(self) or real_open(self, *a, **k))
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        load_settings(params)
    assert time.perf_counter() - start < 1.0 and read == []
    assert str(info.value) == (f"{params}: 104,857,600 bytes, too large for a params file (at most 256 KiB; "
                               "params/default.yaml is 2 KB): is it the right file?")


def test_a_folder_an_endless_device_and_a_pipe(tmp_path):
    """`--params DIR` is one line; /dev/zero is refused at the budget, not read for ever; a pipe (a shell's
    `--params <(...)`) is a params file like any other."""
    with pytest.raises(ConfigError) as info:
        load_settings(tmp_path)
    assert str(info.value) == f"{tmp_path}: a folder, not a params file (e.g. params/default.yaml)"
    with deadline(DEADLINE_S), pytest.raises(ConfigError) as info:
        load_settings("/dev/zero")
    assert str(info.value) == "/dev/zero: more than 256 KiB, too large for a params file"
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    writer = threading.Thread(target=pipe.write_text, args=("lora:\n  rank: 4\n",))
    writer.start()
    try:
        with deadline(DEADLINE_S):
            assert load_settings(pipe).lora.rank == 4
    finally:
        if writer.is_alive():  # the loader never opened the pipe: open it here, so the writer's open returns
            os.close(os.open(pipe, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(DEADLINE_S)


def test_a_utf8_bom_is_read_as_editors_write_it_and_lines_still_count(tmp_path):
    """Windows editors save UTF-8 with a byte-order mark: YAML reads it, so does qerl, and line numbers stay right."""
    params = tmp_path / "params.yaml"
    params.write_bytes(b"\xef\xbb\xbflora:\n  rank: 8\n")
    assert load_settings(params).lora.rank == 8
    params.write_bytes(b"\xef\xbb\xbflora:\n  rank: 8\n  rnk: 4\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(params))}:3: unknown key 'lora.rnk'"):
        load_settings(params)


def test_aliases_within_the_budget_still_share_settings(tmp_path):
    """Aliases are not refused as such: a shared block of settings under a merge key stays a valid params file."""
    params = tmp_path / "params.yaml"
    params.write_text("data: &arith {name: arithmetic, n: 16}\n"
                      "eval:\n  <<: *arith\n  n: 4\n")
    settings = load_settings(params)
    assert (settings.eval.name, settings.eval.n, settings.data.n) == ("arithmetic", 4, 16)


@pytest.mark.parametrize("value, message", [
    ("[" + ", ".join(f"&a{i} [" + ", ".join([f"*a{i - 1}" if i else "q"] * 10) + "]" for i in range(6)) + "]",
     "more than 10,000 values once aliases are expanded (alias *a2 expands to 1,111); a params file holds a few "
     "hundred (is it a YAML bomb?)"),
    ("&t [q_proj, *t]", "alias *t is inside the node it names (a structure without end); write the values out"),
])
def test_a_bomb_or_a_loop_in_a_flag_is_one_line_naming_the_flag(qerl_here, value, message):
    with deadline(DEADLINE_S), pytest.raises(ConfigError):
        load_settings(overrides=[f"lora.target_modules={value}"])
    code, _, err = qerl_here("train", "-S", f"lora.target_modules={value}", "-S", "model.path=/nonexistent")
    assert code == 2
    assert err == f"qerl: error: -S lora.target_modules={value}: {message}"
