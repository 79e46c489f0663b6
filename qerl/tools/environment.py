"""An environment: the state one rollout row's tool calls share, in the spirit of TRL's `environment_factory`.

The engine makes one environment per row (from a factory: a zero-argument callable, as TRL's `environment_factory`)
and drives it: `reset(row)` once, with the data row, before the first turn (its text, if any, is added to the first
user turn); `step(name, arguments)` for each tool call, whose text is the tool turn; `reward(completion)` once at the
end (None: the reward functions alone score the row). `tools` are what the chat template announces; by default
`step` calls them through `call_tool`, so an environment with tools only needs to define them.

Adapters: `ToolsEnvironment(tools)` makes a list of plain functions one (stateless; what `tools=[...]` is),
`TRLEnvironment(obj)` takes an object written for TRL's `environment_factory` (its `reset(**row)`, its optional
`get_reward()` the reward, its other public methods the tools), and `WithTools(env, tools)` adds plain tools beside
an environment's own (TRL's `tools=` next to `environment_factory`). `environment_factory(x, tools)` turns either
form, or a factory of our own, into a factory. `instance` is what the factory made (the TRL object itself, not its
adapter): what reward functions read as `environments`, as TRL passes them. An environment that scores (`get_reward`,
or our `reward`) is a reward source of its own, weight 1 (`episode_rewards`), as TRL sums it with `reward_funcs`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Sequence

from qerl.tools.schema import ToolError, call_tool, tool_name, tool_schemas


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

    @property
    def instance(self) -> Any:
        """The object the factory made, as reward functions get it in `environments`: this one, for ours."""
        return self

    @property
    def scores(self) -> bool:
        """Whether `reward` scores (a subclass overrides it): the environment is then a reward source of its own."""
        return type(self).reward is not Environment.reward


class ToolsEnvironment(Environment):
    """Plain tools as an environment: no state, no reward of its own."""

    def __init__(self, tools: Sequence[Callable]):
        self._tools = tuple(tools)

    @property
    def tools(self) -> Sequence[Callable]:
        return self._tools


# The methods TRL reserves on an environment: never tools
TRL_RESERVED = ("reset", "get_reward")


class TRLEnvironment(Environment):
    """An object written for TRL's `environment_factory`: `reset(**row)` (its columns as keyword arguments, as far
    as its signature takes them), `get_reward()` (optional) its reward, and every other public method a tool."""

    def __init__(self, obj: Any):
        self.obj = obj
        self._tools = tuple(getattr(obj, name) for name in dir(type(obj))
                            if not name.startswith("_") and name not in TRL_RESERVED and callable(getattr(obj, name)))

    @property
    def instance(self) -> Any:
        return self.obj

    @property
    def scores(self) -> bool:
        return callable(getattr(self.obj, "get_reward", None))

    def reward(self, completion: Any) -> float | None:
        return self.obj.get_reward() if self.scores else None

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


class WithTools(Environment):
    """An environment with plain tools beside its own: a call of one of its own tools goes to its `step`, any other
    to the plain tools (stateless, as `tools=[...]`)."""

    def __init__(self, env: Environment, tools: Sequence[Callable]):
        self.env, self.plain = env, tuple(tools)
        self._own = {tool_name(t) for t in env.tools}

    @property
    def tools(self) -> Sequence[Callable]:
        return (*self.plain, *self.env.tools)

    @property
    def instance(self) -> Any:
        return self.env.instance

    def reset(self, row: Mapping[str, Any]) -> str | None:
        return self.env.reset(row)

    def step(self, name: str, arguments: Mapping[str, Any] | str | None) -> str:
        return self.env.step(name, arguments) if name in self._own else call_tool(self.plain, name, arguments)

    @property
    def scores(self) -> bool:
        return self.env.scores

    def reward(self, completion: Any) -> float | None:
        return self.env.reward(completion)


def episode_rewards(probe: Environment) -> Callable[..., list] | None:
    """The reward source of environments like `probe` that score, as TRL adds one for an environment with
    `get_reward`: a TRL-form reward function of `environments` (the objects the factory made, one per completion)
    and `completions`, `async def` where `get_reward` is one; None where they do not score."""
    if not probe.scores:
        return None

    def one(env: Any, completion: Any) -> Any:
        return env.reward(completion) if isinstance(env, Environment) else env.get_reward()

    if inspect.iscoroutinefunction(getattr(probe.instance, "get_reward", None)):
        async def environment_reward(environments, completions, **kwargs):
            return [await one(env, c) for env, c in zip(environments, completions)]
    else:
        def environment_reward(environments, completions, **kwargs):
            return [one(env, c) for env, c in zip(environments, completions)]
    return environment_reward


def environment_factory(spec: Sequence[Callable] | Callable[[], Any],
                        tools: Sequence[Callable] = ()) -> Callable[[], Environment]:
    """A factory of environments, one per row, from a list of tools, a factory of `Environment`s (a subclass
    itself, say) or a TRL `environment_factory` (a class whose public methods are tools); `tools`: plain tools
    beside a factory's own. Makes one instance now and checks its tools, so a factory that raises or a tool without
    hints or docstring fails at set-up in one line, not on the first tool call."""
    if isinstance(spec, (list, tuple)):
        tools = (*tools, *spec)
        tool_schemas(tools)
        return lambda: ToolsEnvironment(tools)
    if not callable(spec):
        raise ToolError(f"environment {spec!r}: expected a list of tools or a zero-argument factory")
    plain = tuple(tools)

    def make() -> Environment:
        made = spec()
        env = made if isinstance(made, Environment) else TRLEnvironment(made)
        return WithTools(env, plain) if plain else env

    try:
        probe = make()
    except Exception as e:  # noqa: BLE001 - the user's factory: its failure is a set-up error naming it
        text = " ".join(str(e).split())
        raise ToolError(f"environment {getattr(spec, '__qualname__', spec)!r}: its factory raised "
                        f"{type(e).__name__}{': ' + text if text else ''}") from None
    probe.schemas()
    return make
