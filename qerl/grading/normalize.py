"""Normalization: LaTeX/markdown noise (delimiters, units, degrees, thousands separators, `\\text{}`, `x =`) -> one
canonical string, so that equal strings mean equal answers and the cheap comparisons come first."""

from __future__ import annotations

import re
from fractions import Fraction

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
_THOUSANDS_RE = re.compile(r"^-?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?$")  # not "0,111" (a decimal comma)
_SPACED_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?: \d{3})+(?:\.\d+)?$")
_WORDS_RE = re.compile(r"[A-Za-z][A-Za-z\s'.\-]*")
_BARE_LETTER_RE = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]")  # a letter that is not part of a \command
_REPEATING_RE = re.compile(r"(-?)(\d*)\.(\d*)\\overline\{?(\d{1,20})\}?")  # 0.\overline{3}, 1.2\overline{45}
_CHOICE_RE = re.compile(r"\(([a-zA-Z])\)|\(([A-E])\)([\d\\-].*)")


def normalize_answer(answer: str) -> str:
    """Canonical string for an extracted answer; equal strings mean equal answers."""
    s = _canonical(answer)
    choice = _CHOICE_RE.fullmatch(s)  # multiple choice "(B)", "\textbf{(C)}\ 12"
    return (choice.group(1) or choice.group(2)).upper() if choice else s


def choice_value(answer: str) -> str | None:
    """The value after a multiple-choice letter, normalized: "\\textbf{(D)}\\ 18" -> "18"; None for other answers."""
    choice = _CHOICE_RE.fullmatch(_canonical(answer))
    return choice.group(3) if choice else None


def _canonical(answer: str) -> str:
    s = answer.strip()
    spaced_list = bool(re.search(r",\s", s))  # "32, 349" is a list of two numbers; "32,349", "32,\!349" one number
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
    if _SPACED_THOUSANDS_RE.match(s):
        s = s.replace(" ", "")  # "1 000"
    s = re.sub(r"\s*([^\w\s\\])\s*", r"\1", s)  # spaces around operators/brackets carry no meaning
    s = re.sub(r"(?<=[^a-zA-Z\s])\s+(?=\\)", "", s)
    s = re.sub(r"_\{(\w)\}", r"_\1", s)
    if _THOUSANDS_RE.match(s) and not spaced_list:
        s = s.replace(",", "")
    repeating = _REPEATING_RE.fullmatch(s)
    if repeating:
        s = _repeating_as_fraction(*repeating.groups())
    return s


def _repeating_as_fraction(sign: str, whole: str, fixed: str, period: str) -> str:
    """"0.\\overline{3}" -> "1/3", "1.2\\overline{45}" -> "137/110": a repeating decimal is an exact fraction."""
    value = Fraction(int(whole or "0")) + Fraction(int(fixed + period) - int(fixed or "0"),
                                                   10 ** len(fixed) * (10 ** len(period) - 1))
    value = -value if sign else value
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def is_words(s: str) -> bool:
    """Plain-language answers ("Evelyn", "east", "B") are compared as text, never parsed as products."""
    return bool(_WORDS_RE.fullmatch(s))


def text_key(s: str) -> str:
    return re.sub(r"[\s.]", "", s).lower()
