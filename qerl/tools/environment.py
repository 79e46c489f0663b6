"""An environment: the state one rollout row's tool calls share, in the spirit of TRL's `environment_factory`.

The engine makes one environment per row (from a factory: a zero-argument callable, as TRL's `environment_factory`)
and drives it: `reset(row)` once, with the data row, before the first turn (its text, if any, is added to the first
user turn); `step(name, arguments)` for each tool call, whose text is the tool turn; `reward(completion)` once at the
end (None: the reward functions alone score the row). `tools` are what the chat template announces; by default
`step` calls them through `call_tool`, so an environment with tools only needs to define them.

Adapters: `ToolsEnvironment(tools)` makes a list of plain functions one (stateless; what `tools=[...]` is), and
`TRLEnvironment(obj)` takes an object written for TRL's `environment_factory` (its `reset(**row)`, its public
methods the tools). `environment_factory(x)` turns either form, or a factory of our own, into a factory.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Sequence

from qerl.tools.schema import ToolError, call_tool, tool_schemas


class Environment:
    """Base class: override `tools` (and `reset`, `reward`, or `step` itself where a tool call is not a function
    call). One instance serves one row: its calls come one at a time, never from two threads at once."""

    @property
    def tools(self) -> Sequence[Callable]:
        return ()

    def schemas(self) -> list[dict]:
        """The JSON schemas of `tools`, for the chat template's `tools=` (ToolError if one is no tool)."""
        return tool_schemas(self.tools)

    def reset(self, row: Mapping[str, Any]) -> str | None:
        """Start an episode for this data row (every column); text returned is added to the first user turn."""
        return None

    def step(self, name: str, arguments: Mapping[str, Any] | str | None) -> str:
        """Run one tool call; the text is the tool turn. Never raises for the model's or the tool's mistakes."""
        return call_tool(self.tools, name, arguments)

    def reward(self, completion: Any) -> float | None:
        """The episode's reward, given the completion as reward functions see it (text, or chat messages); None
        when the environment does not score."""
        return None


class ToolsEnvironment(Environment):
    """Plain tools as an environment: no state, no reward of its own."""

    def __init__(self, tools: Sequence[Callable]):
        self._tools = tuple(tools)

    @property
    def tools(self) -> Sequence[Callable]:
        return self._tools


class TRLEnvironment(Environment):
    """An object written for TRL's `environment_factory`: `reset(**row)` (its columns as keyword arguments, as far
    as its signature takes them), and every public method but `reset` a tool."""

    def __init__(self, obj: Any):
        self.obj = obj
        self._tools = tuple(getattr(obj, name) for name in dir(type(obj))
                            if not name.startswith("_") and name != "reset" and callable(getattr(obj, name)))

    @property
    def tools(self) -> Sequence[Callable]:
        return self._tools

    def reset(self, row: Mapping[str, Any]) -> str | None:
        reset = getattr(self.obj, "reset", None)
        if reset is None:
            return None
        parameters = inspect.signature(reset).parameters.values()
        takes_all = any(p.kind is p.VAR_KEYWORD for p in parameters)
        names = {p.name for p in parameters}
        result = reset(**{k: v for k, v in row.items() if takes_all or k in names})
        return None if result is None else str(result)


def environment_factory(spec: Sequence[Callable] | Callable[[], Any]) -> Callable[[], Environment]:
    """A factory of environments, one per row, from a list of tools, a factory of `Environment`s (a subclass
    itself, say) or a TRL `environment_factory` (a class whose public methods are tools). Checks the tools of one
    instance now, so a tool without hints or docstring fails at set-up in one line, not on the first tool call."""
    if isinstance(spec, (list, tuple)):
        tools = tuple(spec)
        tool_schemas(tools)
        return lambda: ToolsEnvironment(tools)
    if not callable(spec):
        raise ToolError(f"environment {spec!r}: expected a list of tools or a zero-argument factory")

    def make() -> Environment:
        made = spec()
        return made if isinstance(made, Environment) else TRLEnvironment(made)

    make().schemas()
    return make
