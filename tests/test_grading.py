"""The grader (qerl.grading) against its case tables, and its promises: bounded time on hostile input, a counted
timeout instead of a hang, a clear rule for several answers, math-verify optional at run time."""

from __future__ import annotations

import json
import time

import pytest

from qerl import grading
from qerl.grading import extract_answer, gold_answer, grade
from qerl.grading import mathverify as mv
from tests.grading_cases import HERE as CASES_DIR
from tests.grading_cases import completion_cases, math_verify_suite

# Cases where the grader deliberately disagrees with the table's expectation, with the reason.
EXCEPTIONS: dict[str, str] = {
    "tests/test_yujianll.py::test_string_extraction | '$1 - \\\\frac{1}{\\\\mathrm{e}}$' | '$1 + \\\\frac{1}{\\\\mathrm{e}}$'":
        "1 + 1/e is not 1 - 1/e. math-verify 0.9.0 reads both as 1 (its parser stops at \\mathrm{e}) and its suite "
        "expects that; a wrong answer graded right is a wrong gradient, so qerl grades it 0.",
    "tests/test_all.py::test_latex_notation | '$9$' | 'Answer $ \\n 9 \\n $'":
        "The answer is 9 (issue #47: a miss on the judged set). math-verify's case expects 0 only under its "
        "latex-only extraction (match_types ['latex']), which skips inline math padded with newlines.",
    "tests/test_all.py::test_latex_notation | '$9$' | 'Answer \\\\( \\n 9 \\n \\\\)'":
        "As above, with \\( \\) for $ $.",
}


@pytest.fixture(autouse=True)
def _worker_ready():
    """math-verify's worker is loaded before each test (a no-op when it is): its start (seconds on a loaded machine,
    again after a test killed one) is no test's timing."""
    grading.start_worker(wait=True)


@pytest.mark.parametrize("case", math_verify_suite() + completion_cases(), ids=lambda c: c.key[:80])
def test_grader_is_right_on_the_case_tables(case) -> None:
    """qerl's grader is right on every case of math-verify's own test suite and of the completion-style table (so
    wherever math-verify or qerl's grader before #29 is right), except the recorded EXCEPTIONS, which it grades the
    other way on purpose. With the default CPU budget, as training grades: a loaded machine cannot flip a verdict."""
    got = grade(case.completion, case.gold)
    expected = 1 - case.expected if case.key in EXCEPTIONS else case.expected
    assert got.score == expected, f"{case.source}: extracted {got.answer!r} vs gold {got.gold!r} ({got.decided_by})"


def test_case_tables_keep_their_sources() -> None:
    suite = json.loads((CASES_DIR / "math_verify_suite.json").read_text())
    assert suite["repository"].endswith("Math-Verify") and len(suite["commit"]) == 40
    assert len(math_verify_suite(judged_only=False)) == 269 and len(math_verify_suite()) == 264
    assert len(completion_cases()) >= 80


@pytest.mark.parametrize("completion, answer", [
    ("first \\boxed{5}. Wait, corrected: \\boxed{7}", "7"),  # a draft, then the answer
    ("The roots are $\\boxed{2}$ and $\\boxed{3}$.", "2, 3"),  # one answer over two boxes
    ("\\boxed{1}, \\boxed{2}, \\boxed{1}", "1, 2"),  # a repeated box counts once
    ("\\boxed{1} no no no \\boxed{2}", "2"),  # words without a connective separate
    ("\\boxed{200} then ... Final Answer: The final answer is $10,455$.", "$10,455$"),  # the latest marker wins
    ("Final Answer: The largest $n$ is 34.", "34"),
    ("so $x \\equiv \\boxed{44}$. Check: 17 * 44 = 748, so our answer is correct.", "44"),  # commentary after a box
    ("The probability is $\\frac{10}{9}$", "\\frac{10}{9}"),  # the last math span, not the last digit
    ("We get $x = 3$, then 3 + 4 = 7.", "7"),  # a number after the last span
    ("The roots are $x = 1$, $x = 4$ and $x = -2$.", "x = 1, x = 4, x = -2"),  # spans joined by connectives only
    ("We have $a = 3$ and $b = 4$, so $c = 5$.", "c = 5"),  # words between spans: the last one
    ("First I thought \\boxed{5}, but rechecking, the answer is \\boxed{9}.", "9"),  # a retraction between boxes
    ("\\boxed{(3, 3)} \\text{ for part (a) and } \\boxed{(1, 1)}", "(3, 3), (1, 1)"),  # a few words: one list
    ("The interest rate is 5 percent.", "5%"),
    ("So the population is 1 000 people.", "1 000"),
    ("17 + 25 = 42", "17 + 25 = 42"),  # all math: the reply is the answer (normalization keeps the value)
    ("AZYUK2A", None),  # a digit inside a word is no answer
    ("\\boxed{" + "1}\\boxed{" * 10 + "1}", "1"),
    ("".join(f"\\boxed{{{i}}}" for i in range(30)), None),  # box spam is no answer
])
def test_extraction_rule(completion: str, answer: str | None) -> None:
    assert extract_answer(completion) == answer


def test_gold_answers_are_taken_whole() -> None:
    assert gold_answer("\\sqrt{12}") == "\\sqrt{12}"
    assert gold_answer("(p,q)=(3,2)") == "(p,q)=(3,2)"
    assert gold_answer("Janet sells 9 eggs.\n#### 18") == "18"
    assert gold_answer("so $\\boxed{\\frac{14}{3}}$.") == "\\frac{14}{3}"


def test_most_answers_never_reach_math_verify() -> None:
    """The fast path: plain numbers and exact matches are decided in process, in well under a millisecond each."""
    before = grading.stats()
    start = time.perf_counter()
    for i in range(200):
        assert grade(f"{i} + 1 = {i + 1}. The answer is \\boxed{{{i + 1}}}.", str(i + 1)).score == 1.0
        assert grade(f"The answer is {i}.", str(i + 1)).score == 0.0
    assert time.perf_counter() - start < 2.0  # ~0.1 s on an idle core
    after = grading.stats()
    assert after["math_verify"] == before["math_verify"] and after["own"] - before["own"] == 400


HOSTILE = {
    "10 MB of text": "x" * 10_000_000,
    "10 MB of digits and commas": "1," * 5_000_000,
    "nested braces": "\\boxed{" + "{" * 5000 + "72" + "}" * 5000 + "}",
    "nested parentheses": "\\boxed{" + "(" * 5000 + "72" + ")" * 5000 + "}",
    "power tower": "\\boxed{" + "2^" * 200 + "2}",
    "braced power tower": "\\boxed{" + "2^{" * 50 + "2" + "}" * 50 + "}",
    "short power tower": "\\boxed{9^{9^{9^{9}}}}",
    "100k unclosed boxes": "\\boxed{" * 100_000,
    "100k closed boxes": "\\boxed{1}" * 100_000,
    "huge literal": "\\boxed{" + "9" * 100_000 + "}",
    "factorial": "\\boxed{100000!}",
    "sin of a googol": "\\boxed{\\sin(10^{100})}",
    "long sum": "\\boxed{" + "+".join(f"x_{{{i}}}^{{{i}}}" for i in range(300)) + "}",
    "deep fractions": "$" + "\\frac{1}{1+" * 40 + "x" + "}" * 40 + "$",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_completion_returns_within_a_second(name: str) -> None:
    for gold in ("72", "\\frac{14}{3}", "x^2+1", "x<1"):
        start = time.perf_counter()
        got = grade(HOSTILE[name], gold)
        assert time.perf_counter() - start < 1.0, (name, gold, got.decided_by)
        assert got.score == 0.0


HUNG_S = 0.5  # the wall-clock backstop in tests with a worker that never answers (60 s in a run)


@pytest.fixture
def hanging_worker(monkeypatch):
    """qerl.grading with a worker that never answers (blocked, using no CPU: only the wall-clock backstop stops it),
    restored afterwards."""
    monkeypatch.setattr(mv, "WORKER_MODULE", "tests.hanging_grader_worker")
    monkeypatch.setattr(mv, "WALL_BACKSTOP_S", HUNG_S)
    hanging = mv.MathVerify()
    monkeypatch.setattr(grading, "_mathverify", hanging)
    yield hanging
    hanging.close()


def test_a_hung_grader_is_a_counted_timeout_not_a_hang(hanging_worker) -> None:
    hanging_worker.start()
    before = grading.stats()["timeouts"]
    for gold in ("x<1", "x<2", "x<3"):  # each one kills a hung worker; the next one asks the standby
        start = time.perf_counter()
        got = grade("The solution is $\\boxed{-x > -1}$.", gold)
        assert time.perf_counter() - start < HUNG_S + 1.0 + (mv.STARTUP_TIMEOUT_S if gold == "x<1" else 0)
        assert got.score == 0.0 and got.timed_out
    assert grading.stats()["timeouts"] - before == 3
    assert grade("\\boxed{42}", "42").score == 1.0  # the fast path does not need the worker


# Hostile for math-verify yet within qerl's size caps: sympy sums a million huge powers, term by term.
# Slow under every size cap (sympy tries closed forms of k^k for minutes), so the CPU budget decides: the backstop for
# what no cap foresaw. Its bound stays under the worker's cap on terms (MAX_TERMS), which decides longer ones at once.
SLOW_SUM = "So the total is $\\boxed{\\sum_{k=1}^{%d} k^{k}}$."


def test_an_answer_over_its_cpu_budget_is_interrupted_and_the_worker_stays() -> None:
    """A comparison over its CPU budget is scored 0 and counted, and interrupted inside the worker, which grades the
    next answer at once (no restart: a restart is seconds of imports)."""
    worker = grading._mathverify.members[0]._active.proc.pid
    before = grading.stats()["timeouts"]
    got = grade(SLOW_SUM % 900, "5", cpu_budget_s=0.2)
    assert got.timed_out and got.score == 0.0
    assert grading.stats()["timeouts"] == before + 1
    assert grade("$\\boxed{-x > -1}$", "x<1").score == 1.0
    assert grading._mathverify.members[0]._active.proc.pid == worker


PRODUCT = "So the product is $\\boxed{\\prod_{k=1}^{%d} \\frac{k+1}{k}}$."


def test_a_verdict_at_the_budgets_edge_is_the_same_under_any_budget_and_on_every_run() -> None:
    """Issue #62: a correct product of ~44,000 terms cost about the 2 s budget and scored 1, 0, 1 on three runs. A
    smaller budget stands for a slower or busier machine: the verdict on the product of 20,000 terms (0.3 s) must not
    change with it, nor from one grading to the next, and a cheap product is still right."""
    got = set()
    for budget in (0.1, grading.CPU_BUDGET_S, 0.1, grading.CPU_BUDGET_S):
        grading._mathverify.forget()  # grade again, not from the cache
        graded = grade(PRODUCT % 20_000, "20001", cpu_budget_s=budget)
        got.add((graded.score, graded.decided_by))
    assert got == {(0.0, "math-verify")}  # over the worker's cap on terms, decided before any comparison
    cheap = grade(PRODUCT % 10, "11")
    assert (cheap.score, cheap.decided_by) == (1.0, "math-verify")


def test_a_worker_stuck_in_one_c_call_is_killed_by_the_kernels_cpu_limit() -> None:
    """Python cannot interrupt one long C call (a CPU timer's exception waits for it to return): the worker's RLIMIT_CPU
    ends it CPU_GRACE_S past the budget (here 0), so a worker never computes on for long after its budget."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    worker = str(Path(mv.__file__).with_name("mathverify_worker.py"))
    code = ("import importlib.util\n"  # the module alone, without the qerl.grading package (sympy: CPU seconds)
            f"spec = importlib.util.spec_from_file_location('w', {worker!r})\n"
            "w = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(w)\n"
            "w._set_limits()\n"
            "w.CPU_GRACE_S = 0\n"
            "w._compare(lambda s, **k: s, lambda a, b, **k: sum(range(10**12)), '1', '1', 0.1)\n")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGXCPU, done.stderr.decode()[-500:]
    assert time.perf_counter() - start < 30


# Answers only math-verify decides (relations, labelled golds, equations of curves, matrices), right and wrong.
MATH_VERIFY_PAIRS = [
    ("The solution is $\\boxed{-x > -%d}$.", "x<%d", 1.0),
    ("Hence $\\boxed{(%d,2)}$.", "(p,q)=(%d,2)", 1.0),
    ("The line is $\\boxed{2x - y + %d = 0}$.", "y=2x+%d", 1.0),
    ("So the lengths are \\boxed{AB = 5, CD = %d}.", "AB=%d,CD=5", 0.0),
    ("So $\\boxed{x \\le %d}$.", "x<%d", 0.0),
]


def test_timeouts_do_not_cascade_into_the_next_answers() -> None:
    """Issue #47: after hostile answers over their budget, the next correct answers still score 1 (they were scored
    0 while a killed worker's replacement loaded: six in a row on a loaded machine)."""
    before = grading.stats()["timeouts"]
    for i in range(3):  # new pairs each: asked, not answered from the cache
        assert grade(SLOW_SUM % (910 + i), "5", cpu_budget_s=0.2).timed_out
    assert grading.stats()["timeouts"] == before + 3
    for i in range(6):
        completion, gold, expected = MATH_VERIFY_PAIRS[i % len(MATH_VERIFY_PAIRS)]
        got = grade(completion % (40 + i), gold % (40 + i))
        assert (got.score, got.decided_by) == (expected, "math-verify"), (i, got)


def test_after_a_killed_worker_the_next_answers_wait_for_the_standby(monkeypatch) -> None:
    """A worker that must be killed (stuck past the wall-clock backstop) hands over to its standby; the answers after
    it get their verdicts even while the standby is still loading, instead of timing out."""
    worker = grading._mathverify.members[0]._active.proc
    monkeypatch.setattr(mv, "WALL_BACKSTOP_S", 0.0)
    assert grade(SLOW_SUM % 900, "5").timed_out
    monkeypatch.undo()
    assert worker.wait(10) is not None  # killed
    got = [grade(c % 50, g % 50) for c, g, _ in MATH_VERIFY_PAIRS]
    assert [(g.score, g.decided_by) for g in got] == [(e, "math-verify") for _, _, e in MATH_VERIFY_PAIRS]


@pytest.fixture
def cpu_hogs():
    """Start three processes that spin on the CPU (on a 2-core machine, each worker then gets ~40% of a core);
    stopped when the test ends."""
    import subprocess
    import sys

    started = []

    def start() -> None:
        started.extend(subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3))

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_scores_do_not_depend_on_the_machines_load(cpu_hogs) -> None:
    """Issue #47: the same answers get the same scores idle and beside three CPU-hogging processes, the answers over
    budget included (a wall-clock deadline made both depend on load and on what was graded before)."""
    pairs = [(SLOW_SUM % 990, "5")] + [(c % 60, g % 60) for c, g, _ in MATH_VERIFY_PAIRS]

    def scores() -> list[tuple[float, str]]:
        grading._mathverify.forget()  # grade again, not from the cache
        return [(g.score, g.decided_by) for g in (grade(c, gold, cpu_budget_s=0.3) for c, gold in pairs)]

    idle = scores()
    cpu_hogs()
    assert scores() == idle == [(0.0, "timeout")] + [(e, "math-verify") for *_, e in MATH_VERIFY_PAIRS]


def test_a_worker_that_died_while_idle_costs_no_answer() -> None:
    """A worker killed from outside between two answers (the OOM killer, an operator) is replaced before the next
    answer is asked, which gets its verdict and counts no timeout."""
    worker = grading._mathverify.members[0]._active.proc
    worker.kill()
    worker.wait()
    before = grading.stats()["timeouts"]
    got = grade("The solution is $\\boxed{-x > -70}$.", "x<70")
    assert (got.score, got.decided_by) == (1.0, "math-verify") and grading.stats()["timeouts"] == before


def test_grading_works_without_math_verify(monkeypatch) -> None:
    """Where math-verify is not installed (e.g. a GPU image), qerl's own equality grades and the grader says so."""
    monkeypatch.setattr(mv, "installed_version", lambda: None)
    missing = mv.MathVerify()
    monkeypatch.setattr(grading, "_mathverify", missing)
    assert grade("\\boxed{2\\sqrt{3}}", "\\sqrt{12}").score == 1.0
    got = grade("$\\boxed{-x > -1}$", "x<1")
    assert got.score == 0.0 and not got.timed_out
    assert grading.grader_info()["math_verify"].startswith("unavailable")


def test_grader_info_names_the_versions() -> None:
    info = grading.grader_info()
    assert info["grader"] == "qerl.grading" and "rule-" in info["grader_version"]
    assert info["math_verify"] == "0.9.0"  # the pin in pyproject.toml


def test_the_dependencies_name_only_extras_that_exist() -> None:
    """pip < 24 warns "X does not provide the extra 'Y'" at install when a requirement names an extra that the
    installed distribution does not declare with that exact spelling, down the chain of extras (#47: math-verify 0.9.0
    declares `antlr4-9-3` and, under it, requires latex2sympy2_extended's `antlr4_9_3`, declared `antlr4-9-3`)."""
    import importlib.metadata
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    todo = [Requirement(r) for r in pyproject["project"]["dependencies"]]
    missing = []
    while todo:
        req = todo.pop()
        if not req.extras:
            continue
        provided = importlib.metadata.distribution(req.name).metadata.get_all("Provides-Extra") or []
        missing += [f"{req.name}[{extra}]" for extra in req.extras if extra not in provided]
        requires = [Requirement(r) for r in importlib.metadata.requires(req.name) or []]
        todo += [r for r in requires for extra in req.extras if r.marker and r.marker.evaluate({"extra": extra})]
    assert not missing, f"extras that pip would warn about: {missing}"


class _ScriptedBackend:
    """A rollout backend that answers each prompt with a fixed reply: evaluation without a model."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = replies

    def generate(self, prompts, sampling, progress=False):
        from types import SimpleNamespace

        texts = self.replies[: len(prompts)]
        self.replies = self.replies[len(prompts):]
        return SimpleNamespace(texts=texts, completion_ids=[[0]] * len(texts), stop_reasons=["eos"] * len(texts))


def test_evaluation_records_the_grader_and_each_extracted_answer(tmp_path) -> None:
    from qerl.data.problems import Example
    from qerl.evaluation.evaluate import evaluate

    examples = [Example("a", "What is x if -x > -1?", "x<1", "math"), Example("b", "What is 6 * 7?", "42", "math")]
    replies = ["Flip the sign: $\\boxed{-x > -1}$.", "6 * 7 = 48, so the answer is 48."]
    result = evaluate(None, None, examples, max_new_tokens=8, progress=False, backend=_ScriptedBackend(replies))
    assert result.metrics["accuracy"] == 0.5 and result.metrics["grader_timeouts"] == 0
    first, second = result.records
    assert (first["extracted"], first["gold_answer"], first["score"], first["graded_by"]) == (
        "-x > -1", "x<1", 1.0, "math-verify")
    assert (second["extracted"], second["gold_answer"], second["score"]) == ("48", "42", 0.0)
    metrics = json.loads((result.save(tmp_path) / "metrics.json").read_text())
    assert metrics["accuracy"] == 0.5 and metrics["grader"] == "qerl.grading" and metrics["math_verify"] == "0.9.0"


def test_trainer_counts_grader_timeouts_in_the_step(hanging_worker) -> None:
    """The trainer's scorer puts the step's timed-out gradings beside its scoring time (metrics key
    grader_timeouts)."""
    from types import SimpleNamespace

    from qerl.data.problems import Example
    from qerl.data.rewards import combined_reward
    from qerl.rl.batch import RolloutBatch
    from qerl.rl.scoring import Scorer

    hanging_worker.start()
    texts = ["$\\boxed{-x > -1}$", "\\boxed{x < 1}", "$\\boxed{-x > -2}$", "The answer is 1."]
    batch = RolloutBatch(examples=[Example("a", "q", "x<1", "math"), Example("b", "q", "1", "math")], group_size=2,
                         samples=SimpleNamespace(texts=texts), sigma=0.0, noise_seed=0, seconds=1.0)
    start = time.perf_counter()
    Scorer(combined_reward({"accuracy": 1.0}))(batch)
    assert time.perf_counter() - start < 2 * (HUNG_S + 1.0) + mv.STARTUP_TIMEOUT_S  # two hung answers
    assert batch.grader_timeouts == 2  # graded twice each (reward mix, accuracy): the cache counts each once
    assert batch.rewards.tolist() == [0.0, 1.0, 0.0, 1.0] and batch.accuracy.tolist() == [0.0, 1.0, 0.0, 1.0]


class _Meeting:
    """A math-verify worker that answers only when the other worker of its pool is being asked at the same time."""

    unavailable, version, timeouts = None, "test", 0

    def __init__(self, barrier):
        self.barrier, self.asked = barrier, 0

    def equal(self, gold, pred, cpu_budget_s):
        self.asked += 1
        self.barrier.wait(timeout=60)  # alone (requests one after the other): BrokenBarrierError, the test fails
        return True, False

    def start(self, wait=False):
        pass

    def close(self):
        pass


def test_a_steps_math_verify_requests_run_in_parallel_over_the_pool(monkeypatch) -> None:
    """grade_all (the trainer's scoring) asks the pool's workers at the same time (math-verify takes ~20 ms an answer,
    one after the other on one worker); the verdicts are cached for the reward mix's own grading."""
    import threading

    barrier = threading.Barrier(2)
    members = [_Meeting(barrier), _Meeting(barrier)]
    pool = mv.MathVerifyPool(members=members)
    monkeypatch.setattr(grading, "_mathverify", pool)
    pairs = [("The solution is $\\boxed{-x > -1}$.", "x<1"), ("So $\\boxed{y \\geq 2}$.", "2 \\le y")]
    got = grading.grade_all(pairs)
    assert [g.decided_by for g in got] == ["math-verify", "math-verify"] and [m.asked for m in members] == [1, 1]
    assert grade(*pairs[0]).score == 1.0 and [m.asked for m in members] == [1, 1]  # from the pool's cache


def test_the_pool_keeps_one_worker_per_four_cores(monkeypatch) -> None:
    for cores, size in ((1, 1), (2, 1), (8, 2), (16, 4), (128, 4)):
        monkeypatch.setattr(mv.os, "cpu_count", lambda cores=cores: cores)
        assert mv.pool_size() == size


def test_a_worker_replaced_as_the_grader_closes_starts_no_standby_after_it(monkeypatch):
    """A timed-out worker is killed and its standby replaced on a thread; a close() in between (the run ending)
    wins: the thread starts no process that nothing would ever close."""
    import threading

    started = []

    class Fake:
        def __init__(self):
            started.append(self)

        def kill(self):
            pass

    monkeypatch.setattr(mv, "_Worker", Fake)
    grader = mv.MathVerify()
    grader.unavailable = None
    grader._active, grader._standby = Fake(), Fake()
    gate = threading.Event()
    grader._active.kill = lambda: gate.wait(10)  # the dead worker's kill outlasts the close below
    grader._retire_active()
    grader.close()
    gate.set()
    for thread in [t for t in threading.enumerate() if t.name == "qerl-mathverify-replace"]:
        thread.join(10)
    assert grader._standby is None and grader._active is None and len(started) == 2
    # Without a close, the replacement does start the new standby
    grader._active, grader._standby = Fake(), Fake()
    grader._retire_active()
    for thread in [t for t in threading.enumerate() if t.name == "qerl-mathverify-replace"]:
        thread.join(10)
    assert isinstance(grader._standby, Fake) and len(started) == 5
