"""Reference computations shared by tests."""

import torch


def policy_logprobs(model, prompt: list[int], completion: list[int], width: int, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at the completion tokens from one full forward over the left-padded sequence:
    what the trainer recomputes, and what every sampler must report."""
    seq = prompt + completion
    ids = torch.tensor([[0] * (width - len(seq)) + seq])
    mask = torch.tensor([[0] * (width - len(seq)) + [1] * len(seq)])
    with torch.no_grad():
        logits = model(ids, attention_mask=mask)[0, -len(completion) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
