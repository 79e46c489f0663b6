"""Tools as TRL takes them: plain Python functions with type hints and a Google-style docstring.

`tool_schema(f)` is the JSON schema a chat template's `tools=` takes, made by transformers' own
`get_json_schema` (the function TRL and the chat templates use), with its errors made one line naming the tool.
`call_tool(tools, name, arguments)` runs one tool call of the model and always returns text: an unknown tool, bad
arguments or a tool that raises become an error message for the model, since one row's mistake must not end the
rollout of the others.
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any, Callable, Mapping, Sequence

# JSON-schema types (as get_json_schema writes them) and the Python values a JSON decoder gives for each
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
               "object": (dict,), "null": (type(None),)}


class ToolError(ValueError):
    """A function that cannot be a tool (no type hint, no docstring, two tools of one name): one line naming it."""


def tool_name(tool: Callable) -> str:
    """The name the model calls the tool by: the function's own, as in TRL."""
    return getattr(tool, "__name__", type(tool).__name__)


def _where(tool: Callable) -> str:
    module = getattr(tool, "__module__", None)
    qualname = getattr(tool, "__qualname__", tool_name(tool))
    return f"{module}:{qualname}" if module else qualname


def tool_schema(tool: Callable) -> dict:
    """The tool's JSON schema ({"type": "function", "function": {name, description, parameters}}), from its type
    hints and its docstring's description and `Args:` section; ToolError naming the tool if either is missing."""
    from transformers.utils import get_json_schema  # a core dependency; imported here, where a schema is needed

    if not callable(tool):
        raise ToolError(f"tool {tool!r}: not a function")
    try:
        return get_json_schema(tool)
    except Exception as e:  # transformers' TypeHintParsingException / DocstringParsingException, and the like
        message = " ".join(str(e).split()) or type(e).__name__
        raise ToolError(f"tool {tool_name(tool)} ({_where(tool)}): {message} (a tool needs a type hint on every "
                        "argument and a Google-style docstring with an Args: line for each)") from None


def tool_schemas(tools: Sequence[Callable]) -> list[dict]:
    """The schemas of all tools, checked once at set-up: each is a tool, and no two share a name."""
    seen: dict[str, Callable] = {}
    for tool in tools:
        name = tool_name(tool)
        if name in seen:
            raise ToolError(f"two tools are named {name!r}: {_where(seen[name])} and {_where(tool)}")
        seen[name] = tool
    return [tool_schema(tool) for tool in tools]


def _error(message: str) -> str:
    return f"Error: {message}"


@functools.lru_cache(maxsize=1024)
def _properties(tool: Callable) -> dict:
    try:
        return tool_schema(tool)["function"]["parameters"].get("properties", {})
    except (ToolError, TypeError):  # no schema (or an unhashable tool): the signature's check is all there is
        return {}


def _bad_arguments(tool: Callable, arguments: dict) -> str | None:
    """Why these arguments cannot call the tool (missing, unexpected, of a JSON type its hints exclude), or None."""
    try:
        inspect.signature(tool).bind(**arguments)
    except TypeError as e:
        return str(e)
    except ValueError:  # no signature to read (a builtin): let the call itself decide
        return None
    try:
        properties = _properties(tool)
    except TypeError:  # unhashable callable
        properties = {}
    for key, value in arguments.items():
        spec = properties.get(key, {})
        kinds = spec.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds or []
        allowed = tuple(t for kind in kinds for t in _JSON_TYPES.get(kind, (object,)))
        if allowed and (not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)):
            return f"argument {key!r} must be {' or '.join(kinds)}, got {type(value).__name__} {value!r:.80}"
    return None


def call_tool(tools: Sequence[Callable], name: str, arguments: Mapping[str, Any] | str | None) -> str:
    """Run the model's call of tool `name` with `arguments` (a mapping, or the JSON text of one) and return its
    result as text (None as "", anything else through str()). Never raises for what the model or the tool got
    wrong: an unknown tool, arguments that are no JSON object or do not fit the signature, a tool that raises (or
    calls sys.exit) all come back as one "Error: ..." text the model can read and act on. Ctrl-C still stops."""
    by_name = {tool_name(t): t for t in tools}
    if name not in by_name:
        known = ", ".join(sorted(by_name)) or "none"
        return _error(f"unknown tool {name!r}; the tools are: {known}")
    tool = by_name[name]
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            return _error(f"tool {name}: arguments are not valid JSON ({e})")
    if not isinstance(arguments, Mapping) or not all(isinstance(k, str) for k in arguments):
        return _error(f"tool {name}: arguments must be a JSON object of named arguments, got {arguments!r:.80}")
    arguments = dict(arguments)
    why = _bad_arguments(tool, arguments)
    if why:
        return _error(f"tool {name}: {why}")
    try:
        result = tool(**arguments)
    except (Exception, SystemExit) as e:
        text = " ".join(str(e).split())
        return _error(f"tool {name} raised {type(e).__name__}" + (f": {text}" if text else ""))
    if result is None:
        return ""
    if isinstance(result, str):
        return result
    try:
        return str(result)
    except Exception as e:  # a result whose __str__ raises is still the tool's failure, not the rollout's
        return _error(f"tool {name} returned a {type(result).__name__} that cannot be shown: {e}")
