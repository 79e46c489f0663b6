"""Tools a model calls during multi-turn rollouts, written as TRL takes them: plain Python functions with type hints
and a Google-style docstring, called with keyword arguments parsed from the model's tool call, returning text.

Owns `schema` (a tool's JSON schema for the chat template, made by transformers' `get_json_schema`, and
`call_tool`, which runs one call and turns any failure into an error text for the model), `sandbox` (untrusted
Python in a confined process per call: limits, namespaces, Landlock, an audit hook; `sandbox_child` is the program
it starts, standard library only), `interpreter` (the `python_interpreter` tool over the sandbox) and `environment`
(the per-row state of tool calls: reset per prompt, step per call, a reward at the end, as TRL's
`environment_factory`).

May import: qerl (nothing of it: the sandbox's child runs apart from qerl, and the rest needs none of it).
"""

from qerl.tools.environment import (Environment, ToolsEnvironment, TRLEnvironment, WithTools, environment_factory,
                                    episode_rewards)
from qerl.tools.interpreter import make_python_interpreter, python_interpreter
from qerl.tools.sandbox import SandboxLimits, SandboxResult, isolation_layers, run_python
from qerl.tools.schema import ToolError, call_tool, tool_name, tool_schema, tool_schemas

__all__ = ["Environment", "SandboxLimits", "SandboxResult", "ToolError", "ToolsEnvironment", "TRLEnvironment",
           "call_tool", "environment_factory", "isolation_layers", "make_python_interpreter", "python_interpreter",
           "run_python", "tool_name", "tool_schema", "tool_schemas", "WithTools", "episode_rewards"]
