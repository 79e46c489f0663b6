"""Shared pytest fixtures."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from qerl.cli import prepare_process  # imports no torch

prepare_process()  # before torch loads: the test run is a process qerl starts

# Prefect's temporary server gets 20 s to answer by default; on 2 shared cores under load it took longer, and the
# flow failed ("Timed out while attempting to connect to ephemeral Prefect API server"). Set before Prefect loads;
# subprocesses inherit it.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "600")

import pytest

from tests import processes
from tests.prefect_server import stop_temporary_servers

SESSION_MARK = processes.mark_session()  # everything the tests start carries it: see pytest_sessionfinish


@pytest.hookimpl(trylast=True)  # after the session fixtures' own teardown
def pytest_sessionfinish(session):
    """Nothing the suite started outlives it, and nothing logs after pytest's result line: Prefect's temporary
    server (started in this process by in-process flows) is stopped now, not by Prefect's atexit hook, whose log line
    hit pytest's closed capture stream ("--- Logging error --- ValueError: I/O operation on closed file."); then
    every process still carrying the session's mark is stopped with its process group (e.g. a temporary server whose
    start-up timed out, whose handle Prefect then dropped)."""
    stop_temporary_servers()
    if "qerl.grading" in sys.modules:  # the grader's math-verify workers: closed as its atexit hook would, now
        sys.modules["qerl.grading"]._mathverify.close()
    left = processes.stop_started_by(SESSION_MARK)
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: the controller reports (below)
        session.config.workeroutput["qerl_stopped"] = left
        return
    report_stopped(session.config, left)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: none without it (e.g. the GPU machines)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: what a worker's session had to stop, reported as the worker's own would be."""
    report_stopped(node.config, getattr(node, "workeroutput", {}).get("qerl_stopped", []))


def report_stopped(config, left: list[str]) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if left and reporter is not None:
        reporter.line("")  # after the progress dots
        reporter.write_line(f"stopped {len(left)} process(es) the tests left running: " + "; ".join(left),
                            yellow=True)


@pytest.fixture(autouse=True)
def seeded_generators():
    """Every test starts from the same global random state, whichever tests ran before it in its process: with
    pytest-xdist (scripts/test.sh runs two workers) a file's neighbours differ from run to run, and a draw from the
    global generator (LoRA's A initialization, an unseeded randn) would differ with them."""
    import random

    random.seed(0)
    if "torch" in sys.modules:  # not imported yet: torch starts from its fixed default seed
        sys.modules["torch"].manual_seed(0)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(0)


@pytest.fixture(autouse=True)
def log_streams_open():
    """No log handler writes to a stream an earlier test closed. Prefect sets up its console handlers once per
    process, on the stderr of whichever test first ran a flow in it: pytest's capture of that test, closed when it
    ended. Every later log line through them printed "--- Logging error --- ValueError: I/O operation on closed
    file." into the next test's stderr (and failed tests that compare it). With pytest-xdist which test comes first
    in a worker varies, so such a handler now points at the running test's stderr, as a child process's would."""
    loggers = [logging.getLogger(), *(x for x in logging.Logger.manager.loggerDict.values()
                                      if isinstance(x, logging.Logger))]
    for logger in loggers:
        for handler in logger.handlers:
            if not isinstance(handler, logging.StreamHandler):
                continue
            console = getattr(handler, "console", None)  # Prefect's handler prints through a rich Console of its own
            with handler.lock:  # not setStream: it flushes the closed stream first
                if getattr(handler.stream, "closed", False):
                    handler.stream = sys.stderr
                if console is not None and getattr(console.file, "closed", False):
                    console.file = sys.stderr


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    """The real SmolLM2-135M-Instruct tokenizer with its chat template (no download): from the embedded model's
    cached Hugging Face folder, which the GGUF is converted into once."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder (converted once from the GGUF into the qerl cache,
    ~30 s the first time, instant afterwards)."""
    import torch

    from qerl.model.loading import embedded_model_path

    try:
        return embedded_model_path()
    except FileNotFoundError as e:
        if torch.cuda.is_available():  # the GPU machines cannot carry the 98 MB GGUF; CPU CI always has it
            pytest.skip(str(e))
        raise


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama (2 layers, hidden 64, tied embeddings) saved by transformers with the real SmolLM2 tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(smollm2_tokenizer), max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=smollm2_tokenizer.bos_token_id,
                         eos_token_id=smollm2_tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger than HF's init (std 0.02) so logits are peaked: no near-ties in greedy parity
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder


# The tiny trainer (tests/tiny_trainer_process.py) in the test's own process, for runs that need no process of their
# own (a start, a resume, a stop: everything goes through the run folder); a child costs an interpreter's and a grader
# worker's start-up, most of a tiny run's time. Kills, stalls and full disks still run in a child.
IN_A_CHILD_ONLY = ("--stall-at-checkpoint", "--stall-at-export", "--fill-disk-at-checkpoint", "--hold-until")


@pytest.fixture
def here(caplog, capsys):
    """`here(*args)`: the tiny trainer's `main` in this process; (exit code, what its stderr would hold: the log lines
    as the child formats them, then its error line)."""
    from tests import tiny_trainer_process

    def run(*args) -> tuple[int, str]:
        argv = [str(a) for a in args]
        assert not set(argv) & set(IN_A_CHILD_ONLY), "these patch qerl for good: only in a process of their own"
        caplog.clear()
        capsys.readouterr()
        with caplog.at_level(logging.INFO):
            code = tiny_trainer_process.main(argv)
        lines = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in caplog.records]
        return code, "\n".join([*lines, *capsys.readouterr().err.splitlines()])

    return run


@pytest.fixture
def main_here(caplog, capsys, monkeypatch):
    """`main_here(main, *args)`: a command's `main(argv)` (qerl.cli's, a flow module's) in this process, from the
    repository root as its child would run; (exit code, its stdout, what its stderr would hold: the log lines, then
    what it printed there). For what fails before or after a tiny model's load, a child's interpreter and imports
    (~4 s of CPU) cost more than the test."""
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)

    def run(main, *args) -> tuple[int, str, str]:
        caplog.clear()
        capsys.readouterr()
        # Only pytest's own handlers on the root logger meanwhile: a child has none of what imports in this process
        # added (Prefect's console handler, on a stream an earlier test's capture closed, adds "--- Logging error ---").
        root = logging.getLogger()
        foreign = [h for h in root.handlers if not type(h).__module__.startswith("_pytest")]
        for handler in foreign:
            root.removeHandler(handler)
        try:
            with caplog.at_level(logging.INFO):
                code = main([str(a) for a in args])
        finally:
            for handler in foreign:
                root.addHandler(handler)
        out, err = capsys.readouterr()
        lines = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in caplog.records]
        return code, out, "\n".join([*lines, *err.splitlines()])

    return run


@pytest.fixture
def qerl_here(main_here):
    """`qerl_here(*args)`: `main_here` for the `qerl` command."""
    from qerl.cli import main

    return lambda *args: main_here(main, *args)


@pytest.fixture
def finish_here(here):
    """`finish_here(*args)`: the tiny trainer run to its end in this process; what its stderr would hold."""

    def run(*args) -> str:
        code, err = here(*args)
        assert code == 0, err
        return err

    return run
