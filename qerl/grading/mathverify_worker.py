"""The math-verify worker: a child process that answers "are these two answers equal?" with HuggingFace math-verify.

Protocol (one JSON object per line): it first writes {"ready": VERSION} (or {"unavailable": REASON}), then for each
request {"gold": ..., "pred": ...} on stdin one reply {"equal": bool} on stdout. It exits when stdin closes (its parent
is gone). math-verify's own timeouts are off (they use signal alarms): the parent enforces a deadline by killing this
process, the one way to stop sympy for sure.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

# One of each construct, parsed before the worker says it is ready, so no graded answer pays for a first parse.
WARM_UP = [
    ("$\\frac{1}{2}$", "$0.5$"), ("$x < 1$", "$-x > -1$"), ("$(p,q)=(3,2)$", "$(3,2)$"), ("$AB=4,CD=5$", "$4, 5$"),
    ("$[0,1) \\cup (2, \\infty)$", "$x \\geq 5$"), ("$\\{1, 2\\}$", "$\\begin{pmatrix}1 & 2\\\\ 3 & 4\\end{pmatrix}$"),
    ("$y = 2x + 1$", "$2x - y + 1 = 0$"), ("$2\\sqrt{3} \\pi^2 \\sin(x)$", "$\\text{E}$"), ("$10\\%$", "$1,000$"),
    ("$F_n = \\sum_{k=0}^{n-1} F_k F_{n-k-1}$", "$-2 \\le x \\le 7$"), ("$x^2/4 + y^2/3 = 1$", "$x \\in [-2,7]$"),
]
MEMORY_LIMIT_BYTES = 4 << 30  # address space: a runaway sympy expansion fails with MemoryError, not an OOM kill


def _exit_with_parent() -> None:
    """A watchdog thread: when the parent dies (even by SIGKILL, which closes no pipe we would be reading while
    sympy computes), this process is re-parented, and exits instead of computing on as an orphan."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _write(out, obj: dict) -> None:
    out.write(json.dumps(obj).encode() + b"\n")
    out.flush()


def main() -> None:
    _exit_with_parent()
    out = sys.stdout.buffer
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    except (ImportError, ValueError, OSError):  # not on every platform; the parent's deadline still holds
        pass
    try:
        import importlib.metadata
        import logging

        logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # "timeout is disabled" warnings: ours
        from math_verify import parse, verify

        version = importlib.metadata.version("math-verify")
        for gold, pred in WARM_UP:  # antlr builds its parser tables lazily: the first parse of a construct is slow
            verify(parse(gold, parsing_timeout=None), parse(pred, parsing_timeout=None), timeout_seconds=None)
    except Exception as err:  # noqa: BLE001 - any failure to load means: grade without math-verify
        _write(out, {"unavailable": f"{type(err).__name__}: {err}"[:300]})
        return
    _write(out, {"ready": version})
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            gold = parse(request["gold"], parsing_timeout=None)
            pred = parse(request["pred"], parsing_timeout=None)
            reply = {"equal": bool(verify(gold, pred, timeout_seconds=None))}
        except Exception as err:  # noqa: BLE001 - math-verify and sympy raise anything on odd input: not equal
            reply = {"equal": False, "error": f"{type(err).__name__}"}
        _write(out, reply)


if __name__ == "__main__":
    main()
