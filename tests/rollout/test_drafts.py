"""qerl.rollout.drafts: the draft source of speculative rollouts (history, siblings, prompt, own completion), its caps,
its state through the trainer's state format, its determinism and its cost."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from qerl.rollout.drafts import DraftHistory, DraftSession

ROOT = Path(__file__).resolve().parents[2]
P, Q = [1, 2, 3], [90, 91, 92]


def test_a_sibling_drafts_what_another_row_of_its_prompt_wrote_and_the_draft_grows_with_it():
    session = DraftSession(None, [P, P, Q])
    session.extend(0, [10, 11, 12])
    session.extend(1, [10, 11])
    assert session.propose(1, 5) == [12]  # the index is built here, from what the rows have so far
    session.extend(0, [13, 14])  # indexed as it comes; the draft reads on in row 0's own list
    assert session.propose(1, 5) == [12, 13, 14]
    session.extend(0, [20, 21, 22])  # n-grams that first occur after the index was built
    session.extend(1, [12, 30, 20, 21])
    assert session.propose(1, 5) == [22]
    session.extend(2, [10, 11])  # another prompt's row: not a sibling, no draft from rows 0 and 1
    assert session.propose(2, 5) == []


def test_the_history_drafts_a_completion_from_its_first_token_and_the_most_recent_occurrence_wins():
    history = DraftHistory()
    history.add(P, [5, 6, 7, 8])
    session = DraftSession(history, [P])
    assert session.propose(0, 3) == [5, 6, 7]  # the prompt's end was followed by the earlier completion
    session.extend(0, [5, 6])
    assert session.propose(0, 5) == [7, 8]

    unbuilt = DraftSession(history, [P])
    history.add(P, [5, 6, 9])
    assert session.propose(0, 5) == [7, 8]  # a session reads the history once, when it is built,
    assert unbuilt.propose(0, 5) == [5, 6, 7, 8]  # even where it indexes it later
    newer = DraftSession(history, [P])
    assert newer.propose(0, 5) == [5, 6, 9]
    newer.extend(0, [5, 6])
    assert newer.propose(0, 5) == [9]  # (5, 6) was followed by 7, then by 9: the most recent


def test_the_prompt_drafts_its_own_repetition_down_to_n_min_tokens_only():
    prompt = [7, 3, 4, 5, 6, 8, 3, 4]  # ends with (3, 4), which occurred before; (8, 3, 4) did not
    assert DraftSession(None, [prompt]).propose(0, 3) == [5, 6, 8]
    assert DraftSession(None, [prompt], n_min=3).propose(0, 3) == []
    assert DraftSession(None, [prompt], n_max=2, n_min=2).propose(0, 3) == [5, 6, 8]


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    prompt = [5, 1, 2, 7, 9, 1, 2, 8, 5, 1, 2]
    assert DraftSession(None, [prompt]).propose(0, 2) == [7, 9]  # (5, 1, 2) over the later (1, 2)
    assert DraftSession(None, [prompt], n_max=2).propose(0, 2) == [8, 5]


def test_a_row_drafts_from_its_own_completion_but_never_matches_itself_at_its_end():
    session = DraftSession(None, [[9, 8]])
    session.extend(0, [40, 41, 42, 43])
    assert session.propose(0, 4) == []  # its last n-grams occur only where it ends: nothing followed them yet
    session.extend(0, [40, 41])
    assert session.propose(0, 4) == [42, 43, 40, 41]


def test_no_match_and_k_limit_the_draft():
    session = DraftSession(None, [[9, 8]])
    session.extend(0, [40, 41, 42, 43, 44, 40, 41])
    assert session.propose(0, 2) == [42, 43]  # k truncates
    assert session.propose(0, 0) == [] and session.propose(0, -1) == []
    assert session.propose(0, 100) == [42, 43, 44, 40, 41]  # as much as there is
    session.extend(0, [77])
    assert session.propose(0, 4) == []  # (41, 77) never occurred
    assert DraftSession(None, [[5]]).propose(0, 4) == []  # shorter than n_min
    with pytest.raises(ValueError, match="n_min <= n_max"):
        DraftSession(None, [P], n_max=2, n_min=3)


def test_an_index_built_late_drafts_as_one_built_first_and_kept_up_token_by_token():
    """The lazy build (zipped slices, dict.update) and `extend`'s incremental stores index the same occurrences."""
    rng = random.Random(3)
    prompt = [rng.randrange(6) for _ in range(12)]
    tokens = [rng.randrange(6) for _ in range(150)]
    history = DraftHistory()
    history.add(prompt, [rng.randrange(6) for _ in range(40)])
    early = DraftSession(history, [prompt], n_max=5, n_min=1)
    early.propose(0, 1)  # built before any token
    drafts = 0
    for i, token in enumerate(tokens):
        early.extend(0, [token])
        late = DraftSession(history, [prompt], n_max=5, n_min=1)
        late.extend(0, tokens[:i + 1])
        assert late.propose(0, 6) == early.propose(0, 6), i
        drafts += bool(early.propose(0, 6))
    assert drafts > 100


def test_finish_adds_the_rows_completions_to_the_history_once():
    history = DraftHistory()
    session = DraftSession(history, [P, Q, P])
    for row, tokens in enumerate([[10, 11], [20], [30, 31, 32]]):
        session.extend(row, tokens)
    assert session.completion(2) == [30, 31, 32]
    session.finish()
    assert history.completions(P) == [[10, 11], [30, 31, 32]] and history.completions(Q) == [[20]]
    assert history.prompts() == [Q, P]  # row order: P's last add came last
    with pytest.raises(RuntimeError, match="already added"):
        session.finish()
    other = DraftHistory()
    session2 = DraftSession(None, [P])
    session2.extend(0, [1])
    with pytest.raises(ValueError, match="no history"):
        session2.finish()
    session2.finish(other)
    assert other.completions(P) == [[1]]


def test_the_history_keeps_the_newest_per_prompt_completions_of_each_prompt():
    history = DraftHistory(per_prompt=3)
    for i in range(5):
        history.add(P, [i, i + 1])
    history.add(Q, [7])
    history.add(P, [])  # empty: not kept
    assert history.completions(P) == [[2, 3], [3, 4], [4, 5]]
    assert history.completions(Q) == [[7]] and history.completions([4, 4]) == []
    assert len(history) == 4 and history.tokens == len(P) + 6 + len(Q) + 1


def test_the_history_drops_the_oldest_prompts_entries_first_past_max_tokens():
    a, b, c = [1, 1], [2, 2], [3, 3]
    history = DraftHistory(max_tokens=20)
    history.add(a, [10] * 5)
    history.add(b, [20] * 5)
    assert history.tokens == 14
    history.add(c, [30] * 5)  # 21 tokens: a (the oldest) loses its completion, and with its last one its key
    assert history.prompts() == [b, c] and history.tokens == 14 and history.completions(a) == []
    history.add(b, [21] * 5)  # b is now the newest prompt
    assert history.prompts() == [c, b]
    history.add(c, [31] * 5)  # 24: b, now the oldest, loses its oldest completion
    assert history.prompts() == [b, c] and history.tokens == 19
    assert history.completions(b) == [[21] * 5] and history.completions(c) == [[30] * 5, [31] * 5]
    history.add([4], [40] * 20)  # could never fit: not kept, and pushes nothing out
    assert history.prompts() == [b, c] and history.tokens == 19
    with pytest.raises(ValueError, match="int32"):
        history.add(P, [2**31])


def filled_history(seed: int, prompts: int = 12, **caps: int) -> DraftHistory:
    rng = random.Random(seed)
    history = DraftHistory(**caps)
    keys = [[rng.randrange(30) for _ in range(rng.randrange(1, 9))] for _ in range(prompts)]
    for _ in range(80):
        history.add(rng.choice(keys), [rng.randrange(30) for _ in range(rng.randrange(0, 25))])
    return history


def drafts_of(history: DraftHistory, seed: int) -> list[list[int]]:
    """What a session over every prompt of `history` (twice each) drafts as its rows grow by random tokens."""
    rng = random.Random(seed)
    rows = [p for p in history.prompts() for _ in range(2)]
    session = DraftSession(history, rows)
    found = []
    for _ in range(30):
        for row in range(len(rows)):
            found.append(session.propose(row, 4))
            session.extend(row, [rng.randrange(30)])
    return found


def test_the_state_goes_through_the_trainers_state_format_and_comes_back_exactly(tmp_path):
    from qerl.run import safestate
    from qerl.run.folder import STATE_FILE, STATE_TENSORS

    history = filled_history(0, per_prompt=4, max_tokens=300)
    state = history.state_dict()
    assert state["prompt_tokens"].dtype == torch.int32 and state["completion_offsets"].dtype == torch.int64
    # As the trainer keeps it: one key of its state tree, written by RunFolder.save_checkpoint's safestate.save.
    safestate.save({"step": 3, "drafts": state}, tmp_path / STATE_FILE, tmp_path / STATE_TENSORS)
    back = DraftHistory(per_prompt=4, max_tokens=300)
    back.load_state_dict(safestate.load(tmp_path / STATE_FILE, tmp_path / STATE_TENSORS)["drafts"])

    assert back.prompts() == history.prompts() and len(back) == len(history) and back.tokens == history.tokens
    assert all(back.completions(p) == history.completions(p) for p in history.prompts())
    again = back.state_dict()
    assert all(torch.equal(again[k], v) if isinstance(v, torch.Tensor) else again[k] == v for k, v in state.items())
    assert drafts_of(back, 1) == drafts_of(history, 1)
    assert sum(map(bool, drafts_of(history, 1))) > 50  # the comparison is of drafts, not of empty lists
    for h in (history, back):  # the eviction order came back too
        h.add([5, 5, 5], [1] * 40)
    assert back.prompts() == history.prompts() and back.tokens == history.tokens <= 300

    empty = DraftHistory()
    safestate.save(empty.state_dict(), tmp_path / "e.json", tmp_path / "e.safetensors")
    restored = filled_history(2)
    restored.load_state_dict(safestate.load(tmp_path / "e.json", tmp_path / "e.safetensors"))
    assert restored.prompts() == [] and restored.tokens == 0
    with pytest.raises(ValueError, match="not a draft history state"):
        restored.load_state_dict({**state, "format": "something else"})


def test_a_smaller_cap_at_load_trims_the_restored_history():
    history = filled_history(0, per_prompt=8)
    smaller = DraftHistory(per_prompt=2, max_tokens=100)
    smaller.load_state_dict(history.state_dict())
    assert smaller.tokens <= 100 and all(len(smaller.completions(p)) <= 2 for p in smaller.prompts())
    assert all(smaller.completions(p) == history.completions(p)[-len(smaller.completions(p)):]
               for p in smaller.prompts())


HASH_SEED_SCRIPT = textwrap.dedent("""
    import hashlib, json, sys
    import torch
    from tests.rollout.test_drafts import drafts_of, filled_history
    history = filled_history(5)
    digest = hashlib.sha256()
    for key, value in sorted(history.state_dict().items()):
        digest.update(key.encode())
        digest.update(value.numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode())
    print(json.dumps({"state": digest.hexdigest(), "drafts": drafts_of(history, 6),
                      "prompts": history.prompts(), "hash": hash(b"qerl")}))
""")


def test_nothing_depends_on_the_hash_seed():
    def run(seed: str) -> dict:
        out = subprocess.run([sys.executable, "-c", HASH_SEED_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                             env=dict(os.environ, PYTHONHASHSEED=seed), timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run("0"), run("4242")
    assert first["hash"] != second["hash"]  # the seed did change Python's hashes of bytes
    assert sum(map(bool, first["drafts"])) > 50
    assert {k: v for k, v in first.items() if k != "hash"} == {k: v for k, v in second.items() if k != "hash"}


def test_propose_and_extend_for_8_rows_of_1000_tokens_are_cheap():
    """Measured on the 2-core CPU this was written on: about 0.05 s for the 8,000 propose + extend pairs (with a
    16 x 1,000-token history per prompt), and about 0.03 s to build the two prompts' indexes."""
    rng = random.Random(0)
    history = DraftHistory()
    prompts = [[rng.randrange(50) for _ in range(200)] for _ in range(2)]
    for prompt in prompts:
        for _ in range(16):
            history.add(prompt, [rng.randrange(50) for _ in range(1000)])
    generated = [[rng.randrange(50) for _ in range(1000)] for _ in range(8)]
    session = DraftSession(history, [prompts[row % 2] for row in range(8)])
    for row in range(8):
        session.propose(row, 4)  # the indexes, built
    start = time.perf_counter()
    drafts = 0
    for step in range(1000):
        for row in range(8):
            drafts += bool(session.propose(row, 4))
            session.extend(row, (generated[row][step],))
    elapsed = time.perf_counter() - start
    assert drafts > 7000  # a small vocabulary: nearly every 2-gram has occurred, the costly case
    assert elapsed < 2.0, f"8 rows x 1,000 tokens of propose + extend took {elapsed:.2f} s"
