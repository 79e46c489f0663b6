"""Checkpoints load into the same numbers transformers computes, and bad checkpoints fail naming the culprit."""
import json
import logging
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qerl.model.loading import CheckpointError, embedded_model_path, load_model, resolve_model
from qerl.model.transformer import Transformer


def copy_folder(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_hf_folder_loads_to_transformers_logits(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model, tokenizer = load_model(tiny_llama_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode("The cat sat on the mat and looked")])
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() < 1e-4
    assert isinstance(model, Transformer) and not model.training
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, though the file has no lm_head
    assert tokenizer.eos_token == "<|im_end|>"


def test_sharded_folder_and_dtype(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="2MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model, tokenizer = load_model(tmp_path, dtype=torch.bfloat16)
    assert tokenizer is None  # no tokenizer files in that folder
    assert model.model.layers[1].mlp.up_proj.weight.dtype == torch.bfloat16
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, hf.model.layers[1].mlp.up_proj.weight.bfloat16())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        resolve_model(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_architecture_is_a_clear_error(tiny_llama_dir, tmp_path):
    folder = copy_folder(tiny_llama_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_model(folder)


def _edit_weights(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_missing_tensor_names_file_and_tensor(tiny_llama_dir, tmp_path):
    folder = copy_folder(tiny_llama_dir, tmp_path / "m")
    _edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"m: missing tensor\(s\) model.layers.1.mlp.down_proj.weight"):
        load_model(folder)


def test_unexpected_tensor_is_an_error(tiny_llama_dir, tmp_path):
    folder = copy_folder(tiny_llama_dir, tmp_path / "m")
    _edit_weights(folder, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) model.layers.0.self_attn.q_proj.bias"):
        load_model(folder)


def test_shape_mismatch_names_tensor_and_shapes(tiny_llama_dir, tmp_path):
    folder = copy_folder(tiny_llama_dir, tmp_path / "m")
    _edit_weights(folder, lambda t: t.update({"model.layers.0.mlp.gate_proj.weight": torch.zeros(100, 64)}))
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.gate_proj.weight has shape \(100, 64\).*\(128, 64\)"):
        load_model(folder)


def test_corrupt_or_absent_weights_are_clear_errors(tiny_llama_dir, tmp_path):
    folder = copy_folder(tiny_llama_dir, tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read safetensors"):
        load_model(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(folder)


def test_unsupported_quantization_config_is_an_error(tiny_llama_dir, tmp_path):
    folder = copy_folder(tiny_llama_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unsupported quantization_config.*'gptq'"):
        load_model(folder)


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4", "nf4", "fp8"])
def test_quantized_folder_loads_through_quant_linears(tiny_llama_dir, tmp_path, scheme):
    """A folder written by qerl's quantizer loads into QuantLinears computing what in-memory quantization does."""
    from qerl.quant.checkpoint import quantize_checkpoint
    from qerl.quant.linear import QuantLinear, quantize_model

    quantize_checkpoint(tiny_llama_dir, tmp_path / "q", scheme, progress=False)
    assert load_model(tmp_path / "q")[0].model.embed_tokens.weight.dtype == torch.bfloat16  # its config's dtype
    loaded, tokenizer = load_model(tmp_path / "q", dtype=torch.float32)  # as a CPU run loads it (model.dtype auto)
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, QuantLinear)
    assert loaded.model.layers[0].self_attn.q_proj.scheme == scheme and tokenizer is not None
    reference, _ = load_model(tiny_llama_dir)
    quantize_model(reference, scheme)
    quantized = {n: m for n, m in loaded.named_modules() if isinstance(m, QuantLinear)}
    assert len(quantized) == 14
    for name, layer in quantized.items():  # every code and scale loaded bit-exactly where it belongs
        for key, tensor in layer.quantized_tensors().items():
            expected = reference.get_submodule(name).quantized_tensors()[key]
            assert tensor.dtype == expected.dtype and torch.equal(tensor.view(torch.uint8), expected.view(torch.uint8))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    # The rest (embeddings, norms) is stored as the source holds it: the same base, bit for bit. (In bf16, the
    # embedded SmolLM2's greedy replies differed: `qerl eval` and the DVC evaluate stage disagreed.)
    reference_state = reference.state_dict()
    assert all(torch.equal(t, reference_state[k]) for k, t in loaded.state_dict().items())
    with torch.no_grad():
        assert torch.equal(loaded(ids), reference(ids))


@pytest.mark.slow
def test_embedded_smollm2_matches_transformers_greedy(smollm2_dir):
    """Our model on the real SmolLM2 weights: transformers' greedy continuation is ours too, logits close."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model, tokenizer = load_model("embedded")
    assert time.perf_counter() - start < 10  # the cached folder loads fast (the GGUF converts once)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        full = hf.generate(ids, max_new_tokens=20, do_sample=False)
        ours, theirs = model(full), hf(full).logits
    assert (ours - theirs).abs().max() < 1e-3
    # Teacher-forced argmax over transformers' own greedy sequence = the same 20 greedy tokens.
    assert torch.equal(ours[0, ids.shape[1] - 1:-1].argmax(-1), full[0, ids.shape[1]:])
    # Real weights, correctly un-permuted from llama.cpp's layout: the model knows the answer.
    assert "Paris" in tokenizer.decode(full[0, ids.shape[1]:])


def _gpt2_byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: a valid byte-level BPE vocabulary with no merges."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(rest))]


def write_tiny_gguf(path, arch: str = "llama"):
    """A tiny Llama written the way llama.cpp converts one: q/k rows permuted, MLP weights Q8_0, small BPE
    vocabulary. Returns the transformers model it came from."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = _gpt2_byte_symbols() + ["Ġt", "he", "<|im_end|>"]
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokens), tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(2), writer.add_context_length(512), writer.add_embedding_length(64)
    writer.add_feed_forward_length(128), writer.add_head_count(4), writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6), writer.add_rope_freq_base(10000.0), writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2"), writer.add_tokenizer_pre("default"), writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3]), writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(len(tokens) - 1), writer.add_eos_token_id(len(tokens) - 1)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    gguf_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                  "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down"}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(2):
        for hf_name, name in gguf_names.items():
            w = state[f"model.layers.{i}.{hf_name}.weight"]
            if name in ("attn_q", "attn_k"):  # llama.cpp's convert-time permutation
                heads = 4 if name == "attn_q" else 2
                w = w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
            if name.startswith("ffn_") and w.ndim == 2:
                q8 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(f"blk.{i}.{name}.weight", q8, raw_shape=q8.shape,
                                  raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                writer.add_tensor(f"blk.{i}.{name}.weight", w)
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return hf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_gguf(path)


def test_gguf_file_matches_transformers_gguf_loader(tiny_gguf):
    from transformers import AutoModelForCausalLM

    path, source = tiny_gguf
    model, tokenizer = load_model(path)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    ids = torch.tensor([tokenizer.encode("the tether")])
    with torch.no_grad():
        ours = model(ids)
        assert (ours - theirs(ids).logits).abs().max() < 1e-5
        assert (ours - source(ids).logits).abs().max() < 1e-2  # only Q8_0 rounding away from the source weights
    assert torch.equal(model.model.layers[1].self_attn.q_proj.weight, source.model.layers[1].self_attn.q_proj.weight)
    assert tokenizer.eos_token == "<|im_end|>"


def test_unsupported_or_malformed_gguf_is_a_clear_error(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(tmp_path / "phi.gguf", "phi2")
    writer.add_block_count(1)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(CheckpointError, match="phi.gguf: unsupported GGUF architecture 'phi2'"):
        load_model(tmp_path / "phi.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF but not really")
    with pytest.raises(CheckpointError, match="junk.gguf: not a readable GGUF file"):
        load_model(tmp_path / "junk.gguf")


def test_embedded_folder_is_converted_once_atomically(tiny_gguf, tmp_path, monkeypatch):
    """The embedded model's conversion (here of the tiny GGUF) leaves one complete folder, found by alias."""
    import qerl.model.loading

    path, source = tiny_gguf
    monkeypatch.setattr(qerl.model.loading, "embedded_gguf_path", lambda: path)
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))
    folder = embedded_model_path()
    assert folder.parent == tmp_path / "cache" and resolve_model("smollm2") == folder == resolve_model("embedded")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary folder left behind
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert embedded_model_path() == folder and (folder / "model.safetensors").stat().st_mtime_ns == stamp
    model, tokenizer = load_model("embedded")
    ids = torch.tensor([tokenizer.encode("the tether")])
    with torch.no_grad():
        assert (model(ids) - source(ids).logits).abs().max() < 1e-2


# A model folder that names code of its own: transformers would ask "Do you wish to run the custom code? [y/N]" and
# import it on a yes. This module writes a marker when imported: it must never be.
EVIL_MODULE = '''
from pathlib import Path
Path({marker!r}).write_text("ran")
from transformers import PreTrainedTokenizerFast, LlamaConfig
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
class EvilConfig(LlamaConfig):
    model_type = "evil"
'''
CUSTOM_CODE = {  # the file that names the code, and what it adds to the folder's own
    "tokenizer_config.json": {"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}},
    "config.json": {"auto_map": {"AutoConfig": "evil.EvilConfig"}},
}


@pytest.mark.parametrize("command", ["train", "eval"])
@pytest.mark.parametrize("file", CUSTOM_CODE)
def test_a_model_folder_that_names_custom_code_is_refused_in_one_line_and_runs_nothing(tiny_llama_dir, tmp_path,
                                                                                     qerl_here, monkeypatch, file,
                                                                                     command):
    import io

    folder, marker = copy_folder(tiny_llama_dir, tmp_path / "model"), tmp_path / "ran"
    (folder / "evil.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    (folder / file).write_text(json.dumps({**json.loads((folder / file).read_text()), **CUSTOM_CODE[file]}))
    answer = io.StringIO("y\n")  # what a user might type at transformers' prompt: nothing may ask
    monkeypatch.setattr("sys.stdin", answer)
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))  # where transformers would copy the code
    code, out, err = qerl_here(command, "--params", "params/tiny.yaml", "-S", "tracking.backend=none",
                               "-S", f"model.path={folder}", "--out", tmp_path / "out")
    assert code == 2, err
    assert err.strip().splitlines()[-1] == (
        f"qerl: error: {folder / file}: key 'auto_map' names custom code to run "
        f"({', '.join(CUSTOM_CODE[file]['auto_map'])}); qerl runs no code from a model folder: use a model whose "
        "architecture transformers implements, or remove 'auto_map' if the folder does not need it")
    assert not marker.exists()
    assert answer.tell() == 0 and "custom code?" not in out + err  # no prompt, nothing read from stdin
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("file", CUSTOM_CODE)
def test_qerl_quantize_of_a_folder_that_names_custom_code_is_refused_and_writes_nothing(tiny_llama_dir, tmp_path,
                                                                                       qerl_here, file):
    """It copied the code and the `auto_map` into an output that looked like a qerl quantization."""
    folder = copy_folder(tiny_llama_dir, tmp_path / "model")
    (folder / "evil.py").write_text(EVIL_MODULE.format(marker=str(tmp_path / "ran")))
    (folder / file).write_text(json.dumps({**json.loads((folder / file).read_text()), **CUSTOM_CODE[file]}))
    code, _, err = qerl_here("quantize", "--model", folder, "--out", tmp_path / "out")
    assert code == 2, err
    assert err.strip().splitlines()[-1].startswith(f"qerl: error: {folder / file}: key 'auto_map' names custom code")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


BOM = b"\xef\xbb\xbf"
UNREADABLE_JSON = {  # how the file is spoilt -> what the line says of it
    "a byte-order mark": (lambda raw: BOM + raw, "starts with a UTF-8 byte-order mark, which transformers' JSON "
                          "reader refuses: save it as UTF-8 without one"),
    "trailing text": (lambda raw: raw + b"\n}\n", "invalid JSON (Extra data: "),
}


@pytest.mark.parametrize("how", UNREADABLE_JSON)
@pytest.mark.parametrize("file", ["tokenizer_config.json", "config.json", "tokenizer.json"])
@pytest.mark.parametrize("command", ["quantize", "train"])
def test_a_model_folders_unreadable_json_is_one_line_naming_the_file(tiny_llama_dir, tmp_path, qerl_here, file, how,
                                                                      command):
    """transformers' own error (`Unexpected UTF-8 BOM`, `Extra data`) named no file; a quantization copied a
    tokenizer_config.json no loader reads. A BOM is refused as transformers refuses it, so what qerl accepts loads
    elsewhere too."""
    folder = copy_folder(tiny_llama_dir, tmp_path / "model")
    spoil, said = UNREADABLE_JSON[how]
    (folder / file).write_bytes(spoil((folder / file).read_bytes()))
    args = (["quantize", "--model", folder] if command == "quantize" else
            ["train", "--params", "params/tiny.yaml", "-S", "tracking.backend=none", "-S", f"model.path={folder}"])
    code, _, err = qerl_here(*args, "--out", tmp_path / "out")
    assert code == 2, err
    assert err.strip().splitlines()[-1].startswith(f"qerl: error: {folder / file}: {said}"), err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def sharded_outside(folder: Path) -> str:
    """The index maps every tensor to a shard outside the folder (a sibling's weights, or any file the user can
    read): the quantization read it and wrote it out as the folder's own."""
    outside = folder.parent / "elsewhere.safetensors"
    (folder / "model.safetensors").rename(outside)
    with safe_open(outside, framework="pt") as f:
        names = list(f.keys())
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "../elsewhere.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return "model.safetensors.index.json: shard '../elsewhere.safetensors' is not a file of this folder (an index " \
           "names its shards by file name)"


def config_a_list(folder: Path) -> str:
    (folder / "config.json").write_text("[]\n")
    return "config.json: expected a JSON object (the model's settings), got list"


def weights_garbage(folder: Path) -> str:
    (folder / "model.safetensors").write_bytes(b"\0" * 100)
    return "model.safetensors: cannot read safetensors ("


def processor_names_code(folder: Path) -> str:
    (folder / "evil.py").write_text("raise SystemExit('ran')\n")
    (folder / "preprocessor_config.json").write_text(json.dumps({"auto_map": {"AutoProcessor": "evil.P"}}))
    return "preprocessor_config.json: key 'auto_map' names custom code to run (AutoProcessor)"


# Before: an AttributeError, a SafetensorError and a KeyError (exit 1, no file named, the shard outside read), and a
# processor's auto_map copied into the output beside its code
UNQUANTIZABLE = {"index names a shard outside the folder": sharded_outside, "config.json a list": config_a_list,
                 "weights garbage": weights_garbage, "a processor names custom code": processor_names_code}


@pytest.mark.parametrize("how", UNQUANTIZABLE)
def test_qerl_quantize_of_a_folder_it_cannot_take_as_it_is_is_one_line_naming_the_file(tiny_llama_dir, tmp_path,
                                                                                         qerl_here, how):
    folder = copy_folder(tiny_llama_dir, tmp_path / "model")
    said = UNQUANTIZABLE[how](folder)
    code, _, err = qerl_here("quantize", "--model", folder, "--out", tmp_path / "out")
    assert code == 2, err
    assert err.strip().splitlines()[-1].startswith(f"qerl: error: {folder}/{said}"), err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_quantize_checkpoint_itself_reads_no_shard_outside_the_folder(tiny_llama_dir, tmp_path):
    """Beside the commands' check of the folder: `qerl export` quantizes a dense base through it too."""
    from qerl.quant.checkpoint import quantize_checkpoint

    folder = copy_folder(tiny_llama_dir, tmp_path / "model")
    said = sharded_outside(folder)
    with pytest.raises(ValueError) as err:
        quantize_checkpoint(folder, tmp_path / "out", "nvfp4", progress=False)
    assert str(err.value) == f"{folder}/{said}"


def test_qerl_quantize_copies_no_code_from_the_model_folder(tiny_llama_dir, tmp_path, qerl_here, caplog):
    """Python files beside the weights (a modeling_*.py no config names) were copied into the output as side files:
    nothing there runs them, but a quantization is no place to pass code on."""
    folder = copy_folder(tiny_llama_dir, tmp_path / "model")
    (folder / "modeling_extra.py").write_text("raise SystemExit('ran')\n")
    with caplog.at_level(logging.INFO):
        code, _, err = qerl_here("quantize", "--model", folder, "--out", tmp_path / "out")
    assert code == 0, err
    assert not list((tmp_path / "out").glob("*.py"))
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()  # the other side files still are
    assert any("modeling_extra.py" in r.getMessage() and "not copied" in r.getMessage() for r in caplog.records)


def test_every_transformers_load_in_qerl_refuses_remote_code():
    """Beside the check above, each `from_pretrained` call of qerl's says trust_remote_code=False itself."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for file in [*(root / "qerl").rglob("*.py"), *(root / "benchmarks").rglob("*.py")]:
        for call in re.finditer(r"\w+\.from_pretrained\((?:[^()]|\([^()]*\))*\)", file.read_text()):
            if "PeftModel" in call.group(0) or '"' + "{" in call.group(0):  # an adapter; text written for users
                continue
            assert "trust_remote_code=False" in call.group(0), f"{file}: {call.group(0)}"
