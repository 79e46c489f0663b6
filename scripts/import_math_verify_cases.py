"""Copy the parametrized (gold, prediction, expected) cases of math-verify's own test suite into a JSON table.

Usage: python scripts/import_math_verify_cases.py GIT_DIR [COMMIT] > tests/grading_cases/math_verify_suite.json

GIT_DIR is a clone of https://github.com/huggingface/Math-Verify. The test files are read as text (their literal
`@pytest.mark.parametrize` lists, through `ast`), never imported. Each case keeps the file, the test function and the
non-default options its test passes to math-verify (match_types, precision, strict, allow_set_relation_comp), so a
case whose expectation depends on such an option can be told apart from one that states a plain fact.
"""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys

FILES = ["tests/test_all.py", "tests/test_numina_cases.py", "tests/test_open_thoughts.py", "tests/test_yujianll.py",
         "tests/test_boxed.py", "tests/test_strict.py"]
ROLES = {"gold": "gold", "pred": "prediction", "expected": "expected", "result": "expected"}


def _options(fn: ast.FunctionDef) -> dict:
    """The keyword options of the call to compare_strings/verify in the test body (literals only)."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("compare_strings", "verify"):
            out = {}
            for kw in node.keywords:
                try:
                    out[kw.arg] = ast.literal_eval(kw.value)
                except ValueError:  # a parameter passed through, e.g. precision=precision
                    out[kw.arg] = f"<{ast.unparse(kw.value)}>"
            return out
    return {}


def _literal(node: ast.expr):
    """A literal, or an f-string over `math` (test_float_precision writes its gold as f"{math.sqrt(17):.15f}")."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        if isinstance(node, (ast.List, ast.Tuple)):
            return type(node.elts)(_literal(e) for e in node.elts) if isinstance(node, ast.List) else tuple(
                _literal(e) for e in node.elts)
        if isinstance(node, ast.JoinedStr):
            return eval(compile(ast.Expression(node), "<case>", "eval"), {"__builtins__": {}, "math": math})
        raise


def cases(source: str, path: str) -> list[dict]:
    out = []
    for fn in ast.parse(source).body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        for deco in fn.decorator_list:
            if not (isinstance(deco, ast.Call) and ast.unparse(deco.func).endswith("parametrize")):
                continue
            names = [n.strip() for n in ast.literal_eval(deco.args[0]).split(",")]
            options = _options(fn)
            for values in _literal(deco.args[1]):
                row = dict(zip(names, values))
                case = {ROLES[k]: v for k, v in row.items() if k in ROLES}
                extra = {k: v for k, v in row.items() if k not in ROLES}  # per-case options (precision, strict, ...)
                opts = {k: (extra.get(v[1:-1], v) if isinstance(v, str) and v.startswith("<") else v)
                        for k, v in options.items()}
                opts.update({k: v for k, v in extra.items() if k not in opts and k != "config"})
                case["expected"] = int(case["expected"])
                out.append({"source": f"{path}::{fn.name}", **case, "options": opts})
    return out


def main() -> None:
    git_dir, commit = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "HEAD"
    sha = subprocess.run(["git", "-C", git_dir, "rev-parse", commit], capture_output=True, text=True,
                         check=True).stdout.strip()
    table = []
    for path in FILES:
        text = subprocess.run(["git", "-C", git_dir, "show", f"{sha}:{path}"], capture_output=True, text=True,
                              check=True).stdout
        table += cases(text, path)
    json.dump({"repository": "https://github.com/huggingface/Math-Verify", "commit": sha,
               "license": "Apache-2.0 (test_all.py: MIT, (c) 2024 The HuggingFace Team)",
               "cases": table}, sys.stdout, indent=1, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
