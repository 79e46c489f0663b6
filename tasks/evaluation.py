"""`evaluate`: accuracy of a policy on the evaluation split, on an in-process model or a base + adapter folder."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from qerl.config import Settings
from qerl.tasks.retry import retry_transient


# Not cached: an eval is cheap next to training, and caching would need the model's weights in the key.
@task(name="evaluate", retries=1, retry_delay_seconds=5, retry_condition_fn=retry_transient,
      cache_policy=NO_CACHE, persist_result=False)
def evaluate(settings: Settings, adapter: str | None = None, out_dir: str | None = None, limit: int | None = None,
             model=None, tokenizer=None):
    """`qerl.evaluation.evaluate.run_eval`: greedy (or k-sample) accuracy; writes metrics.json + samples.jsonl
    to `out_dir`."""
    from qerl.evaluation.evaluate import run_eval

    return run_eval(settings, adapter=adapter, out_dir=out_dir, limit=limit, model=model, tokenizer=tokenizer,
                    progress=False)
