"""Drafts for speculative rollouts without a draft model: the next tokens of a row guessed from text the run already
has, for the engine to verify in one forward.

Where the guesses come from (as in prompt-lookup decoding, SuffixDecoding and SPEC-RL), for a row of prompt P:

* the run's earlier completions of P: GRPO samples every prompt `group_size` times per step and the same prompts
  again in later epochs, and a policy that moves a little per step repeats much of what it wrote before;
* the row's siblings, the other rows of P in the same call, as far as they have been generated;
* P itself and the row's own completion so far (a repeated name, a formula copied from the question).

`DraftHistory` is the first source, kept across calls and in checkpoints (`state_dict`: tensors and plain values,
which `qerl.run.safestate` stores). `DraftSession` serves one sampling call: the engine `extend`s each row with the
tokens it accepted and asks `propose(row, k)` for a draft; `finish()` adds the call's completions to the history.

A draft is the continuation of the longest n-gram (n from `n_max` down to `n_min`) that ends the row's prompt +
completion and occurred earlier in one of those sources; nothing matching, no draft. Exactness is not this module's
job: the engine accepts a drafted token only where its own sampling agrees, so the samples are those of plain
decoding whatever the drafts are. A draft here only decides how many tokens one forward can yield.

Deterministic: dicts find entries by hash (a prompt's bytes hash differently under each PYTHONHASHSEED) but keep
them in insertion order, and nothing here is ordered, chosen or stored by a hash, so PYTHONHASHSEED changes no
proposal and no stored byte.
"""
from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import torch

FORMAT = "qerl.rollout.drafts/1"  # the state_dict's version; load_state_dict refuses others
_INT32 = (-(2**31), 2**31)
assert array("i").itemsize == 4, "array('i') must be int32 for the flat state tensors"


def _ids(tokens: Iterable[int]) -> array:
    """Token ids as a compact int32 array (4 bytes a token, not a Python int object each: a history holds millions)."""
    try:
        return array("i", [int(t) for t in tokens])
    except OverflowError:
        raise ValueError(f"token ids must fit in int32 {list(_INT32)}") from None


class DraftHistory:
    """The newest `per_prompt` completions of each prompt the run sampled, oldest first, keyed by the prompt's token
    ids; the persistent draft source, kept in checkpoints.

    Bounded: at most `max_tokens` tokens are held, counting each prompt kept (its key) and each completion. Past it,
    entries go oldest prompt first: the prompt whose latest `add` is oldest loses its oldest completion, and the prompt
    itself goes with its last one (so a prompt added again is kept longer). A completion that with its prompt alone
    exceeds `max_tokens` is not kept, nor is an empty one (no draft can come from it).
    """

    def __init__(self, per_prompt: int = 16, max_tokens: int = 1 << 22):
        if per_prompt < 1:
            raise ValueError(f"per_prompt must be >= 1, got {per_prompt}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.per_prompt = per_prompt
        self.max_tokens = max_tokens  # 4 Mi tokens by default: 16 MiB in a checkpoint, about as much in memory
        # prompt key (its int32 bytes) -> (prompt ids, completions oldest first). A dict's order is insertion order,
        # so re-inserting on every add keeps the prompts oldest-added first: the eviction order, independent of hash().
        self._entries: dict[bytes, tuple[array, list[array]]] = {}
        self._tokens = 0

    @property
    def tokens(self) -> int:
        """The tokens held: every kept prompt's and completion's."""
        return self._tokens

    def __len__(self) -> int:
        """The completions held."""
        return sum(len(completions) for _, completions in self._entries.values())

    def add(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> None:
        """Keep `completion_ids` as the newest completion of `prompt_ids`, dropping what the caps then exclude."""
        completion = _ids(completion_ids)
        if not completion:
            return
        prompt = _ids(prompt_ids)
        if len(prompt) + len(completion) > self.max_tokens:
            return  # it would push out every other entry and then itself
        key = prompt.tobytes()
        entry = self._entries.pop(key, None)
        if entry is None:
            entry = (prompt, [])
            self._tokens += len(prompt)
        self._entries[key] = entry  # now the newest prompt
        entry[1].append(completion)
        self._tokens += len(completion)
        if len(entry[1]) > self.per_prompt:
            self._tokens -= len(entry[1].pop(0))
        self._trim()

    def completions(self, prompt_ids: Sequence[int]) -> list[list[int]]:
        """The completions kept of `prompt_ids`, oldest first; [] for a prompt not held."""
        entry = self._entries.get(_ids(prompt_ids).tobytes())
        return [c.tolist() for c in entry[1]] if entry else []

    def prompts(self) -> list[list[int]]:
        """The prompts held, the one added to longest ago first (the next to lose entries)."""
        return [prompt.tolist() for prompt, _ in self._entries.values()]

    def _stored(self, prompt: array) -> list[array]:
        """The completions of `prompt` as stored, in a list of their own: a later add changes the history's list, never
        the arrays, so a session holding these keeps what it read."""
        entry = self._entries.get(prompt.tobytes())
        return list(entry[1]) if entry else []

    def _trim(self) -> None:
        while self._tokens > self.max_tokens:
            key = next(iter(self._entries))
            prompt, completions = self._entries[key]
            self._tokens -= len(completions.pop(0))
            if not completions:
                del self._entries[key]
                self._tokens -= len(prompt)

    def state_dict(self) -> dict[str, Any]:
        """The history as flat tensors and plain values (what `qerl.run.safestate` stores): `prompt_tokens` (int32,
        the prompts one after the other, oldest-added first) cut by `prompt_offsets` (int64 [P+1]); `counts` (int64
        [P], each prompt's completions); `completion_tokens` (int32, every prompt's completions, oldest first, in the
        prompts' order) cut by `completion_offsets` (int64 [C+1]); the caps and the format's version."""
        prompt_tokens, completion_tokens = array("i"), array("i")
        prompt_offsets, completion_offsets, counts = [0], [0], []
        for prompt, completions in self._entries.values():
            prompt_tokens.extend(prompt)
            prompt_offsets.append(len(prompt_tokens))
            counts.append(len(completions))
            for completion in completions:
                completion_tokens.extend(completion)
                completion_offsets.append(len(completion_tokens))
        return {"format": FORMAT, "per_prompt": self.per_prompt, "max_tokens": self.max_tokens,
                "prompt_tokens": _int32_tensor(prompt_tokens),
                "prompt_offsets": torch.tensor(prompt_offsets, dtype=torch.int64),
                "counts": torch.tensor(counts, dtype=torch.int64),
                "completion_tokens": _int32_tensor(completion_tokens),
                "completion_offsets": torch.tensor(completion_offsets, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with those `state_dict` returned: the same prompts and completions in the same order
        (so the same evictions and drafts follow). The caps stay this object's (the run's current settings); the
        entries are trimmed to them, which changes nothing when they equal the saved ones."""
        if state.get("format") != FORMAT:
            raise ValueError(f"not a draft history state (format {state.get('format')!r}, expected {FORMAT!r})")
        prompt_tokens = array("i", state["prompt_tokens"].to(torch.int32).tolist())
        completion_tokens = array("i", state["completion_tokens"].to(torch.int32).tolist())
        prompt_offsets = state["prompt_offsets"].tolist()
        completion_offsets = state["completion_offsets"].tolist()
        counts = state["counts"].tolist()
        if (len(prompt_offsets) != len(counts) + 1 or len(completion_offsets) != sum(counts) + 1
                or prompt_offsets[-1] != len(prompt_tokens) or completion_offsets[-1] != len(completion_tokens)):
            raise ValueError("draft history state: offsets and counts do not cut the token tensors")
        entries: dict[bytes, tuple[array, list[array]]] = {}
        tokens, c = 0, 0
        for p, count in enumerate(counts):
            prompt = prompt_tokens[prompt_offsets[p]:prompt_offsets[p + 1]]
            completions = [completion_tokens[completion_offsets[i]:completion_offsets[i + 1]]
                           for i in range(c, c + count)]
            c += count
            entries[prompt.tobytes()] = (prompt, completions[-self.per_prompt:])
            tokens += len(prompt) + sum(len(x) for x in completions[-self.per_prompt:])
        self._entries, self._tokens = entries, tokens
        self._trim()


def _int32_tensor(values: array) -> torch.Tensor:
    # frombuffer shares the array's memory (no list of Python ints on the way) and refuses an empty buffer.
    return torch.frombuffer(values, dtype=torch.int32).clone() if values else torch.zeros(0, dtype=torch.int32)


class _Group:
    """The rows of one distinct prompt in a call and their shared sources (history, prompt, one another)."""

    __slots__ = ("prompt", "tail", "history", "rows", "sources", "index")

    def __init__(self, prompt: list[int], history: list[array], n_max: int):
        self.prompt = prompt
        self.tail = prompt[max(len(prompt) - n_max, 0):]  # as much of the prompt as a context reaches into it
        self.history = history  # the history's completions of the prompt when the session began (a snapshot)
        self.rows: list[int] = []
        self.sources: list[list[int]] = []  # the sequences the index points into: prompt, history, rows
        # n-gram (a tuple, n_min to n_max tokens) -> where what followed its most recent occurrence starts, as
        # source number * _STRIDE + position. An int, not a (list, position) pair: the collector stops tracking a
        # tuple of ints at its first pass, but a pair holding a list it tracks for the index's life, and every full
        # collection would traverse the index's hundreds of thousands of them. None until the first propose of one
        # of the rows.
        self.index: dict[tuple[int, ...], int] | None = None


_STRIDE = 1 << 40  # positions in a source stay below it


class DraftSession:
    """The drafts of one sampling call over `prompt_ids` (one entry per row; rows with equal prompts are siblings).

    `extend(row, tokens)` appends tokens a row generated; `propose(row, k)` drafts up to k next tokens for it;
    `finish()` adds the rows' completions to the history. The history is read when the session is built (later adds
    change none of its drafts); a prompt's index is built from it on the first `propose` of one of its rows, since
    only rows that reach speculation need one.

    A draft: the longest n-gram, n from `n_max` down to `n_min`, ending the row's prompt + completion that occurred
    earlier in a source of the row (its prompt's earlier completions, its siblings' completions so far, its prompt,
    its own completion), and up to k tokens that followed it there. Of an n-gram's occurrences the most recent wins,
    in the order the index saw them: the prompt, the history oldest first, the rows' tokens so far (row by row) when
    the index was built, then as `extend` brings them. Recency, not frequency (vLLM's suffix decoding counts how often
    each continuation followed): the newest samples are those of the policy closest to the one now sampling, and
    keeping one occurrence per n-gram is one dict store per n a token (counting continuations is several), and lets a
    prompt's history be indexed at C speed (`dict.update` over zipped slices) rather than token by token in Python.

    Cost: `extend` one dict store per n (n_min..n_max) a token once the prompt's index is built, an append before;
    `propose` at most n_max - n_min + 1 dict lookups (keys of n_max tokens at most) and a k-token slice; building a
    prompt's index, (n_max - n_min + 1) dict stores per token of its prompt, history and rows so far.
    """

    def __init__(self, history: DraftHistory | None, prompt_ids: Sequence[Sequence[int]], n_max: int = 4,
                 n_min: int = 2):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.history = history
        self.n_max, self.n_min = n_max, n_min
        self._cuts = [slice(-n, None) for n in range(n_max, n_min - 1, -1)]  # a window's n-grams, longest first
        groups: dict[bytes, _Group] = {}
        self._group_of: list[_Group] = []
        # Per row: its prompt's tail, then its completion so far. Siblings' drafts read on from inside these lists,
        # so a continuation grows as its row does.
        self._sequences: list[list[int]] = []
        self._base: list[int] = []  # per row: its source number in its group's index * _STRIDE (set on building)
        for row, ids in enumerate(prompt_ids):
            prompt = _ids(ids)
            group = groups.get(prompt.tobytes())
            if group is None:
                stored = history._stored(prompt) if history is not None else []
                group = groups[prompt.tobytes()] = _Group(prompt.tolist(), stored, n_max)
            group.rows.append(row)
            self._group_of.append(group)
            self._sequences.append(list(group.tail))
            self._base.append(0)
        self._finished = False

    def __len__(self) -> int:
        return len(self._sequences)

    def completion(self, row: int) -> list[int]:
        """The tokens `extend` gave `row` so far."""
        return self._sequences[row][len(self._group_of[row].tail):]

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        """Append `tokens`, generated by `row`, to its completion (and, once indexed, to its prompt's index)."""
        sequence, index = self._sequences[row], self._group_of[row].index
        if index is None:
            sequence.extend(int(t) for t in tokens)
            return
        n_max, cuts, base = self.n_max, self._cuts, self._base[row]
        for t in tokens:
            sequence.append(int(t))
            end = len(sequence) - 1  # the new token follows the n-grams that end just before it
            window = tuple(sequence[end - n_max:end] if end >= n_max else sequence[:end])
            if len(window) >= self.n_min:
                for cut in cuts:  # a window shorter than n_max stores its longest n-grams again: harmless
                    index[window[cut]] = base + end

    def propose(self, row: int, k: int) -> list[int]:
        """Up to `k` drafted next tokens of `row`; [] when no n-gram of at least `n_min` tokens ending it matches."""
        if k <= 0:
            return []
        sequence, group = self._sequences[row], self._group_of[row]
        if group.index is None:
            self._build(group)
        # Only n-grams that something followed are indexed, so the row's own last n-gram (followed by nothing yet)
        # never matches itself: the trivial match is out by construction.
        window = tuple(sequence[-self.n_max:])
        if len(window) < self.n_min:
            return []
        get = group.index.get
        for cut in self._cuts:
            found = get(window[cut])
            if found is not None:
                source, start = divmod(found, _STRIDE)
                return group.sources[source][start:start + k]
        return []

    def finish(self, history: DraftHistory | None = None) -> None:
        """Add every row's completion (what `extend` gave it) to `history`, by default the one the session was built
        from, in row order; once per session. A caller whose final completions differ from the tokens extended (cut
        at a stop string) can `add` those to the history itself instead."""
        if self._finished:
            raise RuntimeError("this DraftSession's completions were already added to the history")
        target = history if history is not None else self.history
        if target is None:
            raise ValueError("no history to add the completions to")
        self._finished = True
        for row, group in enumerate(self._group_of):
            target.add(group.prompt, self.completion(row))

    def _build(self, group: _Group) -> None:
        group.index = {}
        self._index_all(group, group.prompt, 0)  # n-grams inside the prompt, followed by the prompt: once a group
        first = len(group.tail)  # in a row's sequence, what follows from here on is a completion
        for completion in group.history:
            self._index_all(group, group.tail + completion.tolist(), first)
        for row in group.rows:
            self._base[row] = self._index_all(group, self._sequences[row], first)

    def _index_all(self, group: _Group, sequence: list[int], first: int) -> int:
        """Make `sequence` a source of `group` and index its every n-gram followed by a token at `first` or later, in
        order (a later occurrence replaces an earlier one): the n-grams come from zipped slices and go in by
        `dict.update`, at C speed. Returns the source's number * _STRIDE."""
        base = len(group.sources) * _STRIDE
        group.sources.append(sequence)
        length = len(sequence)
        for n in range(self.n_min, self.n_max + 1):
            start = max(first, n)  # the first position an n-gram ends just before
            if start < length:
                grams = zip(*(sequence[start - n + i:length - n + i] for i in range(n)))
                group.index.update(zip(grams, range(base + start, base + length)))
        return base
