"""Rows as objects (issue #61): the engine's call API lets a row wait for a tool and resume from its cache, advance by
several tokens in one step, and outlive its call (handed back unfinished, continued by a later call).

CPU: the reference engine (exact shapes, a check after every token) and the bucketed engine (buckets, compaction,
checks every 4 steps), on the small random model the engine tests build.
"""
import pytest
import torch

from qerl.rollout.engine import RolloutEngine
from qerl.rollout.generate import generate
from tests.rollout.test_speculation import ScriptedDrafts
from tests.rollout.test_engine import assert_same, prompts, tiny

ENGINES = {"reference": lambda m: RolloutEngine.reference(m),
           "bucketed": lambda m: RolloutEngine(m, check_every=4, window=8)}


@pytest.mark.parametrize("kind", list(ENGINES))
def test_a_row_waiting_for_a_tool_is_not_advanced_and_resumes_from_its_cache(kind):
    """Row 1 pauses at the first check while the others go on; it resumes with a tool's tokens, which are prefilled
    from its cache: it then continues as a fresh rollout of its prompt, its tokens and the tool's would. The others
    are what the call without the pause samples."""
    model, ps = tiny(), prompts(4)
    engine, max_new, tool = ENGINES[kind](model), 20, [11, 12, 13]
    plain = generate(model, None, ps, max_new, temperature=0, eos_token_ids=[])
    with engine.open(None, ps, max_new, temperature=0, eos_token_ids=[]) as call:
        assert call.advance()
        call.pause(1)
        paused = call.rows[1].count
        for _ in range(3):
            call.advance()
        assert call.rows[1].state.value == "waiting_for_tool" and call.rows[1].count == paused
        assert call.rows[1].slot >= 0  # its cache row is kept
        call.resume(1, tool)
        call.run()
        out = call.result()
    before = plain.completion_ids[1][:paused]
    context = ps[1] + before + tool
    rest = generate(model, None, [context], max_new - paused - len(tool), temperature=0, eos_token_ids=[])
    assert out.completion_ids[1] == before + tool + rest.completion_ids[0]
    assert out.logprobs[1][paused:paused + len(tool)].tolist() == [0.0] * len(tool)  # not sampled
    assert torch.allclose(out.logprobs[1][paused + len(tool):], rest.logprobs[0], atol=1e-5)
    others = [0, 2, 3]
    assert_same(out.select(others), plain.select(others))


@pytest.mark.parametrize("kind", list(ENGINES))
def test_rows_resumed_together_continue_as_each_alone_would(kind):
    """Three rows pause at different lengths and resume at once with tool turns of 1, 3 and 6 tokens: the bucketed
    engine prefills them in one forward (each shorter turn padded past its own slots), the exact engine one by one;
    either way each row then continues as a fresh rollout of its prompt, its tokens and its tool turn would."""
    model, ps = tiny(), prompts(6)
    engine, max_new = ENGINES[kind](model), 24
    turns = {0: [11], 2: [12, 13, 14], 5: [15, 16, 17, 18, 19, 20]}
    with engine.open(None, ps, max_new, temperature=0, eos_token_ids=[]) as call:
        assert call.advance()
        paused = {}
        for i in turns:  # at different counts: rows 0 and 2 now, row 5 a few steps later
            if i == 5:
                call.advance()
            call.pause(i)
            paused[i] = call.rows[i].count
        forwards = call.resume_rows(list(turns.items()))
        call.run()
        out = call.result()
    assert forwards == (1 if kind == "bucketed" else len(turns))
    plain = generate(model, None, ps, max_new, temperature=0, eos_token_ids=[])
    for i, tool in turns.items():
        before = plain.completion_ids[i][:paused[i]]
        rest = generate(model, None, [ps[i] + before + tool], max_new - paused[i] - len(tool), temperature=0,
                        eos_token_ids=[])
        assert out.completion_ids[i] == before + tool + rest.completion_ids[0], i
        assert torch.allclose(out.logprobs[i][paused[i] + len(tool):], rest.logprobs[0], atol=1e-5), i
    others = [1, 3, 4]
    assert_same(out.select(others), plain.select(others))


def test_a_row_advances_by_several_tokens_in_one_step():
    """With right drafts a row gains several tokens in one `advance` (one verify forward), the same tokens as greedy
    decoding."""
    model, ps = tiny(), prompts(3)
    ref = generate(model, None, ps, 16, temperature=0, eos_token_ids=[])
    drafts = ScriptedDrafts({i: ids for i, ids in enumerate(ref.completion_ids)})
    engine = RolloutEngine(model, check_every=4, window=8, speculative="on")
    with engine.open(None, ps, 16, temperature=0, eos_token_ids=[], drafts=drafts) as call:
        call.advance()  # the first check: every row goes on at its own slot
        counts = [r.count for r in call.rows]
        steps = engine.stats["verify_steps"]
        call.advance()
        assert engine.stats["verify_steps"] == steps + 1
        gained = [r.count - c for r, c in zip(call.rows, counts)]
        call.run()
        out = call.result()
    assert min(gained) >= 2, gained
    assert_same(out, ref, atol=1e-4)


@pytest.mark.parametrize("kind", list(ENGINES))
def test_a_row_handed_back_unfinished_is_continued_by_a_later_call(kind):
    """A call stopped after two checks hands back its unfinished rows; a later call (with a new prompt beside them)
    continues them: each ends as the uninterrupted call's row, token for token, its draws its own (row_seeds)."""
    model, ps = tiny(), prompts(5, seed=4)
    seeds, eos, max_new = [21, 22, 23, 24, 25], [5, 7, 11], 24
    kw = dict(temperature=1.0, eos_token_ids=eos)
    engine = ENGINES[kind](model)
    whole = engine.generate(None, ps, max_new, row_seeds=seeds, **kw)
    with engine.open(None, ps, max_new, row_seeds=seeds, **kw) as call:
        call.advance()
        call.advance()
        carried = call.hand_back()
        first = call.result()
    index = [i for i, r in enumerate(first.stop_reasons) if r == "cut"]
    assert index and len(carried) == len(index)
    for i, row in zip(index, carried):  # the tokens so far go with the row
        assert first.completion_ids[i] == row.earlier == whole.completion_ids[i][:len(row.earlier)]
    new_prompt = prompts(1, seed=9)
    with engine.open(None, new_prompt, max_new, row_seeds=[77], carried=carried, **kw) as later:
        later.run()
        then = later.result()
    assert_same(then.select(range(1, 1 + len(index))), whole.select(index))
    assert_same(then.select([0]), engine.generate(None, new_prompt, max_new, row_seeds=[77], **kw))


def test_the_sampling_kernels_keys_take_each_rows_own_step():
    """On CUDA a carried row draws the kernel keys of its own completion index (its earlier calls' tokens counted):
    a tensor of steps gives each row the key the int step gives it, so a continued row reuses no key."""
    from qerl.rollout.sampling import step_keys

    seeds = torch.tensor([0, 5, 2**62 + 7, 123456789])
    offsets = torch.tensor([0, 3, 17, 2**40])
    for step in (0, 1, 9):
        own = step_keys(seeds, offsets + step)
        assert [int(k) for k in own] == [int(step_keys(seeds[i:i + 1], int(o) + step)) for i, o in enumerate(offsets)]
