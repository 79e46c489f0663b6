"""Tools as TRL takes them (qerl.tools.schema, .environment, .interpreter): schemas from hints and docstrings, one-line
errors naming the function, tool calls whose every failure is text for the model, environments per row."""

from __future__ import annotations

import json
import sys

import pytest

from qerl.data.rewards import is_async
from qerl.tools import (Environment, SandboxLimits, ToolError, ToolsEnvironment, TRLEnvironment, call_tool,
                        environment_factory, episode_rewards, make_python_interpreter, python_interpreter, tool_schema,
                        tool_schemas)


def get_weather(city: str, days: int = 1, metric: bool = True) -> str:
    """Weather forecast for a city.

    Args:
        city: The city's name, e.g. "Paris".
        days: How many days ahead.
        metric: Celsius rather than Fahrenheit.
    """
    return f"{city}: sunny for {days} day(s), {'20 C' if metric else '68 F'}"


def no_hint(city) -> str:
    """Weather.

    Args:
        city: The city.
    """
    return city


def no_docstring(city: str) -> str:
    return city


def undocumented_argument(city: str, days: int) -> str:
    """Weather.

    Args:
        city: The city.
    """
    return city


def failing(x: int) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"boom on {x}\nsecond line")


def exiting() -> str:
    """Calls sys.exit."""
    sys.exit(3)


def returns_a_list(n: int) -> list:
    """The first n squares.

    Args:
        n: How many.
    """
    return [i * i for i in range(n)]


def test_a_schema_comes_from_the_hints_and_the_docstring():
    assert tool_schema(get_weather) == {"type": "function", "function": {
        "name": "get_weather", "description": "Weather forecast for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": 'The city\'s name, e.g. "Paris".'},
            "days": {"type": "integer", "description": "How many days ahead."},
            "metric": {"type": "boolean", "description": "Celsius rather than Fahrenheit."}},
            "required": ["city"]},
        "return": {"type": "string"}}}


@pytest.mark.parametrize("tool,why", [
    (no_hint, "Argument city is missing a type hint"),
    (no_docstring, "has no docstring"),
    (undocumented_argument, "no description for the argument 'days'"),
])
def test_a_function_that_is_no_tool_is_one_line_naming_it(tool, why):
    with pytest.raises(ToolError) as e:
        tool_schema(tool)
    message = str(e.value)
    assert "\n" not in message and why in message
    assert message.startswith(f"tool {tool.__name__} (tests.test_tools:{tool.__name__}): ")


def test_two_tools_of_one_name_are_refused_naming_both():
    def get_weather(city: str) -> str:
        """Another.

        Args:
            city: The city.
        """
        return city

    with pytest.raises(ToolError, match=r"^two tools are named 'get_weather': tests.test_tools:get_weather and "
                                        r"tests.test_tools:test_two_tools.*<locals>.get_weather$"):
        tool_schemas([globals()["get_weather"], get_weather])


def test_a_call_returns_the_tools_text():
    assert call_tool([get_weather], "get_weather", {"city": "Oslo", "days": 2}) == "Oslo: sunny for 2 day(s), 20 C"
    assert call_tool([get_weather], "get_weather", '{"city": "Oslo", "metric": false}') == \
        "Oslo: sunny for 1 day(s), 68 F"  # arguments as the JSON text of a tool call
    assert call_tool([returns_a_list], "returns_a_list", {"n": 3}) == "[0, 1, 4]"


@pytest.mark.parametrize("name,arguments,error", [
    ("get_wether", {"city": "Oslo"}, "Error: unknown tool 'get_wether'; the tools are: failing, get_weather"),
    ("get_weather", {}, "Error: tool get_weather: missing a required argument: 'city'"),
    ("get_weather", {"city": "Oslo", "country": "NO"}, "Error: tool get_weather: got an unexpected keyword argument "
                                                       "'country'"),
    ("get_weather", {"city": "Oslo", "days": "two"}, "Error: tool get_weather: argument 'days' must be integer, got "
                                                     "str 'two'"),
    ("get_weather", {"city": "Oslo", "days": True}, "Error: tool get_weather: argument 'days' must be integer, got "
                                                    "bool True"),
    ("get_weather", '{"city": "Oslo"', "Error: tool get_weather: arguments are not valid JSON"),
    ("get_weather", '["Oslo"]', "Error: tool get_weather: arguments must be a JSON object of named arguments, "
                                "got ['Oslo']"),
    ("failing", {"x": 1}, "Error: tool failing raised RuntimeError: boom on 1 second line"),
])
def test_every_failure_of_a_call_is_one_error_text_for_the_model(name, arguments, error):
    result = call_tool([get_weather, failing], name, arguments)
    assert result.startswith(error) and "\n" not in result


def test_a_tool_that_exits_does_not_end_the_rollout():
    assert call_tool([exiting], "exiting", None) == "Error: tool exiting raised SystemExit: 3"


def test_an_interrupt_still_stops():
    def interrupted() -> str:
        """Ctrl-C while the tool runs."""
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        call_tool([interrupted], "interrupted", {})


def test_the_python_interpreter_is_a_tool_whose_description_states_its_limits():
    schema = tool_schema(python_interpreter)["function"]
    assert schema["name"] == "python_interpreter"
    assert schema["parameters"]["required"] == ["code"]
    assert "Limits: 10 s, 512 MiB of memory, 16 KiB of output." in schema["description"]
    small = make_python_interpreter(SandboxLimits(wall_s=2, memory_mib=256, output_bytes=2048), site_packages=False)
    description = tool_schema(small)["function"]["description"]
    assert "Limits: 2 s, 256 MiB of memory, 2 KiB of output." in description
    assert "Only the standard library" in description


def test_the_python_interpreter_runs_a_models_call():
    assert call_tool([python_interpreter], "python_interpreter", json.dumps({"code": "print(sum(range(10)))"})) == "45"
    result = call_tool([python_interpreter], "python_interpreter", {"code": "print(1)\nprint(undefined)"})
    assert result.startswith("1\nTraceback") and result.endswith("NameError: name 'undefined' is not defined")


class Counter(Environment):
    """A stateful environment of our own: a counter per row, rewarded for reaching the row's target."""

    def reset(self, row):
        self.value, self.target = 0, row["target"]
        return f"Reach {self.target}."

    @property
    def tools(self):
        return [self.add]

    def add(self, n: int) -> str:
        """Add to the counter.

        Args:
            n: How much to add.
        """
        self.value += n
        return str(self.value)

    def reward(self, completion):
        return float(self.value == self.target)


def test_an_environment_keeps_state_per_row_and_rewards_at_the_end():
    make = environment_factory(Counter)
    first, second = make(), make()
    assert first.reset({"target": 3, "prompt": "..."}) == "Reach 3."
    second.reset({"target": 5})
    assert first.schemas()[0]["function"]["name"] == "add"
    assert [first.step("add", {"n": 2}), first.step("add", '{"n": 1}'), second.step("add", {"n": 1})] == ["2", "3", "1"]
    assert (first.reward("done"), second.reward("done")) == (1.0, 0.0)
    assert first.step("sub", {"n": 1}) == "Error: unknown tool 'sub'; the tools are: add"


def test_plain_tools_are_an_environment():
    env = environment_factory([get_weather, python_interpreter])()
    assert isinstance(env, ToolsEnvironment)
    assert env.reset({"prompt": "x"}) is None and env.reward("anything") is None
    assert [s["function"]["name"] for s in env.schemas()] == ["get_weather", "python_interpreter"]
    assert env.step("get_weather", {"city": "Rome"}) == "Rome: sunny for 1 day(s), 20 C"


class IncrementEnv:
    """Written for TRL's environment_factory: reset(**row), public methods are the tools."""

    def __init__(self):
        self._counter = 0

    def reset(self, start: int = 0, **kwargs) -> None:
        self._counter = start

    def increment(self, a: int) -> int:
        """Increment the integer by a specified value.

        Args:
            a: The value to increment by.
        """
        self._counter += a
        return self._counter


def test_a_trl_environment_factory_runs_unchanged():
    env = environment_factory(IncrementEnv)()
    assert isinstance(env, TRLEnvironment)
    assert env.reset({"start": 10, "prompt": "Increment by one."}) is None
    assert [s["function"]["name"] for s in env.schemas()] == ["increment"]
    assert env.step("increment", {"a": 1}) == "11"


class ScoredIncrementEnv(IncrementEnv):
    """TRL's environment with its reserved `get_reward` (no tool: it has no docstring to be one)."""

    def get_reward(self):
        return float(self._counter)


def test_a_trl_environments_get_reward_is_its_reward_and_plain_tools_sit_beside_its_own():
    env = environment_factory(ScoredIncrementEnv, tools=[get_weather])()
    env.reset({"start": 1})
    assert [s["function"]["name"] for s in env.schemas()] == ["get_weather", "increment"]
    assert env.step("increment", {"a": 2}) == "3" and env.step("get_weather", {"city": "Rome"}).startswith("Rome")
    assert env.step("get_reward", {}).startswith("Error: unknown tool 'get_reward'")
    assert env.reward("done") == 3.0
    assert isinstance(env.instance, ScoredIncrementEnv) and env.instance._counter == 3  # what reward functions see
    with pytest.raises(ToolError, match="two tools are named 'increment'"):
        environment_factory(ScoredIncrementEnv, tools=[ScoredIncrementEnv().increment])


def test_an_environment_that_scores_is_a_reward_source_of_its_own_sync_or_async():
    import asyncio

    class AsyncScored(IncrementEnv):
        async def get_reward(self):
            return float(self._counter)

    assert episode_rewards(environment_factory(IncrementEnv)()) is None  # no get_reward: no reward of its own
    assert episode_rewards(environment_factory([get_weather])()) is None
    envs = [environment_factory(ScoredIncrementEnv)() for _ in range(2)]
    for n, env in enumerate(envs):
        env.reset({"start": n})
    reward = episode_rewards(envs[0])
    assert reward(environments=[e.instance for e in envs], completions=["a", "b"]) == [0.0, 1.0]
    made = [environment_factory(AsyncScored)() for _ in range(2)]
    made[1].reset({"start": 4})
    reward = episode_rewards(made[0])
    assert is_async(reward)  # run with the other async rewards, on their event loop
    assert asyncio.run(reward(environments=[e.instance for e in made], completions=["a", "b"])) == [0.0, 4.0]
    ours = [environment_factory(Counter)() for _ in range(2)]  # our own Environment's reward(completion)
    ours[0].reset({"target": 0})
    ours[1].reset({"target": 1})
    assert episode_rewards(ours[0])(environments=[e.instance for e in ours], completions=["", ""]) == [1.0, 0.0]


def test_a_factory_that_raises_fails_at_set_up_in_one_line():
    def broken():
        raise RuntimeError("no\nsimulator")

    with pytest.raises(ToolError, match=r"^environment '.*broken': its factory raised RuntimeError: no simulator$"):
        environment_factory(broken)


def test_an_environment_whose_tool_has_no_docstring_fails_at_set_up():
    class Bad:
        def reset(self, **row):
            pass

        def look(self, where: str) -> str:
            return where

    with pytest.raises(ToolError, match=r"^tool look \(tests.test_tools:.*Bad.look\): Cannot generate JSON schema"):
        environment_factory(Bad)
    with pytest.raises(ToolError, match="^tool no_docstring"):
        environment_factory([no_docstring])
