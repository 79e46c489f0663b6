"""benchmarks/bench_vllm.py's folders, on the CPU: the config-only folders vLLM fills with made-up weights
(`--weights dummy`, for shapes whose checkpoint does not fit the GPU machine's disk) declare the same model as the
checkpoint the random arm writes, so both runs measure the same thing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors import safe_open

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_vllm  # noqa: E402


def shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_dummy_folders_declare_what_the_random_checkpoint_holds(tmp_path):
    bench_vllm.write_folder("tiny", tmp_path, "random")
    bench_vllm.write_folder("tiny", tmp_path, "dummy")
    real, dummy = tmp_path, tmp_path / "dummy"
    for scheme in ("bf16", "nvfp4"):  # quantize_checkpoint's config.json, quantization_config included
        assert json.loads((dummy / scheme / "config.json").read_text()) \
            == json.loads((real / scheme / "config.json").read_text()), scheme
        assert not list((dummy / scheme).glob("*.safetensors"))  # vLLM makes the weights up: nothing to write
    adapter = "lora/adapter_model.safetensors"
    assert shapes(dummy / adapter) == shapes(real / adapter)
    assert json.loads((dummy / "lora/adapter_config.json").read_text())["target_modules"] == list(bench_vllm.PROJECTIONS)
    before = (real / "nvfp4" / "config.json").stat().st_mtime_ns
    bench_vllm.write_folder("tiny", tmp_path, "random")  # written once: a second call finds it done
    assert (real / "nvfp4" / "config.json").stat().st_mtime_ns == before
