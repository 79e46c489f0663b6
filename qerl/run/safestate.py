"""A tree of plain values and tensors on disk with nothing executable in it: the tensors in a safetensors file, the
rest as JSON.

Why not `torch.save`: a pickle names the functions to call while it is loaded, so a checkpoint received from
someone else (or altered on a shared disk) would run its author's code on `--resume`. JSON and safetensors carry
values only; reading them calls nothing the file chooses.

What JSON lacks is spelled out with one-key marker objects: tensors and numpy arrays (stored in the safetensors
file under a generated name), tuples (`random.setstate` wants them) and dicts with non-string keys (an optimizer's
state is keyed by parameter index). Floats keep every bit: Python writes the shortest repr that reads back exactly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

TENSOR, ARRAY, TUPLE, PAIRS = "__tensor__", "__ndarray__", "__tuple__", "__pairs__"
_MARKERS = {TENSOR, ARRAY, TUPLE, PAIRS}


class StateFormatError(ValueError):
    """A state file that cannot be read back (missing, truncated, hand-edited, not ours); `file` names it."""

    def __init__(self, file: Path, reason: str):
        super().__init__(f"{file}: {reason}")
        self.file = file
        self.reason = reason


def save(tree: Any, json_path: str | os.PathLike, tensors_path: str | os.PathLike) -> None:
    """Write `tree` as `json_path` (its structure and plain values) and `tensors_path` (its tensors)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(tree, tensors, "state")
    save_file(tensors, str(tensors_path))
    Path(json_path).write_text(json.dumps(encoded) + "\n")


def load(json_path: str | os.PathLike, tensors_path: str | os.PathLike) -> Any:
    """The tree `save` wrote; `StateFormatError` naming the file if the two do not read back as one."""
    from safetensors.torch import load_file

    json_path, tensors_path = Path(json_path), Path(tensors_path)
    try:
        encoded = json.loads(json_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: JSON and UTF-8
        raise StateFormatError(json_path, _reason(e)) from None
    try:
        tensors = load_file(str(tensors_path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for truncated or garbage files
        raise StateFormatError(tensors_path, _reason(e)) from None
    try:
        return _decode(encoded, tensors)
    except (KeyError, TypeError, ValueError) as e:
        raise StateFormatError(json_path, _reason(e)) from None


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else "empty or truncated"
    return f"{type(e).__name__}: {text}"


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().cpu().clone().contiguous()  # safetensors refuses shared storage
        return {TENSOR: name}
    if isinstance(value, np.ndarray):
        name = f"t{len(tensors)}"
        tensors[name] = torch.from_numpy(value.astype(np.int64) if value.dtype.kind == "u" else value.copy())
        return {ARRAY: name, "dtype": value.dtype.str}  # unsigned ints: widened, as torch lacks most of them
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {TUPLE: [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not _MARKERS & value.keys():
            return {k: _encode(v, tensors, f"{where}.{k}") for k, v in value.items()}
        return {PAIRS: [[_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise TypeError(f"{where}: a {type(value).__name__} has no safe on-disk form")  # a new kind of state: our bug


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if TENSOR in value:
        return tensors[value[TENSOR]]
    if ARRAY in value:
        return tensors[value[ARRAY]].numpy().astype(np.dtype(value["dtype"]))
    if TUPLE in value:
        return tuple(_decode(v, tensors) for v in value[TUPLE])
    if PAIRS in value:
        return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in value[PAIRS]}
    return {k: _decode(v, tensors) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict)):
        raise TypeError(f"a {type(key).__name__} cannot be a dict key")
    return key
