"""The update's speed paths compute what the plain ops compute: LoRA's update in the GEMM epilogue (`add_low_rank`),
the fused elementwise ops (`qerl.execution.training_ops`), and recomputing only some blocks (`qerl.model.recompute`).

The one-GEMM LoRA path runs on CUDA only in the product; here it is switched on for the CPU (fp32) to check its
forward and gradients against the separate ops. The fused kernels are checked on the GPU (Liger's and inductor's
kernels, bf16)."""

import pytest
import torch

from qerl.config import load_settings
from qerl.execution import fusion, low_rank, training_ops
from qerl.model import recompute
from qerl.quant.linear import QuantLinear
from tests.execution.test_fusion import lora_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids)
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("fuse", [False, True, "mixed-scaling"])
@pytest.mark.parametrize("scheme", [None, "nvfp4"])
def test_lora_update_in_the_gemm_epilogue_gives_the_same_output_and_gradients(monkeypatch, fuse, scheme):
    """The one-GEMM LoRA path (its scaling in the GEMM's alpha where a fused group's adapters share one, in a
    scaled copy of each B where they differ) computes the separate ops' output and gradients."""
    model = lora_model("qwen2", scheme, seed=1)
    if fuse == "mixed-scaling":
        model.model.layers[0].self_attn.k_proj.scaling *= 3
    if fuse:
        model.fuse_projections()
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(5))
    ref_out, ref_grads = _loss_and_grads(model, ids)
    monkeypatch.setattr(low_rank, "ONE_GEMM_DEVICES", {"cuda", "cpu"})  # LoRA layers' and fused groups' alike
    out, grads = _loss_and_grads(model, ids)
    assert torch.allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) == 7 * 2 * 2
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-5, rtol=1e-4), name  # fp32 sums in other orders


def test_one_gemm_path_is_taken_where_enabled(monkeypatch):
    """The epilogue path must really run (else the test above compares the plain ops with themselves)."""
    calls = []
    real = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = lora_model("qwen2", None, seed=1)
    ids = torch.randint(0, 97, (1, 4), generator=torch.Generator().manual_seed(5))
    model(ids)
    assert not calls  # the CPU keeps its separate ops
    monkeypatch.setattr(low_rank, "ONE_GEMM_DEVICES", {"cpu"})
    model(ids)
    assert len(calls) == 7 * len(model.model.layers)


@pytest.mark.parametrize("blocks", [0, 1, 2])
def test_recomputing_some_blocks_gives_the_same_gradients(blocks):
    model = lora_model("llama", None, seed=2).train()
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(6))
    model.gradient_checkpointing = False
    _, ref = _loss_and_grads(model, ids)
    model.gradient_checkpointing = blocks
    _, grads = _loss_and_grads(model, ids)
    for name, g in grads.items():
        assert torch.allclose(g, ref[name], atol=1e-6), name


def test_recompute_plan_follows_the_setting_and_recomputes_nothing_on_the_cpu():
    model = lora_model("llama", None, seed=2)
    ids, attn = torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)
    layers = len(model.model.layers)
    assert recompute.plan(model.model, ids, attn, True) == recompute.MemoryPlan(layers, 0)
    assert recompute.plan(model.model, ids, attn, False) == recompute.MemoryPlan(0, 0)
    assert recompute.plan(model.model, ids, attn, "auto") == recompute.MemoryPlan(0, 0)  # and holds no weights


def test_settings_take_auto_true_false_and_name_the_choices():
    assert load_settings(overrides=[]).model.gradient_checkpointing == "auto"
    assert load_settings(overrides=["model.gradient_checkpointing=true"]).model.gradient_checkpointing is True
    assert load_settings(overrides=["model.training_kernels=liger"]).model.training_kernels == "liger"
    with pytest.raises(Exception, match="model.training_kernels = 'triton'.*'compile'"):
        load_settings(overrides=["model.training_kernels=triton"])


def test_the_cpu_always_runs_the_eager_ops():
    assert not training_ops.TrainingOps("compile")._fast(torch.randn(3, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_silu_mul_keeps_two_inputs_and_gives_eagers_bits(dtype):
    """Off the fused kernels, SiLU(gate) * up saves gate and up only (not SiLU(gate) too), and its output and
    gradients are bitwise those of the plain ops: the CPU's numbers do not move."""
    g = torch.Generator().manual_seed(0)
    gate, up, w = (torch.randn(50, 24, generator=g).to(dtype) for _ in range(3))
    gate.requires_grad_(True)
    up.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = training_ops.EAGER.silu_mul(gate, up)
    assert len(saved) == 2
    grads = torch.autograd.grad((out * w).sum(), (gate, up))
    ref = torch.nn.functional.silu(gate) * up
    ref_grads = torch.autograd.grad((ref * w).sum(), (gate, up))
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_fused_gate_up_halves_are_found_and_nothing_else():
    """The SwiGLU kernel reads a fused gate/up output in place: its halves as the fused group (or Phi-3's chunk)
    split them, 2-D and 3-D, are found; separate tensors, other splits and strided halves are not."""
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(12, 2 * 40, generator=g)
    gate, up = flat.split([40, 40], dim=-1)
    assert training_ops._fused_halves(gate, up) is not None
    assert training_ops._fused_halves(gate, up).data_ptr() == flat.data_ptr()
    gate3, up3 = flat.view(3, 4, 80).chunk(2, dim=-1)  # add_low_rank's view of a 2-D addmm, then split
    fused = training_ops._fused_halves(gate3, up3)
    assert fused is not None and fused.shape == (3, 4, 80) and torch.equal(fused[..., 40:], up3)
    assert training_ops._fused_halves(up, gate) is None  # up first: not the gate-then-up layout
    assert training_ops._fused_halves(gate.clone(), up.clone()) is None
    a, b, _ = torch.randn(12, 120, generator=g).split([40, 40, 40], dim=-1)  # two thirds of a wider tensor
    assert training_ops._fused_halves(a, b) is None
    assert training_ops._fused_halves(*flat[::2].split([40, 40], dim=-1)) is None  # every other row: not contiguous

    class ViewOfAnInternal(torch.autograd.Function):  # as a custom GEMM Function returning a reshape of its result
        @staticmethod
        def forward(ctx, x):
            return (x * 2).view(3, 4, 80)

        @staticmethod
        def backward(ctx, dy):
            return dy.reshape(12, 80) * 2

    gate, up = ViewOfAnInternal.apply(flat.clone().requires_grad_()).split([40, 40], dim=-1)
    assert gate._base is not None and not gate._base.requires_grad  # the internal: reading it would cut the graph
    assert training_ops._fused_halves(gate, up) is None


# ---------------------------------------------------------------------------------------------------------- GPU


@needs_cuda
@pytest.mark.parametrize("shape", [(5, 96), (2, 37, 18944)])
def test_gpu_swiglu_on_fused_halves_matches_liger_and_writes_the_fused_gradient(shape):
    """Our SwiGLU on a fused gate/up output (kernels/swiglu.py, what training_ops.silu_mul runs for such halves)
    gives Liger's forward and gradients, with the gradient in the fused tensor's layout and no copy of the halves."""
    from qerl.kernels import swiglu

    if training_ops._liger() is None:
        pytest.skip("liger-kernel is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    *rows, inter = shape
    fused = torch.randn(*rows, 2 * inter, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    weight = torch.randn(*rows, inter, device="cuda", dtype=torch.bfloat16, generator=g)
    ours = swiglu.SiluMulFused.apply(fused)
    (grad,) = torch.autograd.grad((ours.float() * weight).sum(), fused)
    gate, up = fused.detach().chunk(2, dim=-1)
    gate, up = gate.contiguous().requires_grad_(), up.contiguous().requires_grad_()
    ref = training_ops._liger().LigerSiLUMulFunction.apply(gate, up)
    ref_grads = torch.autograd.grad((ref.float() * weight).sum(), (gate, up))
    assert grad.shape == fused.shape and grad.is_contiguous()
    for a, b in ((ours, ref), (grad[..., :inter], ref_grads[0]), (grad[..., inter:], ref_grads[1])):
        ulp = (a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-3)
        assert (ulp > 2 ** -7).float().mean() < 1e-3, (ulp > 2 ** -7).float().mean()  # a rare 1-ulp tie apart
    gate_v, up_v = fused.split(inter, dim=-1)
    assert torch.equal(training_ops.TrainingOps("liger").silu_mul(gate_v, up_v), ours)  # the views take our kernel




@needs_cuda
@pytest.mark.parametrize("backend", ["compile", "liger"])
def test_gpu_fused_elementwise_ops_match_eager(backend):
    if backend == "liger" and training_ops._liger() is None:
        pytest.skip("liger-kernel is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 37, 512, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    w = (1 + 0.1 * torch.randn(512, device="cuda", generator=g)).bfloat16().requires_grad_()
    gate, up = (torch.randn(3, 37, 1024, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
                for _ in range(2))
    q = torch.randn(3, 37, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2).requires_grad_()
    pos = torch.arange(37, device="cuda").expand(3, 37)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    emb = torch.cat([pos[..., None].float() * inv] * 2, dim=-1)[:, None]
    cos, sin = emb.cos(), emb.sin()

    def run(ops):
        outs = [ops.rms_norm(x, w, 1e-6), ops.silu_mul(gate, up), ops.rope(q, cos, sin)]
        sum((o.float() * torch.linspace(-1, 1, o.shape[-1], device="cuda")).sum() for o in outs).backward()
        grads = [t.grad.clone() for t in (x, w, gate, up, q)]
        for t in (x, w, gate, up, q):
            t.grad = None
        return outs, grads

    ref_outs, ref_grads = run(training_ops.EAGER)
    ops = training_ops.TrainingOps(backend)
    assert ops.backend == backend
    outs, grads = run(ops)
    for o, r in zip(outs + grads, ref_outs + ref_grads):
        rel = (o.float() - r.float()).norm() / r.float().norm()
        assert rel < 1e-2, rel  # bf16 operands: a few ulp of difference at most


@needs_cuda
def test_gpu_recompute_plan_keeps_what_fits_and_recomputes_the_rest():
    from tests.rollout.test_engine import gpu_model

    model, _ = gpu_model("bf16")
    model.train()
    ids = torch.randint(0, 1024, (4, 256), device="cuda")
    attn = torch.ones_like(ids)
    recompute.block_activation_bytes(model.model, ids, attn)  # one-offs (cuBLAS workspace) out of the measurement
    per_block = recompute.block_activation_bytes(model.model, ids, attn)
    assert per_block > 4 * 256 * 512 * 2, per_block  # at least the block's output, bf16
    layers = len(model.model.layers)
    planned = recompute.plan(model.model, ids, attn, "auto")
    free, total = torch.cuda.mem_get_info()
    free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    assert planned.recomputed_blocks == 0, planned  # a small model on a large card keeps everything
    # ... and what the kept activations and the margin (8% of the card + 1 GiB + 3 blocks) leave is spare
    kept = free - layers * per_block
    assert kept - 0.07 * total - 2**30 > planned.spare_bytes > kept - 0.09 * total - 2**30 - 4 * per_block, planned
    # A margin leaving room for about 1.5 blocks: all but one block recomputes (the measurement may vary by a bit)
    planned = recompute.plan(model.model, ids, attn, "auto", margin_bytes=free - int(1.5 * per_block))
    assert planned.recomputed_blocks in (layers - 1, layers - 2), (planned, per_block, free)
    assert planned.spare_bytes < per_block
    # A run that set gradient_checkpointing: true asked for memory first: every block recomputes, nothing is held
    assert recompute.plan(model.model, ids, attn, True, margin_bytes=free // 2) == recompute.MemoryPlan(layers, 0)


needs_gluon = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                                 reason="the FP8 update needs a Hopper GPU (the Gluon layout)")


def smooth_model(scheme: str = "nvfp4"):
    """A random Llama-shaped model (hidden 512, 4 layers) initialized as nn.Linear does (std ~0.58/sqrt(fan-in)), as
    the benchmarks' random 7B is: a rounding error stays a small error through its layers. (The decode tests' models,
    twice that gain, are chaotic on purpose: a 1% perturbation grows to whole nats there, whatever its source.)
    Decoder linears in NVFP4 (the Gluon layout on Hopper) or bf16, LoRA r = 8 live, projections fused."""
    from qerl.model.transformer import ModelConfig, Transformer
    from tests.test_families import frozen_with_live_lora

    cfg = ModelConfig.from_hf({"model_type": "llama", "hidden_size": 512, "intermediate_size": 1536,
                               "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                               "vocab_size": 1024, "max_position_embeddings": 1024})
    torch.manual_seed(0)
    model = Transformer.from_config(cfg, dtype=torch.bfloat16, device="cuda").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed" in name:
                p.normal_(0, 1.0)
            elif p.dim() == 2:
                p.normal_(0, 0.58 / p.shape[1] ** 0.5)
            else:
                p.fill_(1.0)
    return frozen_with_live_lora(model, scheme)


@needs_gluon
@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4-qerl-layout", "bf16", "fp8"])
def test_gpu_fp8_update_agrees_with_bf16_and_runs_fp8(monkeypatch, scheme):
    """model.base_gemm = fp8: the update's forward and dx GEMMs of the frozen base (NVFP4 in the Gluon layout or in
    another, e.g. a shape Gluon cannot hold; bf16; or an FP8 base: quant.scheme fp8) in FP8. The evidence a user needs: per-token log-probs close
    to the bf16 update's, LoRA gradients pointing the same way, and the FP8 GEMMs really ran (forward and backward
    of every layer)."""
    from qerl.kernels import gemm
    from qerl.execution import update_precision
    from qerl.quant import fp8

    layout = "qerl" if scheme == "nvfp4-qerl-layout" else "gluon"
    scheme = "nvfp4" if scheme == "nvfp4-qerl-layout" else scheme

    calls = {"fwd": 0, "bwd": 0}
    if scheme == "nvfp4":
        fwd, bwd = gemm.NVFP4Gemm._forward_fp8, gemm.NVFP4Gemm._grad_input_fp8
        monkeypatch.setattr(gemm.NVFP4Gemm, "_forward_fp8",
                            lambda s, x: calls.__setitem__("fwd", calls["fwd"] + 1) or fwd(s, x))
        monkeypatch.setattr(gemm.NVFP4Gemm, "_grad_input_fp8",
                            lambda s, d: calls.__setitem__("bwd", calls["bwd"] + 1) or bwd(s, d))
    elif scheme == "fp8":  # the FP8 base's _scaled_mm products (kernels/fp8_gemm.py)
        fwd, bwd = gemm.FP8Gemm._forward, gemm.FP8Gemm._grad_input
        monkeypatch.setattr(gemm.FP8Gemm, "_forward", lambda s, b, x: (
            b == "fp8_weight" and calls.__setitem__("fwd", calls["fwd"] + 1)) or fwd(s, b, x))
        monkeypatch.setattr(gemm.FP8Gemm, "_grad_input", lambda s, b, d: (
            b == "fp8_weight" and calls.__setitem__("bwd", calls["bwd"] + 1)) or bwd(s, b, d))
    else:  # count the frozen bf16 linears' FP8 autograd calls
        forward, backward = fp8._FP8Linear.forward, fp8._FP8Linear.backward
        monkeypatch.setattr(fp8._FP8Linear, "forward", staticmethod(
            lambda ctx, *a: calls.__setitem__("fwd", calls["fwd"] + 1) or forward(ctx, *a)))
        monkeypatch.setattr(fp8._FP8Linear, "backward", staticmethod(
            lambda ctx, *a: calls.__setitem__("bwd", calls["bwd"] + 1) or backward(ctx, *a)))
    model = smooth_model(scheme)
    for m in [*model.modules(), *(g.fused for g in fusion.groups(model))]:
        if isinstance(m, QuantLinear):
            m.gpu_layout = layout  # quant.gpu_layout, as prepare_base sets it (read at each layer's first forward)
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, 1024, (4, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def logp_and_grads(precision):
        for p in params:
            p.grad = None
        with update_precision(model, precision):
            logits = model(ids)[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
            (-logp.mean()).backward()
        return logp.detach(), torch.cat([p.grad.flatten().float() for p in params])

    logp16, g16 = logp_and_grads("bf16")
    assert calls == {"fwd": 0, "bwd": 0}
    if scheme == "nvfp4":  # the layout asked for, in every layer (built at the first forward)
        layouts = {m._gemm.layout for m in model.modules() if getattr(m, "_gemm", None) is not None}
        assert layouts == {layout}, layouts
    logp8, g8 = logp_and_grads("fp8")
    layers = len(model.model.layers)
    # qkv, o, gate_up, down: forward and dx (but the first qkv's: nothing before it needs a gradient)
    assert calls["fwd"] == 4 * layers and calls["bwd"] == 4 * layers - 1, calls
    gap = (logp8 - logp16).abs()
    cos = torch.nn.functional.cosine_similarity(g8, g16, dim=0).item()
    print(f"fp8 vs bf16 update: |logp gap| mean {gap.mean():.4f} max {gap.max():.4f}, LoRA grad cosine {cos:.5f}")
    assert gap.mean() <= 0.02 and cos >= 0.99


def test_the_fp8_update_leaves_cpu_linears_exact():
    """Off CUDA (and outside the FP8 update) a frozen linear is computed as it always was: `frozen_linear` is the
    hook every base projection goes through, so it must be the identity wherever FP8 does not apply."""
    from qerl.kernels.context import GemmContext
    from qerl.quant import fp8

    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 48, dtype=torch.bfloat16).requires_grad_(False)
    linear.gemm_context = GemmContext()
    x = torch.randn(5, 7, 32, dtype=torch.bfloat16)
    with linear.gemm_context.update_precision("fp8"):
        assert torch.equal(fp8.frozen_linear(linear, x), linear(x))
    assert torch.equal(fp8.frozen_linear(linear, x), linear(x))


@needs_gluon
@pytest.mark.parametrize("m, k", [(5, 96), (37, 3584), (64, 18944)])
def test_gpu_fp8_quantize_kernels_equal_their_references(m, k):
    """The FP8 update's Triton kernels (rows of activations; W and Wᵀ of a bf16 weight) write exactly what the
    PyTorch expressions they replace write, padding rows to 16 for `_scaled_mm`."""
    from qerl.kernels import fp8_rows as kern
    from qerl.kernels.gemm import fp8_rows_reference
    from qerl.quant import fp8

    g = torch.Generator("cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    q, s = kern.fp8_rows(x)
    rq, rs = fp8_rows_reference(x)
    assert q.shape[0] % 16 == 0 and q.shape[0] - m < 16
    assert torch.equal(s[:m], rs) and torch.equal(q[:m].view(torch.uint8), rq.view(torch.uint8))
    assert not q[m:].float().any() and (s[m:] == 1).all()
    column = torch.rand(k, device="cuda", generator=g) + 0.01  # the FP8 base's dx: its row scales folded into dy
    q, s = kern.fp8_rows(x, column)
    rq, rs = fp8_rows_reference(x, column)
    assert torch.equal(s[:m], rs) and torch.equal(q[:m].view(torch.uint8), rq.view(torch.uint8))
    w = torch.randn(k // 2 + 16, k, device="cuda", dtype=torch.bfloat16, generator=g)
    linear = torch.nn.Linear(k, w.shape[0], bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    linear.weight.copy_(w)
    _, inv_n, _, inv_k = fp8._scales(linear)
    for inv, transposed in ((inv_n, False), (inv_k, True)):
        got, ref = kern.weight_fp8(w, inv, transposed), fp8._weight_fp8(w, inv, transposed)
        assert got.shape == ref.shape and torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


@needs_gluon
@pytest.mark.parametrize("scheme, precision", [("nvfp4", "bf16"), ("nvfp4", "fp8"), ("bf16", "bf16")])
def test_gpu_shared_prompts_forward_agrees_with_forward(scheme, precision):
    """The update's shared-prompt forward on CUDA (`model.share_prompts`, on by default): with the fused training
    kernels, fused projections and each base GEMM precision, every real token's hidden state and the LoRA gradients
    are the plain forward's to bf16 rounding (the packed GEMMs have other shapes, so other roundings)."""
    from qerl.execution import ExecutionPlan, attach, update_precision
    from qerl.execution.shared_prompts import forward_shared_prompts
    from tests.test_model import grouped_rows

    model = smooth_model(scheme).train()
    attach(model, ExecutionPlan(training_kernels="auto"))
    params = [p for p in model.parameters() if p.requires_grad]
    ids, mask, prompt_len = grouped_rows(prompt_len=96, completion_len=160, groups=2, size=4, vocab=1024)
    ids, mask = ids.cuda(), mask.cuda()
    weights = torch.randn(*ids.shape, model.config.hidden_size, device="cuda",
                          generator=torch.Generator("cuda").manual_seed(1)) * mask[..., None]
    results = []
    for shared in (False, True):
        for p in params:
            p.grad = None
        with update_precision(model, precision):
            hidden = forward_shared_prompts(model.model, ids, mask, prompt_len) if shared \
                else model.model(ids, attention_mask=mask)
            (hidden.float() * weights).sum().backward()
        results.append(((hidden.detach().float() * mask[..., None]),
                        torch.cat([p.grad.flatten().float() for p in params])))
    (plain, plain_grad), (shared, shared_grad) = results
    rel = ((plain - shared).abs().mean() / plain.abs().mean()).item()
    cos = torch.nn.functional.cosine_similarity(plain_grad, shared_grad, dim=0).item()
    print(f"shared vs plain forward ({scheme}, {precision}): hidden rel. gap {rel:.5f}, LoRA grad cosine {cos:.6f}")
    assert rel <= 5e-3 and cos >= 0.999


@needs_gluon
@pytest.mark.parametrize("scheme", ["nvfp4", "bf16"])
def test_gpu_update_path_gives_the_plain_paths_gradients(monkeypatch, scheme):
    """The whole CUDA update path (fused kernels, fused projections, LoRA's update in the GEMM's epilogue) against
    the plain one (eager ops, separate LoRA ops): every LoRA factor gets its gradient, pointing the same way. A
    kernel that read a tensor outside the graph would leave whole layers without one."""
    from qerl.execution import ExecutionPlan, attach

    model = smooth_model(scheme).train()
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, 1024, (4, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def grads(fast: bool):
        for p in params:
            p.grad = None
        attach(model, ExecutionPlan(training_kernels="auto" if fast else "eager"))
        monkeypatch.setattr(low_rank, "ONE_GEMM_DEVICES", {"cuda"} if fast else set())
        logits = model(ids)[:, :-1].float()
        (-torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).mean()).backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
        return [p.grad.float().flatten() for p in params]

    plain, fast = grads(False), grads(True)
    worst = min(torch.nn.functional.cosine_similarity(a, b, dim=0).item() for a, b in zip(plain, fast))
    print(f"CUDA update path vs plain ({scheme}): worst per-factor gradient cosine {worst:.5f}")
    assert worst >= 0.99  # bf16 in other orders; a graph cut leaves factors without a gradient or far off


def test_held_weights_are_written_once_within_the_budget_and_freed_after():
    """qerl.kernels.gemm.weight_copy: outside `held_weights` every call writes the shared scratch; inside, each owner's
    copy is written once and read after, while the budget lasts (beyond it, the scratch as before); on exit nothing
    is held."""
    from qerl.kernels.context import GemmContext

    cpu, writes, context = torch.device("cpu"), [], GemmContext()
    a, b, c = object(), object(), object()

    def copy(owner, value):
        return context.weight_copy(owner, ("w",), 8, torch.float32, cpu,
                                   lambda flat: writes.append(owner) or flat.fill_(value).view(2, 4))

    scratch_ptr = context.scratch(8, torch.float32, cpu).data_ptr()
    assert copy(a, 1.0).data_ptr() == scratch_ptr and writes == [a]
    with context.held_weights(2 * 8 * 4) as held:  # room for two copies
        wa, wb, wc = copy(a, 1.0), copy(b, 2.0), copy(c, 3.0)
        assert held() == 64 and wc.data_ptr() == scratch_ptr and scratch_ptr not in (wa.data_ptr(), wb.data_ptr())
        writes.clear()
        assert copy(a, 9.0) is wa and copy(b, 9.0) is wb and writes == []  # kept: not written again
        assert wa.eq(1.0).all() and wb.eq(2.0).all()
        copy(c, 3.0)
        assert writes == [c]  # the one beyond the budget is written at every call
    assert not context.holding
    writes.clear()
    assert copy(a, 1.0).data_ptr() == scratch_ptr and writes == [a]


@needs_gluon
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_held_weights_give_the_same_update_and_dequantize_each_weight_once(monkeypatch, precision):
    """The trainer's update with the dequantized NVFP4 weights kept (model.keep_dequantized): bit for bit the
    gradients of dequantizing per GEMM, over two micro-batches, with each weight dequantized once (per direction in
    FP8, whose forward and dx copies are scaled along different dimensions)."""
    from qerl.kernels import gluon_nvfp4
    from qerl.execution import execution_of, held_weights, update_precision

    calls = []
    real = gluon_nvfp4.dequantize
    monkeypatch.setattr(gluon_nvfp4, "dequantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = smooth_model("nvfp4").train()
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator("cuda").manual_seed(0)
    micro_batches = [torch.randint(0, 1024, (4, 256), device="cuda", generator=gen) for _ in range(2)]

    def grads(budget):
        calls.clear()
        for p in params:
            p.grad = None
        with update_precision(model, precision), held_weights(model, budget) as held:
            for ids in micro_batches:
                logits = model(ids)[:, :-1].float()
                (-torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).mean()).backward()
            return torch.cat([p.grad.flatten() for p in params]), len(calls), held()

    per_call, dequantized, held = grads(0)
    layers = len(model.model.layers)
    assert held == 0 and dequantized == 2 * (2 * 4 * layers - 1)  # forward and dx per micro-batch
    kept, dequantized, held = grads(2**40)
    assert torch.equal(kept, per_call)
    # The GEMMs: each block's fused q/k/v and gate/up, its o and down.
    modules = [*model.modules(), *(g.fused for g in fusion.groups(model))]
    weights = {id(g): g.n * g.k for g in (getattr(m, "_gemm", None) for m in modules) if g is not None}
    assert len(weights) == 4 * layers
    first_qkv = fusion.groups(model)[0].fused._gemm  # nothing before it needs dx
    if precision == "bf16":  # one bf16 Wᵀ serves forward and dx
        assert dequantized == 4 * layers and held == 2 * sum(weights.values())
    else:  # FP8: W scaled per row for the forward, Wᵀ per row for dx, one byte each
        assert dequantized == 2 * 4 * layers - 1 and held == 2 * sum(weights.values()) - first_qkv.n * first_qkv.k
    assert not execution_of(model).gemm.holding


@needs_cuda
@pytest.mark.parametrize("chunk_size", [None, 512])  # one chunk of the default size; several, the last short
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gpu_head_kernel_gives_the_pytorch_paths_log_probs_entropies_and_gradient(monkeypatch, chunk_size,
                                                                                    temperature):
    """`qerl.kernels.vocab_softmax` under the update's head (bf16, a frozen head) computes what the PyTorch path does from
    the same bf16 logits: log-probs and entropies to fp32 reduction order, the hidden states' bf16 gradient to
    its rounding."""
    from qerl.rl.grpo import head_log_probs

    ops = training_ops.TrainingOps("compile")  # a fused backend, as the trainer's on CUDA
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(3, 700, 256, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(32000, 256, device="cuda", generator=g) / 16).bfloat16()
    ids = torch.randint(0, 32000, (3, 700), device="cuda", generator=g)
    upstream = torch.randn(3, 700, device="cuda", generator=g)

    def run(ops):
        logp, entropy = head_log_probs(hidden, weight, ids, temperature, want_entropy=True, chunk_size=chunk_size,
                                       ops=ops)
        (grad,) = torch.autograd.grad((logp * upstream).sum(), hidden)
        return logp, entropy, grad

    assert ops.head_kernel(weight) is not None
    fused = run(ops)
    ops = training_ops.TrainingOps("compile", vocab_kernel=False)  # QERL_VOCAB_KERNEL=0 (qerl.debug)
    assert ops.head_kernel(weight) is None
    plain = run(ops)
    torch.testing.assert_close(fused[0], plain[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(fused[1], plain[1], rtol=0, atol=2e-5)
    torch.testing.assert_close(fused[2].float(), plain[2].float(), rtol=2e-2, atol=1e-3)
    assert fused[2].dtype == torch.bfloat16


def test_the_head_kernel_runs_only_where_the_fused_training_kernels_do():
    """On the CPU, and with `model.training_kernels: eager` anywhere, the LM head stays PyTorch's (what it was)."""
    assert training_ops.TrainingOps("compile").head_kernel(torch.zeros(4, 2, dtype=torch.bfloat16)) is None
    if torch.cuda.is_available():
        assert training_ops.EAGER.head_kernel(torch.zeros(4, 2, dtype=torch.bfloat16, device="cuda")) is None
