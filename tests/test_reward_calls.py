"""Reward functions in TRL's form beside qerl's: told apart by signature, called once per batch with TRL's arguments,
async ones together, None rows left out, each within its budget, every failure one line; TRL's documented examples
train unchanged, and a run a reward failed resumes from its last checkpoint."""

import asyncio
import json
import logging
import signal
import threading
import time

import pytest
import torch

from qerl.config import settings_from_dict
from qerl.data.problems import SYSTEM_PROMPT, build_prompt
from qerl.data.rewards import reward_form, reward_terms
from qerl.params_yaml import ConfigError
from qerl.rl.reward_calls import RewardCalls, RewardFailed, RewardInputs, TrainerState
from tests.test_trainer import make_trainer, tiny_settings

HERE = "tests.test_reward_calls"


def calls(specs: dict, timeout_s=5.0, forms=None) -> RewardCalls:
    return RewardCalls(reward_terms(specs, forms), timeout_s)


def rows(n: int = 4, step: int = 0, **columns) -> RewardInputs:
    texts = [f"answer {i}" for i in range(n)]
    return RewardInputs(prompts=[f"prompt {i // 2}" for i in range(n)], completions=list(texts), texts=texts,
                        golds=[str(i) for i in range(n)], completion_ids=[[1] * (i + 1) for i in range(n)],
                        columns={k: list(v) for k, v in columns.items()}, trainer_state=TrainerState(step, 10),
                        questions=[f"What is {i // 2} + 1?" for i in range(n)])


# -- functions the tests name as module:function ------------------------------------------------------------------

def legacy(completion, gold):
    return float(completion.endswith(gold))


def by_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def sees_everything(prompts, completions, completion_ids, trainer_state, topic, **kwargs):
    """Echoes what it was given into SEEN, for the test to read."""
    SEEN.update(prompts=prompts, completions=completions, completion_ids=completion_ids, step=trainer_state.global_step,
                topic=topic, kwargs=sorted(kwargs))
    return [1.0] * len(completions)


SEEN: dict = {}


def names_its_arguments(completions, topic):  # no **kwargs: only what it names
    return [float(t == "math") for t in topic]


def math_only(completions, topic, **kwargs):  # TRL's example 4: None where the task is not its own
    return [1.0 if t == "math" else None for t in topic]


def code_only(completions, topic, **kwargs):
    return [2.0 if t == "code" else None for t in topic]


def never_applies(completions, **kwargs):
    return [None] * len(completions)


def one_value(completions, **kwargs):
    return [1.0]


def a_string(completions, **kwargs):
    return [1.0, "high", 1.0, 1.0]


def a_nan(completions, **kwargs):
    return [1.0, 1.0, float("nan"), 1.0]


def not_a_list(completions, **kwargs):
    return 1.0


def a_tensor(completions, **kwargs):
    return torch.tensor([0.5] * len(completions))


def raises(completions, **kwargs):
    return [1 / 0 for _ in completions]


STARTED = threading.Event()  # set by notes_its_cancel once it runs


def raises_once_the_other_runs(completions, **kwargs):
    """Fails only once the async reward is running: cancelling one that has not started is no test of cancelling."""
    assert STARTED.wait(30)
    return [1 / 0 for _ in completions]


def legacy_raises_on_row_2(completion, gold):
    if gold == "2":
        raise KeyError("no such answer")
    return 0.0


RELEASE = threading.Event()  # set at each test's end: a hung reward thread returns


def hangs(completions, **kwargs):
    RELEASE.wait(30)
    return [0.0] * len(completions)


def uses_a_signal_alarm(completions, **kwargs):  # as math-verify's parse and verify do by default
    old = signal.signal(signal.SIGALRM, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, old)
    return [1.0] * len(completions)


def captures(prompts, completions, **kwargs):
    SEEN.update(prompts=prompts, completions=completions)
    return [0.0] * len(completions)


def math_verify_accuracy(completions, gold, **kwargs):  # as open-r1 wrote it: math-verify's default timeouts
    from math_verify import parse, verify

    return [float(verify(parse(f"${g}$"), parse(c))) for c, g in zip(completions, gold)]


MET: dict = {}


async def meets_the_other(completions, **kwargs):
    """Returns only once `waits_for_the_other` runs too: run one after the other, both would time out."""
    MET.setdefault("first", asyncio.Event()).set()
    await asyncio.wait_for(MET.setdefault("second", asyncio.Event()).wait(), 3)
    return [1.0] * len(completions)


async def waits_for_the_other(completions, **kwargs):
    MET.setdefault("second", asyncio.Event()).set()
    await asyncio.wait_for(MET.setdefault("first", asyncio.Event()).wait(), 3)
    return [2.0] * len(completions)


async def sleeps_long(completions, **kwargs):
    await asyncio.sleep(30)
    return [0.0] * len(completions)


async def notes_its_cancel(completions, **kwargs):
    STARTED.set()
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        MET["cancelled"] = True
        raise
    return [0.0] * len(completions)


async def blocks_its_loop(completions, **kwargs):
    RELEASE.wait(30)  # a sync call inside an async def: the loop cannot cancel it
    return [0.0] * len(completions)


@pytest.fixture(autouse=True)
def released():
    RELEASE.clear()
    STARTED.clear()
    MET.clear()
    yield
    RELEASE.set()


# -- the form -----------------------------------------------------------------------------------------------------

def test_the_form_is_told_by_signature_or_declared():
    assert reward_form(legacy, "x") == "qerl"
    assert reward_form(lambda completion, gold="": 0.0, "x") == "qerl"  # as the built-in format reward
    assert reward_form(by_length, "x") == "trl"
    assert reward_form(lambda prompts, completions: [], "x") == "trl"  # `completions`, no **kwargs
    assert reward_form(lambda **kwargs: [], "x") == "trl"  # **kwargs, no `completions`
    with pytest.raises(ValueError, match=r"reward 'x': its signature \(text\) is neither TRL's .* declare its form "
                                         r"in train.reward_forms \(x: trl or qerl\)"):
        reward_form(lambda text: 0.0, "x")
    terms = reward_terms({f"{HERE}:legacy": 1.0, "accuracy": 0.5}, {f"{HERE}:legacy": "trl"})
    assert [(t.form, t.label, t.weight) for t in terms] == [("trl", "legacy", 1.0), ("qerl", "accuracy", 0.5)]


def test_the_params_check_the_forms_before_anything_loads():
    base = {"train": {"rewards": {f"{HERE}:legacy": 1.0}}}
    assert settings_from_dict(base).train.reward_timeout_s == 60.0
    with pytest.raises(ConfigError, match=r"train.reward_forms = \{'accuracy': 'trl'\}: reward_forms names 'accuracy'"
                                          r", which rewards does not hold"):
        settings_from_dict({"train": {**base["train"], "reward_forms": {"accuracy": "trl"}}})
    with pytest.raises(ConfigError, match=r"reward_forms.tests.test_reward_calls:legacy = 'batch': expected one of "
                                          r"'qerl', 'trl'"):
        settings_from_dict({"train": {**base["train"], "reward_forms": {f"{HERE}:legacy": "batch"}}})
    with pytest.raises(ConfigError, match=r"^params: train.rewards = \{'math:floor': 1.0\}: reward 'math:floor': its "
                                          r"signature \(x, /\) is neither TRL's"):
        settings_from_dict({"train": {"rewards": {"math:floor": 1.0}}})
    with pytest.raises(ConfigError, match=r"train.rewards = .*an async def reward takes TRL's form"):
        settings_from_dict({"train": {"rewards": {f"{HERE}:sleeps_long": 1.0},
                                      "reward_forms": {f"{HERE}:sleeps_long": "qerl"}}})
    with pytest.raises(ConfigError, match=r"train.reward_timeout_s = 0.0: must be > 0"):
        settings_from_dict({"train": {"reward_timeout_s": 0}})
    assert settings_from_dict({"train": {"reward_timeout_s": None}}).train.reward_timeout_s is None


# -- the call -----------------------------------------------------------------------------------------------------

def test_trl_functions_get_the_batch_every_column_and_the_step():
    scores = calls({f"{HERE}:sees_everything": 1.0})(rows(4, step=3, topic=["math", "math", "code", "code"],
                                                          answer=list("0123")))
    assert scores.total == [1.0] * 4
    assert SEEN["prompts"] == ["prompt 0", "prompt 0", "prompt 1", "prompt 1"]
    assert SEEN["completions"] == ["answer 0", "answer 1", "answer 2", "answer 3"]
    assert SEEN["completion_ids"] == [[1], [1, 1], [1, 1, 1], [1, 1, 1, 1]]
    assert SEEN["step"] == 3 and SEEN["topic"] == ["math", "math", "code", "code"]
    assert SEEN["kwargs"] == ["answer", "gold"]  # the other columns, and qerl's bare answers
    # a function without **kwargs gets only the arguments it names
    assert calls({f"{HERE}:names_its_arguments": 1.0})(rows(4, topic=["math", "x", "math", "x"])).total == [
        1.0, 0.0, 1.0, 0.0]


def test_a_missing_column_is_named_before_the_first_step():
    with pytest.raises(ValueError, match=r"reward 'tests.test_reward_calls:names_its_arguments' needs 'topic', which "
                                         r"is neither one of TRL's arguments .* nor a column of the data \(answer, "
                                         r"question\)"):
        calls({f"{HERE}:names_its_arguments": 1.0}).check_arguments(["question", "answer"])
    calls({f"{HERE}:names_its_arguments": 1.0}).check_arguments(["question", "topic"])


def test_the_legacy_form_and_a_mix_of_both_sum_their_weighted_values():
    scores = calls({f"{HERE}:legacy": 2.0, f"{HERE}:by_length": 0.5})(rows(4))
    assert scores.by_label == {"legacy": [1.0] * 4, "by_length": [8.0] * 4}
    assert scores.total == [2 * 1.0 + 0.5 * 8.0] * 4


def test_none_rows_are_left_out_of_a_function_and_rows_no_function_scores_get_0_with_a_warning(caplog):
    mix = calls({f"{HERE}:math_only": 1.0, f"{HERE}:code_only": 0.5, f"{HERE}:never_applies": 3.0})
    with caplog.at_level(logging.WARNING):
        scores = mix(rows(4, topic=["math", "code", "poetry", "math"]))
    assert scores.by_label["math_only"] == [1.0, None, None, 1.0]
    assert scores.total == [1.0, 1.0, 0.0, 1.0]  # TRL's nansum over the weighted values
    assert ("step 1: every reward function returned None for 1 of 4 completions (first: row 2 (question 'What is 1 "
            "+ 1?')); they are rewarded 0") in caplog.text


def test_async_functions_run_together():
    start = time.monotonic()
    scores = calls({f"{HERE}:meets_the_other": 1.0, f"{HERE}:waits_for_the_other": 1.0, f"{HERE}:legacy": 1.0})(
        rows(2))
    assert scores.total == [4.0, 4.0] and time.monotonic() - start < 3


def test_outputs_are_lists_of_numbers_or_none_one_per_completion():
    assert calls({f"{HERE}:a_tensor": 1.0})(rows(4)).total == [0.5] * 4
    step = "at step 1"
    for name, message in [
            ("one_value", f"returned 1 value {step} for the step's 4 completions: expected one per completion"),
            ("a_string", f"returned 'high' \\(str\\) for row 1 \\(question 'What is 0 \\+ 1\\?'\\) {step}: expected "
                         "a number, or None where it does not apply"),
            ("a_nan", f"returned nan for row 2 \\(question 'What is 1 \\+ 1\\?'\\) {step}: expected a finite number"),
            ("not_a_list", f"returned float {step}: expected a list of 4 numbers")]:
        with pytest.raises(RewardFailed, match=f"^reward 'tests.test_reward_calls:{name}' {message}"):
            calls({f"{HERE}:{name}": 1.0})(rows(4))


def test_a_raise_names_the_function_the_row_where_known_and_the_line():
    with pytest.raises(RewardFailed, match=r"^reward 'tests.test_reward_calls:raises' raised on its batch of 4 "
                                           r"completions at step 1: ZeroDivisionError: division by zero "
                                           r"\(.*tests/test_reward_calls.py:\d+\)$"):
        calls({f"{HERE}:raises": 1.0})(rows(4))
    with pytest.raises(RewardFailed, match=r"^reward 'tests.test_reward_calls:legacy_raises_on_row_2' raised on row 2 "
                                           r"\(question 'What is 1 \+ 1\?'\) at step 1: KeyError: 'no such answer'"):
        calls({f"{HERE}:legacy_raises_on_row_2": 1.0})(rows(4))


def test_a_sync_function_over_its_budget_fails_the_step_and_its_thread_is_left_behind():
    start = time.monotonic()
    with pytest.raises(RewardFailed, match=r"^reward 'tests.test_reward_calls:hangs' did not return within "
                                           r"train.reward_timeout_s = 0.3 s at step 1 on its batch of 4 completions "
                                           r"\(its thread cannot be stopped"):
        calls({f"{HERE}:hangs": 1.0}, timeout_s=0.3)(rows(4))
    assert time.monotonic() - start < 3
    assert any(t.name == "reward hangs" and t.daemon for t in threading.enumerate())  # exits with the process


def test_an_async_function_over_its_budget_is_cancelled_and_one_blocking_its_loop_is_named():
    with pytest.raises(RewardFailed, match=r"'tests.test_reward_calls:sleeps_long' did not return within "
                                           r"train.reward_timeout_s = 0.3 s at step 1 .*\(cancelled\)"):
        calls({f"{HERE}:sleeps_long": 1.0}, timeout_s=0.3)(rows(4))
    mix = calls({f"{HERE}:blocks_its_loop": 1.0, f"{HERE}:by_length": 1.0}, timeout_s=0.3)
    with pytest.raises(RewardFailed, match=r"'tests.test_reward_calls:blocks_its_loop' did not return .* and blocked "
                                           r"its event loop \(a blocking call in an async def"):
        mix(rows(4))
    RELEASE.set()
    mix.close()


def test_a_step_a_sync_reward_failed_cancels_its_async_ones():
    mix = calls({f"{HERE}:notes_its_cancel": 1.0, f"{HERE}:raises_once_the_other_runs": 1.0})
    with pytest.raises(RewardFailed, match="ZeroDivisionError"):
        mix(rows(4))
    deadline = time.monotonic() + 5
    while "cancelled" not in MET and time.monotonic() < deadline:
        time.sleep(0.01)
    assert MET.get("cancelled")
    mix.close()


def test_math_verify_with_its_signal_timeouts_works_as_a_reward(caplog):
    pytest.importorskip("math_verify")
    inputs = rows(2)
    inputs.completions = ["The answer is $\\frac{1}{2}$", "It is $3$"]
    inputs.golds = ["0.5", "4"]
    with caplog.at_level(logging.WARNING):
        assert calls({f"{HERE}:math_verify_accuracy": 1.0})(inputs).total == [1.0, 0.0]
    assert "math_verify_accuracy' needs the main thread" in caplog.text  # it refused the worker thread


def test_a_function_that_needs_the_main_thread_is_called_there_from_then_on(caplog):
    """Signal-based timeouts (math-verify's defaults) refuse a worker thread: such a function is called again in the
    trainer's thread, as TRL calls it, with a warning once; outside the main thread that cannot help: one line."""
    mix = calls({f"{HERE}:uses_a_signal_alarm": 1.0})
    with caplog.at_level(logging.WARNING):
        assert mix(rows(2)).total == [1.0, 1.0] and mix(rows(2)).total == [1.0, 1.0]
    assert caplog.text.count("needs the main thread (a signal-based timeout inside it): it is called in the trainer's "
                             "thread from now on, without train.reward_timeout_s") == 1
    assert calls({f"{HERE}:uses_a_signal_alarm": 1.0}, timeout_s=None)(rows(2)).total == [1.0, 1.0]
    failed = []
    worker = threading.Thread(target=lambda: failed.append(pytest.raises(RewardFailed, calls(
        {f"{HERE}:uses_a_signal_alarm": 1.0}), rows(2))))
    worker.start()
    worker.join()
    assert "ValueError: signal only works in main thread" in str(failed[0].value)
    assert "(it needs the main thread, as signal-based timeouts do; the trainer runs in another thread here)" in str(
        failed[0].value)


# -- in training --------------------------------------------------------------------------------------------------

def write_rows(path, n=8):
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"question": f"What is {i}+1?", "answer": str(i + 1), "ground_truth": str(i + 1)}) + "\n")
    return path


def test_trls_documented_examples_train_unchanged(tmp_path):
    """TRL's examples (tests/trl_doc_rewards.py) in a real step: standard text, a dataset column, chat messages."""
    from tests import trl_doc_rewards as trl

    data = {"name": str(write_rows(tmp_path / "rows.jsonl")), "n": 8}
    standard = {"tests.trl_doc_rewards:reward_len": 1.0, "tests.trl_doc_rewards:reward_func": 1.0,
                "tests.trl_doc_token_rewards:reward_func": 0.1, f"{HERE}:captures": 0.0}
    with make_trainer(tiny_settings(tmp_path, data=data, train={"steps": 1, "rewards": standard,
                                                                "reward_format": "standard"}),
                      tmp_path / "standard") as trainer:
        batch = trainer.score(trainer.rollout())
        texts, golds = batch.samples.texts, [ex.columns["ground_truth"] for ex in batch.examples for _ in range(4)]
        by_length = [float(len(ids)) for ids in batch.samples.completion_ids]
        expected = [a + b + 0.1 * c for a, b, c in zip(trl.reward_len(texts), trl.reward_func(texts, golds), by_length)]
        assert batch.rewards.tolist() == pytest.approx(expected)
        assert batch.reward_terms["reward_len"].tolist() == trl.reward_len(texts)
        # standard: the prompt text the policy continued, the completion's text
        question = batch.examples[0].question
        assert SEEN["prompts"][0] == build_prompt(trainer.tokenizer, question, SYSTEM_PROMPT)
        assert SEEN["completions"] == texts
        metrics = trainer.train_step()
    assert set(metrics) >= {"rewards/reward_len/mean", "rewards/reward_len/std",
                            "rewards/tests.trl_doc_rewards.reward_func/mean",  # two functions of one name
                            "rewards/tests.trl_doc_token_rewards.reward_func/mean"}
    logged = json.loads((tmp_path / "standard" / "metrics.jsonl").read_text().splitlines()[0])
    assert logged["rewards/reward_len/mean"] == metrics["rewards/reward_len/mean"]

    # The tests' tokenizer has a chat template: TRL's conversational format, where completions are messages
    with make_trainer(tiny_settings(tmp_path, data=data, train={
            "steps": 1, "rewards": {"tests.trl_doc_rewards:format_reward_func": 1.0, "format": 1.0,
                                    f"{HERE}:captures": 0.0}}), tmp_path / "chat") as trainer:
        batch = trainer.score(trainer.rollout())
        assert SEEN["prompts"][0] == [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": batch.examples[0].question}]
        assert SEEN["completions"][0] == [{"role": "assistant", "content": batch.samples.texts[0]}]
        metrics = trainer.train_step()
    assert metrics["rewards/format_reward_func/mean"] == 0.0 and metrics["rewards/format/mean"] == 0.0


FAIL_AT_STEP: list = []  # the step at which `fails_when_asked` raises (the resumed run's is unset)


def fails_when_asked(completions, trainer_state, **kwargs):
    if trainer_state.global_step + 1 in FAIL_AT_STEP:
        raise RuntimeError("the judge is down")
    return [c.count("1") / max(len(c), 1) for c in completions]


def test_a_failing_reward_fails_its_step_in_one_line_and_the_run_resumes_from_its_last_checkpoint(tmp_path, here,
                                                                                                  finish_here):
    rewards = f"train.rewards={{'{HERE}:fails_when_asked': 1.0}}"
    finish_here(tmp_path / "full", "-S", rewards, "-S", "train.save_every=1")  # the uninterrupted run
    FAIL_AT_STEP.append(3)
    try:
        code, err = here(tmp_path / "run", "-S", rewards, "-S", "train.save_every=1")
    finally:
        FAIL_AT_STEP.clear()
    assert code == 2
    assert err.splitlines()[-1] == (
        f"tiny-trainer: error: reward '{HERE}:fails_when_asked' raised on its batch of 8 completions at step 3: "
        f"RuntimeError: the judge is down ({__file__}:{fails_when_asked.__code__.co_firstlineno + 2}); fix it and "
        "continue from step-000002 with --resume")
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-000001", "step-000002"]

    finish_here(tmp_path / "run", "--resume", "-S", rewards, "-S", "train.save_every=1")
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    from tests.test_trainer import adapter_tensors

    full, resumed = adapter_tensors(tmp_path / "full"), adapter_tensors(tmp_path / "run")
    assert all(torch.equal(full[k], resumed[k]) for k in full)
