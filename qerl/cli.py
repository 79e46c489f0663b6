"""`qerl quantize | train | eval | export | params`: the command line over the core (no Prefect, MLflow or DVC
needed)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path

from qerl.config import load_settings, require_extras
from qerl.debug import debug_requested
from qerl.errors import report
from qerl.run.outdir import check_writable, removed_if_empty_on_failure

log = logging.getLogger(__name__)


def _add_debug(p: argparse.ArgumentParser, default) -> None:
    # On the main parser and on each command (`qerl train ... --debug` is what people type); SUPPRESS keeps a
    # command's absent flag from resetting the main parser's.
    p.add_argument("--debug", action="store_true", default=default,
                   help="show the full traceback of an error (also: QERL_DEBUG=1)")


def _add_params(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default=None, help="parameter file (default: params/default.yaml)")
    p.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one parameter, DVC style (repeatable), e.g. -S lora.rank=8")


def build_parser() -> argparse.ArgumentParser:
    from qerl.quant.formats import SCHEMES, SERVABLE_SCHEMES  # the codec registry names the schemes

    parser = argparse.ArgumentParser(prog="qerl", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
    _add_debug(parser, default=False)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("eval", help="accuracy of a model (and optional adapter) on an evaluation split")
    _add_params(p)
    p.add_argument("--adapter", default=None, help="a PEFT adapter folder to evaluate on top of the base")
    p.add_argument("--out", default=None, help="output folder (default: eval.out_dir)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N examples")

    p = sub.add_parser("quantize", help="quantize a checkpoint's decoder linears (NVFP4 etc.) into a new folder")
    p.add_argument("--model", required=True, help="Hugging Face folder, .gguf file, or 'embedded'")
    p.add_argument("--out", required=True, help="destination folder")
    p.add_argument("--scheme", default="nvfp4", choices=SCHEMES)
    p.add_argument("--eval-text", default=None, help="a text file for perplexity before/after")
    p.add_argument("--strict", action="store_true", help="fail on a layer that cannot be quantized")

    p = sub.add_parser("train", help="GRPO/DAPO training of LoRA on the quantized base with AQN")
    _add_params(p)
    p.add_argument("--out", default=None, help="run folder (default: train.out_dir)")
    p.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help="train N steps, then stop with a checkpoint (never past train.steps); with --resume, N more "
                        "steps past the checkpoint it resumes from")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue from the newest intact checkpoint in the run folder")
    again.add_argument("--overwrite", action="store_true",
                       help="delete a previous run's outputs in the run folder and start over")

    p = sub.add_parser("export", help="the trained policy for vLLM and transformers: the NVFP4 base + the PEFT "
                                      "adapter, or (--merge) the LoRA merged and re-quantized; README.md with commands")
    p.add_argument("--adapter", required=True, help="a PEFT adapter folder (e.g. runs/default/adapter)")
    p.add_argument("--out", required=True, help="destination folder (must not exist or be empty)")
    p.add_argument("--merge", action="store_true", help="merge the LoRA into the base and quantize it again")
    p.add_argument("--model", default=None, help="the base checkpoint (default: the adapter's base_model_name_or_path)")
    p.add_argument("--scheme", default=None, choices=SERVABLE_SCHEMES,
                   help="the base's format in training (default: a quantized base's own, else nvfp4)")

    p = sub.add_parser("params", help="print the resolved parameters as YAML")
    _add_params(p)
    for command in sub.choices.values():
        _add_debug(command, default=argparse.SUPPRESS)
    return parser


def _cmd_eval(args) -> int:
    from qerl.evaluation.evaluate import run_eval
    from qerl.run.folder import refuse_run_folder

    settings = load_settings(args.params, args.overrides)
    require_extras(settings)
    named = "--out" if args.out else "eval.out_dir"
    out = check_writable(args.out or settings.eval.out_dir, named)
    refuse_run_folder(out, named)  # as `train` refuses a folder in use or holding a run
    result = run_eval(settings, adapter=args.adapter, out_dir=out, limit=args.limit)
    print(json.dumps({**result.metrics, **result.grader}, indent=2))  # the accuracy and what graded it
    print(f"wrote {out / 'metrics.json'} and {out / 'samples.jsonl'}")
    return 0


def _cmd_quantize(args) -> int:
    from qerl.evaluation.evaluate import add_perplexity
    from qerl.model.loading import check_model_folder, resolve_model
    from qerl.quant.checkpoint import quantize_checkpoint

    check_writable(args.out)
    text = _read_text(Path(args.eval_text)) if args.eval_text else None
    source = resolve_model(args.model)
    if source.is_dir():  # as train and eval refuse it: the output would carry the code and its auto_map
        check_model_folder(source)
    report = quantize_checkpoint(source, Path(args.out), args.scheme, strict=args.strict)
    if text is not None:
        add_perplexity(report, text)
    print(f"quantized: {report.dst}")  # the summary is already in the log (quantize_checkpoint logs it once)
    return 0


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes().count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x})") from None


def _cmd_train(args) -> int:
    from qerl.rl.distributed import DistributedError, process_group
    from qerl.rl.stopping import TrainingStopped
    from qerl.rl.trainer import Trainer

    settings = load_settings(args.params, args.overrides)
    require_extras(settings)  # a package the params need: the first thing to fix, before any path or weight
    if args.max_steps is not None and args.max_steps < 1:
        raise ValueError(f"--max-steps {args.max_steps}: must be >= 1")
    out = check_writable(args.out or settings.train.out_dir, "--out" if args.out else "train.out_dir")
    # Under torchrun: one rank of a data-parallel run (rank 0 writes the outputs); otherwise plain one process.
    try:
        with process_group(settings.train.collective_timeout_s) as group:
            if not group.is_main:
                logging.getLogger().setLevel(logging.WARNING)  # one rank reports progress
            with removed_if_empty_on_failure(out), Trainer(settings, out_dir=out, resume=args.resume,
                                                          overwrite=args.overwrite) as trainer:
                if group.is_main:  # once the run has started: a refusal before it stays one line
                    _say_what_train_leaves_to_the_flows(settings)
                adapter = trainer.train(max_steps=args.max_steps)
    except DistributedError as exc:  # a rank died or timed out: say so in a line, never hang
        if debug_requested(args.debug):
            raise
        print(f"qerl: error: {exc}", file=sys.stderr)
        return 1
    except TrainingStopped as stop:  # SIGTERM / Ctrl-C after a checkpoint: its line says how to continue
        stop.resume_with(["qerl", "train"], args.params, args.overrides, out, args.max_steps)
        raise
    if group.is_main:
        print(f"adapter: {adapter}")
    return 0


def _say_what_train_leaves_to_the_flows(settings) -> None:
    """One log line naming the params that `qerl train` does not act on, and what does: evaluations between steps and
    MLflow tracking are the training flow's (qerl.flows.train wraps Trainer.evaluate), since the core runs without
    Prefect or MLflow. A setting that does nothing must say so, not be skipped without a word (params/tiny.yaml sets
    both)."""
    ignored = [f"train.eval_every = {settings.train.eval_every} (evaluations between steps)"] \
        if settings.train.eval_every else []
    if settings.tracking.backend != "none":
        ignored.append(f"tracking.backend = {settings.tracking.backend!r}")
    if ignored:
        log.warning("qerl train does not act on %s: it trains and writes the run folder only; python -m "
                    "qerl.flows.train with the same --params and -S evaluates and tracks (qerl eval evaluates an "
                    "adapter)", " nor ".join(ignored))


def _cmd_export(args) -> int:
    from qerl.model.export import export_policy

    check_writable(args.out)
    result = export_policy(args.adapter, args.out, merge=args.merge, model=args.model, scheme=args.scheme)
    print(f"wrote {result.out} ({'merged, ' if result.merged else ''}{result.scheme}); serve it with:")
    print(f"cd {shlex.quote(str(result.out))} && {result.vllm_command}")  # the export's own paths are relative
    return 0


def _cmd_params(args) -> int:
    print(load_settings(args.params, args.overrides).to_yaml(), end="")
    return 0


def prepare_process() -> None:
    """What a process that qerl starts sets for itself, first (the `qerl` command, qerl.flows.startup, scripts):
    importing qerl sets nothing process-wide.

    OpenMP threads that spin while waiting turn every small CPU op 15-150x slower as soon as another process shares
    the cores (measured on 2-core machines: a 0.9 ms matmul took 16 ms); passive waiting costs nothing when alone.
    It only takes effect if set before torch loads its OpenMP runtime, so a caller does this before importing torch
    (this module imports no torch). A value the user set is kept."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> int:
    prepare_process()
    args = build_parser().parse_args(argv)
    debug = debug_requested(args.verbose or args.debug)
    logging.basicConfig(level=logging.DEBUG if debug_requested(args.verbose) else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    command = {"eval": _cmd_eval, "quantize": _cmd_quantize, "train": _cmd_train, "export": _cmd_export,
               "params": _cmd_params}
    try:
        return command[args.command](args)
    except (Exception, KeyboardInterrupt) as exc:  # one line (exit 2 for bad input); --debug shows the traceback
        return report("qerl", exc, debug)


if __name__ == "__main__":
    sys.exit(main())
