"""Tool calls in a model's own words (issue #64): the Hermes format parsed (and every way a call can be wrong, as
an answer for the model), the tool turn's glue read off real chat templates, tools named as module:function."""
import pytest

from qerl.rollout.tool_calls import HERMES, ToolCallFormat, ToolTurn, call_tool, format_of, load_tools


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def test_a_hermes_call_parses_with_arguments_as_an_object_or_a_json_string():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert HERMES.parse(text) == ("add", {"a": 1, "b": 2})
    assert HERMES.parse('<tool_call>{"name": "add", "arguments": "{\\"a\\": 4}"}</tool_call>') == ("add", {"a": 4})
    assert HERMES.parse('<tool_call>{"name": "now"}</tool_call>') == ("now", {})
    earlier = '<tool_call>{"name": "x", "arguments": {}}</tool_call> then <tool_call>{"name": "add"}</tool_call>'
    assert HERMES.parse(earlier)[0] == "add"  # the call that ended the turn


@pytest.mark.parametrize("text, error", [
    ("no tag</tool_call>", "Error: a tool call is written <tool_call>"),
    ("<tool_call>{oops</tool_call>", "Error: the tool call is not JSON"),
    ('<tool_call>["add"]</tool_call>', 'Error: the tool call needs a "name"'),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', 'Error: "arguments" must be an object'),
    ('<tool_call>{"name": "sub", "arguments": {}}</tool_call>', "Error: unknown tool 'sub'; the tools are: add"),
    ('<tool_call>{"name": "add", "arguments": {"c": 1}}</tool_call>', "Error: tool add: "),  # qerl.tools' check
])
def test_a_wrong_call_is_answered_with_a_one_line_error(text, error):
    """Malformed calls are ours to answer; what the tool makes of a call, qerl.tools.call_tool's."""
    answer = call_tool({"add": add}, HERMES, text)
    assert answer.startswith(error) and "\n" not in answer


def test_a_tools_result_is_its_str():
    assert call_tool({"add": add}, HERMES, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>') \
        == "5"


def test_the_stop_filter_keeps_only_tokens_that_can_end_the_tag(smollm2_tokenizer):
    """SmolLM2 (49,152 tokens): a few hundred can end '</tool_call>' (their text holds '>'), and the tag is found
    in a turn's decoded tokens, at the token that completes it."""
    stop = HERMES.stop(smollm2_tokenizer)
    assert 0 < len(stop.candidates) < 2000
    ids = smollm2_tokenizer.encode('Sure. <tool_call>{"name": "add", "arguments": {}}</tool_call>',
                                   add_special_tokens=False)
    ends = [k for k in range(1, len(ids) + 1) if stop.completes(ids[:k])]
    assert ends and ends[0] == len(ids) and ids[-1] in stop.candidates


def test_smollm2s_template_has_no_tool_format_its_tool_turn_is_a_tool_message(smollm2_tokenizer):
    assert format_of(smollm2_tokenizer) is HERMES  # the documented tag
    turn = ToolTurn.from_template(smollm2_tokenizer)
    assert turn == ToolTurn("<|im_end|>\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")
    ids = turn.tokens(smollm2_tokenizer, "5")
    assert smollm2_tokenizer.decode(ids) == "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


# Qwen2.5-Instruct's chat template, its tool-message and generation-prompt branches (the rest abridged)
QWEN25 = """{%- for message in messages %}
{%- if message.role == "user" or message.role == "system" or message.role == "assistant" %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


def test_qwens_tool_turn_is_a_tool_response_in_a_user_turn(smollm2_tokenizer):
    import copy

    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = QWEN25
    turn = ToolTurn.from_template(tokenizer)
    assert turn == ToolTurn("<|im_end|>\n<|im_start|>user\n<tool_response>\n",
                            "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_writes_a_reply_differently_before_a_tool_message_is_refused(smollm2_tokenizer):
    import copy

    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}{% endif %}"
                               "{% if loop.last %}.{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="renders an assistant reply differently"):
        ToolTurn.from_template(tokenizer)


def test_tools_load_as_module_function_and_bad_names_are_refused_naming_them():
    assert load_tools(["tests.rollout.test_tool_calls:add"]) == {"add": add}
    for spec, match in [("add", "name it as 'package.module:function'"),
                        ("tests.nowhere:add", "cannot import module 'tests.nowhere'"),
                        ("tests.rollout.test_tool_calls:missing", "is missing"),
                        ("tests.rollout.test_tool_calls:QWEN25", "is not callable")]:
        with pytest.raises(ValueError, match=match):
            load_tools([spec])
    with pytest.raises(ValueError, match="a second tool named 'add'"):
        load_tools(["tests.rollout.test_tool_calls:add"] * 2)


def test_a_format_of_other_tags():
    fmt = ToolCallFormat(open="[CALL]", close="[/CALL]")
    assert fmt.parse('[CALL]{"name": "f", "arguments": {"x": 1}}[/CALL]') == ("f", {"x": 1})
