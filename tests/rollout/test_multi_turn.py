"""Multi-turn rollouts on the engine (issue #64): a row stops at its tool call and waits while the others decode, the
tool's answer is appended as a tool turn prefilled from the row's cache, and the rollout goes on; the tokens a tool
appended are masked (log-prob 0, `generated_mask` False), and the generated tokens' log-probs are the trainer's.

CPU: the reference engine and the bucketed engine on the small random model of the engine tests, with a character
tokenizer (one token per printable character) so that a tool call is text the test can force or find.
"""
import threading
import time
from collections import Counter

import pytest
import torch
import transformers.utils  # noqa: F401  (qerl.tools reads a tool's schema through it: its first import takes
# seconds, which the first tool call of the process would otherwise pay while the other rows decode to their end)

from qerl.rollout.engine import RolloutEngine
from qerl.rollout.multi_turn import ToolUse, generate_with_tools
from qerl.rollout.tool_calls import ToolCallFormat, ToolTurn
from tests.reference import policy_logprobs
from tests.rollout.test_engine import prompts, tiny

ENGINES = {"reference": lambda m: RolloutEngine.reference(m),
           "bucketed": lambda m: RolloutEngine(m, check_every=4, window=8)}
TURN = ToolTurn("\n<tool>", "</tool>\n")  # the glue around an answer (a chat template's, in real runs)


class CharTokenizer:
    """The tiny model's 97 ids as text: 0..94 the printable ASCII characters, 95 a newline, 96 the EOS."""

    eos_token_id = 96

    def __len__(self):
        return 97

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\n" if i == 95 else "" if i == 96 else chr(32 + i) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [95 if c == "\n" else ord(c) - 32 for c in text]


TOKENIZER = CharTokenizer()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def long() -> str:
    """A long answer."""
    return "x" * 100


def forcing(scripts: dict[int, str]):
    """A logits processor making row r write scripts[r] from its first token on (the rest of its tokens sampled)."""
    ids = {r: TOKENIZER.encode(text) for r, text in scripts.items()}

    def force(logits, rows, at):
        for k, (r, i) in enumerate(zip(rows.tolist(), at.tolist())):
            if r in ids and i < len(ids[r]):
                logits[k] = -1e9
                logits[k, ids[r][i]] = 0.0
    return force


def call_text(name: str, **arguments) -> str:
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def rollout(engine, ps, max_new, use, scripts=None, **kw):
    kw = {"temperature": 1.0, "eos_token_ids": [], "row_seeds": list(range(1, len(ps) + 1)), **kw}
    return generate_with_tools(engine, TOKENIZER, ps, max_new, use,
                               logits_processor=forcing(scripts) if scripts else None, **kw)


@pytest.mark.parametrize("kind", list(ENGINES))
def test_a_row_waits_for_its_slow_tool_while_the_other_decodes_then_goes_on_after_its_answer(kind):
    """Row 0 calls a tool that sleeps 0.5 s; row 1 decodes meanwhile (the engine's steps advance during the sleep).
    The answer follows row 0's call as a tool turn (masked, log-prob 0), and row 0 decodes on after it: its tokens
    there are what a fresh rollout of its whole context samples (the cache extended, no prefix recomputed)."""
    model, ps = tiny(), prompts(2)
    engine = ENGINES[kind](model)
    seen = {}

    def slow_add(a: int, b: int) -> str:
        """Add two integers, slowly."""
        seen["steps at start"] = engine.stats["verify_steps"]
        time.sleep(0.5)
        seen["steps at end"] = engine.stats["verify_steps"]
        return str(a + b)

    script = call_text("slow_add", a=2, b=3)
    out, stats = rollout(engine, ps, 160, ToolUse({"slow_add": slow_add}, turn=TURN), {0: script})
    assert seen["steps at end"] > seen["steps at start"]  # other rows decoded during the tool's sleep
    assert stats["tool_calls"] == 1 and stats["tool_errors"] == 0 and stats["tool_seconds"] >= 0.5
    text = out.texts[0]
    answer = TURN.before + "5" + TURN.after
    assert text.startswith(script + answer) and len(text) > len(script + answer)  # the continuation
    mask, lps = out.generated_mask[0], out.logprobs[0]
    tool = slice(len(script), len(script) + len(answer))
    assert not mask[tool].any() and mask[:tool.start].all() and mask[tool.stop:].all()
    assert lps[tool].abs().max() == 0
    assert out.generated_mask[1].all() and len(out.completion_ids[1]) == 160
    context = out.prompt_ids[0] + out.completion_ids[0][:tool.stop]
    after = out.completion_ids[0][tool.stop:]
    expected = policy_logprobs(model, context, after, len(context) + len(after), 1.0)
    assert torch.allclose(lps[tool.stop:], expected, atol=1e-4)


def test_several_rows_call_their_tools_at_once():
    """Four rows' calls run concurrently: each waits at a barrier that opens only once all four are running (it
    would time out, and answer an error, if they ran one after the other); each row gets its own answer."""
    model, ps = tiny(), prompts(4)
    barrier = threading.Barrier(4, timeout=20)

    def echo(x: int) -> str:
        """Its argument back, once the other calls run too."""
        barrier.wait()
        return f"got {x}"

    scripts = {r: call_text("echo", x=r) for r in range(4)}
    out, stats = rollout(RolloutEngine.reference(model), ps, 120, ToolUse({"echo": echo}, turn=TURN), scripts)
    assert stats["tool_calls"] == 4 and stats["tool_errors"] == 0
    for r in range(4):
        assert out.texts[r].startswith(scripts[r] + TURN.before + f"got {r}" + TURN.after)


def test_the_turn_limit_ends_a_row_at_the_call_past_it():
    """max_turns 1: the first call is answered, the second ends the completion there (stop reason stop), without
    an answer; max_turns 0: the first call ends it."""
    model, ps = tiny(), prompts(1)
    none = ToolUse({"add": add}, max_turns=0, turn=TURN)
    out, stats = rollout(RolloutEngine.reference(model), ps, 200, none, {0: call_text("add", a=1, b=1)})
    assert out.texts[0] == call_text("add", a=1, b=1) and out.stop_reasons == ["stop"] and stats["tool_calls"] == 0
    first, second = call_text("add", a=1, b=1), call_text("add", a=2, b=2)
    answer = TURN.before + "2" + TURN.after
    use = ToolUse({"add": add}, max_turns=1, turn=TURN)
    out, stats = rollout(RolloutEngine.reference(model), ps, 200, use, {0: first + answer + second})
    assert out.texts[0] == first + answer + second
    assert out.stop_reasons == ["stop"] and stats["tool_calls"] == 1
    assert out.generated_mask[0].tolist() == [True] * len(first) + [False] * len(answer) + [True] * len(second)


def test_a_malformed_call_an_unknown_tool_and_a_raising_one_get_an_error_and_the_rollout_goes_on():
    model, ps = tiny(), prompts(3)

    def div(a: int, b: int) -> float:
        """a / b."""
        return a / b

    scripts = {0: "<tool_call>{oops</tool_call>", 1: call_text("nope"), 2: call_text("div", a=1, b=0)}
    out, stats = rollout(RolloutEngine.reference(model), ps, 200, ToolUse({"div": div}, turn=TURN), scripts)
    assert stats["tool_calls"] == 3 and stats["tool_errors"] == 3
    errors = ["Error: the tool call is not JSON", "Error: unknown tool 'nope'; the tools are: div",
              "Error: tool div raised ZeroDivisionError: division by zero"]
    for r, error in enumerate(errors):
        rest = out.texts[r][len(scripts[r]):]
        assert rest.startswith(TURN.before + error), rest
        assert len(out.completion_ids[r]) == 200 and out.stop_reasons[r] == "length"  # it went on to its length


def test_a_tool_past_its_time_is_answered_with_an_error():
    """The rollout ends while the tool is still blocked (it is released only afterwards): its row got an error
    string in its place and went on to its length."""
    model, ps = tiny(), prompts(1)
    release, returned = threading.Event(), []

    def stuck() -> str:
        """Never in time."""
        release.wait(30)
        returned.append(True)
        return "late"

    use = ToolUse({"stuck": stuck}, timeout_s=0.1, turn=TURN)
    out, stats = rollout(RolloutEngine.reference(model), ps, 150, use, {0: call_text("stuck")})
    assert not returned  # the tool was still running: the rollout did not wait for it
    release.set()
    assert stats["tool_timeouts"] == 1
    assert TURN.before + "Error: the tool call took longer than 0.1 s" + TURN.after in out.texts[0]
    assert "late" not in out.texts[0] and len(out.completion_ids[0]) == 150


def test_an_answer_that_does_not_fit_the_budget_ends_the_row_at_its_call():
    model, ps = tiny(), prompts(1)
    script = call_text("long")
    use = ToolUse({"long": long}, turn=TURN)
    out, _ = rollout(RolloutEngine.reference(model), ps, len(script) + 50, use, {0: script})
    assert out.texts[0] == script and out.stop_reasons == ["length"]


def test_a_rows_tokens_do_not_depend_on_how_long_the_tools_take():
    """Draws are keyed by each row's completion index: a slow tool and a fast one give every row the same tokens."""
    model, ps = tiny(), prompts(3)
    results = []
    for delay in (0.0, 0.3):
        def slow_add(a: int, b: int) -> int:
            """Add."""
            time.sleep(delay)
            return a + b
        out, _ = rollout(RolloutEngine.reference(model), ps, 90, ToolUse({"slow_add": slow_add}, turn=TURN),
                         {0: call_text("slow_add", a=1, b=2), 2: call_text("slow_add", a=3, b=4)})
        results.append(out)
    assert results[0].completion_ids == results[1].completion_ids
    assert all(torch.equal(a, b) for a, b in zip(results[0].logprobs, results[1].logprobs))


@pytest.mark.parametrize("switches", [dict(), dict(share_prompts=True), dict(pack=True),
                                      dict(share_prompts=True, pack=True)])
def test_the_generated_tokens_log_probs_are_the_trainers_recomputation(switches):
    """Nothing forced: the model's own tokens end its turns (a format whose closing tag is the character it writes
    most), the calls are malformed and answered with an error, several turns a row. The rollout's log-probs of the
    generated tokens equal the update's forward (`PolicyLogProbs` over the batch's padded layout, with shared
    prompts and packing too) within single-turn's tolerance (tests/rollout/test_generate.py's 1e-4), and the loss
    mask the update reads is 0 exactly at the tool turns."""
    from qerl.data.example import Example
    from qerl.rl.batch import RolloutBatch
    from qerl.rl.logprobs import PolicyLogProbs

    model, ps = tiny(), [p for p in prompts(2, seed=5) for _ in range(2)]  # two groups of two
    engine = RolloutEngine.reference(model)
    plain = engine.generate(TOKENIZER, ps, 60, temperature=1.0, eos_token_ids=[], row_seeds=[1, 2, 3, 4])
    common = Counter(t for c in plain.completion_ids for t in c).most_common(1)[0][0]
    fmt = ToolCallFormat(open="<", close=TOKENIZER.decode([common]))
    short = ToolTurn("[", "]")
    out, stats = rollout(engine, ps, 160, ToolUse({}, format=fmt, turn=short))
    assert stats["tool_calls"] >= 4 and any((~m).sum() > 0 for m in out.generated_mask)
    batch = RolloutBatch(examples=[Example("0", "q", "a", "plain")] * 2, group_size=2, samples=out, sigma=0.0,
                         noise_seed=0, seconds=0.0)
    t = batch.padded(pad_id=0)
    with torch.no_grad():
        logp, _ = PolicyLogProbs(model, 1.0, **switches)(t["ids"], t["attn"], t["P"], want_entropy=False)
    mask = t["mask"].bool()
    for i, (m, lp) in enumerate(zip(out.generated_mask, out.logprobs)):
        assert mask[i, :len(m)].tolist() == m.tolist() and not mask[i, len(m):].any()
        assert torch.allclose(logp[i, :len(m)][m], lp[m], atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_resumed_rows_continuation_is_the_policys_on_the_graphed_engine():
    """On CUDA (graphs, fused kernels, the verify step at one query per row, extend_row on the fused cache): a row's
    tool turn is prefilled from its cache and its continuation's log-probs are a full forward's (fp32 on the CPU) as
    closely as the rows that called nothing: the engine's Triton kernels multiply fp32 in TF32 (~1e-2 here), while
    a tool turn at wrong positions or slots would be off by the size of a log-prob."""
    import copy

    model = tiny(device="cuda")
    engine = RolloutEngine(model)
    ps = prompts(8)
    script = call_text("add", a=2, b=3)
    scripts = {r: script for r in range(0, 8, 2)}
    out, stats = rollout(engine, ps, 160, ToolUse({"add": add}, turn=TURN), scripts)
    assert stats["tool_calls"] == 4 and engine.stats["captures"] > 0
    cpu = copy.deepcopy(model).cpu()
    answer = TURN.before + "5" + TURN.after

    def gap(r: int, start: int) -> float:
        context, after = out.prompt_ids[r] + out.completion_ids[r][:start], out.completion_ids[r][start:]
        expected = policy_logprobs(cpu, context, after, len(context) + len(after), 1.0)
        return (out.logprobs[r][start:] - expected).abs().max().item()

    floor = max(gap(r, 0) for r in range(1, 8, 2))  # the rows without a call: the kernels' own rounding
    assert floor < 0.05
    for r in scripts:
        assert out.texts[r].startswith(script + answer)
        end = len(script) + len(answer)
        assert not out.generated_mask[r][len(script):end].any()
        assert gap(r, end) <= 2 * floor + 1e-3, (r, gap(r, end), floor)


@pytest.mark.parametrize("kind", list(ENGINES))
def test_rows_that_make_no_call_sample_what_a_rollout_without_tools_does(kind):
    """Rows of a call with tools draw as the lockstep phase does (each row's generator here, the kernel keyed by its
    seed and index on CUDA): without a call their tokens are a single-turn rollout's, and a row that called a tool
    does not change its neighbours' tokens."""
    model, ps = tiny(), prompts(3)
    engine = ENGINES[kind](model)
    kw = dict(temperature=0.9, top_k=40, eos_token_ids=[5, 7], row_seeds=[11, 12, 13])
    single = engine.generate(TOKENIZER, ps, 40, **kw)
    multi, stats = generate_with_tools(engine, TOKENIZER, ps, 40, ToolUse({}, turn=TURN), **kw)
    assert stats["tool_calls"] == 0 and multi.completion_ids == single.completion_ids
    assert multi.stop_reasons == single.stop_reasons
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(multi.logprobs, single.logprobs))
    called, _ = rollout(engine, ps, 120, ToolUse({"add": add}, turn=TURN),
                        {0: call_text("add", a=1, b=2)}, **kw)
    assert called.completion_ids[1:] == engine.generate(TOKENIZER, ps, 120, **kw).completion_ids[1:]


def test_each_row_has_its_own_environment_reset_with_its_data_row():
    """`ToolUse.environment` (TRL's environment_factory, through qerl.tools): one environment per row, reset with
    the row's columns before the rollout, answering that row's calls from its own state; a reset that returns text
    for the first user turn is refused before anything is sampled."""
    from qerl.tools import Environment, environment_factory

    class Counter_(Environment):
        def reset(self, row):
            self.base, self.calls = int(row["base"]), 0

        def step(self, name, arguments):
            self.calls += 1
            return f"{name}:{self.base + self.calls}"

    model, ps = tiny(), prompts(2)
    script = call_text("count") + TURN.before + "count:11" + TURN.after + call_text("count")
    use = ToolUse({}, turn=TURN, environment=environment_factory(Counter_))
    out, stats = rollout(RolloutEngine.reference(model), ps, 220, use, {0: script, 1: call_text("count")},
                         rows=[{"base": 10}, {"base": 20}])
    assert out.texts[0].startswith(script + TURN.before + "count:12" + TURN.after)  # row 0's second call
    assert out.texts[1].startswith(call_text("count") + TURN.before + "count:21" + TURN.after)
    assert stats["tool_calls"] == 3

    class Greeting(Environment):
        def reset(self, row):
            return "Hello"

    with pytest.raises(ValueError, match="its reset returned text for the first user turn"):
        rollout(RolloutEngine.reference(model), ps, 50, ToolUse({}, turn=TURN, environment=Greeting))


def test_the_params_environment_and_tools_resolve_together_into_one_tool_use(tmp_path):
    """`rollout.environment` (a file's TRL class) beside `rollout.tools`: the prompts announce both, each row's calls
    reach the environment's own tool or the plain one, and the rollout carries the rows' environments."""
    from qerl.config import settings_from_dict
    from qerl.rollout.multi_turn import tool_use_of

    path = tmp_path / "my_env.py"
    path.write_text('''
class Counter:
    def reset(self, base=0, **row):
        self.value = base

    def count(self) -> str:
        """Count one more.

        Returns:
            The count.
        """
        self.value += 1
        return str(self.value)
''')
    rollout_settings = settings_from_dict({"rollout": {"environment": f"{path}:Counter",
                                                       "tools": ["tests.test_tools:get_weather"]}}).rollout
    use = tool_use_of(rollout_settings)
    assert list(use.tools) == ["get_weather", "count"]  # plain tools first, as TRL's tools + the environment's
    use = ToolUse(use.tools, turn=TURN, environment=use.environment)
    model, ps = tiny(), prompts(2)
    weather = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    out, stats = rollout(RolloutEngine.reference(model), ps, 220, use, {0: call_text("count"), 1: weather},
                         rows=[{"base": 10}, {"base": 20}])
    assert out.texts[0].startswith(call_text("count") + TURN.before + "11" + TURN.after)
    assert out.texts[1].startswith(weather + TURN.before + "Oslo: sunny for 1 day(s), 20 C" + TURN.after)
    assert [env.instance.value for env in out.environments] == [11, 20] and stats["tool_errors"] == 0


class _FakeCall:
    """The two things `_HeldTurns` reads and does: the rows' states, and `resume_rows`."""

    def __init__(self, decoding: int, waiting: int):
        from types import SimpleNamespace

        from qerl.rollout.rows import RowState

        self.rows = [SimpleNamespace(state=RowState.DECODING) for _ in range(decoding)] + \
            [SimpleNamespace(state=RowState.WAITING_FOR_TOOL) for _ in range(waiting)]
        self.resumed: list[list] = []

    def resume_rows(self, turns):
        self.resumed.append(list(turns))
        return 1


def test_answered_tool_turns_are_held_while_rows_decode_and_prefilled_together():
    """The bucketed engine's tool-turn prefill costs one forward whatever its rows: answers are held while 16 rows
    decode until 4 are held (a quarter), or the first has waited a prefill's time, or nothing decodes; the exact
    engine's are never held."""
    from qerl.rollout.multi_turn import _HeldTurns

    stats = {"tool_turn_prefills": 0}
    held, call = _HeldTurns(batch=True), _FakeCall(decoding=16, waiting=4)
    held.prefill_s = 60.0  # a slow prefill: only the count releases here
    for i in range(3):
        held.add(i, [7])
        held.release(call, stats)
        assert call.resumed == []
    held.add(3, [8, 9])
    held.release(call, stats)
    assert call.resumed == [[(0, [7]), (1, [7]), (2, [7]), (3, [8, 9])]] and stats["tool_turn_prefills"] == 1
    held.prefill_s = 0.0  # the first held has waited as long as the last prefill took
    held.add(4, [5])
    held.release(call, stats)
    assert call.resumed[-1] == [(4, [5])]
    idle, nothing_decodes = _HeldTurns(batch=True), _FakeCall(decoding=0, waiting=2)
    idle.prefill_s = 60.0
    idle.add(0, [1])
    idle.release(nothing_decodes, stats)
    assert nothing_decodes.resumed == [[(0, [1])]]
    exact, busy = _HeldTurns(batch=False), _FakeCall(decoding=16, waiting=1)
    exact.prefill_s = 60.0
    exact.add(0, [1])
    exact.release(busy, stats)
    assert busy.resumed == [[(0, [1])]]


@pytest.mark.parametrize("kind", list(ENGINES))
def test_rows_answered_together_go_on_after_their_own_answers_in_either_engine(kind):
    """Four rows call at once and their answers come back together (a barrier): each row goes on after its own
    answer, whichever rows' turns shared a prefill (the bucketed engine's batches depend on when the answers land;
    `_HeldTurns`' rule is tested above); the exact engine prefills each turn alone."""
    model, ps = tiny(), prompts(4)
    barrier = threading.Barrier(4, timeout=20)

    def echo(x: int) -> str:
        """Its argument back, once the other calls run too."""
        barrier.wait()
        return f"got {x}"

    scripts = {r: call_text("echo", x=r) for r in range(4)}
    out, stats = rollout(ENGINES[kind](model), ps, 120, ToolUse({"echo": echo}, turn=TURN), scripts)
    assert stats["tool_calls"] == 4
    assert stats["tool_turn_prefills"] == 4 if kind == "reference" else 1 <= stats["tool_turn_prefills"] <= 4
    for r in range(4):
        assert out.texts[r].startswith(scripts[r] + TURN.before + f"got {r}" + TURN.after)
