"""qerl's own answer equality, in process and bounded: exact string, then structure (tuples, intervals, sets,
matrices, `a \\pm b`), then numbers (exact fractions), then symbolic equality through qerl's bounded parser
(qerl.grading.symbolic).

It is the grader's fast path: most answers are decided here in microseconds; what it cannot prove equal goes to
math-verify in a worker process (qerl.grading.mathverify).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from qerl.grading.limits import MAX_ANSWER_CHARS
from qerl.grading.normalize import choice_value, is_words, normalize_answer, text_key
from qerl.grading.symbolic import MAX_NUMBER_DIGITS, Budget, symbolic_equal, to_sympy

MAX_ITEMS = 50  # elements of a tuple / set / matrix


_MATRIX_RE = re.compile(r"\\begin\{([pbvB]?matrix)\}(.*)\\end\{\1\}", re.DOTALL)
_WORD_JOINER_RE = re.compile(r"\s+(?:and|or)\s+")
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
    items = _split_top(_WORD_JOINER_RE.sub(",", s), ",")  # "x=2 or x=3", "-3 and \\frac{1}{2}": roots
    if items and len(items) > 1:
        return "set", "", [x for item in items for x in _expand_pm(item)]
    if len(_expand_pm(s)) == 2:
        return "set", "", _expand_pm(s)
    return None


def _structures_equal(
    a: tuple[str, str, list[str]], b: tuple[str, str, list[str]], depth: int, budget: Budget
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



_PLAIN_NUMBER_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")


def _as_fraction(s: str) -> Fraction | None:
    if len(s) > MAX_NUMBER_DIGITS or not _PLAIN_NUMBER_RE.fullmatch(s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _equal(p: str, g: str, depth: int, budget: Budget) -> bool:
    if not p or not g:
        return False
    if p == g:
        return True
    if depth > 4:
        return False
    sp, sg = _structure(p), _structure(g)
    if sp or sg:
        return sp is not None and sg is not None and _structures_equal(sp, sg, depth, budget)
    if is_words(p) and is_words(g):
        return text_key(p) == text_key(g)
    fp, fg = _as_fraction(p), _as_fraction(g)
    if fp is not None and fg is not None:
        return fp == fg
    return symbolic_equal(p, g, budget)


def answers_equal(pred: str, gold: str) -> bool:
    """Whether two extracted answers denote the same value; bounded work, never raises."""
    try:
        if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
            return False
        return _equal(normalize_answer(pred), normalize_answer(gold), 0, Budget())
    except Exception:
        return False


# math-verify compares numbers rounded to 6 decimals: numbers further apart than this differ for both graders.
_NUMBERS_SURELY_DIFFER = Fraction(1, 10**5)


def _number_value(s: str) -> complex | None:
    """The value of an answer that is one number ("1.5", "\\frac{14}{3}", "2\\sqrt{3}", "6+9i"), else None."""
    fraction = _as_fraction(s)
    if fraction is not None:
        return complex(float(fraction))
    expr = to_sympy(s)
    if expr is None or not expr.is_number:
        return None
    try:
        value = complex(expr.evalf(20))
    except (TypeError, ValueError, OverflowError):
        return None
    return value if math.isfinite(value.real) and math.isfinite(value.imag) else None


def _varies(s: str) -> bool:
    """Whether an answer is an expression in variables that takes two different values at two points (x^2 + 1),
    so no number can equal it."""
    expr = to_sympy(s)
    if expr is None or not expr.free_symbols or len(expr.free_symbols) > 8:
        return False
    try:
        values = [complex(expr.evalf(15, subs={x: v for x in expr.free_symbols})) for v in (0.37, 1.61)]
    except (TypeError, ValueError, OverflowError, ZeroDivisionError):
        return False
    return all(map(math.isfinite, (values[0].real, values[1].real))) and abs(values[0] - values[1]) > 1e-6


def _shape(s: str) -> tuple[str, complex | None]:
    """("many", None) for a tuple/set/interval/matrix/union/`a \\pm b` of 2+ items, ("word", None) for a word of
    3+ letters, ("number", value) for one number, ("function", None) for an expression that varies with its
    variables, ("other", None) for the rest (equations, labels, anything qerl's parser does not read)."""
    structure = _structure(s)
    if structure is not None and len(structure[2]) >= 2:
        return "many", None
    if is_words(s):
        return ("word", None) if len(s) > 2 else ("other", None)  # "e", "pi" may be numbers to math-verify
    value = _number_value(s)
    if value is not None:
        return "number", value
    return ("function", None) if _varies(s) else ("other", None)


# Labels, equations, ratios and prose (`x_1 = a, x_2 = b`, `7:32`, `1 and 2`): normalization may have cut these
# down (an equation chain to its last value), so only math-verify may call them different.
_LOSSY_RE = re.compile(r"[=:;<>]|\\q?quad|\b(?:and|or)\b|\\(?:[lg]eq?|neq|in)(?![a-zA-Z])")


def _far_apart(a: complex, b: complex) -> bool:
    return abs(a - b) > float(_NUMBERS_SURELY_DIFFER) * max(1.0, abs(a), abs(b))


def _distinct(values: list[complex]) -> list[complex]:
    """The values sorted, near-equal neighbours merged ({5, 5} is {5})."""
    out: list[complex] = []
    for v in sorted(values, key=lambda z: (z.real, z.imag)):
        if not out or _far_apart(out[-1], v):
            out.append(v)
    return out


def _numeric_structures_differ(p: str, g: str) -> bool:
    """Two tuples / intervals / matrices / sets of plain numbers that differ beyond rounding: by their brackets or
    shape, or by an item (in order for tuples and matrices, as sets for sets)."""
    sp, sg = _structure(p), _structure(g)
    if sp is None or sg is None or sp[0] != sg[0] or sp[0] not in ("seq", "matrix", "set"):
        return False
    vp = [_number_value(normalize_answer(x)) for x in sp[2]]
    vg = [_number_value(normalize_answer(x)) for x in sg[2]]
    if None in vp or None in vg:
        return False
    if sp[0] == "set":
        vp, vg = _distinct(vp), _distinct(vg)
    elif sp[1] != sg[1]:
        return True  # (1,2) vs [1,2], a 2x2 matrix vs a 4-vector
    return len(vp) != len(vg) or any(_far_apart(a, b) for a, b in zip(vp, vg))


def _surely_different(p: str, g: str, raw_p: str, raw_g: str) -> bool:
    """Answers whose difference needs no math-verify, so qerl's "not equal" is final: two numbers more than 1e-5
    apart (relative; whatever their notation), two different words, a number or word against several items (a
    tuple, set, interval, matrix) or against an expression that varies (x^2 + 1), two tuples/sets/matrices of
    numbers that differ. `p`, `g` normalized; `raw_p`, `raw_g` as extracted."""
    if is_words(p) and is_words(g):
        return len(p) > 1 and len(g) > 1
    (kind_p, value_p), (kind_g, value_g) = _shape(p), _shape(g)
    if kind_p == kind_g == "number":
        return _far_apart(value_p, value_g)
    if _LOSSY_RE.search(raw_p) or _LOSSY_RE.search(raw_g):
        return False
    if kind_p == kind_g == "many":
        return _numeric_structures_differ(p, g)
    return {kind_p, kind_g} in ({"many", "number"}, {"many", "word"}, {"word", "number"}, {"function", "number"},
                                {"function", "word"})


_DECIMAL_COMMA_RE = re.compile(r"-?\d+,\d+")
_DECIMAL_POINT_RE = re.compile(r"-?\d+\.\d+")


def _decimal_comma_twins(p: str, g: str) -> bool:
    """"1000,99" and "1000.99": a decimal comma (as in most of Europe) against the same number with a point. Only
    then: "3,5" alone may be a list of two answers, but not when the other side reads "3.5"."""
    for a, b in ((p, g), (g, p)):
        if _DECIMAL_COMMA_RE.fullmatch(a) and _DECIMAL_POINT_RE.fullmatch(b) and a.replace(",", ".") == b:
            return True
    return False


_PERCENT_RE = re.compile(r"%|\bpercent\b", re.IGNORECASE)


def _percent_twins(p: str, g: str, raw_p: str, raw_g: str) -> bool:
    """"25\\%" and "0.25" (or "\\frac14"; "33\\frac13\\%" and "\\frac13"): a percent on one side only, against its
    value as a share. (Against "25", the percent sign is dropped as a unit: normalization.) Exact for plain numbers;
    to 12 significant digits for the rest (a rounded share such as 33.3% stays wrong)."""
    for a, raw_a, b, raw_b in ((p, raw_p, g, raw_g), (g, raw_g, p, raw_p)):
        if _PERCENT_RE.search(raw_a) and not _PERCENT_RE.search(raw_b):
            plain = _as_fraction(a)
            if plain is not None:
                share = plain / 100
                return _equal(f"{share.numerator}/{share.denominator}", b, 0, Budget())
            value, other = _number_value(a), _number_value(b)
            return value is not None and other is not None and abs(value / 100 - other) <= 1e-12 * max(1, abs(other))
    return False


_LABELLED_RE = re.compile(r"\s*((?:[A-Za-z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?|[A-Z]{2,3})\s*=\s*(\S.*)", re.DOTALL)


def _labelled_values(raw: str) -> dict[str, str] | None:
    """{label: value} of a list of named values ("a=2, b=3", "AB=4; CD=5"); None for anything else, and for the
    roots of one unknown ("x_1=2, x_2=3", "x=2 or x=3"), which are a set in any order."""
    items = _split_top(_WORD_JOINER_RE.sub(",", raw.strip().strip("$").replace(";", ",")), ",")
    if not items or len(items) < 2 or len(items) > MAX_ITEMS:
        return None
    values: dict[str, str] = {}
    for item in items:
        named = _LABELLED_RE.fullmatch(item)
        if named is None:
            return None
        label = re.sub(r"[{}\s]", "", named.group(1))
        if label in values:
            return None
        values[label] = named.group(2)
    if len({label.split("_")[0] for label in values}) == 1:
        return None
    return values


def _same_named_values(named_p: dict[str, str], named_g: dict[str, str]) -> bool:
    """Two lists of named values ("b=3, a=2" and "a=2,b=3") that match name by name."""
    return named_p.keys() == named_g.keys() and all(
        _equal(normalize_answer(named_p[k]), normalize_answer(named_g[k]), 0, Budget()) for k in named_p)


def _choice_value_equal(p: str, g: str, raw_p: str, raw_g: str) -> bool:
    """"(D) 18" against "18": a multiple-choice answer that also states the value is right by its value too."""
    for raw, other in ((raw_p, g), (raw_g, p)):
        value = choice_value(raw)
        if value is not None and _equal(value, other, 0, Budget()):
            return True
    return False


def own_verdict(pred: str, gold: str) -> bool | None:
    """qerl's own verdict: True (equal), False (surely not: two plain numbers or words that differ, or an answer
    too long to be one), None (not proven either way: math-verify decides). Bounded work, never raises."""
    try:
        if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
            return False
        named_p, named_g = _labelled_values(pred), _labelled_values(gold)
        if named_p is not None and named_g is not None:  # a set comparison would call "a=3, b=2" right
            return True if _same_named_values(named_p, named_g) else None  # else math-verify decides
        p, g = normalize_answer(pred), normalize_answer(gold)
        if (_equal(p, g, 0, Budget()) or _decimal_comma_twins(p, g) or _percent_twins(p, g, pred, gold)
                or _choice_value_equal(p, g, pred, gold)):
            return True
        return False if _surely_different(p, g, pred, gold) else None
    except Exception:
        return None
