"""The `qerl` command line end to end: quantize a checkpoint, then evaluate the quantized model from it (a `qerl`
child process, as a user runs it); then the command's one-line errors, from its `main` in this process (conftest's
`qerl_here`: the same argument parsing, error reporting and exit codes, without a child's interpreter and imports)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.patience import patience

REPO = Path(__file__).resolve().parent.parent


def qerl(*args, cwd=REPO, timeout=patience(600)):
    return subprocess.run([sys.executable, "-m", "qerl.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def test_quantize_then_eval_the_quantized_folder(tiny_llama_dir, tmp_path):
    out = tmp_path / "tiny-nvfp4"
    text = tmp_path / "sample.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    proc = qerl("quantize", "--model", tiny_llama_dir, "--out", out, "--scheme", "nvfp4", "--eval-text", text)
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    log = proc.stdout + proc.stderr
    assert "perplexity" in log.lower()
    assert log.count("layers quantized") == 1 and "relative error 0." not in log  # one summary, no per-tensor lines

    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_llama_dir)}, "quant": {"scheme": "nvfp4", "quantized_path": str(out)},
        "eval": {"n": 3, "max_new_tokens": 4, "batch_size": 3, "out_dir": str(tmp_path / "eval")},
    }))
    proc = qerl("eval", "--params", params)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["num_examples"] == 3 and 0.0 <= metrics["accuracy"] <= 1.0
    assert metrics["grader"] == "qerl.grading" and metrics["grader_timeouts"] == 0  # what graded, beside the number
    rows = [json.loads(x) for x in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert {"prompt", "completion", "extracted", "gold_answer", "gold", "score", "graded_by"} <= set(rows[0])


def test_missing_model_is_one_clear_error(tmp_path, qerl_here):
    code, _, err = qerl_here("quantize", "--model", tmp_path / "nope", "--out", tmp_path / "out")
    assert code == 2  # bad input
    assert err.startswith("qerl: error:") and "nope" in err
    assert "Traceback" not in err


def test_missing_adapter_fails_in_one_line_before_the_model_loads(tmp_path, qerl_here):
    code, _, err = qerl_here("eval", "--params", REPO / "params" / "default.yaml",
                             "--adapter", tmp_path / "nonexistent")
    assert code == 2  # bad input
    assert err.splitlines() == [f"qerl: error: adapter folder {tmp_path / 'nonexistent'} does not exist"]


def test_malformed_data_row_names_file_and_line(tmp_path, qerl_here):
    rows = tmp_path / "gsm.jsonl"
    rows.write_text('{"question": "1+1?", "answer": "2 #### 2"}\n{"question": "2+2?"}\n')
    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump({"eval": {"name": str(rows), "n": 1}}))
    code, _, err = qerl_here("eval", "--params", params)
    assert code == 2  # bad input
    assert f"{rows}:2" in err and "answer" in err
    assert "Traceback" not in err


def test_quantize_onto_a_non_empty_folder_is_one_line(tiny_llama_dir, tmp_path, qerl_here):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = qerl_here("quantize", "--model", tiny_llama_dir, "--out", out)
    assert code == 2
    assert err.splitlines() == [f"qerl: error: destination {out} already exists and is not an empty folder"]
    assert (out / "keep.txt").read_text() == "mine"


def test_quantize_removes_what_a_killed_quantization_left_and_refuses_a_destination_in_use(tiny_llama_dir, tmp_path,
                                                                                           qerl_here):
    """The lock is held here, the quantization runs here too: flock locks of two open files conflict in one process."""
    from qerl.run.lock import output_lock

    out = tmp_path / "q"
    leftover = tmp_path / ".q.tmp-k1ll3d"  # what mkdtemp named the folder of a quantization killed half-way
    leftover.mkdir()
    (leftover / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1000)
    with output_lock(out):
        code, _, err = qerl_here("quantize", "--model", tiny_llama_dir, "--out", out)
        assert code == 2
        assert err.startswith(f"qerl: error: output folder {out} is in use by PID ")
        assert leftover.exists()  # a writer may own it while the lock is held
    code, _, err = qerl_here("quantize", "--model", tiny_llama_dir, "--out", out)
    assert code == 0, err
    assert not leftover.exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # no temp folder, no lock file left


def test_a_damaged_adapter_is_one_line_and_debug_shows_the_traceback(tiny_llama_dir, tmp_path, qerl_here,
                                                                     monkeypatch):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    (adapter / "adapter_model.safetensors").write_bytes(b"\x00\x01garbage")
    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump({"model": {"path": str(tiny_llama_dir)}, "quant": {"scheme": "bf16"},
                                      "eval": {"n": 1, "max_new_tokens": 2}}))
    args = ("eval", "--params", params, "--adapter", adapter, "--out", tmp_path / "eval")
    code, _, err = qerl_here(*args)
    assert code == 2
    assert err.strip().splitlines()[-1].startswith(
        f"qerl: error: {adapter / 'adapter_model.safetensors'}: cannot read safetensors (")
    assert "Traceback" not in err
    code, _, err = qerl_here(*args, "--debug")
    assert code == 2 and "Traceback (most recent call last)" in err
    monkeypatch.setenv("QERL_DEBUG", "1")
    code, _, err = qerl_here(*args)
    assert code == 2 and "Traceback (most recent call last)" in err


def test_an_unexpected_error_is_one_line_with_exit_1_and_a_hint(capsys):
    from qerl.errors import report

    assert report("qerl", RuntimeError("CUDA out of memory.\nTried to allocate 6.00 GiB")) == 1
    assert capsys.readouterr().err.splitlines() == [
        "qerl: error: RuntimeError: CUDA out of memory. Tried to allocate 6.00 GiB (unexpected; rerun with --debug "
        "or QERL_DEBUG=1 for the traceback)"]
    assert report("qerl", FileExistsError("x exists")) == 2
    assert report("qerl", KeyboardInterrupt()) == 130


def test_a_non_utf8_data_file_is_one_line_naming_file_and_line(tmp_path, qerl_here):
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'{"question": "1+1?", "answer": "2 #### 2"}\n{"question": "\xff", "answer": "2 #### 2"}\n')
    code, _, err = qerl_here("eval", "-S", f"eval.name={rows}", "-S", "eval.n=null")
    assert code == 2
    assert err.splitlines() == [f"qerl: error: {rows}:2: not UTF-8 (byte 0xff at byte 15 of the line)"]


def test_an_empty_params_file_is_one_line_not_a_run_with_every_default(tmp_path, qerl_here):
    params = tmp_path / "empty.yaml"
    params.write_text("# nothing yet\n")
    code, _, err = qerl_here("train", "--params", params, "--out", tmp_path / "run")
    assert code == 2
    assert err.splitlines() == [f"qerl: error: {params}: the params file is empty (no sections); start from "
                                        "params/default.yaml"]
    assert not (tmp_path / "run").exists()


def test_an_unknown_reward_name_fails_with_the_other_settings(tmp_path, qerl_here):
    """Before anything loads: the model path does not even exist."""
    code, _, err = qerl_here("train", "-S", "model.path=/nonexistent", "-S", "train.rewards={accuarcy: 1.0}", "--out",
                             tmp_path / "run")
    assert code == 2
    assert err.splitlines() == [
        "qerl: error: -S train.rewards={accuarcy: 1.0}: train.rewards = {'accuarcy': 1.0}: unknown reward "
        "'accuarcy': use one of ['accuracy', 'format'] or 'package.module:function'"]


def test_n_beyond_the_dataset_names_the_key_and_the_file_before_the_model_loads(tmp_path, qerl_here):
    """The model path does not exist: the error comes from the data, checked first."""
    table = tmp_path / "problems.csv"
    table.write_text("question,answer\nWhat is 1 + 1?,2\nWhat is 2 + 2?,4\n")
    code, _, err = qerl_here("eval", "-S", "model.path=/nonexistent", "-S", f"eval.name={table}", "-S", "eval.n=5")
    assert code == 2
    assert err.splitlines() == [f"qerl: error: eval.n = 5: {table} has only 2 examples (lower eval.n, or set "
                                        "it to null for all of them)"]
    code, _, err = qerl_here("train", "-S", "model.path=/nonexistent", "-S", f"data.name={table}", "-S", "data.n=3",
                             "--out", tmp_path / "run")
    assert code == 2
    assert err.splitlines()[-1] == (f"qerl: error: data.n = 3: {table} has only 2 examples (lower data.n, or "
                                            "set it to null for all of them)")


BEYOND_THE_DATA = ("more than the 16 training prompts of arithmetic (data.n = 16): a step would repeat prompts; "
                   "set it to 16 or fewer")


@pytest.mark.parametrize("prompts, said", [
    (17, BEYOND_THE_DATA),
    # past the completions a step may draw, the params refuse it before the data is read
    (100_000_000, "100000000 prompts x 2 completions = 200,000,000 a step, past the 65,536 qerl draws in one (a large "
                  "run draws 512 x 16 = 8,192); lower prompts_per_step or group_size"),
])
def test_prompts_per_step_beyond_the_data_is_one_line_before_the_model_loads(tmp_path, qerl_here, prompts, said):
    """params/tiny.yaml trains on 16 prompts: more per step would repeat them (10^8 ran for minutes in step 1)."""
    start = time.perf_counter()
    flag = f"rollout.prompts_per_step={prompts}"
    code, _, err = qerl_here("train", "--params", "params/tiny.yaml", "-S", "tracking.backend=none",
                             "-S", flag, "--out", tmp_path / "run")
    assert code == 2, err
    where = f"-S {flag}: " if said != BEYOND_THE_DATA else ""
    assert err.splitlines()[-1] == f"qerl: error: {where}rollout.prompts_per_step = {prompts}: {said}"
    assert "loaded" not in err and time.perf_counter() - start < 60 and not (tmp_path / "run").exists()


def test_lora_targets_that_match_nothing_are_refused_from_the_config_before_the_weights_load(tmp_path, qerl_here):
    code, _, err = qerl_here("train", "--params", "params/tiny.yaml", "-S", "tracking.backend=none",
                             "-S", "lora.target_modules=[qkv, attn_out]", "--out", tmp_path / "run")
    assert code == 2, err
    assert err.splitlines()[-1] == (
        "qerl: error: lora.target_modules: LoRA target_modules ['qkv', 'attn_out'] match no module; linear layers "
        "are named ['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']")
    assert "loaded" not in err and not (tmp_path / "run").exists()  # the weights never loaded


def test_a_damaged_parquet_file_is_one_line_without_the_datasets_librarys_own_lines(tmp_path, qerl_here):
    table = tmp_path / "bad.parquet"
    table.write_bytes(b"PAR1 not really")
    code, _, err = qerl_here("eval", "-S", "model.path=/nonexistent", "-S", f"eval.name={table}", "-S", "eval.n=null")
    assert code == 2
    assert err.splitlines() == [f"qerl: error: {table}: Parquet magic bytes not found in footer. Either the "
                                        "file is corrupted or this is not a parquet file."]


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_backend_whose_package_is_missing_is_one_line_naming_key_and_install_before_anything_loads(
        tmp_path, qerl_here, monkeypatch, command):
    """rollout.backend: vllm without vLLM was found after the model had loaded (9-25 s), exit 1 "unexpected"."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # as where vLLM is not installed (whether or not it is here)
    code, out, err = qerl_here(command, "--params", "params/tiny.yaml", "-S", "rollout.backend=vllm",
                               "--out", tmp_path / "run")
    assert (code, out) == (2, "")
    assert err.splitlines() == ["qerl: error: rollout.backend 'vllm' needs vllm, which is not installed: "
                                'pip install "qerl[vllm]" (vllm 0.26, for torch 2.11)']  # no "loaded ..." first
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("vllm_init, error", [
    ("raise RuntimeError('vLLM was built for CUDA 12.8, this driver runs 12.4')",
     "RuntimeError: vLLM was built for CUDA 12.8, this driver runs 12.4"),
    ("import vllm._C  # its compiled ops, absent from a build for another torch",
     "ModuleNotFoundError: No module named 'vllm._C'"),
])
def test_a_broken_vllm_install_is_one_line_naming_its_error_exit_2(tmp_path, qerl_here, monkeypatch, vllm_init,
                                                                   error):
    """An installed vLLM whose import raises (a build for another torch or CUDA) was an "unexpected" exit 1, or (an
    ImportError inside it) was called not installed; and the base vLLM would load was quantized into the cache
    first."""
    monkeypatch.setattr("qerl.model.served.served_base", lambda settings: pytest.fail("vLLM's base built first"))
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text(vllm_init + "\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    code, out, err = qerl_here("train", "--params", "params/tiny.yaml", "-S", "rollout.backend=vllm",
                               "--out", tmp_path / "run")
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == (f"qerl: error: vLLM failed to import: {error} (rollout.backend 'vllm'; "
                                    'reinstall it: pip install "qerl[vllm]" (vllm 0.26, for torch 2.11))')
    assert not (tmp_path / "run").exists()


class StartedRun:
    """Stands in for `qerl.rl.trainer.Trainer` once it has started (the model loaded, the run folder claimed): what
    `qerl train` says then depends on its settings alone, and a real start costs 10-30 s of loading and plotting."""

    def __init__(self, settings, out_dir, **options):
        self.out = out_dir

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def train(self, max_steps=None):
        return self.out / "adapter"


def test_train_names_in_one_line_the_params_it_leaves_to_the_flows(tmp_path, qerl_here, monkeypatch):
    """params/tiny.yaml sets train.eval_every and tracking.backend: mlflow, which only the training flow acts on;
    `qerl train` skipped both without a word. Said once the run has started (a refusal before stays one line)."""
    import qerl.rl.trainer

    monkeypatch.setattr(qerl.rl.trainer, "Trainer", StartedRun)
    code, out, err = qerl_here("train", "--params", "params/tiny.yaml", "--out", tmp_path / "run")
    assert (code, out) == (0, f"adapter: {tmp_path / 'run' / 'adapter'}\n")
    assert err.splitlines() == [
        "WARNING qerl.cli: qerl train does not act on train.eval_every = 1 (evaluations between steps) nor "
        "tracking.backend = 'mlflow': it trains and writes the run folder only; python -m qerl.flows.train with the "
        "same --params and -S evaluates and tracks (qerl eval evaluates an adapter)"]
    code, _, err = qerl_here("train", "--params", "params/tiny.yaml", "--out", tmp_path / "run",
                             "-S", "train.eval_every=0", "-S", "tracking.backend=none")
    assert (code, err) == (0, "")


def test_quantize_fp8_then_eval_the_folder(tiny_llama_dir, tmp_path, qerl_here):
    """`qerl quantize --scheme fp8` writes compressed-tensors FP8_DYNAMIC; `qerl eval` runs the folder's fp8 base."""
    out = tmp_path / "tiny-fp8"
    code, _, err = qerl_here("quantize", "--model", tiny_llama_dir, "--out", out, "--scheme", "fp8")
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "float-quantized"
    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_llama_dir)}, "quant": {"scheme": "fp8", "quantized_path": str(out)},
        "eval": {"n": 2, "max_new_tokens": 3, "batch_size": 2, "out_dir": str(tmp_path / "eval")},
    }))
    code, _, err = qerl_here("eval", "--params", params)
    assert code == 0, err
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["num_examples"] == 2


# The tool-use recipe (README "Recipe: RL with a python tool"), cut to one short step: its own params otherwise
TOOLS_TINY = ("--params", "params/tools_tiny.yaml", "-S", "rollout.max_new_tokens=24", "-S", "data.n=2",
              "-S", "rollout.prompts_per_step=1")


def test_the_tool_use_recipe_trains_with_the_python_tool_and_counts_its_calls(tmp_path, qerl_here):
    """`qerl train --params params/tools_tiny.yaml`: multi-turn rollouts with qerl's sandboxed interpreter, the
    calls counted in every step's metrics; the call its system prompt teaches runs in the tool the run built."""
    from qerl.config import load_settings
    from qerl.rollout.multi_turn import tool_use_of
    from qerl.rollout.tool_calls import call_tool

    code, out, err = qerl_here("train", *TOOLS_TINY, "-S", "train.steps=1", "--out", tmp_path / "run")
    assert code == 0, err
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    counts = {k: rows[0][f"rollout/{k}"] for k in ("tool_calls", "tool_errors", "tool_timeouts", "tool_seconds")}
    # A 135M model seldom writes a call in 24 tokens: the counters are there, consistent, and within the budget
    # (2 completions, max_tool_calling_iterations 2 each)
    assert 0 <= counts["tool_errors"] <= counts["tool_calls"] <= 2 * 2 and counts["tool_timeouts"] == 0
    use = tool_use_of(load_settings(REPO / "params" / "tools_tiny.yaml").rollout)
    prompt = load_settings(REPO / "params" / "tools_tiny.yaml").data.system_prompt
    taught = prompt[prompt.index("<tool_call>"):prompt.index("</tool_call>") + len("</tool_call>")]
    assert call_tool(use.tools, use.format, taught) == "72.0"


def test_the_tool_use_recipe_evaluates_multi_turn_and_reports_the_calls(tmp_path, qerl_here):
    """`qerl eval` with the recipe's rollout.tools samples multi-turn completions and reports the calls (per sample)
    beside the accuracy."""
    code, _, err = qerl_here("eval", *TOOLS_TINY, "-S", "eval.n=2", "-S", "eval.max_new_tokens=24",
                             "--out", tmp_path / "eval")
    assert code == 0, err
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["num_examples"] == 2 and 0.0 <= metrics["accuracy"] <= 1.0
    assert {"tool_calls", "tool_errors", "tool_timeouts"} <= set(metrics)
    assert 0 <= metrics["tool_errors"] <= metrics["tool_calls"] * metrics["num_examples"]
