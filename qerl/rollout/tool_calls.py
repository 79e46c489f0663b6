"""Tool calls in a model's own words: where one ends, what it asks for, how its answer goes back into the chat.

A tool is a plain Python callable with type hints and a docstring, called with the keyword arguments of the model's
call and returning a str (as TRL's `tools=[...]`; `qerl.tools` owns what a tool is: its schema, and running one call
with every failure made an error text for the model). Params name them as `module:function` (`load_tools`), as they
name reward functions (one resolver for both: `qerl.plugins`).

The format is Hermes' (Qwen2.5, Qwen3 and Hermes models are trained on it; their chat templates write it):

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

A model family whose template has no tool-call format of its own (SmolLM2's: it renders every role the same way)
gets the same tag, documented in the README, which its system prompt must then teach. A row stops at the first
`</tool_call>` of its turn (one call per turn; the answer comes back before it goes on). The tool turn is what the
model's chat template writes between an assistant message and the next assistant generation with a tool message in
between (`ToolTurn.from_template`: the template rendered with and without it, the difference taken), so the
continuation reads what the model would see in a real chat.
"""
from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qerl.plugins import resolve_callable
from qerl.rollout.rows import ToolStop
from qerl.tools.schema import call_tool as run_tool

__all__ = ["ToolCallFormat", "ToolTurn", "load_tools", "call_tool", "parse_call", "format_of", "HERMES"]

_REPLY, _ANSWER = "\x00QERL_REPLY\x00", "\x00QERL_TOOL_ANSWER\x00"  # markers no template writes itself


@dataclass(frozen=True)
class ToolCallFormat:
    """A tool call written as `open` JSON `close`: {"name": ..., "arguments": {...}} (arguments may also be a JSON
    string of the object, as some models write it)."""

    open: str = "<tool_call>"
    close: str = "</tool_call>"

    def stop(self, tokenizer: Any) -> ToolStop:
        """Where a row's turn ends with a tool call, for this tokenizer: only tokens whose text holds the closing
        tag's last character can complete it (a cheap filter: most tokens then cost no decode)."""
        return ToolStop(self.close, _holding(tokenizer, self.close[-1]), window=len(self.close) + 8,
                        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False))

    def parse(self, text: str) -> tuple[str, dict[str, Any]]:
        """(name, arguments) of the last call in `text` (a turn ending with the closing tag); ValueError saying what
        is wrong with it otherwise (the model gets that as the tool's answer)."""
        end = text.rfind(self.close)
        start = text.rfind(self.open, 0, end if end >= 0 else len(text))
        if end < 0 or start < 0:
            raise ValueError(f"a tool call is written {self.open}{{\"name\": ..., \"arguments\": {{...}}}}{self.close}")
        body = text[start + len(self.open):end].strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            raise ValueError(f"the tool call is not JSON ({e.msg} at character {e.pos})") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError('the tool call needs a "name" (a string) and "arguments" (an object)')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise ValueError('"arguments" is a string that is not a JSON object') from None
        if not isinstance(arguments, dict):
            raise ValueError('"arguments" must be an object of keyword arguments')
        return call["name"], arguments


HERMES = ToolCallFormat()

_HOLDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {character: the ids holding it}


def _holding(tokenizer: Any, char: str) -> frozenset[int]:
    """The ids whose vocabulary piece holds `char`, kept per tokenizer (reading a 150k vocabulary takes ~0.1 s, which
    every step's rollout would pay again)."""
    try:
        known = _HOLDING.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that takes no weak reference
        known = {}
    if char not in known:
        try:
            pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        except AttributeError:  # a tokenizer without a vocabulary view: every id decoded once
            pieces = [tokenizer.decode([i]) for i in range(len(tokenizer))]
        known[char] = frozenset(i for i, p in enumerate(pieces) if p is not None and char in p)
    return known[char]


def parse_call(fmt: ToolCallFormat, text: str) -> tuple[str, dict[str, Any]] | str:
    """(name, arguments) of the tool call that ends `text`, or the one-line error the model gets for a malformed
    one (qerl.tools' convention: "Error: ...")."""
    try:
        return fmt.parse(text)
    except ValueError as e:
        return f"Error: {e}"


def call_tool(tools: dict[str, Callable[..., Any]], fmt: ToolCallFormat, text: str) -> str:
    """The answer the model gets to the tool call that ends `text`: the tool's result as text, or a one-line error (a
    malformed call here; an unknown tool, bad arguments or a tool that raises in `qerl.tools.call_tool`, which runs
    it): the rollout goes on either way."""
    call = parse_call(fmt, text)
    if isinstance(call, str):
        return call
    return run_tool(list(tools.values()), *call)


@dataclass(frozen=True)
class ToolTurn:
    """What follows a tool call in the token stream up to the next assistant generation: `before` + the tool's
    answer + `after` (e.g. Qwen2.5: `<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n` ... `\\n</tool_response>
    <|im_end|>\\n<|im_start|>assistant\\n`)."""

    before: str
    after: str

    def tokens(self, tokenizer: Any, answer: str) -> list[int]:
        return tokenizer.encode(self.before + answer + self.after, add_special_tokens=False)

    @classmethod
    def from_template(cls, tokenizer: Any) -> "ToolTurn":
        """The glue of `tokenizer`'s chat template: a conversation rendered once ending with an assistant reply and
        once with a tool message after it and the generation prompt; the end of the reply and the difference are
        the glue around the tool's answer."""
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template to render a tool turn with")
        reply = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _REPLY}]
        answered = reply + [{"role": "tool", "content": _ANSWER}]
        plain = tokenizer.apply_chat_template(reply, tokenize=False)
        full = tokenizer.apply_chat_template(answered, tokenize=False, add_generation_prompt=True)
        if not full.startswith(plain) or _ANSWER not in full[len(plain):] or _REPLY not in plain:
            raise ValueError("the chat template renders an assistant reply differently once a tool message follows "
                             "it: qerl cannot tell the tool turn's tokens")
        before, after = full[len(plain):].split(_ANSWER)
        return cls(plain[plain.index(_REPLY) + len(_REPLY):] + before, after)


def format_of(tokenizer: Any) -> ToolCallFormat:
    """The tool-call format of the model family: Hermes' where its chat template writes `<tool_call>` (Qwen2.5,
    Qwen3, Hermes); the same tag, as qerl's documented default, for a template with none of its own (SmolLM2's).
    (Other families' own formats, Llama 3.1's `<|python_tag|>` or Mistral's `[TOOL_CALLS]`, are not read yet: such
    a model must be taught the tag by its system prompt.)"""
    return HERMES


def load_tools(specs: list[str]) -> dict[str, Callable[..., Any]]:
    """`module:function` (or `path/to/file.py:function`) names -> {the function's name: the function}; ValueError
    naming the first that does not resolve to a callable (`qerl.plugins`), or two tools of one name."""
    tools: dict[str, Callable[..., Any]] = {}
    for spec in specs:
        fn = resolve_callable(spec, "tool")
        name = getattr(fn, "__name__", spec.rpartition(":")[2])
        if name in tools:
            raise ValueError(f"tool {spec!r}: a second tool named {name!r} (the model calls tools by name)")
        tools[name] = fn
    return tools
