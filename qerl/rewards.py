"""Reward functions for RL on math reasoning, graded the way a careful human grader would.

Three separate parts:
  1. extraction    - `extract_answer`: the final answer of a completion or of a gold solution;
  2. normalization - `normalize_answer`: LaTeX/markdown noise (delimiters, units, degrees, thousands
                     separators, `\\text{}`, `x =`) -> one canonical string;
  3. equality      - `answers_equal`: exact string, then structure (tuples, intervals, sets, matrices,
                     `a \\pm b`), then numbers (exact fractions), then symbolic equality through a small
                     LaTeX parser that builds sympy objects directly.

Rewards run on every sampled completion, so hostile text must fail fast instead of hanging a trainer
step: there is no `eval`, no `simplify`, and every sympy object is built under hard caps (answer length,
digits per number, nesting depth, exponent size) before sympy ever sees it. Symbolic equality is
decided by exact structural comparison, else numerically at fixed pseudo-random points with bounded
magnitudes. math_verify is deliberately not used: it relies on signal alarms (main thread only) and is
absent on the GPU machine, and rewards must be identical on every machine.
"""

from __future__ import annotations

import importlib
import math
import random
import re
from fractions import Fraction
from functools import lru_cache
from typing import Callable

import sympy

RewardFn = Callable[[str, str], float]

MAX_ANSWER_CHARS = 500  # longest extracted answer we grade (MATH-500's longest is ~60 characters)
MAX_NUMBER_DIGITS = 100  # longer literals are not math, they are an attack (and trip int() limits)
MAX_NESTING = 30  # bracket depth accepted by the parser
MAX_TOKENS = 200
MAX_EXPONENT = 10_000  # |exponent| of any power
MAX_POWER_BITS = 20_000  # size of an exact power's result, estimated before sympy computes it
MAX_FACTORIAL = 500
MAX_ITEMS = 50  # elements of a tuple / set / matrix
MAX_SYMBOLS = 8
MAX_SYMBOLIC_COMPARISONS = 40  # numeric (evalf) comparisons per graded pair, a few ms each
REL_TOL = 1e-50  # |a - b| / max(|a|, |b|, 1) at or below which evaluated values are equal (see _agree_at)
N_POINTS = 6  # random points in (0, 2) for expressions with free symbols; >= 2 must be conclusive
MAX_POINT_MAGNITUDE = 1e12  # at larger values a +1 difference drowns in the tolerance: point inconclusive


# --------------------------------------------------------------------------------------------------
# 1. Extraction
# --------------------------------------------------------------------------------------------------

_SPACES_RE = re.compile(r" *")
_PHRASE_RE = re.compile(r"\banswer\s*(?:(?P<neg>is\s+not\b|isn't)|is\b\s*:?|:|=)", re.IGNORECASE)
# A number not glued to a preceding word/closing paren (so "x-3" / "2010-2015" give 3 / 2015, not -3).
_NUMBER_RE = re.compile(r"(?<![\w)])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|\d+(?:\.\d+)?", re.ASCII)


def _matching_brace(text: str, open_at: int) -> int | None:
    """Index of the `}` closing the `{` at `open_at`, skipping escaped `\\{` `\\}`.

    None if unclosed within MAX_ANSWER_CHARS: a longer box is no final answer, and the bound keeps
    a megabyte of braces from costing a megabyte of Python loop.
    """
    depth = 0
    stop = min(len(text), open_at + MAX_ANSWER_CHARS + 2)
    i = open_at
    while i < stop:
        ch = text[i]
        if ch == "\\":
            i += 1
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _last_boxed(text: str) -> tuple[bool, str | None]:
    """(found, content) of the last `\\boxed{...}` / `\\fbox{...}`; content None when it is malformed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return False, None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    i = _SPACES_RE.match(text, i).end()
    if i < len(text) and text[i] == "{":
        end = _matching_brace(text, i)
        return True, None if end is None else text[i + 1 : end].strip()
    bare = re.match(r"[^\s$]+", text[i : i + MAX_ANSWER_CHARS + 1])  # `\boxed 5`
    return True, bare.group(0) if bare else None


def _clip_phrase(rest: str) -> str:
    """The answer after "answer is": up to the end of its line or sentence, outside any brackets."""
    depth = 0
    for i, ch in enumerate(rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "\n":
            return rest[:i]
        elif depth <= 0 and ch in ".;!?" and (i + 1 == len(rest) or rest[i + 1].isspace()):
            return rest[:i]
        elif depth <= 0 and ch == "," and re.match(r",\s+[A-Za-z]{2}", rest[i : i + 8]):
            return rest[:i]  # "5, so ..." ends the answer; "(1, 2)" and "3, 5, 7" do not
    return rest


def _marked_answer(text: str) -> tuple[bool, str | None]:
    """(found, answer) from an explicit final-answer marker: boxed, else the last of "answer is" / ####.

    A negated phrase ("the answer is not 5") counts as a marker without an answer, so the grader
    does not fall back to picking up the 5.
    """
    has_box, boxed = _last_boxed(text)
    if has_box:
        return True, boxed
    phrase_at, phrase, last = -1, None, None
    for last in _PHRASE_RE.finditer(text):
        pass
    if last:
        phrase_at = last.start()
        tail = text[last.end() : last.end() + MAX_ANSWER_CHARS + 1]
        phrase = None if last.group("neg") else _clip_phrase(tail.lstrip(" \t\n:")).strip() or None
    hash_at = text.rfind("####")
    if hash_at > phrase_at:
        line = text[hash_at + 4 : hash_at + 4 + MAX_ANSWER_CHARS + 1].split("\n", 1)[0].strip()
        return True, line or None
    return phrase_at >= 0, phrase


def extract_answer(text: str) -> str | None:
    """The final answer in `text`, raw (not normalized); None if there is none.

    Priority: the last `\\boxed{}` / `\\fbox{}` (an unclosed one means no answer), else the later of
    an "answer is ..." / "Answer: ..." phrase and a `#### N` line, else the last number in the text.
    """
    found, answer = _marked_answer(text)
    return answer if found else _last_number(text)


def _last_number(text: str) -> str | None:
    # Search a window ending at the last digit, not the whole text: "1,1,1,..." x 1 MB stays O(n) in C.
    last_digit = max(text.rfind(d) for d in "0123456789")
    if last_digit < 0:
        return None
    window = text[max(0, last_digit - MAX_ANSWER_CHARS) : last_digit + 1]
    last = None
    for last in _NUMBER_RE.finditer(window):
        pass
    return last.group(0) if last else None  # a number filling the window is over MAX_ANSWER_CHARS anyway


def _gold_answer(gold: str) -> str | None:
    """Gold may be a bare answer ("72", "\\frac{14}{3}") or a worked solution with a marker."""
    found, answer = _marked_answer(gold)
    return answer if found else gold.strip() or None


# --------------------------------------------------------------------------------------------------
# 2. Normalization
# --------------------------------------------------------------------------------------------------

_UNICODE = {"\u2212": "-", "\u2013": "-", "\u00d7": "\\times ", "\u00f7": "\\div ", "\u00b7": "\\cdot ",
            "\u03c0": "\\pi ", "\u221e": "\\infty ", "\u221a": "\\sqrt", "\u00b0": "^\\circ", "\u00b1": "\\pm "}
_DROP_RE = re.compile(
    r"\\(?:left|right|bigg|Bigg|big|Big)(?![a-zA-Z])|\\displaystyle|\\q?quad(?![a-zA-Z])|(?<!\\)\\[!,;: ]|~"
)
_TEXT_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|texttt|textnormal|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}"
)
_DEGREE_RE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree")
_ASSIGN_RE = re.compile(r"^(?:[a-zA-Z](?:_\{?\w+\}?)?|\\[a-zA-Z]+)\s*(?:=|\\in(?![a-zA-Z]))\s*(?=\S)")
# "18 dollars", "5.4 cents", "3\sqrt{2} cm^2", "12 because ...": keep the math, drop trailing words.
_UNIT_TAIL_RE = re.compile(r"^(?P<head>.*?[\d})])\s+(?!(?:and|or)\b)[A-Za-z]{2,}[A-Za-z0-9\s'^./-]*$")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_WORDS_RE = re.compile(r"[A-Za-z][A-Za-z\s'.\-]*")
_BARE_LETTER_RE = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]")  # a letter that is not part of a \command
_CHOICE_RE = re.compile(r"\(([a-zA-Z])\)|\(([A-E])\)[\d\\-].*")


def normalize_answer(answer: str) -> str:
    """Canonical string for an extracted answer; equal strings mean equal answers."""
    s = answer.strip()
    for char, latex in _UNICODE.items():
        s = s.replace(char, latex)
    s = s.strip("* ")  # markdown bold
    for _ in range(3):  # $..$, \(..\), \[..\] possibly nested
        s = re.sub(r"^\\[(\[]|\\[)\]]$", "", s).strip().strip("$").strip()
    s = re.sub(r"(?<=\d)\\[,!]\s*(?=\d)", "", s)  # 3\,000 and 10,\!080: thin-space thousands separators
    s = _DROP_RE.sub(" ", s)
    s = re.sub(r"\\[dtc]frac", r"\\frac", s)
    s = re.sub(r"\\[dt]binom", r"\\binom", s)
    s = s.replace("{,}", "")  # LaTeX thousands separator 1{,}000
    s = _DEGREE_RE.sub("", s)
    s = re.sub(r"\\?%|\\?\$", "", s)
    for _ in range(5):  # nested \text{..\mbox{..}..}
        s, n = _TEXT_RE.subn(r" \1 ", s)
        if not n:
            break
    s = re.sub(r"\\(?:leq|le)(?![a-zA-Z])", r"\\le ", s)
    s = re.sub(r"\\(?:geq|ge)(?![a-zA-Z])", r"\\ge ", s)
    s = s.strip().rstrip(".,;").strip()
    s = _ASSIGN_RE.sub("", s, count=1)
    if "=" in s and not _BARE_LETTER_RE.search(s):
        s = s.rsplit("=", 1)[1]  # "3^3 = 27", "\frac{1}{2} = 0.5": a chain without variables ends in its value
    unit = _UNIT_TAIL_RE.match(s)
    if unit:
        s = unit.group("head")
    s = re.sub(r"\s+", " ", s).strip()
    s = re.sub(r"\s*([^\w\s\\])\s*", r"\1", s)  # spaces around operators/brackets carry no meaning
    s = re.sub(r"(?<=[^a-zA-Z\s])\s+(?=\\)", "", s)
    s = re.sub(r"_\{(\w)\}", r"_\1", s)
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    choice = _CHOICE_RE.fullmatch(s)  # multiple choice "(B)", "\textbf{(C)}\ 12"
    return (choice.group(1) or choice.group(2)).upper() if choice else s


def _is_words(s: str) -> bool:
    """Plain-language answers ("Evelyn", "east", "B") are compared as text, never parsed as products."""
    return bool(_WORDS_RE.fullmatch(s))


def _text_key(s: str) -> str:
    return re.sub(r"[\s.]", "", s).lower()


# --------------------------------------------------------------------------------------------------
# 3a. Structure: tuples, intervals, sets, unions, matrices, a \pm b
# --------------------------------------------------------------------------------------------------

_MATRIX_RE = re.compile(r"\\begin\{([pbvB]?matrix)\}(.*)\\end\{\1\}", re.DOTALL)
_OPEN, _CLOSE = "([{", ")]}"


def _split_top(s: str, sep: str) -> list[str] | None:
    """Split on `sep` outside brackets (`\\{ \\}` count as brackets); None when brackets don't balance."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        if s.startswith(sep, i) and depth == 0:
            parts.append(s[start:i])
            i += len(sep)
            start = i
            continue
        ch = s[i]
        if ch == "\\" and i + 1 < len(s) and s[i + 1] in "{}":
            ch = s[i + 1]
            i += 1
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth < 0:
                return None
        i += 1
    if depth != 0:
        return None
    parts.append(s[start:])
    return parts


def _expand_pm(item: str) -> list[str]:
    if item.count("\\pm") + item.count("\\mp") == 1:
        sign = item.replace("\\mp", "\\pm")
        return [sign.replace("\\pm", "+"), sign.replace("\\pm", "-")]
    return [item]


def _structure(s: str) -> tuple[str, str, list[str]] | None:
    """(kind, shape, items) for compound answers, None for a scalar.

    kinds: "seq" (ordered; shape = its brackets, so `[2,5)` != `[2,5]`), "set" (unordered: `\\{..\\}`,
    bare lists "3, 5, 7", `a \\pm b`), "union" (unordered intervals), "matrix" (shape = rows x cols).
    """
    matrix = _MATRIX_RE.fullmatch(s)
    if matrix:
        rows = [row.split("&") for row in re.split(r"\\\\", matrix.group(2)) if row.strip()]
        if len({len(row) for row in rows}) != 1:
            return None
        return "matrix", f"{len(rows)}x{len(rows[0])}", [item for row in rows for item in row]
    unions = _split_top(s, "\\cup")
    if unions and len(unions) > 1:
        return "union", "", unions
    # The inner text splitting cleanly means the outer brackets pair up: "(1)(2)" is no tuple.
    if len(s) >= 4 and s.startswith("\\{") and s.endswith("\\}") and (items := _split_top(s[2:-2], ",")):
        return "set", "", [x for item in items for x in _expand_pm(item)]
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and (items := _split_top(s[1:-1], ",")):
        if len(items) > 1:
            return "seq", s[0] + s[-1], items
    items = _split_top(s, ",")
    if items and len(items) > 1:
        return "set", "", [x for item in items for x in _expand_pm(item)]
    if len(_expand_pm(s)) == 2:
        return "set", "", _expand_pm(s)
    return None


def _structures_equal(
    a: tuple[str, str, list[str]], b: tuple[str, str, list[str]], depth: int, budget: _Budget
) -> bool:
    (kind_a, shape_a, items_a), (kind_b, shape_b, items_b) = a, b
    if kind_a != kind_b or shape_a != shape_b or len(items_a) != len(items_b) or len(items_a) > MAX_ITEMS:
        return False
    items_a = [normalize_answer(x) for x in items_a]
    items_b = [normalize_answer(x) for x in items_b]
    if kind_a in ("seq", "matrix"):
        return all(_equal(x, y, depth + 1, budget) for x, y in zip(items_a, items_b))
    unmatched = list(items_b)  # equality is an equivalence, so greedy matching is exact
    for x in items_a:
        hit = next((k for k, y in enumerate(unmatched) if _equal(x, y, depth + 1, budget)), None)
        if hit is None:
            return False
        unmatched.pop(hit)
    return True


# --------------------------------------------------------------------------------------------------
# 3b. Bounded LaTeX -> sympy parser
# --------------------------------------------------------------------------------------------------


class _Unparsable(Exception):
    """Input outside the grammar or over a size cap."""


_TOKEN_RE = re.compile(
    r"\s*(?:(?P<num>\d+(?:\.\d*)?|\.\d+)|(?P<cmd>\\[a-zA-Z]+|\\[{}|])|(?P<sym>[a-zA-Z])"
    r"|(?P<op>[-+*/^_()\[\]{}!|,=']))"
)
_FUNCTIONS = {
    "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot, "sec": sympy.sec,
    "csc": sympy.csc, "arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan,
    "sinh": sympy.sinh, "cosh": sympy.cosh, "tanh": sympy.tanh, "ln": sympy.log, "log": sympy.log,
    "exp": sympy.exp,
}
_CONSTANTS = {"pi": sympy.pi, "infty": sympy.oo}
_GREEK = set(
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi rho "
    "sigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Phi Psi Omega".split()
)
_ATOM_COMMANDS = {"frac", "sqrt", "binom"} | set(_FUNCTIONS) | set(_CONSTANTS) | _GREEK


def _tokenize(s: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(s):
        match = _TOKEN_RE.match(s, pos)
        if not match:
            if s[pos:].strip():
                raise _Unparsable(s[pos:])
            break
        pos = match.end()
        tokens.append((match.lastgroup, match.group(match.lastgroup)))
        if len(tokens) > MAX_TOKENS:
            raise _Unparsable("too many tokens")
    return tokens


def _number(text: str) -> sympy.Rational:
    if len(text) > MAX_NUMBER_DIGITS:
        raise _Unparsable("number too long")
    value = Fraction(text)  # exact: 0.5 == 1/2, 2.50 == 5/2
    return sympy.Rational(value.numerator, value.denominator)


def _bits(value: sympy.Expr) -> float:
    """Upper-ish estimate of the bits an exact number needs (largest rational part or magnitude)."""
    rational_bits = max((max(abs(r.p).bit_length(), r.q.bit_length()) for r in value.atoms(sympy.Rational)), default=1)
    magnitude = abs(complex(value.evalf(15)))
    log_bits = abs(math.log2(magnitude)) if 0.0 < magnitude < float("inf") else 0.0
    return max(rational_bits, log_bits, 1.0)


def _safe_pow(base: sympy.Expr, exp: sympy.Expr) -> sympy.Expr:
    """base**exp, refusing powers whose exact value would be huge (`9^9^9^9`) before sympy computes them."""
    if exp.is_number:
        size = abs(complex(exp.evalf(15)))
        if not size <= MAX_EXPONENT:
            raise _Unparsable("exponent too large")
        if base.is_number and base not in (sympy.S.Zero, sympy.S.One, sympy.S.NegativeOne):
            if _bits(base) * size > MAX_POWER_BITS:
                raise _Unparsable("power too large")
    return base**exp


def _safe_factorial(n: sympy.Expr) -> sympy.Expr:
    if n.is_number and not (n.is_Integer and 0 <= n <= MAX_FACTORIAL):
        raise _Unparsable("factorial argument")
    return sympy.factorial(n)


def _safe_binomial(n: sympy.Expr, k: sympy.Expr) -> sympy.Expr:
    if n.is_number and not (n.is_Integer and 0 <= n <= 10 * MAX_FACTORIAL):
        raise _Unparsable("binomial argument")
    return sympy.binomial(n, k)


class _LatexParser:
    """Recursive descent over LaTeX math tokens: sum > product (incl. implicit) > unary > power > atom."""

    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens = tokens
        self.pos = 0
        self.depth = 0
        self.in_abs = False

    def parse(self) -> sympy.Expr:
        expr = self.sum()
        if self.pos != len(self.tokens):
            raise _Unparsable("trailing tokens")
        return expr

    def peek(self) -> tuple[str | None, str | None]:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else (None, None)

    def take(self) -> tuple[str | None, str | None]:
        token = self.peek()
        self.pos += 1
        return token

    def expect(self, text: str) -> None:
        if self.take()[1] != text:
            raise _Unparsable(f"expected {text}")

    def sum(self) -> sympy.Expr:
        expr = self.product()
        while self.peek()[1] in ("+", "-"):
            op = self.take()[1]
            rhs = self.product()
            expr = expr + rhs if op == "+" else expr - rhs
        return expr

    def starts_atom(self) -> bool:
        kind, text = self.peek()
        if kind in ("num", "sym") or text in ("(", "{"):
            return not (kind == "num" and self.tokens[self.pos - 1][0] == "num")  # "2 3" is not 6
        if text == "|":
            return not self.in_abs
        return kind == "cmd" and text[1:] in _ATOM_COMMANDS

    def product(self) -> sympy.Expr:
        expr = self.unary()
        while True:
            text = self.peek()[1]
            if text in ("*", "\\cdot", "\\times"):
                self.take()
                expr = expr * self.unary()
            elif text in ("/", "\\div"):
                self.take()
                expr = expr / self.unary()
            elif self.starts_atom():
                expr = expr * self.power()
            else:
                return expr

    def unary(self) -> sympy.Expr:
        text = self.peek()[1]
        if text in ("-", "+"):
            self.take()
            value = self.unary()
            return -value if text == "-" else value
        return self.power()

    def power(self) -> sympy.Expr:
        base = self.atom()
        while self.peek()[1] == "!":
            self.take()
            base = _safe_factorial(base)
        if self.peek()[1] == "^":
            self.take()
            return _safe_pow(base, self.exponent())
        return base

    def exponent(self) -> sympy.Expr:
        text = self.peek()[1]
        if text in ("-", "+"):
            self.take()
            value = self.exponent()
            return -value if text == "-" else value
        return self.power()  # right-associative: 2^3^2 = 2^(3^2)

    def group(self, close: str) -> sympy.Expr:
        expr = self.sum()
        self.expect(close)
        return expr

    def arg(self) -> sympy.Expr:
        """A command argument: `{...}` or, as in LaTeX, one character (`\\frac12` = 1/2)."""
        kind, text = self.peek()
        if text == "{":
            self.take()
            return self.group("}")
        if kind == "num" and len(text) > 1:
            self.tokens[self.pos] = ("num", text[1:])
            return _number(text[0])
        if kind in ("num", "sym", "cmd"):
            return self.atom()
        raise _Unparsable("missing argument")

    def atom(self) -> sympy.Expr:
        # Every nesting ((..), {..}, \frac{\frac..}) passes through here: bound the recursion.
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise _Unparsable("nesting too deep")
        value = self._atom()
        self.depth -= 1
        return value

    def _atom(self) -> sympy.Expr:
        kind, text = self.take()
        if kind == "num":
            value = _number(text)
            if text.isdigit() and self.peek()[1] == "\\frac":  # mixed number 1\frac{4}{5} = 9/5
                frac = self._atom()
                return value + frac if frac.is_Rational and frac > 0 else value * frac
            return value
        if kind == "sym":
            return self.symbol(text)
        if text in ("(", "{"):
            return self.group(")" if text == "(" else "}")
        if text == "|" and not self.in_abs:
            self.in_abs = True
            inner = self.group("|")
            self.in_abs = False
            return sympy.Abs(inner)
        if kind == "cmd":
            return self.command(text[1:])
        raise _Unparsable(f"unexpected {text}")

    def symbol(self, letter: str) -> sympy.Expr:
        if self.peek()[1] == "_":  # x_1, a_{n}
            self.take()
            kind, text = self.take()
            if text == "{":
                parts = []
                while self.peek()[0] in ("num", "sym"):
                    parts.append(self.take()[1])
                self.expect("}")
                text = "".join(parts)
            elif kind not in ("num", "sym"):
                raise _Unparsable("subscript")
            return sympy.Symbol(f"{letter}_{text}")
        return {"i": sympy.I, "e": sympy.E}.get(letter) or sympy.Symbol(letter)

    def command(self, name: str) -> sympy.Expr:
        if name == "frac":
            numerator = self.arg()
            return numerator / self.arg()
        if name == "sqrt":
            if self.peek()[1] == "[":
                self.take()
                index = self.group("]")
                return _safe_pow(self.arg(), 1 / index)
            return sympy.sqrt(self.arg())
        if name == "binom":
            n = self.arg()
            return _safe_binomial(n, self.arg())
        if name in _CONSTANTS:
            return _CONSTANTS[name]
        if name in _GREEK:
            return sympy.Symbol(name)
        if name in _FUNCTIONS:
            power = None
            if self.peek()[1] == "^":  # \sin^2 x
                self.take()
                power = self.exponent()
            base = None
            if name == "log" and self.peek()[1] == "_":  # \log_2 8
                self.take()
                base = self.arg()
            arg = self.power()
            value = _FUNCTIONS[name](arg) if base is None else sympy.log(arg, base)
            return value if power is None else _safe_pow(value, power)
        raise _Unparsable(f"unknown command \\{name}")


@lru_cache(maxsize=4096)
def _to_sympy(s: str) -> sympy.Expr | None:
    """sympy value of a normalized scalar answer, or None if it is not (bounded) math."""
    if not s or len(s) > MAX_ANSWER_CHARS or re.search(r"(?<![\\a-zA-Z])[a-zA-Z]{3,}", s):
        return None  # a bare word of 3+ letters is text, not a product of symbols
    try:
        expr = _LatexParser(_tokenize(s)).parse()
        if not isinstance(expr, sympy.Expr) or expr.has(sympy.nan, sympy.zoo) or not _exponents_bounded(expr):
            return None  # \frac{1}{0}, 0^{-1}, \infty - \infty, folded towers
        return expr
    except Exception:  # _Unparsable, and anything sympy raises on odd input
        return None


class _Budget:
    """Symbolic comparisons allowed per graded pair: two 50-item sets must not cost 2,500 of them."""

    def __init__(self, comparisons: int = MAX_SYMBOLIC_COMPARISONS):
        self.left = comparisons

    def spend(self) -> bool:
        self.left -= 1
        return self.left >= 0


def _exponents_bounded(expr: sympy.Expr) -> bool:
    """sympy folds (x^{10000})^{10000} into x^{10^8} on its own; refuse such results too."""
    return all(
        not node.exp.is_number or abs(complex(node.exp.evalf(15))) <= MAX_EXPONENT
        for node in sympy.preorder_traversal(expr)
        if isinstance(node, sympy.Pow)
    )


def _value(expr: sympy.Expr, point: dict) -> sympy.Expr | None:
    value = expr.evalf(30, subs=point)
    if not value.is_number or value.free_symbols or value.has(sympy.nan, sympy.zoo):
        return None
    return value


def _agree_at(a: sympy.Expr, b: sympy.Expr, diff: sympy.Expr, point: dict) -> bool | None:
    """Whether a == b at `point` (None: inconclusive there).

    The difference is evaluated as one expression: sympy's evalf raises its working precision on
    cancellation (up to 100 digits), so a true zero comes out ~1e-130 while a real difference keeps
    30 correct digits.
    """
    va, vb = _value(a, point), _value(b, point)
    if va is None or vb is None:
        return None
    if va.is_infinite or vb.is_infinite:
        return va == vb
    scale = max(abs(va), abs(vb), sympy.S.One)
    if point and scale > MAX_POINT_MAGNITUDE:
        return None  # x^{1000} vs x^{1000}+1 look alike at x = 1.9 (even to 30 digits); other points decide
    dv = _value(diff, point)
    return None if dv is None else bool(abs(dv) <= REL_TOL * scale)


def _symbolic_equal(p: str, g: str, budget: _Budget) -> bool:
    a, b = _to_sympy(p), _to_sympy(g)
    if a is None or b is None:
        return False
    if a == b:
        return True
    if (a.is_Rational and b.is_Rational) or not budget.spend():
        return False  # exact values that differ: no tolerance (0.333 != 1/3)
    diff = a - b
    if diff == 0:
        return True
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    if len(symbols) > MAX_SYMBOLS:
        return False
    if not symbols:
        return _agree_at(a, b, diff, {}) is True
    rng = random.Random(0)  # fixed points: identical rewards on every run and machine
    agreed = 0
    for _ in range(N_POINTS):
        point = {s: sympy.Rational(rng.randint(15, 195), 100) for s in symbols}
        verdict = _agree_at(a, b, diff, point)
        if verdict is False:
            return False
        agreed += verdict is True
    return agreed >= 2


# --------------------------------------------------------------------------------------------------
# 3c. Equality
# --------------------------------------------------------------------------------------------------

_PLAIN_NUMBER_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")


def _as_fraction(s: str) -> Fraction | None:
    if len(s) > MAX_NUMBER_DIGITS or not _PLAIN_NUMBER_RE.fullmatch(s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _equal(p: str, g: str, depth: int, budget: _Budget) -> bool:
    if not p or not g:
        return False
    if p == g:
        return True
    if depth > 4:
        return False
    sp, sg = _structure(p), _structure(g)
    if sp or sg:
        return sp is not None and sg is not None and _structures_equal(sp, sg, depth, budget)
    if _is_words(p) and _is_words(g):
        return _text_key(p) == _text_key(g)
    fp, fg = _as_fraction(p), _as_fraction(g)
    if fp is not None and fg is not None:
        return fp == fg
    return _symbolic_equal(p, g, budget)


def answers_equal(pred: str, gold: str) -> bool:
    """Whether two extracted answers denote the same value; bounded work, never raises."""
    try:
        if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
            return False
        return _equal(normalize_answer(pred), normalize_answer(gold), 0, _Budget())
    except Exception:
        return False


# --------------------------------------------------------------------------------------------------
# Rewards
# --------------------------------------------------------------------------------------------------


def score(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer equals the gold answer, else 0.0. Never raises.

    `gold` may be a bare answer ("72", "\\frac{14}{3}"), a GSM8K solution ending `#### 72`, or a MATH
    solution with `\\boxed{}`; both sides go through the same extractor.
    """
    try:
        pred, target = extract_answer(completion), _gold_answer(gold)
        return 1.0 if pred is not None and target is not None and answers_equal(pred, target) else 0.0
    except Exception:
        return 0.0


MIN_REASONING_CHARS = 20
_AFTER_BOX_RE = re.compile(r"[\s$.!)\]\\]*")  # closing `$`, `\]`, `\)`, a full stop


def format_reward(completion: str, gold: str = "") -> float:
    """1.0 if the completion reasons, then gives exactly one final boxed answer, else 0.0.

    Rule: exactly one `\\boxed{...}` / `\\fbox{...}`, closed and non-empty; at least
    MIN_REASONING_CHARS non-space characters before it; after it only whitespace, `$`, `\\]`, `\\)`
    and end punctuation. `gold` is ignored (same signature as every reward).
    """
    try:
        if completion.count("\\boxed") + completion.count("\\fbox") != 1:
            return 0.0
        start = max(completion.find("\\boxed"), completion.find("\\fbox"))
        open_at = completion.find("{", start)
        if open_at < 0 or completion[start:open_at] not in ("\\boxed", "\\fbox"):
            return 0.0
        close_at = _matching_brace(completion, open_at)
        if close_at is None or not completion[open_at + 1 : close_at].strip():
            return 0.0
        reasoning = re.sub(r"\s", "", completion[:start])
        if len(reasoning) < MIN_REASONING_CHARS:
            return 0.0
        return 1.0 if _AFTER_BOX_RE.fullmatch(completion[close_at + 1 :]) else 0.0
    except Exception:
        return 0.0


REWARDS: dict[str, RewardFn] = {"accuracy": score, "format": format_reward}


def get_reward_fn(name: str) -> RewardFn:
    """A built-in reward by name (see REWARDS) or a user function given as "package.module:function"."""
    if name in REWARDS:
        return REWARDS[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"unknown reward {name!r}: use one of {sorted(REWARDS)} or 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r} ({err})") from err
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward {name!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {module_name}.{attr} is not callable")
    return fn


def combined_reward(specs: dict[str, float]) -> RewardFn:
    """Weighted sum of named rewards, e.g. {"accuracy": 1.0, "format": 0.1}; names resolve up front."""
    if not specs:
        raise ValueError("combined_reward needs at least one reward spec")
    terms = [(get_reward_fn(name), float(weight)) for name, weight in specs.items()]
    if not all(math.isfinite(weight) for _, weight in terms):
        raise ValueError(f"reward weights must be finite numbers: {specs}")

    def reward(completion: str, gold: str) -> float:
        return sum(weight * fn(completion, gold) for fn, weight in terms)

    reward.__doc__ = f"Weighted reward {dict(specs)}."
    return reward
