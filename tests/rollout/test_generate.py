"""Rollout sampling: greedy parity with transformers, exact log-probs, stop conditions, reproducibility."""
import pytest
import torch
import torch.nn.functional as F

from qerl.model.loading import load_model
from qerl.rollout.generate import generate
from qerl.rollout.sampling import Rollout, sample_tokens
from tests.reference import policy_logprobs

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived", "2 + 2 ="]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def test_greedy_matches_transformers_greedy(tiny, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run the full length on both sides
    out = generate(model, tokenizer, PROMPTS, max_new_tokens=12, temperature=0, eos_token_ids=[])
    for prompt, ids in zip(out.prompt_ids, out.completion_ids):  # left padding must not change any row
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
        assert ids == expected.tolist()
    assert out.stop_reasons == ["length"] * 3
    assert out.texts == [tokenizer.decode(ids, skip_special_tokens=True) for ids in out.completion_ids]


def test_logprobs_equal_a_full_forward_at_the_sampled_tokens(tiny):
    """What the trainer recomputes: log_softmax(logits / T) over left-padded prompt + completion."""
    model, tokenizer = tiny
    temperature = 0.7
    out = generate(model, tokenizer, PROMPTS, max_new_tokens=10, temperature=temperature, top_p=0.9, top_k=50,
                   seed=3, eos_token_ids=[])
    width = max(len(p) + len(c) for p, c in zip(out.prompt_ids, out.completion_ids))
    for prompt, completion, logprobs in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        expected = policy_logprobs(model, prompt, completion, width, temperature)
        assert logprobs.dtype == torch.float32 and len(logprobs) == len(completion)
        assert torch.allclose(logprobs, expected, atol=1e-4)


def test_greedy_logprobs_are_untempered(tiny):
    model, tokenizer = tiny
    out = generate(model, tokenizer, PROMPTS[:1], max_new_tokens=1, temperature=0, eos_token_ids=[])
    with torch.no_grad():
        logits = model(torch.tensor([out.prompt_ids[0]]))[0, -1]
    assert torch.allclose(out.logprobs[0], F.log_softmax(logits, -1)[out.completion_ids[0]], atol=1e-5)


def test_eos_ends_a_row_and_is_kept(tiny):
    model, tokenizer = tiny
    free = generate(model, tokenizer, PROMPTS, max_new_tokens=8, temperature=0, eos_token_ids=[])
    eos = free.completion_ids[0][3]  # pretend the 4th greedy token of row 0 is EOS
    out = generate(model, tokenizer, PROMPTS, max_new_tokens=8, temperature=0, eos_token_ids=[eos])
    first = free.completion_ids[0].index(eos)
    assert out.completion_ids[0] == free.completion_ids[0][:first + 1] and out.stop_reasons[0] == "eos"
    assert len(out.logprobs[0]) == first + 1
    for i in (1, 2):  # the other rows continue unaffected until their own stop
        row = free.completion_ids[i]
        cut = row.index(eos) + 1 if eos in row else len(row)
        assert out.completion_ids[i] == row[:cut]
        assert out.stop_reasons[i] == ("eos" if eos in row else "length")


def test_stop_string_truncates_ids_and_text_consistently(tiny):
    model, tokenizer = tiny
    free = generate(model, tokenizer, PROMPTS[:2], max_new_tokens=12, temperature=0, eos_token_ids=[])
    ids = free.completion_ids[0]
    stop = tokenizer.decode(ids[4:6]).strip()[:3]  # a string the greedy text produces around token 5
    assert stop, "need a non-empty stop string"
    out = generate(model, tokenizer, PROMPTS[:2], max_new_tokens=12, temperature=0, stop_strings=[stop],
                   eos_token_ids=[])
    got = out.completion_ids[0]
    assert out.stop_reasons[0] == "stop" and len(got) < len(ids)
    assert got == ids[:len(got)]  # a prefix of the unstopped sequence...
    assert stop in out.texts[0] and stop not in tokenizer.decode(got[:-1])  # ...ending at the completing token
    assert out.texts[0] == tokenizer.decode(got, skip_special_tokens=True)
    assert len(out.logprobs[0]) == len(got)


def test_same_seed_same_samples(tiny):
    model, tokenizer = tiny
    runs = [generate(model, tokenizer, PROMPTS, max_new_tokens=8, temperature=1.0, seed=s, eos_token_ids=[])
            for s in (7, 7, 8)]
    assert runs[0].completion_ids == runs[1].completion_ids
    assert all(torch.equal(a, b) for a, b in zip(runs[0].logprobs, runs[1].logprobs))
    assert runs[0].completion_ids != runs[2].completion_ids
    gen = torch.Generator().manual_seed(7)  # an explicit generator draws the same as the seed
    assert generate(model, tokenizer, PROMPTS, max_new_tokens=8, generator=gen,
                    eos_token_ids=[]).completion_ids == runs[0].completion_ids


def test_top_k_1_is_greedy(tiny):
    model, tokenizer = tiny
    greedy = generate(model, tokenizer, PROMPTS, max_new_tokens=8, temperature=0, eos_token_ids=[])
    top1 = generate(model, tokenizer, PROMPTS, max_new_tokens=8, temperature=1.3, top_k=1, seed=0,
                    eos_token_ids=[])
    assert top1.completion_ids == greedy.completion_ids


def test_token_id_prompts_and_zero_new_tokens(tiny):
    model, tokenizer = tiny
    ids = [tokenizer.encode(p) for p in PROMPTS]
    assert generate(model, tokenizer, ids, max_new_tokens=5, temperature=0).completion_ids == \
        generate(model, tokenizer, PROMPTS, max_new_tokens=5, temperature=0).completion_ids
    empty = generate(model, tokenizer, PROMPTS, max_new_tokens=0)
    assert isinstance(empty, Rollout) and empty.completion_ids == [[]] * 3 and empty.stop_reasons == ["length"] * 3
    assert model.model.layers[0].self_attn.kv_cache is None  # memory handed back after generation


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_new_tokens=-1), "max_new_tokens"), (dict(seed=1, generator=torch.Generator()), "seed or generator"),
])
def test_bad_arguments_are_clear_errors(tiny, kwargs, match):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match=match):
        generate(model, tokenizer, PROMPTS, **{"max_new_tokens": 2, **kwargs})
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, tokenizer, [[1, 2], []], max_new_tokens=2)


def test_top_k_and_top_p_restrict_the_support():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4)
    gen = torch.Generator().manual_seed(0)
    for kwargs, support in [(dict(top_k=2), {0, 1}), (dict(top_p=0.5), {0}), (dict(top_p=0.75), {0, 1}),
                            (dict(top_p=0.9), {0, 1, 2}), ({}, {0, 1, 2, 3})]:
        tokens, logprobs = sample_tokens(logits, 1.0, generator=gen, **kwargs)
        assert set(tokens.tolist()) == support, kwargs
        assert torch.allclose(logprobs, probs.log()[tokens])  # untruncated policy log-probs
    tokens, _ = sample_tokens(logits, 1.0, generator=gen)
    freq = torch.bincount(tokens, minlength=4) / len(tokens)
    assert torch.allclose(freq, probs, atol=0.03)  # an exact draw from the distribution


@pytest.mark.slow
def test_smollm2_answers_and_stops_at_eos(smollm2_dir):
    model, tokenizer = load_model(smollm2_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           tokenize=False, add_generation_prompt=True)
    out = generate(model, tokenizer, [prompt, prompt], max_new_tokens=40, temperature=0)
    assert "Paris" in out.texts[0] and out.stop_reasons == ["eos", "eos"]
    assert out.completion_ids[0][-1] == tokenizer.eos_token_id and out.completion_ids[0] == out.completion_ids[1]
    assert "<|im_end|>" not in out.texts[0]


def test_each_distinct_prompt_is_prefilled_once(tiny, monkeypatch):
    """GRPO's groups repeat every prompt: the prefill runs on the distinct prompts only and its KV rows are copied,
    giving the same samples and log-probs as a prefill of every row."""
    from qerl.rollout.engine import RolloutEngine

    model, tokenizer = tiny
    group = [p for p in PROMPTS for _ in range(4)]
    kw = dict(max_new_tokens=8, temperature=1.0, eos_token_ids=[], row_seeds=list(range(len(group))))
    prefill_rows = []
    real_forward = type(model).forward

    def counting_forward(self, input_ids, *args, **kwargs):
        if input_ids.shape[1] > 1:
            prefill_rows.append(input_ids.shape[0])
        return real_forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", counting_forward)
    shared = generate(model, tokenizer, group, **kw)
    assert prefill_rows == [len(PROMPTS)]
    monkeypatch.setattr(RolloutEngine, "_prefill_once_per_prompt",
                        lambda self, ids, valid, rows, prompt_len: self._prefill(ids, rows, prompt_len))
    every = generate(model, tokenizer, group, **kw)
    assert prefill_rows == [len(PROMPTS), len(group)]
    assert shared.completion_ids == every.completion_ids
    for a, b in zip(shared.logprobs, every.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
