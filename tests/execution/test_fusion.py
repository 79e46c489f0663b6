"""Fused q/k/v and gate/up projections (`qerl.execution.fusion`): the same numbers as separate layers, one copy of the
weights, state dicts and adapters unchanged, LoRA updates and moves followed. CPU (fp32); on CUDA the engine's graphs
read the same groups (test_engine's GPU tests run the fused model through `load_base_model`)."""
import pytest
import torch

from qerl.execution import fusion
from qerl.model.lora import LoraSettings, adapters_disabled, apply_lora, lora_layers, merged_state_dict
from qerl.quant.linear import QuantLinear, quantize_model
from qerl.rollout.engine import RolloutEngine
from tests.rollout.test_engine import prompts, tiny


def lora_model(model_type="qwen2", scheme=None, dropout=0.0, seed=0):
    model = tiny(model_type, seed=seed)
    if scheme:
        quantize_model(model, scheme)
    apply_lora(model, LoraSettings(rank=4, alpha=8, dropout=dropout,
                                   target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj")))
    with torch.no_grad():  # non-zero B, so the adapters change the output; seeded by position, not by id()
        for i, layer in enumerate(lora_layers(model).values()):
            layer.lora_B.normal_(0, 0.3, generator=torch.Generator().manual_seed(1000 * seed + i))
    return model


# Fused and separate layers sum the same products in another order (one GEMM over the concatenated weights): they
# agree to the dtype's rounding, scaled by the values' size, not bit for bit.
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=2e-3),
             torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def assert_same_numbers(actual, expected, what=""):
    torch.testing.assert_close(actual, expected, **TOLERANCE[expected.dtype], msg=lambda m: f"{what}: {m}")


def twins(model_type="qwen2", scheme=None, dropout=0.0):
    """(separate, fused) copies of one model with the same adapters."""
    a, b = lora_model(model_type, scheme, dropout), lora_model(model_type, scheme, dropout)
    b.load_state_dict(a.state_dict())
    assert b.fuse_projections() == 2 * len(b.model.layers)
    return a, b


def storage_bytes(model) -> int:
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers(), *(t for m in model.modules() if isinstance(m, QuantLinear)
                                                       for t in m.quantized_tensors().values())):
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


@pytest.mark.parametrize("scheme", [None, "nvfp4", "mxfp4"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_fused_forward_and_lora_grads_match_separate_layers(model_type, scheme):
    a, b = twins(model_type, scheme)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(7))
    la, lb = a(ids), b(ids)
    assert_same_numbers(lb, la, "logits")
    la.square().mean().backward()
    lb.square().mean().backward()
    grads_a = {n: p.grad for n, p in a.named_parameters() if p.requires_grad}
    grads_b = {n: p.grad for n, p in b.named_parameters() if p.requires_grad}
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == 7 * 2 * 2
    for n in grads_a:
        assert grads_b[n] is not None, n
        assert_same_numbers(grads_b[n], grads_a[n], n)


def test_dropout_keeps_one_mask_per_member():
    a, b = twins(dropout=0.5)
    a.train(), b.train()
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(3)
    la = a(ids)
    torch.manual_seed(3)
    lb = b(ids)
    assert torch.allclose(la, lb, atol=1e-5)  # same draws in the same order as the separate layers


@pytest.mark.parametrize("scheme", [None, "nvfp4"])
def test_weights_held_once_and_state_dict_unchanged(scheme):
    model = lora_model(scheme=scheme)
    before_bytes, before = storage_bytes(model), {k: v.clone() for k, v in model.state_dict().items()}
    model.fuse_projections()
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    # concatenated, not copied (NVFP4: the group keeps one shared 4-byte global scale instead of one per member)
    assert 0 <= before_bytes - storage_bytes(model) <= (4 * 3 * len(model.model.layers) if scheme else 0)
    attn = model.model.layers[0].self_attn
    if scheme:
        assert attn.q_proj.base.weight_packed is None and attn.q_proj.base.rows_of is not None
    merged = dict(merged_state_dict(model, torch.float32))
    fusion.unfuse_projections(model)
    assert all(torch.equal(merged[k], v) for k, v in merged_state_dict(model, torch.float32))


@pytest.mark.parametrize("scheme", [None, "nvfp4"])
def test_decode_path_follows_optimizer_steps_and_adapter_switches(scheme):
    a, b = twins(scheme=scheme)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    attn_a, attn_b = a.model.layers[1].self_attn, b.model.layers[1].self_attn

    def check():
        with torch.no_grad():
            for got, want in zip(attn_b.project_qkv(x, fused=True), attn_a.project_qkv(x, fused=True)):
                assert torch.allclose(got, want, atol=1e-4)
            return attn_b.project_qkv(x, fused=True)[1]

    before = check()
    ids = torch.randint(0, 97, (1, 4), generator=torch.Generator().manual_seed(4))
    a(ids).sum().backward()
    grads = {n: p.grad for n, p in a.named_parameters() if p.requires_grad}
    for model in (a, b):  # an optimizer step writes the factors in place; both take the same step (Adam divides by
        # the gradient's size, so gradients that differ in the last bit could move the twins apart by lr)
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        for n, p in params.items():
            p.grad = grads[n].clone()
        torch.optim.AdamW(params.values(), lr=0.1).step()
    assert not torch.allclose(check(), before, atol=1e-2)  # the step moved the output the check compares
    with adapters_disabled(a), adapters_disabled(b):
        check()
    with torch.no_grad():  # a write that bumps no version counter: the engine's sync re-copies it
        for m in (attn_a.k_proj, attn_b.k_proj):
            m.lora_B.data.add_(1.0)
    b.sync_projections()
    check()


@pytest.mark.parametrize("scheme", [None, "nvfp4"])
def test_moves_and_loads_rebuild_the_group(scheme):
    a, b = twins(scheme=scheme)
    b.double()  # members get private copies; the group re-concatenates at its next call
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(6))
    assert torch.allclose(a.double()(ids), b(ids), atol=1e-8)
    c = lora_model(scheme=scheme, seed=5)
    b.load_state_dict(c.double().state_dict())  # loaded rows are the members' own; the group follows them
    assert torch.allclose(c(ids), b(ids), atol=1e-8)
    group = fusion.groups(b)[0]
    assert group._current()


def test_layers_that_cannot_be_one_gemm_stay_separate():
    model = tiny("llama")
    quantize_model(model, "nvfp4")
    attn = model.model.layers[0].self_attn
    attn.k_proj.weight_global_scale.mul_(2)  # no longer one NVFP4 weight
    assert model.fuse_projections() == 2 * len(model.model.layers) - 1
    assert fusion.GROUP_ATTR not in attn.__dict__ and attn.k_proj.rows_of is None


def test_engine_tokens_unchanged_by_fusion():
    a, b = twins(scheme="nvfp4")
    ps = prompts(4)
    kw = dict(max_new_tokens=6, temperature=0.0)
    out_a = RolloutEngine(a, fused=True).generate(None, ps, **kw)
    out_b = RolloutEngine(b, fused=True).generate(None, ps, **kw)
    assert out_a.completion_ids == out_b.completion_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["bf16", "nvfp4"])
def test_gpu_fused_training_step_matches_separate(scheme):
    from tests.rollout.test_engine import gpu_model

    (a, pa), (b, pb) = gpu_model(scheme), gpu_model(scheme, fuse=True)
    ids = torch.randint(0, 1024, (4, 64), generator=torch.Generator().manual_seed(0)).cuda()
    la, lb = a(ids).float(), b(ids).float()
    assert (la - lb).abs().max() <= 0.02 * la.abs().max()
    la.logsumexp(-1).mean().backward()
    lb.logsumexp(-1).mean().backward()
    for p, q in zip(pa, pb):
        assert (p.grad.float() - q.grad.float()).norm() <= 0.05 * p.grad.float().norm()


def test_gpu_layout_setting_reaches_every_nvfp4_layer(smollm2_dir):
    """quant.gpu_layout picks the layout each layer's GPU GEMM is built in (qerl.kernels.gemm.NVFP4Gemm's `layout`): the
    loader hands it to every quantized layer, and a fused projection inherits it from its members."""
    from qerl.config import ModelSettings, QuantSettings
    from qerl.model.runtime import load_base_model

    net, _ = load_base_model(ModelSettings(path=str(smollm2_dir), device="cpu", dtype="float32"),
                             QuantSettings(scheme="nvfp4", gpu_layout="gluon"))
    layers = [m for m in net.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 7 * len(net.model.layers) and {m.gpu_layout for m in layers} == {"gluon"}
    net.fuse_projections()
    assert net.model.layers[0].self_attn.q_proj.rows_of.gpu_layout == "gluon"
