r"""Completion-style grading cases: a whole model reply against a gold answer, as the trainer and `qerl eval` see them.

Written for issue #29 (qerl's grader vs math-verify 0.9.0). `expected` is what a careful human grader says; where a
case is a judgment call its note says which way and why. Categories: boxed answers, several boxes, fractions vs
decimals, \dfrac, percentages, units and text, thousands separators, radicals, sets, intervals, tuples, relations,
labelled golds, bare-LaTeX golds, plain-text replies, close-but-wrong answers, replies of SmolLM2-135M-Instruct (the
embedded default) to the arithmetic task, unicode minus, answers with no final-answer marker.

Each row: (completion, gold, expected, note).
"""

CASES: list[tuple[str, str, int, str]] = [
    # --- boxed answers
    (r"Adding the two amounts gives $12 + 30 = 42$, so the total is $\boxed{42}$.", "42", 1, "boxed"),
    (r"We need $3 \times 14$. Thus the answer is \boxed{42}", "42", 1, "boxed, no closing $"),
    (r"\[ \boxed{x = 7} \]", "7", 1, "boxed assignment"),
    (r"The value is \boxed{\frac{7}{2}}.", r"\frac72", 1, "boxed fraction vs short form"),
    (r"So $n = \boxed{34}$.", "34", 1, "box after an assignment"),
    (r"First I got \boxed{12}. Wait, I forgot the last term: the sum is \boxed{15}.", "15", 1,
     "a corrected second box: the last one counts"),
    (r"First I got \boxed{12}. Wait, I forgot the last term: the sum is \boxed{15}.", "12", 0,
     "a corrected box: the earlier one does not count"),
    (r"The solutions are $\boxed{2}$ and $\boxed{3}$.", "2, 3", 1, "an answer split over adjacent boxes"),
    (r"The solutions are $\boxed{2}$ and $\boxed{3}$.", "3", 0, "split answer vs one of its parts"),
    (r"$x = \boxed{-1}$ or $x = \boxed{4}$", r"-1, 4", 1, "split answer joined by 'or'"),
    (r"**Final Answer**" "\n" r"\boxed{\text{E}}", "E", 1, r"\text{E} vs E"),
    (r"The answer is $\boxed{\textbf{(C)}}$", "C", 1, "multiple choice letter"),
    (r"Final Answer: The largest $n$ is 34.", "34", 1, "a sentence after 'Final Answer:'"),
    (r"Final Answer: The final answer is $\frac{3}{5}$. I hope it is correct.", r"\frac35", 1, "Minerva format"),
    # --- fractions vs decimals, \dfrac
    (r"The probability is $\boxed{\dfrac{3}{8}}$.", r"\frac{3}{8}", 1, r"\dfrac"),
    (r"The probability is $\boxed{0.375}$.", r"\frac{3}{8}", 1, "exact decimal of a fraction"),
    (r"The probability is $\boxed{0.38}$.", r"\frac{3}{8}", 0, "a rounded decimal is close, not equal"),
    (r"So the ratio is $\boxed{1/3}$.", r"\frac13", 1, "slash fraction"),
    (r"So the ratio is $\boxed{0.333}$.", r"\frac13", 0, "a truncated repeating decimal"),
    (r"\boxed{\tfrac{-5}{2}}", "-2.5", 1, r"\tfrac, negative"),
    (r"\boxed{-\frac{5}{2}}", r"\frac{-5}{2}", 1, "sign placement"),
    (r"\boxed{\frac{10}{4}}", r"\frac52", 1, "unreduced fraction"),
    (r"\boxed{2\frac{1}{2}}", r"\frac52", 1, "mixed number"),
    # --- percentages
    (r"The discount is $\boxed{25\%}$.", "25", 1, "percent sign on the answer"),
    (r"The discount is 25%.", r"25\%", 1, "plain percent"),
    (r"The answer is $\boxed{20\%}$", r"25\%", 0, "wrong percentage"),
    # --- units and text
    (r"She needs $\boxed{18 \text{ cups}}$ of flour.", "18", 1, "unit text in the box"),
    (r"The area is \boxed{48\,\text{cm}^2}.", "48", 1, "unit with a power"),
    (r"It costs \boxed{\$4.50}.", "4.5", 1, "dollars, trailing zero"),
    (r"The angle measures $\boxed{120^\circ}$.", "120", 1, "degrees"),
    (r"It takes \boxed{3\text{ hours}}", r"3 \text{ hours}", 1, "unit on both sides"),
    (r"The day is \boxed{\text{Tuesday}}.", r"\text{Tuesday}", 1, "a word answer"),
    (r"The day is \boxed{\text{Monday}}.", r"\text{Tuesday}", 0, "the wrong word"),
    # --- thousands separators
    (r"The total is $\boxed{7\,425}$.", "7425", 1, r"thin-space thousands separator \,"),
    (r"The total is $\boxed{7{,}425}$.", "7425", 1, "{,} thousands separator"),
    (r"The total is $\boxed{1,234,567}$.", "1234567", 1, "comma thousands separators"),
    (r"So the population is 1 000 people.", "1000", 1, "space thousands separator, no marker"),
    (r"The total is $\boxed{7,425}$.", "7245", 0, "transposed digits"),
    # --- radicals and constants
    (r"The side is $\boxed{2\sqrt{3}}$.", r"\sqrt{12}", 1, "simplified radical vs bare-LaTeX gold"),
    (r"The side is $\boxed{\sqrt{12}}$.", r"2\sqrt{3}", 1, "unsimplified radical"),
    (r"The side is $\boxed{2\sqrt{3}}$.", r"3\sqrt{2}", 0, "close-but-wrong radical"),
    (r"The circumference is $\boxed{2\pi}$.", r"2\pi", 1, r"bare-LaTeX gold 2\pi"),
    (r"The circumference is $\boxed{6.28}$.", r"2\pi", 0, "a decimal approximation of pi"),
    (r"The value is $\boxed{\frac{\sqrt{2}}{2}}$.", r"\frac{1}{\sqrt{2}}", 1, "rationalized denominator"),
    # --- sets, intervals, tuples
    (r"The roots are $\boxed{\{-2, 3\}}$.", r"\{3,-2\}", 1, "set order does not matter"),
    (r"The roots are $x = -2$ and $x = 3$, so \boxed{-2, 3}.", "3, -2", 1, "bare list is a set"),
    (r"The roots are \boxed{-2, 3}.", "-2", 0, "extra root"),
    (r"The domain is $\boxed{[0,1)}$.", "[0,1)", 1, "bare-LaTeX interval gold"),
    (r"The domain is $\boxed{[0,1]}$.", "[0,1)", 0, "closed vs half-open"),
    (r"The range is $\boxed{(-\infty, 2] \cup [5, \infty)}$.", r"(-\infty,2]\cup[5,\infty)", 1, "union"),
    (r"The point is $\boxed{(3, -1)}$.", "(3,-1)", 1, "ordered pair"),
    (r"The point is $\boxed{(-1, 3)}$.", "(3,-1)", 0, "swapped pair"),
    (r"Hence $\boxed{(3,2)}$.", "(p,q)=(3,2)", 1, "labelled tuple gold"),
    (r"So the lengths are \boxed{4, 5}.", "AB=4,CD=5", 1, "labelled list gold"),
    (r"So the lengths are \boxed{AB = 4, CD = 5}.", "AB=4,CD=5", 1, "labelled both sides"),
    (r"So the lengths are \boxed{AB = 5, CD = 4}.", "AB=4,CD=5", 0, "labels swapped"),
    (r"\boxed{\begin{pmatrix} 1 \\ -2 \end{pmatrix}}", r"\begin{pmatrix} 1 \\ -2 \end{pmatrix}", 1, "vector"),
    # --- relations
    (r"The solution is $\boxed{-x > -1}$.", "x<1", 1, "equivalent inequality"),
    (r"The solution is $\boxed{x \le 1}$.", "x<1", 0, "strict vs non-strict"),
    (r"So $\boxed{(-\infty, 1)}$.", "x<1", 1, "an interval for a relation gold"),
    (r"The line is $\boxed{y = 2x + 1}$.", "y=2x+1", 1, "equation of a line"),
    (r"The line is $\boxed{2x - y + 1 = 0}$.", "y=2x+1", 1, "the same line rearranged"),
    # --- no final-answer marker
    (r"The probability is $\frac{10}{9}$", r"\frac{10}{9}", 1, "last LaTeX span, not the last digit"),
    (r"Therefore the probability is $\frac13$.", r"\frac{1}{3}", 1, "malformed-short fraction, no box"),
    (r"So the answer is .4", "0.4", 1, "leading-dot decimal"),
    # --- plain-text replies
    (r"The answer is forty-two.", "42", 0, "number words are not graded as numbers"),
    (r"The answer is B.", r"\text{(B)}", 1, "plain-text choice"),
    (r"The answer is: Evelyn", r"\text{Evelyn}", 1, "plain-text name"),
    # --- unicode minus
    (r"The result is \boxed{−7}.", "-7", 1, "unicode minus U+2212"),
    (r"The answer is −12.", "-12", 1, "unicode minus, plain text"),
    (r"The answer is −12.", "12", 0, "unicode minus is a minus"),
    # --- issue #47: misses on the hidden judged set, and more of their kind
    # drafts, then the final answer (the last box is the answer unless the boxes are joined into a list)
    (r"First I thought \boxed{5}, but rechecking, the answer is \boxed{9}.", "9", 1, "a draft box, a comma, a box"),
    (r"First I thought \boxed{5}, but rechecking, the answer is \boxed{9}.", "5", 0, "the draft box does not count"),
    (r"First I thought \boxed{5}, but rechecking, the answer is \boxed{9}.", "5, 9", 0, "a draft is no list item"),
    (r"So it is \boxed{12}, no wait, \boxed{15}", "15", 1, "'no wait' between two boxes"),
    ("That gives \\boxed{7}\nActually I dropped a term, so it is \\boxed{8}", "8", 1, "a correction on the next line"),
    (r"We get $\boxed{3}$, or rather $\boxed{4}$ once the sign is fixed.", "4", 1, "'or rather' corrects"),
    (r"She buys \boxed{4} apples and \boxed{9} pears.", "4, 9", 1, "boxes joined by 'and' stay one list answer"),
    ("The answer is 10. Hmm, let me double-check: 4 + 7 = 11. So the answer is 11.", "11", 1,
     "a stated answer, rechecked and restated"),
    # answers on their own lines
    ("Answer $ \n 9 \n $", "9", 1, "inline math spread over lines"),
    ("The answer is\n$$\n42\n$$", "42", 1, "display math on the lines after 'the answer is'"),
    ("**Final Answer**\n\\[\n\\boxed{\\dfrac{5}{12}}\n\\]", r"\frac{5}{12}", 1, "a boxed display on its own lines"),
    # percent against decimal or fraction
    (r"The probability is $\boxed{25\%}$.", "0.25", 1, "a percent against the decimal gold"),
    (r"So the rate is \boxed{0.25}.", r"25\%", 1, "a decimal against the percent gold"),
    (r"So the share is \boxed{\frac{1}{8}}.", r"12.5\%", 1, "a fraction against the percent gold"),
    (r"The interest rate is 5 percent.", "0.05", 1, "'percent' in words"),
    (r"So the share is \boxed{33\frac{1}{3}\%}.", r"\frac13", 1, "a mixed-number percent against a fraction"),
    (r"So the share is \boxed{33.3\%}.", r"\frac13", 0, "a rounded percent against a fraction"),
    (r"The discount is $\boxed{10\%}$.", "0.01", 0, "a percent off by a factor 10"),
    (r"So the rate is \boxed{25}.", "0.25", 0, "no percent sign: 25 is not 0.25"),
    # labelled roots
    (r"The roots are \boxed{2, 3}.", "x_1=2, x_2=3", 1, "a list of roots against labelled roots"),
    (r"Hence $\boxed{x=2 \text{ or } x=3}$.", "x_1=2, x_2=3", 1, "roots joined by 'or'"),
    (r"Hence $\boxed{x_1 = 3, x_2 = 2}$.", "x_1=2, x_2=3", 1, "roots labelled in the other order"),
    (r"So $\boxed{x = 2 \text{ and } x = 3}$.", "2, 3", 1, "roots joined by 'and' against a bare list"),
    (r"So the answer is x = 2 or x = 3.", "x_1=2, x_2=3", 1, "roots in a sentence"),
    (r"The solutions are $x=\frac{1}{2}$ and $x=-3$, so $\boxed{x=\frac{1}{2}, x=-3}$.", r"x_1=-3, x_2=\frac12", 1,
     "fraction roots, other order"),
    (r"\boxed{-3 \text{ and } \frac{1}{2}}", r"x_1=-3, x_2=\frac{1}{2}", 1, "bare roots joined by 'and'"),
    (r"The solutions are $x = 1$ and $x = -2$.", "x_1=1, x_2=-2", 1, "unboxed roots in two spans joined by 'and'"),
    (r"So $x=1$ or $x=-2$.", "1, -2", 1, "unboxed roots in two spans joined by 'or'"),
    (r"So $x = 3$ and $y = 4$.", "(3,4)", 1, "a pair given as two labelled spans"),
    (r"We have $a = 3$ and $b = 4$, so $c = 5$.", "5", 1, "spans joined by words are not one answer"),
    (r"The roots are \boxed{2, 4}.", "x_1=2, x_2=3", 0, "one root wrong"),
    (r"The root is \boxed{2}.", "x_1=2, x_2=3", 0, "a root missing"),
    # multiple choice with its value
    (r"Hence, the answer is $\boxed{\textbf{(D)}\ 18}$.", "18", 1, "a choice letter and its value, value gold"),
    (r"Hence, the answer is $\boxed{\textbf{(D)}\ 18}$.", "D", 1, "a choice letter and its value, letter gold"),
    (r"Hence, the answer is $\boxed{\textbf{(D)}\ 18}$.", "20", 0, "a choice letter and a wrong value"),
    # units and money
    (r"The speed is $\boxed{60 \text{ km/h}}$.", "60", 1, "a unit with a slash"),
    (r"The mass is $\boxed{3.5 \mathrm{~kg}}$.", "3.5", 1, r"\mathrm{~kg}"),
    (r"In total she pays $\boxed{\$1{,}250}$.", "1250", 1, "dollars with a LaTeX thousands separator"),
    ("Step 1: 3 boxes of 12 is 36.\nStep 2: 36 - 16 = 20.\n\nTherefore, the final answer is: $\\boxed{20}$. "
     "I hope it is correct.", "20", 1, "a reasoning trace ending in a boxed answer"),
    # --- SmolLM2-135M-Instruct replies to the arithmetic task (gold: the exact value)
    ("17 + 25 = 32", "42", 0, "small model, wrong sum"),
    ("17 + 25 = 42", "42", 1, "small model, equation ends in the value"),
    ("To find the sum, we add 58 and 23.\n\n58 + 23 = 81\n\nSo, the answer is 81.", "81", 1,
     "small model, worked"),
    ("To find the difference, subtract 23 from 58: 58 - 23 = 35. The answer is $\\boxed{35}$.", "35", 1,
     "small model, boxed"),
    ("What is 64 - 19?\n\nWhat is 64 - 19?", "45", 0, "small model repeats the question"),
    ("The answer is 45 or 46.", "45", 0, "hedged: two answers"),
    ("64 - 19 = 45 apples", "45", 1, "small model, a unit word"),
    ("Let's calculate: 91 - 37 = 54. Then 54 + 2 = 56.", "56", 1, "no marker, the last value"),
    ("I think it is 47 + 38 = 86.", "85", 0, "small model, off by one"),
    ("\\boxed{-18}", "-18", 1, "negative result"),
    ("The answer is 1,024.", "1024", 1, "comma separator in a sentence"),
    # --- real replies of SmolLM2-135M-Instruct (NVFP4 base) sampled at T = 1 by `qerl eval --params
    #     params/default.yaml -S eval.num_samples=4 -S eval.temperature=1.0` on 2026-11-26 (held-out arithmetic)
    ("To find the final answer, 7 + 1 = 8.", "8", 1, "real SmolLM2 reply #1"),
    ("Aldrin's assistant. 1 - (-5) + (2) = 3\n3\nThe formula", "3", 1, "real SmolLM2 reply #18"),
    ("Perfect! \"9 + 2 = 11\"", "11", 1, "real SmolLM2 reply #30"),
    ("To add 6 and 5, simply add them: 6 + 5 = 11, \n", "11", 1, "real SmolLM2 reply #50"),
    ("6 + 5 results in 11, which is the answer to 6 (11) and can be", "11", 1, "real SmolLM2 reply #51"),
    ("The expression 6 - 1 is 6.", "5", 0, "real SmolLM2 reply #10"),
    ("Numerology absolutely matches your second negative 1, and in mathematics that is -2. \nAlso -1", "1", 0,
     "real SmolLM2 reply #21"),
    ("1 + 9 = 9", "14", 0, "real SmolLM2 reply #39"),
    ("16\nNone 6 - 7 = 6\nDefinitely no 6 - 7 =6.", "-1", 0, "real SmolLM2 reply #58"),
    ("6 + 9 = 6*9 = 6*9 = 39 shares\nahahahah", "15", 0, "real SmolLM2 reply #64"),
]
