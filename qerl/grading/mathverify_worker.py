"""The math-verify worker: a child process that answers "are these two answers equal?" with HuggingFace math-verify.

Protocol (one JSON object per line): it first writes {"ready": VERSION} (or {"unavailable": REASON}), then for each
request {"gold": ..., "pred": ..., "cpu_s": BUDGET} on stdin one reply on stdout: {"equal": bool} (with "too_large":
true when an answer holds more than MAX_TERMS terms of iterated sums and products: refused by its size, before it is
compared), or {"over_budget": true} when the comparison needed more than BUDGET seconds of this process's CPU time.
It exits when stdin closes (its parent is gone).

The budget is CPU time, not wall time, so that a verdict depends on the answer alone, not on how busy the machine is
or on what was graded before. A CPU timer (ITIMER_PROF) interrupts math-verify in Python, which keeps this process
and its warm parser for the next request; math-verify's own timeouts (wall-clock signal alarms) are off. Python
cannot interrupt one long C call (a huge integer power), so the kernel's CPU limit (RLIMIT_CPU, CPU_GRACE_S past the
budget) kills the process then; the parent counts that as over budget too and its standby takes over.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time

# One of each construct, parsed before the worker says it is ready, so no graded answer pays for a first parse.
WARM_UP = [
    ("$\\frac{1}{2}$", "$0.5$"), ("$x < 1$", "$-x > -1$"), ("$(p,q)=(3,2)$", "$(3,2)$"), ("$AB=4,CD=5$", "$4, 5$"),
    ("$[0,1) \\cup (2, \\infty)$", "$x \\geq 5$"), ("$\\{1, 2\\}$", "$\\begin{pmatrix}1 & 2\\\\ 3 & 4\\end{pmatrix}$"),
    ("$y = 2x + 1$", "$2x - y + 1 = 0$"), ("$2\\sqrt{3} \\pi^2 \\sin(x)$", "$\\text{E}$"), ("$10\\%$", "$1,000$"),
    ("$F_n = \\sum_{k=0}^{n-1} F_k F_{n-k-1}$", "$-2 \\le x \\le 7$"), ("$x^2/4 + y^2/3 = 1$", "$x \\in [-2,7]$"),
    ("4", "So the answer is $\\boxed{\\prod_{k=1}^{3} \\frac{k+1}{k}}$."),  # prose and a box: 20 ms the first time
]
# Terms of the iterated sums and products with numeric bounds a comparison may hold (nested ones multiply, siblings
# add): decided on math-verify's parse before it compares, so a verdict never hangs on the clock there. sympy expands
# them one by one, in time that grows with the count without end (`\prod_{k=1}^{44000} \frac{k+1}{k}`, 5 characters
# of bound, took about the whole 2 s budget and scored 1 or 0 from run to run); 1,000 simple terms take ~12 ms.
MAX_TERMS = 1_000
MEMORY_LIMIT_BYTES = 4 << 30  # address space: a runaway sympy expansion fails with MemoryError, not an OOM kill
CPU_GRACE_S = 2  # CPU seconds past the budget after which the kernel kills a worker stuck in one C call
RETRY_S = 0.05  # the CPU timer fires again this often until its exception gets through (a bare `except:` in sympy)


class OverBudget(BaseException):
    """Raised by the CPU timer inside math-verify. A BaseException: math-verify catches every Exception (and its own
    TimeoutException) while it compares, and must not swallow this one."""


_armed = False  # whether the CPU timer may raise: never outside a comparison
_HAS_CPU_TIMER = hasattr(signal, "setitimer") and hasattr(signal, "SIGPROF")  # not on Windows: the backstop only


def _on_cpu_timer(signum, frame) -> None:
    if _armed:
        raise OverBudget


def _exit_with_parent() -> None:
    """A watchdog thread: when the parent dies (even by SIGKILL, which closes no pipe we would be reading while
    sympy computes), this process is re-parented, and exits instead of computing on as an orphan."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _set_limits() -> None:
    """Memory and core-file limits, and the CPU timer's handler: what a process needs before its first _compare."""
    if _HAS_CPU_TIMER:
        signal.signal(signal.SIGPROF, _on_cpu_timer)
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a worker killed by RLIMIT_CPU leaves no core file
    except (ImportError, ValueError, OSError):  # not on every platform; the parent's wall-clock backstop still holds
        pass


def _limit_cpu(seconds: float | None) -> None:
    """The kernel kills this process once its total CPU time passes `seconds` (whole seconds; where supported);
    None: no limit (between requests, so that the CPU an idle worker spends over a long run never kills it)."""
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = hard if seconds is None else int(seconds) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    except (ImportError, ValueError, OSError):
        pass


def _write(out, obj: dict) -> None:
    out.write(json.dumps(obj).encode() + b"\n")
    out.flush()


def _compare(parse, verify, gold: str, pred: str, budget_s: float) -> dict:
    """math-verify's verdict on one pair within `budget_s` CPU seconds of this process."""
    global _armed
    start = time.process_time()
    _limit_cpu(start + budget_s + CPU_GRACE_S)
    try:
        _armed = _HAS_CPU_TIMER
        if _HAS_CPU_TIMER:
            signal.setitimer(signal.ITIMER_PROF, max(budget_s, 1e-6), RETRY_S)
        gold_parsed, pred_parsed = parse(gold, parsing_timeout=None), parse(pred, parsing_timeout=None)
        if max(iterated_terms(gold_parsed), iterated_terms(pred_parsed)) > MAX_TERMS:
            _armed = False
            return {"equal": False, "too_large": True}  # by its size, not its time: the same verdict on every run
        equal = bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
        _armed = False  # before any call, so that the timer cannot raise past this point
        over = time.process_time() - start > budget_s  # finished after an interruption something swallowed
    except OverBudget:
        _armed = False
        over = True
    finally:
        _armed = False
        if _HAS_CPU_TIMER:
            signal.setitimer(signal.ITIMER_PROF, 0)
        _limit_cpu(None)
    return {"over_budget": True} if over else {"equal": equal}


def iterated_terms(parsed: list) -> int:
    """The terms sympy would expand one by one in math-verify's `parse` result: for each iterated sum or product
    whose bounds are numbers, their count, times its body's (nesting multiplies), added over siblings. Symbolic or
    infinite bounds count 1 (sympy sums those in closed form or not at all)."""
    sympy = sys.modules.get("sympy")  # math-verify's parse imported it; without it, nothing parsed is sympy's
    if sympy is None:
        return 0
    Basic, Product, Sum = sympy.Basic, sympy.Product, sympy.Sum

    def terms(expr) -> int:
        if not isinstance(expr, Basic):
            return 0
        inner = sum(terms(arg) for arg in expr.args)
        if not isinstance(expr, (Sum, Product)):
            return inner
        own = 1
        for _, low, high in expr.limits:
            span = high - low
            if span.is_number and span.is_finite:
                own *= int(abs(span)) + 1
        return own * max(inner, 1)

    return max((terms(expr) for expr in parsed), default=0)


def main() -> None:
    _exit_with_parent()
    out = sys.stdout.buffer
    _set_limits()
    try:
        import importlib.metadata
        import logging

        logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # "timeout is disabled" warnings: ours
        from math_verify import parse, verify

        version = importlib.metadata.version("math-verify")
        for gold, pred in WARM_UP:  # antlr builds its parser tables lazily: the first parse of a construct is slow
            verify(parse(gold, parsing_timeout=None), parse(pred, parsing_timeout=None), timeout_seconds=None)
        # The modules and parser tables loaded so far live as long as the process: out of the collector's sight, a
        # full collection during a comparison no longer walks them (tens of ms of a small budget, now and then).
        gc.freeze()
    except Exception as err:  # noqa: BLE001 - any failure to load means: grade without math-verify
        _write(out, {"unavailable": f"{type(err).__name__}: {err}"[:300]})
        return
    _write(out, {"ready": version})
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            reply = _compare(parse, verify, request["gold"], request["pred"], float(request["cpu_s"]))
        except Exception as err:  # noqa: BLE001 - math-verify and sympy raise anything on odd input: not equal
            reply = {"equal": False, "error": f"{type(err).__name__}"}
        _write(out, reply)


if __name__ == "__main__":
    main()
