"""`quantize_checkpoint`: the frozen base, quantized once per (source, scheme, codec version) and reused.

Prefect caches the result (the output folder's path) under that key, and the folder's name carries the key too, so an
unchanged quantization is never recomputed, in this flow run or the next. A cached path whose folder was deleted since
is the caller's to refresh (`qerl.flows.train.with_quantized_base` does).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import CacheKeyFnPolicy
from prefect.exceptions import MissingContextError

from qerl.tasks.retry import retry_transient

_CODE = Path(__file__).resolve().parent.parent / "qerl"


def code_version() -> str:
    """Hash of the code that decides the quantized bytes: the codecs and the checkpoint reader/writer."""
    import qerl

    h = hashlib.sha256(qerl.__version__.encode())
    for path in sorted([*(_CODE / "quant").rglob("*.py"), _CODE / "model" / "loading.py"]):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:12]


def _source_identity(src: Path) -> str:
    """Path, sizes and mtimes: cheap to compute, and a rewritten checkpoint changes it."""
    files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src]
    return "|".join(f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def quantized_dir(model_path: str, scheme: str, out_root: str) -> Path:
    """Where this source+scheme+code version lands: `<out_root>/<model>-<scheme>-<key>`."""
    from qerl.model.loading import resolve_model

    src = resolve_model(model_path).resolve()
    key = hashlib.sha256(f"{_source_identity(src)}|{scheme}|{code_version()}".encode()).hexdigest()[:16]
    return Path(out_root) / f"{src.stem}-{scheme}-{key}"


def _cache_key(context, inputs: dict) -> str:
    return "quantize-" + quantized_dir(inputs["model_path"], inputs["scheme"], inputs["out_root"]).name


def is_complete(folder: str | Path) -> bool:
    """A finished quantized folder (the core writes it atomically: config.json is there only when all is)."""
    return (Path(folder) / "config.json").is_file()


@task(name="quantize-checkpoint", retries=2, retry_delay_seconds=10, retry_condition_fn=retry_transient,
      cache_policy=CacheKeyFnPolicy(cache_key_fn=_cache_key), persist_result=True, result_serializer="json")
def quantize_checkpoint(model_path: str, scheme: str, out_root: str = "runs/quantized") -> str:
    """Quantize `model_path`'s decoder linears to `scheme`; returns the folder (a `quant.quantized_path`)."""
    from qerl.model.loading import check_model_folder, resolve_model
    from qerl.quant.checkpoint import quantize_checkpoint as quantize
    from qerl.run.lock import output_lock

    source = resolve_model(model_path)
    if source.is_dir():  # as `qerl quantize` does: no code of a model folder in our output
        check_model_folder(source)
    dst = quantized_dir(model_path, scheme, out_root)
    if is_complete(dst):  # e.g. a fresh Prefect home has no record of a folder made earlier
        return str(dst)

    def waiting(holder: str) -> None:
        _logger().info("waiting for %s, which is quantizing %s to %s in %s; this run reuses it", holder, model_path,
                       scheme, dst)

    # Another flow (one with a Prefect home of its own, whose cache knows nothing of this one's) may be writing the
    # same folder: wait for it and reuse its result instead of failing on the folder's lock. The core's own lock on
    # `dst` joins this one (hand_over), so no third process can slip in between the check and the write.
    with output_lock(dst, hand_over=True, on_wait=waiting):
        if not is_complete(dst):
            quantize(source, dst, scheme, progress=False)
    return str(dst)


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """The task run's logger (its lines reach the Prefect UI), or this module's outside a run."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)
