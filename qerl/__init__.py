"""qerl: quantization-enhanced RL of LLMs (NVFP4 base + LoRA + adaptive quantization noise).

The parts, bottom up; each imports only parts listed before it (a package's docstring names which ones), never the
other way, lazily or for types included (tests/test_architecture.py checks both). kernels/, tasks/ and flows/ are
folders at the repository's top, installed as qerl.kernels, qerl.tasks, qerl.flows (pyproject.toml):

    kernels/     the GPU kernels (Triton, Gluon) and their GEMM dispatch (imports nothing of qerl)
    debug        every environment variable qerl reads, and the reading of them (imports nothing of qerl)
    errors       how an error ends a command: one line, exit codes (imports only qerl.debug)
    run/         the run on disk: the run folder (lock, start/resume rules, checkpoints, metrics), atomic writes
    quant/       the 4-bit formats, the quantized linear layer, quantized checkpoints
    grading/     is an answer right: extraction, qerl's equality, math-verify in a worker
    plugins      user code params name (reward functions, tools, environments): `module:function` or
                 `file.py:function` resolved in one place (imports nothing of qerl)
    tools/       what a model calls in multi-turn rollouts: tools' schemas and calls, the sandboxed Python
                 interpreter, environments (imports nothing of qerl)
    data/        problems (generated, hub, local tables), prompts, rewards
    params_yaml  the YAML of a params file or -S value, read within a size, depth and alias budget (imports nothing
                 of qerl)
    config       the settings of params/*.yaml (it asks quant/ and data/ whether a scheme or reward exists)
    execution/   how the model runs: its execution plan (GEMM context, precision phases) and the blocks' kernels
    model/       the policy: the decoder, its families, LoRA, AQN noise, loading, export
    rollout/     sampling completions: the engine and the reference sampler behind one seam
    evaluation/  accuracy of a policy, comparisons of runs
    rl/          the RL loop: GRPO/DAPO, the trainer and its step, data parallelism
    cli          the `qerl` command
    tasks/       the pipeline's Prefect tasks over the core
    flows/       the pipeline: Prefect flows, MLflow tracking, DVC stage helpers (`python -m qerl.flows.<name>`)
"""

from pathlib import Path as _Path

__version__ = "0.1.0"

# kernels/, tasks/ and flows/ sit at the top of the repository but are qerl's: pip installs them as qerl/kernels,
# qerl/tasks, qerl/flows (pyproject.toml's package-dir). A source checkout run without installing (PYTHONPATH=$PWD, as
# the GPU machines run the tree) finds them under the same names: a finder answers for exactly those three (no other
# folder of the checkout: qerl.tests or qerl.benchmarks must not resolve), with a namespace package on the folder.
# It answers for no other name, so nothing else an import finds changes. The three have no __init__.py (namespace
# portions): with the checkout's root on sys.path, a bare `import kernels` still finds an installed `kernels`
# (Hugging Face's) rather than ours, which a regular package would have shadowed.
TOP_LEVEL = ("kernels", "tasks", "flows")


class _CheckoutFolders:
    """The import system's finder (sys.meta_path) of qerl.kernels, qerl.tasks and qerl.flows in a source checkout."""

    def __init__(self, root: _Path):
        self.folders = {f"{__name__}.{name}": str(root / name) for name in TOP_LEVEL}

    def find_spec(self, name, path=None, target=None):
        if name not in self.folders:
            return None
        spec = _machinery.ModuleSpec(name, None, is_package=True)  # no loader: a namespace package
        spec.submodule_search_locations = [self.folders[name]]
        return spec


_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "kernels").is_dir() and (_checkout / "pyproject.toml").is_file():
    import importlib.machinery as _machinery
    import sys as _sys

    if not any(isinstance(f, _CheckoutFolders) for f in _sys.meta_path):  # (a reload of qerl adds none)
        _sys.meta_path.append(_CheckoutFolders(_checkout))
