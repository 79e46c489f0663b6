"""Put this folder on PYTHONPATH (with QERL_OPS_LOG=path) and every process records each distinct call signature
of the training ops that torch.compile serves (qerl.execution.training_ops._compiled): op, rank, the dims of size 1,
grad mode, whether any input needs a gradient, dtype, contiguity, and the first caller in qerl. Used to find the
calls a trainer makes that its precompile workers did not (issue #61's compile-count test)."""
import json
import sys
import os
import traceback

_LOG = os.environ.get("QERL_OPS_LOG")


def _install() -> None:
    import functools

    import torch
    from qerl.execution import training_ops as ops

    real = ops._compiled
    seen = set()

    @functools.cache
    def recorded(name):
        fn = real(name)

        def call(*args):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            x = tensors[0]
            key = (name, [list(int(s == 1) for s in t.shape) for t in tensors], torch.is_grad_enabled(),
                   [t.requires_grad for t in tensors], str(x.dtype), [t.is_contiguous() for t in tensors])
            k = json.dumps(key)
            if k not in seen:
                seen.add(k)
                where = [f"{f.filename.rsplit('/qerl/', 1)[-1]}:{f.lineno}" for f in traceback.extract_stack()
                         if "/qerl/" in f.filename and "training_ops" not in f.filename][-3:]
                with open(_LOG, "a") as fh:
                    fh.write(json.dumps({"pid": os.getpid(), "worker": "qerl.rl.precompile" in " ".join(sys.argv) or any("precompile" in a for a in sys.argv), "key": key, "shapes": [list(t.shape) for t in tensors],
                                         "strides": [list(t.stride()) for t in tensors], "where": where}) + "\n")
            return fn(*args)
        return call

    ops._compiled = recorded


if _LOG:
    import importlib.abc
    import sys

    class _Hook(importlib.abc.MetaPathFinder):  # install once qerl.execution.training_ops is imported
        def find_spec(self, name, path, target=None):
            if name == "qerl.execution.training_ops":
                sys.meta_path.remove(self)
                spec = importlib.util.find_spec(name)
                loader = spec.loader
                orig = loader.exec_module

                def exec_module(module):
                    orig(module)
                    _install()
                loader.exec_module = exec_module
                return spec
            return None

    import importlib.util
    sys.meta_path.insert(0, _Hook())
