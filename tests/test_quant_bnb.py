"""QLoRA's base through bitsandbytes (quant.scheme nf4-bnb): storage, kernels, and the whole trainer and engine on it.

Runs for real where bitsandbytes is installed (the `qlora` extra; 0.50 computes 4-bit on the CPU too); without it
only the one-line install error is tested. The GPU test at the end is for the CUDA kernels and graph capture.
"""
import sys

import pytest
import torch
from torch import nn

from qerl.config import ModelSettings, QuantSettings
from qerl.quant import nf4
from tests.rollout.test_engine import assert_same, prompts, tiny

INSTALL = 'pip install -e ".[qlora]"'


def test_without_bitsandbytes_the_scheme_fails_in_one_line_saying_how_to_install(monkeypatch, capsys):
    from qerl import cli
    from qerl.model.runtime import load_base_model
    from qerl.quant.bnb import require_bitsandbytes

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed: `import` raises ImportError
    expected = f"quant.scheme 'nf4-bnb' needs bitsandbytes, which is not installed: {INSTALL}"
    with pytest.raises(ImportError) as info:
        require_bitsandbytes()
    assert str(info.value) == expected
    with pytest.raises(ImportError, match="qlora"):  # before the model is loaded
        load_base_model(ModelSettings(path="/nonexistent"), QuantSettings(scheme="nf4-bnb"))
    assert cli.main(["eval", "-S", "model.path=/nonexistent", "-S", "quant.scheme=nf4-bnb", "-S", "eval.n=2"]) == 2  # bad input the user can fix
    assert capsys.readouterr().err == f"qerl: error: {expected}\n"


def test_nf4_bnb_is_quantized_at_load_only():
    from qerl.config import ConfigError, settings_from_dict

    with pytest.raises(ConfigError, match="quantized_path.*nf4-bnb quantizes at load"):
        settings_from_dict({"quant": {"scheme": "nf4-bnb", "quantized_path": "checkpoints/x"}})


# ---------------------------------------------------------------------------------------------------- with bnb


@pytest.fixture(scope="module")
def bnb():
    return pytest.importorskip("bitsandbytes")


def test_our_nf4_codec_maps_onto_a_bnb_quant_state_bit_for_bit(bnb):
    """Same NF4 table and blocks; bnb's codes are round-to-nearest against the exact absmax. Our weights, as a bnb
    state with fp32 absmax (no double quantization), dequantize in bnb to exactly what our codec gives."""
    from qerl.quant.bnb import nf4_to_bnb

    F = bnb.functional
    assert torch.equal(F.get_4bit_type("nf4", device="cpu").float(), nf4.NF4_VALUES)
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=False, quant_type="nf4")
    blocks = w.reshape(-1, 64)
    absmax = blocks.abs().amax(-1)
    assert torch.equal(state.absmax, absmax)
    nearest = torch.bucketize((blocks / absmax[:, None]).clamp(-1, 1), nf4._MIDPOINTS).reshape(-1)
    high_first = torch.stack([packed.reshape(-1) >> 4, packed.reshape(-1) & 15], -1).reshape(-1)
    assert torch.equal(high_first, nearest)

    ours = nf4.quantize(w)
    for dtype in (torch.float32, torch.bfloat16):
        packed, state = nf4_to_bnb(ours, tuple(w.shape), dtype)
        assert torch.equal(F.dequantize_4bit(packed, state), nf4.dequantize(**ours, dtype=dtype))


def test_linear_matches_its_dequantized_weight_and_loads_into_bnb_linear4bit(bnb):
    from qerl.quant.bnb import BnbLinear4bit

    torch.manual_seed(0)
    dense = nn.Linear(192, 80)
    layer = BnbLinear4bit.from_linear(dense)
    assert (layer.in_features, layer.out_features, layer.dtype) == (192, 80, torch.float32)
    assert layer.weight.quant_state.nested and layer.weight.dtype == torch.uint8  # double quant, QLoRA's recipe
    w = layer.dequantized_weight()
    ours = nf4.dequantize(**nf4.quantize(dense.weight), dtype=torch.float32)
    rms = lambda t: t.square().mean().sqrt()  # noqa: E731
    assert 0 < rms(w - dense.weight) < 1.05 * rms(ours - dense.weight)  # as close as our own NF4 codec
    x = torch.randn(5, 192, requires_grad=True)
    out = layer(x)
    torch.testing.assert_close(out, x @ w.T + dense.bias, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()  # a frozen base: gradients to the input only
    torch.testing.assert_close(x.grad, (2 * out.detach()) @ w, atol=1e-4, rtol=1e-4)
    assert not any(p.requires_grad for p in layer.parameters())

    # Linear4bit-compatible storage: the same state-dict keys, and bnb's own layer built from ours computes the same.
    state = layer.state_dict()
    real = bnb.nn.Linear4bit(192, 80, bias=True, compute_dtype=torch.float32, quant_type="nf4")
    real.load_state_dict(dense.state_dict())
    real = real.to("cpu")  # bnb quantizes on the move
    assert set(state) == set(real.state_dict())
    stats = {k.removeprefix("weight."): v for k, v in state.items() if k.startswith("weight.")}
    real.weight = bnb.nn.Params4bit.from_prequantized(state["weight"], stats, device="cpu", module=real)
    real.bias = nn.Parameter(state["bias"])
    with torch.no_grad():
        torch.testing.assert_close(real(x), out, atol=1e-4, rtol=1e-4)

    layer.to(torch.bfloat16)  # the compute dtype follows; the packed codes and their state do not change
    assert layer.dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16
    assert torch.equal(layer.weight.data, state["weight"]) and layer(x.detach()).dtype == torch.float32


def test_trainer_and_engine_run_on_a_bnb_base(bnb, tmp_path):
    """The QLoRA baseline in the same stack: LoRA on it, the engine equals the reference, a GRPO step trains."""
    from qerl.model.lora import LoraSettings, apply_lora
    from qerl.quant.bnb import BnbLinear4bit, quantize_model_bnb
    from qerl.rl.trainer import Trainer
    from qerl.rollout.backends import EngineBackend, ReferenceBackend, Sampling
    from tests.test_trainer import char_tokenizer, tiny_model, tiny_settings

    model, ps = tiny("qwen2"), prompts()
    dense = tiny("qwen2")
    replaced = quantize_model_bnb(model)
    assert len(replaced) == 2 * 7 and all(isinstance(model.get_submodule(n), BnbLinear4bit) for n in replaced)
    with torch.no_grad():  # the model computes with exactly its dequantized weights
        for name in replaced:
            dense.get_submodule(name).weight.copy_(model.get_submodule(name).dequantized_weight())
        ids = torch.tensor([ps[0]])
        torch.testing.assert_close(model(ids), dense(ids), atol=1e-4, rtol=1e-4)
    for p in apply_lora(model, LoraSettings(rank=4, alpha=8)):
        p.data.normal_(0, 0.1)
    greedy = Sampling(max_new_tokens=8, temperature=0, eos_token_ids=())
    assert_same(EngineBackend(model, None, check_every=3).generate(ps, greedy),
                ReferenceBackend(model, None).generate(ps, greedy))

    settings = tiny_settings(tmp_path, quant={"scheme": "nf4-bnb"}, train={"steps": 1, "save_every": 1})
    tokenizer = char_tokenizer()
    base = tiny_model(tokenizer)
    quantize_model_bnb(base)
    base.requires_grad_(False)
    trainer = Trainer(settings, tmp_path / "run", model=base, tokenizer=tokenizer, progress=False)
    before = [p.detach().clone() for p in trainer.params]
    metrics = trainer.train_step()
    assert metrics["grad_norm"] > 0 and any(not torch.equal(a, b) for a, b in zip(before, trainer.params))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bnb_kernels_graphs_and_engine(bnb):
    """On CUDA: bnb's 4-bit GEMM (bf16) against its dequantized weight, and the engine's CUDA graphs replaying it."""
    from qerl.quant.bnb import BnbLinear4bit
    from qerl.rollout.engine import RolloutEngine
    from tests.rollout.test_engine import gpu_model

    torch.manual_seed(0)
    layer = BnbLinear4bit.from_linear(nn.Linear(1024, 512, dtype=torch.bfloat16, device="cuda"))
    for rows in (1, 8, 64):  # bnb takes a GEMV kernel for one row, a dequantize + GEMM for more
        x = torch.randn(rows, 1024, dtype=torch.bfloat16, device="cuda")
        ref = x.float() @ layer.dequantized_weight(torch.float32).T
        assert (layer(x).float() - ref).abs().max() <= 2e-2 * ref.abs().max(), rows

    model, _ = gpu_model("nf4-bnb")
    assert any(isinstance(m, BnbLinear4bit) for m in model.modules())
    ps = prompts(24, vocab=1024, seed=5, max_len=40)
    eager = RolloutEngine(model, use_graphs=False, check_every=4).generate(None, ps, 32, temperature=0,
                                                                            eos_token_ids=[])
    graphed = RolloutEngine(model, check_every=4)
    out = graphed.generate(None, ps, 32, temperature=0, eos_token_ids=[])
    print(f"nf4-bnb: graphs {graphed.use_graphs}, captures {graphed.stats['captures']}")
    assert graphed.use_graphs and graphed.stats["captures"] >= 1  # bnb's kernels capture (no host sync)
    match = sum(a == b for a, b in zip(out.completion_ids, eager.completion_ids)) / len(ps)
    assert match >= 0.9, match
