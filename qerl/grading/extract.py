r"""Extraction: the final answer of a completion (or of a gold solution), as raw text; None when there is none.

The rule, in order (the first that applies decides):
  1. Markers. The latest of: the last group of boxes, an "answer is ..." / "Answer: ..." phrase (to the end of
     its sentence), a `#### N` line. So "\boxed{200} ... Final Answer: the final answer is $10,455$." is 10,455;
     but a phrase after a box with neither math nor a choice letter ("so our answer is correct") is commentary.
     - Boxes (`\boxed{}` / `\fbox{}`): the last box is the answer, unless boxes are joined into a list: by a
       connective (`,` `;` `&` "and" "or") or by no words at all, with at most MAX_JOINER_WORDS other words between
       them ("\boxed{1} papers and \boxed{2} bins", "\boxed{(3,3)} for part (a) and \boxed{(1,1)}") and none that
       takes the earlier box back ("no", "but", "actually", "rather", "answer", ...: RETRACTING), no sentence end,
       colon or blank line, and at most MAX_JOINER_CHARS characters. So
       `\boxed{2} and \boxed{3}` is `2, 3`; a repeated box counts once; "\boxed{12}. Wait... \boxed{15}" and
       "\boxed{5}, but rechecking, the answer is \boxed{9}" are drafts, then the answer (15, 9). An unclosed last
       box, or more than MAX_BOXES in a group, means no answer (no fallback to numbers).
     - A phrase: "The answer is not 5" is a marker without an answer. A sentence after the marker gives what
       follows its last " is " ("Answer: The largest $n$ is 34" is 34); one that opens with words gives its first
       math span or number ("Final Answer: Jane started 3 hours ago" is 3).
     - A phrase whose answer opens with a math span ("The answer is\n$$\n42\n$$") gives that span.
  2. No marker: the last math span (`$..$`, `$$..$$`, `\(..\)`, `\[..\]`; "$ \n 9 \n $" is 9, but inline math
     whose content itself runs over lines is no answer), with the spans before it that only a connective joins to
     it ("$x = 1$ and $x = -2$" is a list, as boxes are), unless a number follows it in plain text; a reply that is
     all math ("17 + 25 = 42", "\frac{10}{9}") is its own answer; else the last number that is not part of a word
     ("1 000", "1,024", "2,74" kept whole), with a percent sign or "percent" after it ("25%").

Every scan is bounded: only the last SCAN_CHARS of a completion are read, and each search looks at most
MAX_ANSWER_CHARS around the place it looks at, so a 10 MB completion costs what its tail costs.
"""

from __future__ import annotations

import re

from qerl.grading.limits import MAX_ANSWER_CHARS

MAX_BOXES = 20  # boxes in one final group; more is box spam, not an answer
MAX_JOINER_CHARS = 100  # text between two boxes of one group
TAIL_CHARS = 4 * MAX_ANSWER_CHARS  # how far back from the end a marker-less answer is looked for
SCAN_CHARS = 100_000  # how far back from the end any answer is looked for (~25k tokens: longer is no reply)

_UNICODE_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-"})
_SPACES_RE = re.compile(r" *")
_PHRASE_RE = re.compile(r"\banswer\s*(?:(?P<neg>is\s+not\b|isn't)|is\b\s*:?|:|=)", re.IGNORECASE)
# Between two boxes of one answer: no sentence end, colon or blank line.
_BREAK_RE = re.compile(r"[.!?:](?:\s|$)|\n\s*\n")
_CONNECTIVE_RE = re.compile(r"[,;&]|\b(?:and|or)\b")  # "\boxed{1} papers and \boxed{2} bins" is one answer
_LETTER_RE = re.compile(r"[A-Za-z]")  # words without a connective: "\boxed{1} no no no \boxed{2}" is not
_COMMAND_RE = re.compile(r"\\[A-Za-z]+")
# Words between two boxes that take the earlier one back: the later box is the answer, not a second item.
RETRACTING = frozenset(
    "no not nope but wait actually rather instead oops hmm sorry correction corrected correct mistake wrong error "
    "recheck rechecking recompute recomputing recalculate recalculating redo check checking let verify answer "
    "final so thus hence therefore".split())
MAX_JOINER_WORDS = 3  # words other than "and"/"or" between two boxes of one group: "\text{ for part (a) and }"
# $$..$$, $..$ (an escaped \$ inside is text), \(..\), \[..\]
_MATH_SPAN_RE = re.compile(
    r"(?<!\\)\$\$(.+?)(?<!\\)\$\$|(?<!\\)\$((?:[^$]|(?<=\\)\$)+?)(?<!\\)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]",
    re.DOTALL)
# A number not glued to a preceding letter/closing paren (so "x-3", "2010-2015", "AZYUK2A" give 3, 2015, none);
# thousands with commas or single spaces ("1,024", "1 000"), a decimal comma ("2,74"), a fraction "3/4".
_NUMBER_RE = re.compile(
    r"(?<![A-Za-z)\d.,])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d{1,3}(?: \d{3})+(?![\d,.])|\d+,\d{1,2}(?![\d,])|\d+)"
    r"(?:\.\d+)?(?:/\d+)?|(?<![A-Za-z\d.])\.\d+",
    re.ASCII,
)
_SPAN_JOINER_RE = re.compile(r"\s*(?:,\s*(?:and|or)?|and|or)\s*")  # between the math spans of one answer
_PERCENT_AFTER_RE = re.compile(r"\s?(?:\\?%|percent\b)", re.IGNORECASE)
_MATHLIKE_RE = re.compile(r"[\d$\\]")
_WORD_RE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")  # an English word, not a \command
_TEXT_RUN_RE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")  # "So", "cm": a reply with one is not all math


def matching_brace(text: str, open_at: int) -> int | None:
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


def _box_start(text: str, end: int) -> int:
    """Start of the last `\\boxed` / `\\fbox` that starts before `end` (-1: none)."""
    return max(text.rfind("\\boxed", 0, end), text.rfind("\\fbox", 0, end))


def _box_at(text: str, start: int) -> tuple[str | None, int]:
    """(content, index after the box) of the box starting at `start`; content None when it is malformed."""
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    i = _SPACES_RE.match(text, i).end()
    if i < len(text) and text[i] == "{":
        end = matching_brace(text, i)
        return (None, i) if end is None else (text[i + 1 : end].strip(), end + 1)
    bare = re.match(r"[^\s$]+", text[i : i + MAX_ANSWER_CHARS + 1])  # `\boxed 5`
    return (bare.group(0), i + bare.end()) if bare else (None, i)


def _joins(between: str) -> bool:
    """Whether the text between two boxes makes them one answer (see the module's rule 1)."""
    if len(between) > MAX_JOINER_CHARS or _BREAK_RE.search(between):
        return False
    words = [w.lower() for w in _TEXT_RUN_RE.findall(between)]
    others = [w for w in words if w not in ("and", "or")]
    if len(others) > MAX_JOINER_WORDS or RETRACTING.intersection(others):
        return False
    return bool(_CONNECTIVE_RE.search(between)) or not _LETTER_RE.search(_COMMAND_RE.sub("", between))


def _final_boxes(text: str) -> tuple[int, list[str] | None]:
    """(start, contents) of the last group of boxes (start -1: no box); contents None when the last box is
    malformed or the group is spam."""
    start = _box_start(text, len(text))
    if start < 0:
        return -1, None
    content, _ = _box_at(text, start)
    if not content:
        return start, None
    last_start = start
    group = [content]
    while True:
        previous = _box_start(text, start)
        if previous < 0:
            break
        content, end = _box_at(text, previous)
        if not content or end > start or not _joins(text[end:start]):
            break  # a nested box, a malformed one, or a draft answer
        group.insert(0, content)
        start = previous
        if len(group) > MAX_BOXES:
            return last_start, None
    return last_start, list(dict.fromkeys(group))  # the same answer boxed twice is one answer


def _clip_phrase(rest: str) -> str:
    """The answer after "answer is": up to the end of its line or sentence, outside any brackets."""
    depth, escaped = 0, False
    for i, ch in enumerate(rest):
        if escaped:  # \! \; \, are LaTeX spacing, not a sentence end
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch in "([{":
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


def _outside_math(text: str) -> str:
    return _MATH_SPAN_RE.sub(lambda m: "\0" * len(m.group(0)), text)


def _answer_in_sentence(phrase: str) -> str:
    """A sentence after "Answer:" gives what follows its last " is " ("The largest $n$ is 34" -> "34"); a sentence
    that opens with words gives its first math span or number ("Jane started growing 3 hours ago" -> "3"). An answer
    that opens with its value keeps its words for normalization ("18 dollars because ..."), and a word or two
    ("Evelyn", "forty-two") stays."""
    plain = _outside_math(phrase)
    at = plain.rfind(" is ")
    if at >= 0 and phrase[at + 4 :].strip():
        return phrase[at + 4 :].strip()
    if _WORD_RE.match(plain) and len(_WORD_RE.findall(plain)) >= 3:
        span, number = _MATH_SPAN_RE.search(phrase), _NUMBER_RE.search(plain)
        first = min((m for m in (span, number) if m), key=lambda m: m.start(), default=None)
        if first is not None:
            return next(g for g in first.groups() if g is not None).strip() if first is span else first.group(0)
    return phrase


def _phrase_answer(text: str) -> tuple[int, str | None]:
    """(start, answer) of the later of an "answer is" phrase and a `####` line (start -1: neither).

    A negated phrase ("the answer is not 5") counts as a marker without an answer, so the grader
    does not fall back to picking up the 5.
    """
    phrase_at, phrase, last = -1, None, None
    for last in _PHRASE_RE.finditer(text):
        pass
    if last:
        phrase_at = last.start()
        tail = text[last.end() : last.end() + MAX_ANSWER_CHARS + 1]
        rest = tail.lstrip(" \t\n:*")
        display = _MATH_SPAN_RE.match(rest)
        if last.group("neg"):
            phrase = None
        elif display and "\n" in display.group(0):  # "The answer is\n$$\n42\n$$": a line would cut it
            phrase = display.group(0)
        else:
            phrase = _clip_phrase(rest).strip() or None
            if phrase is not None:
                phrase = _answer_in_sentence(phrase)
    hash_at = text.rfind("####")
    if hash_at > phrase_at:
        line = text[hash_at + 4 : hash_at + 4 + MAX_ANSWER_CHARS + 1].split("\n", 1)[0].strip()
        return hash_at, line or None
    return phrase_at, phrase


def _last_number(text: str) -> tuple[int, str | None]:
    """(end, text) of the last number in `text` that is not part of a word; (-1, None) if none."""
    # Search a window ending at the last digit, not the whole text: "1,1,1,..." x 1 MB stays O(n) in C.
    last_digit = max(text.rfind(d) for d in "0123456789")
    if last_digit < 0:
        return -1, None
    offset = max(0, last_digit - MAX_ANSWER_CHARS)
    last = None
    for last in _NUMBER_RE.finditer(text[offset : last_digit + 1]):
        pass
    if last is None:
        return -1, None
    end = offset + last.end()
    percent = _PERCENT_AFTER_RE.match(text, end)  # "25%", "5 percent": the percent is part of the answer
    return (percent.end(), last.group(0) + "%") if percent else (end, last.group(0))


def _span_content(span: re.Match) -> str | None:
    inline = span.group(2) if span.group(2) is not None else span.group(3)
    content = next(g for g in span.groups() if g is not None).strip()
    if inline is not None and "\n" in content:
        return None  # inline math runs over lines only by mistake ("$5 for him\nand $"): not a span
    return content if content and len(content) <= MAX_ANSWER_CHARS else None


def _last_math_spans(text: str) -> tuple[int, list[str] | None]:
    """(end, contents) of the last `$..$` / `$$..$$` / `\\(..\\)` / `\\[..\\]` in the tail of `text`, with the spans
    before it that a bare connective joins to it ("$x = 1$ and $x = -2$": both roots; as with boxes, at most
    MAX_BOXES, a repeated one counted once)."""
    offset = max(0, len(text) - TAIL_CHARS)
    spans = list(_MATH_SPAN_RE.finditer(text, offset))
    if not spans or _span_content(spans[-1]) is None:
        return -1, None
    group = [spans[-1]]
    for span in reversed(spans[:-1]):
        if (len(group) >= MAX_BOXES or _span_content(span) is None
                or not _SPAN_JOINER_RE.fullmatch(text, span.end(), group[0].start())):
            break
        group.insert(0, span)
    return spans[-1].end(), list(dict.fromkeys(_span_content(span) for span in group))


def _unmarked_answer(text: str) -> list[str] | None:
    tail = text[-TAIL_CHARS:].strip()
    if len(tail) <= MAX_ANSWER_CHARS and tail == text.strip() and not _TEXT_RUN_RE.search(
            re.sub(r"\\text\{[^{}]*\}", "", tail)) and "$" not in tail:
        return [tail] if tail else None  # the whole reply is math: "17 + 25 = 42", "\frac{10}{9}", "1 000"
    spans_end, spans = _last_math_spans(text)
    number_end, number = _last_number(text)
    if spans_end >= number_end:
        return spans
    return None if number is None else [number]


def _marked_answer(text: str) -> tuple[bool, list[str] | None]:
    """(found, answer) from the latest final-answer marker (see the module's rule 1)."""
    box_at, boxes = _final_boxes(text)
    phrase_at, phrase = _phrase_answer(text)
    # After a box, "so our answer is correct" is commentary: a later phrase overrides a box only with math in it.
    if phrase_at > box_at and (box_at < 0 or phrase is None or _MATHLIKE_RE.search(phrase) or len(phrase) <= 3):
        return True, None if phrase is None else [phrase]
    return box_at >= 0, boxes


def final_answers(text: str) -> list[str] | None:
    """The final answer of `text` as a list (several boxes of one group give several items); None if there is
    none. See the module docstring for the rule."""
    text = text[-SCAN_CHARS:].translate(_UNICODE_MINUS)
    found, answers = _marked_answer(text)
    if found:
        return answers
    return _unmarked_answer(text)


def extract_answer(text: str) -> str | None:
    """The final answer in `text`, raw (not normalized); a group of boxes joined with ", "; None if there is none."""
    answers = final_answers(text)
    return None if answers is None else ", ".join(answers)


def gold_answer(gold: str) -> str | None:
    """Gold may be a bare answer ("72", "\\frac{14}{3}", "$x<1$", "(p,q)=(3,2)") or a worked solution with a marker
    (MATH's `\\boxed{}`, GSM8K's `#### 72`). A bare gold is taken whole, never reduced to its last number."""
    text = gold.translate(_UNICODE_MINUS)
    found, answers = _marked_answer(text)
    if found and answers is not None:
        return ", ".join(answers)
    box_at = _box_start(text, len(text))
    if found and box_at >= 0:  # an unclosed box in a gold (a typo, not an attack): the rest of the text
        return text[box_at:].split("{", 1)[-1].strip()[: MAX_ANSWER_CHARS + 1] or None
    return text.strip()[: MAX_ANSWER_CHARS + 1] or None
