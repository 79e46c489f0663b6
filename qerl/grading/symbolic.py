"""qerl's own bounded LaTeX -> sympy parser and symbolic equality (the in-process fast path of the grader).

Every sympy object is built under hard caps (answer length, digits per number, nesting depth, exponent size) before
sympy ever sees it: there is no `eval`, no `simplify`. Symbolic equality is decided by exact structural comparison,
else numerically at fixed pseudo-random points with bounded magnitudes. This runs in the trainer's own process, so it
must stay bounded on any input; math-verify (qerl.grading.mathverify), which is not bounded, runs in a worker process.
"""

from __future__ import annotations

import math
import random
import re
from fractions import Fraction
from functools import lru_cache

import sympy

from qerl.grading.limits import MAX_ANSWER_CHARS

MAX_NUMBER_DIGITS = 100  # longer literals are not math, they are an attack (and trip int() limits)
MAX_NESTING = 30  # bracket depth accepted by the parser
MAX_TOKENS = 200
MAX_EXPONENT = 10_000  # |exponent| of any power
MAX_POWER_BITS = 20_000  # size of an exact power's result, estimated before sympy computes it
MAX_FACTORIAL = 500
MAX_SYMBOLS = 8
MAX_SYMBOLIC_COMPARISONS = 40  # numeric (evalf) comparisons per graded pair, a few ms each
REL_TOL = 1e-50  # |a - b| / max(|a|, |b|, 1) at or below which evaluated values are equal (see _agree_at)
N_POINTS = 6  # random points in (0, 2) for expressions with free symbols; >= 2 must be conclusive
MAX_POINT_MAGNITUDE = 1e12  # at larger values a +1 difference drowns in the tolerance: point inconclusive


class _Unparsable(Exception):
    """Input outside the grammar or over a size cap."""


class _TooLarge(_Unparsable):
    """Input over a size cap: no final answer of a math problem, and no input for math-verify either (see too_large)."""


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
            raise _TooLarge("too many tokens")
    return tokens


def _number(text: str) -> sympy.Rational:
    if len(text) > MAX_NUMBER_DIGITS:
        raise _TooLarge("number too long")
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
            raise _TooLarge("exponent too large")
        if base.is_number and base not in (sympy.S.Zero, sympy.S.One, sympy.S.NegativeOne):
            if _bits(base) * size > MAX_POWER_BITS:
                raise _TooLarge("power too large")
    return base**exp


def _safe_factorial(n: sympy.Expr) -> sympy.Expr:
    if n.is_number and not (n.is_Integer and 0 <= n <= MAX_FACTORIAL):
        raise _TooLarge("factorial argument")
    return sympy.factorial(n)


def _safe_binomial(n: sympy.Expr, k: sympy.Expr) -> sympy.Expr:
    if n.is_number and not (n.is_Integer and 0 <= n <= 10 * MAX_FACTORIAL):
        raise _TooLarge("binomial argument")
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
            raise _TooLarge("nesting too deep")
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
def to_sympy(s: str) -> sympy.Expr | None:
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


@lru_cache(maxsize=4096)
def too_large(s: str) -> bool:
    """Whether a normalized answer is over a size cap of qerl's parser (`100000!`, `\\binom{100000}{50000}`,
    `(x^{10000})^{10000}`, thousands of tokens): such an answer is graded 0 without asking math-verify, which would
    spend its whole CPU budget on it for nothing."""
    if len(s) > MAX_ANSWER_CHARS:
        return True
    try:
        expr = _LatexParser(_tokenize(s)).parse()
        return isinstance(expr, sympy.Expr) and not _exponents_bounded(expr)
    except _TooLarge:
        return True
    except Exception:  # outside the grammar: math-verify may read it
        return False


class Budget:
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


def symbolic_equal(p: str, g: str, budget: Budget) -> bool:
    a, b = to_sympy(p), to_sympy(g)
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
