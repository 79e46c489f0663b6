"""The `qerl` command line end to end: quantize a checkpoint, then evaluate the quantized model from it."""

import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def qerl(*args, cwd=REPO, timeout=600):
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
    assert "perplexity" in proc.stdout.lower()

    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_llama_dir)}, "quant": {"scheme": "nvfp4", "quantized_path": str(out)},
        "eval": {"n": 3, "max_new_tokens": 4, "batch_size": 3, "out_dir": str(tmp_path / "eval")},
    }))
    proc = qerl("eval", "--params", params)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["num_examples"] == 3 and 0.0 <= metrics["accuracy"] <= 1.0
    rows = [json.loads(x) for x in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert {"prompt", "completion", "extracted", "gold", "score"} <= set(rows[0])


def test_missing_model_is_one_clear_error(tmp_path):
    proc = qerl("quantize", "--model", tmp_path / "nope", "--out", tmp_path / "out")
    assert proc.returncode == 2  # bad input
    assert proc.stderr.startswith("qerl: error:") and "nope" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_malformed_data_row_names_file_and_line(tmp_path):
    rows = tmp_path / "gsm.jsonl"
    rows.write_text('{"question": "1+1?", "answer": "2 #### 2"}\n{"question": "2+2?"}\n')
    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump({"eval": {"name": str(rows), "n": 1}}))
    proc = qerl("eval", "--params", params)
    assert proc.returncode == 2  # bad input
    assert f"{rows}:2" in proc.stderr and "answer" in proc.stderr
    assert "Traceback" not in proc.stderr
