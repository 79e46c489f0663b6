"""The Python interpreter tool: a model's code run in the sandbox (qerl.tools.sandbox), its output as the result."""

from __future__ import annotations

from typing import Callable

from qerl.tools.sandbox import SandboxLimits, run_python

# The description the model reads: one sentence a line, so no line break falls inside a sentence.
_DOC = """Run a Python 3 program and return what it prints (stdout, then any error).

    Each call is a new process and nothing carries over from one call to the next, so print every value you need.
    There is no network, and no file but the program's own working folder.{packages}
    Limits: {wall:g} s, {memory} MiB of memory, {output} of output.

    Args:
        code: The complete program to run, e.g. "print(sum(range(10)))".
    """


def make_python_interpreter(limits: SandboxLimits = SandboxLimits(), *, site_packages: bool = True,
                            max_chars: int = 16 * 1024) -> Callable[[str], str]:
    """A `python_interpreter(code: str) -> str` tool with these limits; its docstring (which the model reads as the
    tool's description) states them. `max_chars`: longest result returned (head and tail kept)."""

    def python_interpreter(code: str) -> str:
        return run_python(code, limits, site_packages=site_packages).text(max_chars)

    output = f"{limits.output_bytes // 1024} KiB" if limits.output_bytes % 1024 == 0 else f"{limits.output_bytes} bytes"
    python_interpreter.__doc__ = _DOC.format(
        packages="\n    The installed packages (numpy, sympy, ...) can be imported." if site_packages else
        "\n    Only the standard library can be imported.",
        wall=limits.wall_s, memory=limits.memory_mib, output=output)
    return python_interpreter


python_interpreter = make_python_interpreter()
