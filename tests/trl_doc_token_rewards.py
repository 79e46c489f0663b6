"""TRL's documentation's example 1 (GRPOTrainer, "Using a custom reward function"), unchanged."""


def reward_func(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]
