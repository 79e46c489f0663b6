"""Problems to train and evaluate on: generated arithmetic, GSM8K / MATH-500 loaders, prompts, a resumable sampler.

Everything here is plain data (`Example`) so the RL loop, the evaluator and the pipeline shell share one format.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from qerl.data.example import Example
from qerl.data.rewards import extract_answer

__all__ = [
    "Example",
    "arithmetic_task",
    "load_jsonl",
    "load_dataset",
    "SYSTEM_PROMPT",
    "build_prompt",
    "PromptSampler",
]


# ---------------------------------------------------------------------------------------------------------------------
# Generated arithmetic
# ---------------------------------------------------------------------------------------------------------------------

ARITHMETIC_OPERATORS = "+-*"
ARITHMETIC_KNOBS = ("digits", "operators", "steps")
ARITHMETIC_TEST_FRACTION = 0.1
# Small spaces are shuffled whole (cheap, and a split running out is found in O(space)); larger ones are drawn with a
# seen-set, where collisions are rare and the default sizes never come near exhaustion.
_ENUMERATE_LIMIT = 200_000


def _split_of(digest: bytes) -> Literal["train", "test"]:
    """Split by the question's hash alone: independent of seed and size, so train and test never share a question."""
    bucket = int.from_bytes(digest[:8], "big") / 2**64
    return "test" if bucket < ARITHMETIC_TEST_FRACTION else "train"


def _render(operands: list[int], ops: list[str]) -> tuple[str, int]:
    """Chain operations left to right, e.g. ((17 + 25) * 3) - 9 written as "(17 + 25) * 3 - 9"; returns (text, value).

    Parentheses appear only where usual precedence would otherwise change the chained meaning (a sum or difference
    followed by `*`), so the text evaluates to the value under ordinary rules.
    """
    text, value, last_op = str(operands[0]), operands[0], None
    for op, operand in zip(ops, operands[1:]):
        if op == "*" and last_op in ("+", "-"):
            text = f"({text})"
        text = f"{text} {op} {operand}"
        value = value + operand if op == "+" else value - operand if op == "-" else value * operand
        last_op = op
    return text, value


def _distinct_indices(space: int, rng: random.Random) -> Iterator[int]:
    """All indices in [0, space) once each, in a seeded random order, produced lazily."""
    if space <= _ENUMERATE_LIMIT:
        order = list(range(space))
        rng.shuffle(order)
        yield from order
        return
    seen: set[int] = set()
    while len(seen) < space:
        index = rng.randrange(space)
        if index not in seen:
            seen.add(index)
            yield index


def arithmetic_task(
    split: Literal["train", "test"],
    n: int,
    seed: int = 0,
    digits: int = 2,
    operators: str = "+-",
    steps: int = 1,
    strict: bool = True,
) -> list[Example]:
    """Generate `n` distinct arithmetic questions like "What is (17 + 25) * 3 - 9?" with exact integer golds.

    Difficulty knobs: `digits` per operand (exactly that many, 1-digit operands are 1..9), `operators` drawn from
    "+-*", `steps` = operations chained. The default (2 digits, 1 step, + and -) is learnable by a 135M model within
    minutes of CPU RL. Same arguments give the same list, and a smaller `n` gives a prefix of a larger one.
    The train/test split is a hash of the question, so splits stay disjoint across seeds and sizes.
    With `strict=False`, a split smaller than `n` returns all of its questions instead of raising.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(digits, int) or digits < 1:
        raise ValueError(f"digits must be an int >= 1, got {digits!r}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    bad = sorted(set(operators) - set(ARITHMETIC_OPERATORS))
    if not operators or bad:
        raise ValueError(f"operators must be a non-empty subset of {ARITHMETIC_OPERATORS!r}, got {operators!r}")
    ops = [op for op in ARITHMETIC_OPERATORS if op in operators]  # canonical order: "-+" and "+-" give the same data

    low = 10 ** (digits - 1) if digits > 1 else 1
    num_values = 10**digits - low
    space = num_values ** (steps + 1) * len(ops) ** steps
    examples: list[Example] = []
    for index in _distinct_indices(space, random.Random(seed)):
        if len(examples) == n:
            break
        # Mixed-radix decode: distinct indices give distinct (operands, operators), hence distinct questions.
        operands, chosen_ops = [], []
        for _ in range(steps + 1):
            index, value_index = divmod(index, num_values)
            operands.append(low + value_index)
        for _ in range(steps):
            index, op_index = divmod(index, len(ops))
            chosen_ops.append(ops[op_index])
        expression, value = _render(operands, chosen_ops)
        question = f"What is {expression}?"
        digest = hashlib.sha256(question.encode()).digest()
        if _split_of(digest) == split:
            examples.append(Example(f"arithmetic-{digest.hex()[:12]}", question, str(value), "arithmetic",
                                    columns={"question": question, "answer": str(value)}))
    if len(examples) < n and strict:
        raise ValueError(
            f"arithmetic {split} split has only {len(examples)} distinct questions with digits={digits}, "
            f"operators={operators!r}, steps={steps}; asked for n={n} (raise digits or steps, or add operators)"
        )
    return examples


# ---------------------------------------------------------------------------------------------------------------------
# GSM8K / MATH
# ---------------------------------------------------------------------------------------------------------------------


def _field(row: dict[str, Any], name: str) -> str:
    if name not in row:
        raise ValueError(f"missing field {name!r}")
    value = row[name]
    if not isinstance(value, str):
        raise ValueError(f"field {name!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"empty field {name!r}")
    return value


def _guess_kind(row: dict[str, Any]) -> Literal["gsm8k", "math"]:
    if "problem" in row or "solution" in row:
        return "math"
    answer = row.get("answer")
    if isinstance(answer, str) and "####" in answer:
        return "gsm8k"
    if isinstance(answer, str) and "\\boxed{" in answer:
        return "math"
    raise ValueError(
        "cannot tell the layout from the fields (expected GSM8K 'question'/'answer' with '#### N', "
        "or MATH 'question'/'answer' with \\boxed{} or 'problem'/'answer'); pass kind='gsm8k' or kind='math'"
    )


def _example_from_row(row: dict[str, Any], kind: Literal["gsm8k", "math"], example_id: str) -> Example:
    """Parse one GSM8K or MATH row (local or hub layout); raises ValueError without location (the caller adds it)."""
    if kind == "gsm8k":
        question, answer = _field(row, "question"), _field(row, "answer")
        if "####" not in answer:
            raise ValueError("no gold answer: field 'answer' has no '#### <number>'")
        gold = answer.rsplit("####", 1)[1].strip().replace(",", "")
    elif "problem" in row:  # MATH, hub layout: problem / solution / answer, the bare answer is given
        question, gold = _field(row, "problem"), _field(row, "answer").strip()
    else:  # MATH, local layout: answer is the worked solution
        question, answer = _field(row, "question"), _field(row, "answer")
        if "\\boxed{" not in answer and "The answer is:" not in answer:  # else extract_answer takes any last number
            raise ValueError("no gold answer: field 'answer' has no \\boxed{...} or 'The answer is: ...'")
        gold = (extract_answer(answer) or "").strip()  # the parser that reads the policy's answers: both agree
    if not gold:
        raise ValueError(f"no gold answer: the {'#### line' if kind == 'gsm8k' else 'boxed answer'} is missing or empty")
    return Example(example_id, question.strip(), gold, kind, columns=dict(row))


def load_jsonl(path: str | Path, kind: Literal["gsm8k", "math"] | None = None) -> list[Example]:
    """Load GSM8K (`question`/`answer` ending `#### N`) or MATH (`question`/`answer` with \\boxed{}, or hub
    `problem`/`solution`/`answer`) rows from a jsonl file. `kind` is guessed from the first row when None.

    A malformed row raises ValueError naming the file and 1-based line, e.g. "test.jsonl:17: missing field 'answer'".
    """
    if kind not in (None, "gsm8k", "math"):
        raise ValueError(f"kind must be 'gsm8k', 'math' or None, got {kind!r}")
    path = Path(path)
    examples: list[Example] = []
    with path.open("rb") as f:  # bytes, decoded line by line inside the try: a bad byte gets its file and line too
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)") \
                        from None
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
                kind = kind or _guess_kind(row)  # decided by the first row, then enforced on all
                examples.append(_example_from_row(row, kind, f"{path.parent.name}/{path.name}:{lineno}"))
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


# Short names for well-known datasets: (hub id, config, answer format). With `path`, the local copy is read instead.
_HUB_NAMES: dict[str, tuple[str, str | None, str]] = {
    "gsm8k": ("openai/gsm8k", "main", "gsm8k"),
    "math500": ("HuggingFaceH4/MATH-500", None, "auto"),  # the hub copy has a bare `answer`, local copies \boxed{}
}


def load_dataset(
    name: str,
    split: str = "test",
    n: int | None = None,
    seed: int = 0,
    path: str | Path | None = None,
    *,
    config: str | None = None,
    question_field: str | None = None,
    answer_field: str | None = None,
    answer_format: str = "auto",
    **task_kwargs: Any,
) -> list[Example]:
    """Load problems by name: "arithmetic" (generated, n defaults to 1000), or a table read by Hugging Face
    `datasets` (see `qerl.data.tables`): a hub id (`config` and `split` as in `datasets.load_dataset`), a local
    jsonl/json/parquet/csv file, or a folder of them. "gsm8k" / "math500" are short for their hub ids, or for the
    local copy at `path`. `question_field` / `answer_field` name the columns (default: the usual GSM8K / MATH
    names) and `answer_format` how the gold is written ("gsm8k" `#### 42`, "math" `\\boxed{}`, "plain"; "auto").

    `task_kwargs` are the `ARITHMETIC_KNOBS` of `arithmetic_task`; other datasets ignore them (and the arithmetic
    task ignores the table options), so one config can feed any dataset. With `n`, a seeded random subset of n
    examples is returned (in table order); n larger than the set is an error.
    """
    unknown = sorted(set(task_kwargs) - set(ARITHMETIC_KNOBS))
    if unknown:
        raise TypeError(f"unexpected arguments {unknown}; load_dataset takes only the knobs {ARITHMETIC_KNOBS}")
    if name == "arithmetic":
        if path is not None:
            raise ValueError("the arithmetic task is generated: path= does not apply")
        # n=None: every question of the split, up to 1000 (small knob settings have fewer)
        return arithmetic_task(split, 1000 if n is None else n, seed=seed, strict=n is not None,
                               **task_kwargs)  # type: ignore[arg-type]

    from qerl.data import tables

    name, config, answer_format = _resolve_table(name, path, config, answer_format)
    table = tables.open_table(name, config, split)
    examples = tables.table_examples(table, tables.table_label(name, config, split), question_field, answer_field,
                                     answer_format, id_prefix=tables.table_label(name, config, split, short=True))
    if n is None:
        return examples
    if not 0 <= n <= len(examples):
        raise TooFewExamples(n, len(examples), tables.table_label(name, config, split))
    keep = sorted(random.Random(seed).sample(range(len(examples)), n))
    return [examples[i] for i in keep]


def _resolve_table(name: str, path: str | Path | None, config: str | None,
                   answer_format: str) -> tuple[str, str | None, str]:
    """(table name, config, answer format) after the short names: `path` replaces a short name's hub id."""
    if name in _HUB_NAMES:
        hub_id, hub_config, preset = _HUB_NAMES[name]
        answer_format = preset if answer_format == "auto" else answer_format
        return (str(path), None, answer_format) if path is not None else (hub_id, config or hub_config, answer_format)
    if path is not None:
        raise ValueError(f"path= is only for gsm8k and math500 (pass another file as the name), got name={name!r}")
    return name, config, answer_format


class TooFewExamples(ValueError):
    """A table holds fewer examples than asked for; `examples_for` names the setting that asked."""

    def __init__(self, n: int, available: int, label: str):
        super().__init__(f"n={n} but {label} has {available} examples")
        self.n, self.available, self.label = n, available, label


def examples_for(source: Any, knobs: Any = None, n: int | None = None, key: str = "data.n") -> list[Example]:
    """The examples a `data` or `eval` settings section names (`n` defaults to its own); the arithmetic knobs come
    from `knobs` (default: the section itself, which for `eval` must be given the `data` section). `key` is how an
    `n` beyond the table is named to the user (data.n, eval.n, --limit)."""
    knobs = knobs or source
    try:
        return load_dataset(source.name, split=source.split, n=source.n if n is None else n, seed=source.seed,
                            path=source.path, config=source.config, question_field=source.question_field,
                            answer_field=source.answer_field, answer_format=source.answer_format,
                            digits=knobs.digits, operators=knobs.operators, steps=knobs.steps)
    except TooFewExamples as e:
        raise ValueError(f"{key} = {e.n}: {e.label} has only {e.available} example{'' if e.available == 1 else 's'} "
                         f"(lower {key}, or set it to null for all of them)") from None


def fingerprint(source: Any, knobs: Any = None) -> dict[str, Any]:
    """What identifies the data a `data` / `eval` section names, before any subsetting by `n`: `datasets`'
    fingerprint of the table (its cache key: the hub revision, or a local file's path and modification time), or a
    hash of the generated task. Cheap after the first load; pipelines rerun data preparation when it changes.
    """
    knobs = knobs or source
    if source.name == "arithmetic":
        examples = load_dataset("arithmetic", split=source.split, n=None, seed=source.seed, digits=knobs.digits,
                                operators=knobs.operators, steps=knobs.steps)
        digest = hashlib.sha256(json.dumps([[e.id, e.question, e.gold] for e in examples]).encode()).hexdigest()
        return {"name": "arithmetic", "split": source.split, "rows": len(examples), "fingerprint": digest[:16]}
    from qerl.data import tables

    name, config, _ = _resolve_table(source.name, source.path, source.config, source.answer_format)
    table = tables.open_table(name, config, source.split)
    return {"name": name, "config": config, "split": source.split, "rows": len(table),
            "fingerprint": table._fingerprint}  # public in all but name: `datasets` keys its cache by it


# ---------------------------------------------------------------------------------------------------------------------
# Prompts and sampling
# ---------------------------------------------------------------------------------------------------------------------

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


def uses_chat_template(tokenizer: Any) -> bool:
    """Whether prompts go through the tokenizer's chat template (`prompt_messages`): TRL's "conversational" data."""
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_messages(question: str, system_prompt: str | None = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """The chat messages a prompt is rendered from where the tokenizer has a chat template: the system prompt (unless
    None), then the question as the user's turn."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    return messages


def build_prompt(tokenizer: Any, question: str, system_prompt: str | None = SYSTEM_PROMPT,
                 tools: Sequence[Callable[..., Any]] = ()) -> str:
    """The text the policy continues: the tokenizer's chat template with a generation prompt, or, for tokenizers
    without one (base models), "Question: ...\\nAnswer:" preceded by the system prompt. `system_prompt=None` omits it.
    `tools` (multi-turn rollouts): their schemas go to a template that writes them (Qwen's: transformers reads them
    off the functions' type hints and docstrings, as TRL's tools); a template without tools (SmolLM2's) leaves the
    system prompt to describe them.
    """
    if uses_chat_template(tokenizer):
        template = tokenizer.chat_template
        schemas = {"tools": list(tools)} if tools and isinstance(template, str) and "tools" in template else {}
        return tokenizer.apply_chat_template(prompt_messages(question, system_prompt), tokenize=False,
                                             add_generation_prompt=True, **schemas)
    prompt = f"Question: {question}\nAnswer:"
    return f"{system_prompt}\n\n{prompt}" if system_prompt else prompt


class PromptSampler:
    """Endless batches of examples: each epoch is a fresh permutation seeded by (seed, epoch), and a batch that crosses
    an epoch boundary is filled from the next one, so every batch is full. Resumable via state_dict/load_state_dict.
    """

    def __init__(self, examples: list[Example], batch_size: int, seed: int = 0) -> None:
        if not examples:
            raise ValueError("PromptSampler needs at least one example")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0  # index into the current epoch's permutation
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)  # str seeds are hashed stably across processes
        return order

    def next_batch(self) -> list[Example]:
        """The next `batch_size` examples."""
        batch = []
        while len(batch) < self.batch_size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = self._order[self.position : self.position + self.batch_size - len(batch)]
            batch.extend(self.examples[i] for i in take)
            self.position += len(take)
        return batch

    def __iter__(self) -> Iterator[list[Example]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Position in the stream (JSON-serializable); the examples themselves are not saved."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue exactly where the saved sampler stopped (its seed wins); the example count must match."""
        if state["num_examples"] != len(self.examples):
            raise ValueError(
                f"sampler state is for {state['num_examples']} examples, this sampler has {len(self.examples)}"
            )
        if not 0 <= state["position"] <= len(self.examples):
            raise ValueError(f"sampler state position {state['position']} out of range")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
