"""User code that params name: `package.module:attribute`, or `path/to/file.py:attribute` for a file outside any
package (TRL scripts keep their reward functions and environments in such a file).

`resolve_callable(spec, kind)` is the one resolver behind `train.rewards` (qerl.data.rewards), `rollout.tools` and
`rollout.environment` (qerl.rollout.tool_calls, .multi_turn): the callable the spec names, or a ValueError in one
line that starts with `kind` and the spec and says which part failed (its shape, the import, the attribute, or
that it is not callable), so each caller's message names what the user typed.

A file is imported once per process (its absolute path keys it in `sys.modules`), so two specs of one file name
functions of the same module: a tool's schema cache and the reward labels see one object per function, and a
class an environment file defines is the same class in every spec. Relative paths are from the working folder.
Imports nothing of qerl.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

SHAPE = "'package.module:function' or 'path/to/file.py:function'"


def split_spec(spec: str) -> tuple[str, str] | None:
    """(module or file, attribute) of a spec of the right shape, else None. The last colon splits it, so a Windows
    path's drive letter stays in the file."""
    module, sep, attr = str(spec).rpartition(":")
    return (module, attr) if sep and module and attr and attr.isidentifier() else None


def resolve_callable(spec: str, kind: str) -> Callable[..., Any]:
    """The callable `spec` names; ValueError "{kind} {spec!r}: ..." when it is not of the shape, its module does not
    import, it has no such attribute, or that is not callable."""
    parts = split_spec(spec)
    if parts is None:
        raise ValueError(f"{kind} {spec!r}: name it as {SHAPE}")
    module_name, attr = parts
    module = _module(spec, kind, module_name)
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"{kind} {spec!r}: {module_name}.{attr} is missing (module {module_name!r} has no attribute "
                         f"{attr!r})")
    if not callable(obj):
        raise ValueError(f"{kind} {spec!r}: {module_name}.{attr} is not callable")
    return obj


def _module(spec: str, kind: str, name: str) -> ModuleType:
    if not _is_file(name):
        try:
            return importlib.import_module(name)
        except ImportError as e:
            raise ValueError(f"{kind} {spec!r}: cannot import module {name!r} ({e})") from None
    path = Path(name).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"{kind} {spec!r}: cannot import module {name!r} (no file {path})")
    key = f"qerl_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if key in sys.modules:
        return sys.modules[key]
    loader_spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[key] = module  # before it runs: dataclasses and pickle look their module up by name
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file: any error there is its import failing, named
        del sys.modules[key]
        text = " ".join(str(e).split())
        raise ValueError(f"{kind} {spec!r}: cannot import module {name!r} ({type(e).__name__}"
                         f"{': ' + text if text else ''})") from None
    return module


def _is_file(name: str) -> bool:
    return name.endswith(".py") or "/" in name or "\\" in name
