"""NVFP4 GEMM backends (qerl.kernels.gemm), their dispatch (qerl.kernels.dispatch) and the humming-layout dequantize.

CPU: the dispatch with fake timings, its disk cache (round trip, corrupt, stale, another GPU's entries), and the
table-layout dequantize kernel under Triton's interpreter against the codec, bit for bit, on a synthetic permuted
layout. GPU (`-m gpu`): every backend against the PyTorch reference, humming's effective weights, the canonical
round trip, the fallback when humming-kernels is absent, and QuantLinear keeping one copy.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import torch

from qerl.quant import nvfp4 as codec

CUDA = torch.cuda.is_available()
if not CUDA and "triton" not in sys.modules:  # as in test_kernels.py: the interpreter is chosen at import
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
from qerl.kernels import dispatch, gemm, gluon_nvfp4, humming_nvfp4  # noqa: E402
from qerl.kernels import nvfp4 as K  # noqa: E402
from qerl.kernels.context import GemmContext  # noqa: E402
from tests.patience import patience  # noqa: E402

gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(dispatch, "_capturing", lambda: False)
    return tmp_path / "gemm_dispatch.json"


def _fake(times: dict[str, float], calls: list):
    cands = {name: (lambda name=name: name) for name in times}

    def timer(fn):
        calls.append(fn())
        return times[fn()]

    return cands, timer


def test_dispatch_picks_the_fastest_measured_backend_and_caches_it(cache):
    calls = []
    cands, timer = _fake({"triton": 3e-5, "dequant_cublas": 1e-5}, calls)
    chooser = dispatch.Dispatcher(cache=cache)
    assert chooser.choose("fwd", "qerl", 4096, 1024, 200, cands, timer) == "dequant_cublas"
    assert sorted(calls) == ["dequant_cublas", "triton"]
    # same bucket (129..256): no new measurement; the choice is on disk, keyed by this environment
    assert chooser.choose("fwd", "qerl", 4096, 1024, 256, cands, timer) == "dequant_cublas"
    assert len(calls) == 2
    data = json.loads(cache.read_text())
    assert data["choices"][dispatch.environment_key()] == {"fwd|qerl|4096x1024|m256": "dequant_cublas"}
    # a new process (a new dispatcher) reads the file instead of measuring
    assert dispatch.Dispatcher(cache=cache).choose("fwd", "qerl", 4096, 1024, 130, cands,
                                                   lambda fn: pytest.fail("re-measured")) \
        == "dequant_cublas"


def test_dispatch_defaults_before_measuring_and_during_capture(cache, monkeypatch):
    cands = {"humming": lambda: None, "dequant_cublas": lambda: None}
    defaults = dispatch.Dispatcher("defaults", cache)  # execution.gemm_tuning: defaults
    assert defaults.choose("fwd", "humming", 64, 64, 8, cands, lambda fn: pytest.fail("timed")) == "humming"
    assert defaults.choose("fwd", "humming", 64, 64, 2048, cands) == "dequant_cublas"
    monkeypatch.setattr(dispatch, "_capturing", lambda: True)  # never time inside a CUDA-graph capture
    assert dispatch.Dispatcher(cache=cache).choose("bwd", "humming", 64, 64, 2048, cands,
                                                   lambda fn: pytest.fail("timed")) \
        == "dequant_cublas"
    assert not cache.exists()


def test_dispatch_ignores_a_failing_backend(cache, caplog):
    def broken():
        raise RuntimeError("out of shared memory")

    cands = {"triton": broken, "dequant_cublas": lambda: None}
    with caplog.at_level(logging.WARNING):
        pick = dispatch.Dispatcher(cache=cache).choose("fwd", "qerl", 64, 64, 4, cands, lambda fn: (fn(), 1.0)[1])
    assert pick == "dequant_cublas"
    assert "triton cannot run fwd|qerl|64x64" in caplog.text and "out of shared memory" in caplog.text



def test_compile_tuning_runs_each_backend_once_past_a_failing_one(cache, caplog):
    """execution.gemm_tuning "compile" (the precompile workers): every candidate runs once so that its kernels get
    compiled, nothing is timed or cached, and one that raises (humming's shape asserts) does not end the worker."""
    ran = []

    def humming():
        ran.append("humming")
        raise AssertionError

    cands = {"humming": humming, "dequant_cublas": lambda: ran.append("dequant_cublas")}
    with caplog.at_level(logging.WARNING):
        pick = dispatch.Dispatcher("compile", cache).choose("fwd", "humming", 960, 576, 512, cands,
                                                             lambda fn: pytest.fail("timed"))
    assert pick == "dequant_cublas" and ran == ["humming", "dequant_cublas"]
    assert "humming cannot run fwd|humming|960x576" in caplog.text
    assert not cache.exists()


def test_compile_tuning_never_returns_a_default_that_raised(cache):
    """At small M humming is the default; where its shape asserts fire (3072x576 on the GPU, 2026-11-28), compile
    tuning must hand back a backend that ran, or the layer's own call raises and the precompile worker dies. The
    choice holds for the process, so the candidates run once per shape, not once per call."""
    ran = []

    def humming():
        ran.append("humming")
        raise AssertionError

    cands = {"humming": humming, "dequant_cublas": lambda: ran.append("dequant_cublas")}
    tuner = dispatch.Dispatcher("compile", cache)
    assert dispatch.default_backend("fwd", "humming", 64) == "humming"
    for _ in range(3):
        assert tuner.choose("fwd", "humming", 3072, 576, 64, cands, lambda fn: pytest.fail("timed")) \
            == "dequant_cublas"
    assert ran == ["humming", "dequant_cublas"] and not cache.exists()


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 999, "choices": {}}),
                                     json.dumps({"version": 1, "choices": "nope"}), ""])
def test_a_corrupt_or_stale_cache_is_ignored_with_one_warning(cache, caplog, content):
    cache.write_text(content)
    calls = []
    cands, timer = _fake({"triton": 1e-5, "dequant_cublas": 2e-5}, calls)
    with caplog.at_level(logging.WARNING):
        assert dispatch.Dispatcher(cache=cache).choose("fwd", "qerl", 128, 64, 1, cands, timer) == "triton"
    assert calls, "a bad cache must lead to a fresh measurement"
    assert sum("ignoring GEMM dispatch cache" in r.message for r in caplog.records) == 1
    assert json.loads(cache.read_text())["version"] == dispatch.CACHE_VERSION  # rewritten whole


def test_another_gpus_choices_are_kept_but_not_used(cache):
    other = {"version": 1, "choices": {"Some Other GPU|torch x": {"fwd|qerl|128x64|m1": "dequant_cublas"}}}
    cache.write_text(json.dumps(other))
    calls = []
    cands, timer = _fake({"triton": 1e-5, "dequant_cublas": 2e-5}, calls)
    assert dispatch.Dispatcher(cache=cache).choose("fwd", "qerl", 128, 64, 1, cands, timer) == "triton"
    data = json.loads(cache.read_text())["choices"]
    assert data["Some Other GPU|torch x"] == other["choices"]["Some Other GPU|torch x"]
    assert data[dispatch.environment_key()] == {"fwd|qerl|128x64|m1": "triton"}


def _synthetic_tiled_layout(packed: torch.Tensor, scale: torch.Tensor, seed: int, xor: int):
    """Our tensors rearranged the way humming's repack does (a fixed permutation per 16 x 64 patch, 2N words
    per 16-column stripe; scales [K/16, N] permuted within 64 rows), with random tables: what the dequantize
    kernel must invert without knowing humming."""
    n, k = packed.shape[0], packed.shape[1] * 2
    g = torch.Generator().manual_seed(seed)
    code_tbl = torch.randperm(1024, generator=g).to(torch.int32)  # [64 * 16]: slot of (n % 64, k % 16)
    scale_tbl = torch.randperm(64, generator=g).to(torch.int32)
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(n, k).long()
    nn = torch.arange(n)[:, None]
    kk = torch.arange(k)[None, :]
    slot = (kk // 16) * (16 * n) + (nn // 64) * 1024 + code_tbl.long()[(nn % 64) * 16 + kk % 16]
    nibbles = torch.zeros(n * k, dtype=torch.long)
    nibbles[slot.reshape(-1)] = codes.reshape(-1) ^ xor
    nib = nibbles.view(-1, 8)
    words = sum((nib[:, j] << (4 * j)) for j in range(8))
    words = ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # two's complement int32
    s_out = torch.empty(k // 16, n, dtype=torch.uint8)
    srow = (torch.arange(n) // 64) * 64 + scale_tbl.long()[torch.arange(n) % 64]
    s_out[:, srow] = scale.view(torch.uint8).t()
    return words, s_out, code_tbl, scale_tbl


@pytest.mark.skipif(CUDA, reason="the GPU test below checks the real humming layout")
@pytest.mark.parametrize("transposed", [False, True])
def test_table_layout_dequantize_is_bit_identical_to_the_codec(transposed):
    from qerl.kernels import _triton_nvfp4 as tk

    if not K.interpreting():
        pytest.skip("triton was imported before TRITON_INTERPRET could be set")
    n, k, xor = 128, 96, 8
    w = torch.randn(n, k) * 0.03
    w[5, :16] = 0.0  # an all-zero block
    t = codec.quantize(w)
    words, s_out, code_tbl, scale_tbl = _synthetic_tiled_layout(t["weight_packed"], t["weight_scale"], 0, xor)
    out = torch.full((k, n) if transposed else (n, k), float("nan"), dtype=torch.float32)
    gs = t["weight_global_scale"].reshape(1).float()
    tk.table_layout_dequant_kernel[(-(-k // 64), -(-n // 128))](
        words, s_out, gs, code_tbl, scale_tbl, out, n, k, xor, BLOCK_KB=4, BLOCK_NB=2, TRANSPOSED=transposed)
    ref = codec.dequantize(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], torch.float32)
    got = out.t() if transposed else out
    assert torch.equal(got.contiguous().view(torch.int32), ref.view(torch.int32))


def test_dispatch_defaults_follow_the_measured_trade_off():
    assert dispatch.default_backend("fwd", "qerl", 1) == "triton"
    assert dispatch.default_backend("fwd", "qerl", 2048) == "dequant_cublas"
    assert dispatch.default_backend("fwd", "humming", 64) == "humming"
    assert dispatch.default_backend("bwd", "humming", 16) == "dequant_cublas"
    # a resident FP8 copy (quant.fp8_weights): the layout's own pick at few rows, the FP8 copy at many
    assert dispatch.default_backend("fwd", "gluon+fp8w", 8) == "gluon"
    assert dispatch.default_backend("fwd", "gluon+fp8w", 256) == "fp8_weight"
    assert [dispatch.m_bucket(m) for m in (1, 3, 64, 65, 9000)] == [1, 4, 64, 128, 8192]


# ---------------------------------------------------------------------------------------------------- GPU
def _weight(n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()


def _assert_same_weights(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit for bit; on failure the message says how many differ, whether only by the sign of zero, and a few."""
    g, r = got.contiguous().view(torch.int16), ref.contiguous().view(torch.int16)
    bad = g != r
    if not bool(bad.any()):
        return
    zero_sign_only = bool(((got == 0) & (ref == 0))[bad].all())
    at = bad.nonzero()[:4].tolist()
    pairs = [(tuple(i), float(ref[tuple(i)]), float(got[tuple(i)])) for i in at]
    raise AssertionError(f"{int(bad.sum())} of {ref.numel()} weights differ from qerl.quant.nvfp4.dequantize "
                         f"(only the sign of zero: {zero_sign_only}); (index, want, got): {pairs}")


needs_humming = pytest.mark.skipif(not humming_nvfp4.available(), reason="needs humming-kernels on CUDA")


@gpu
@pytest.mark.parametrize("layout", ["qerl", pytest.param("humming", marks=needs_humming)])
@pytest.mark.parametrize("m", [1, 16, 64, 300, 2048])
def test_every_backend_matches_the_pytorch_reference(layout, m, cache):
    n, k = 1024, 512
    t = codec.quantize(_weight(n, k))
    g = gemm.NVFP4Gemm(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], prefer=layout,
                       context=GemmContext(cache=cache))
    assert g.layout == layout
    w = codec.dequantize(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], torch.float64)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    for backend in g._backends("fwd"):
        y = g.forward(x, backend).double()
        ref = x.double() @ w.T
        assert ((y - ref).norm() / ref.norm()).item() < 5e-3, backend
    for backend in g._backends("bwd"):
        dx = g.grad_input(dy, backend).double()
        ref = dy.double() @ w
        assert ((dx - ref).norm() / ref.norm()).item() < 5e-3, backend
    # the dispatched path, through autograd
    xg = x.clone().requires_grad_()
    y = gemm.linear(xg, g)
    y.backward(dy)
    assert ((xg.grad.double() - dy.double() @ w).norm() / (dy.double() @ w).norm()).item() < 5e-3


@gpu
@pytest.mark.parametrize("layout", ["qerl", pytest.param("humming", marks=needs_humming)])
def test_dequantize_from_the_resident_copy_is_bit_identical(layout):
    t = codec.quantize(_weight(384, 320, seed=1))
    g = gemm.NVFP4Gemm(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], prefer=layout)
    ref = codec.dequantize(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], torch.bfloat16)
    _assert_same_weights(g.dequantize(torch.bfloat16), ref)
    _assert_same_weights(g.dequantize(torch.bfloat16, transposed=True).t(), ref)
    back = g.canonical()  # the checkpoint layout comes back exactly
    for name in ("weight_packed", "weight_scale", "weight_global_scale"):
        assert torch.equal(back[name].view(torch.uint8), t[name].reshape(back[name].shape).view(torch.uint8)), name


@gpu
@needs_humming
def test_hummings_effective_weights_equal_the_codec():
    """x = I makes the GEMM print its weights: humming must compute with exactly the weights we stored."""
    n, k = 512, 256
    t = codec.quantize(_weight(n, k, seed=2))
    g = gemm.NVFP4Gemm(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], prefer="humming")
    eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)
    effective = g.forward(eye, "humming").t()  # [n, k]
    ref = codec.dequantize(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], torch.bfloat16)
    # a sum of products never yields -0.0 (-0 + +0 = +0): E2M1's -0 code prints as +0, the same weight
    _assert_same_weights(effective, ref + 0.0)


@gpu
def test_gpu_the_default_layout_is_gluon_on_hopper_else_humming():
    """One default for every batch size: the Gluon layout on an sm_90 GPU (JIT-free, fastest decode), humming's
    elsewhere; a shape Gluon cannot hold (N % 64, K % 128) keeps humming's (or ours)."""
    t = codec.quantize(_weight(256, 128))
    g = gemm.NVFP4Gemm(t["weight_packed"], t["weight_scale"], t["weight_global_scale"])
    want = "gluon" if gluon_nvfp4.available() else "humming" if humming_nvfp4.available() else "qerl"
    assert g.layout == want
    odd = codec.quantize(_weight(256, 64))  # K = 64: not a Gluon shape
    assert gemm.NVFP4Gemm(odd["weight_packed"], odd["weight_scale"], odd["weight_global_scale"]).layout != "gluon"


@gpu
def test_without_humming_the_layer_keeps_our_layout(monkeypatch):
    monkeypatch.setattr(humming_nvfp4, "HummingLayer", None)
    monkeypatch.setattr(gluon_nvfp4, "available", lambda: False)  # not Hopper: the Gluon default does not apply
    t = codec.quantize(_weight(256, 128))
    g = gemm.NVFP4Gemm(t["weight_packed"], t["weight_scale"], t["weight_global_scale"])
    assert g.layout == "qerl" and g._backends("fwd") == ("triton", "dequant_cublas")
    with pytest.raises(RuntimeError, match="humming-kernels is not usable"):
        gemm.NVFP4Gemm(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], prefer="humming")


@gpu
@needs_humming
def test_quant_linear_keeps_one_copy_and_exports_the_checkpoint_layout():
    from qerl.quant.linear import QuantLinear

    lin = torch.nn.Linear(256, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    q = QuantLinear.from_linear(lin, "nvfp4")
    before = {k: v.clone() for k, v in q.state_dict().items()}
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    y = q(x)
    assert q.cuda_gemm().layout == ("gluon" if gluon_nvfp4.available() else "humming")
    assert q.weight_packed is None and q.weight_scale is None  # no second copy
    after = q.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)), k
    q.cpu()  # a move restores the buffers
    assert q.weight_packed is not None and q._gemm is None
    q.cuda()
    assert torch.equal(q(x), y)


def test_interpreter_tests_in_a_subprocess():
    """The interpreter tests above and below, in a fresh process when this one imported triton before
    TRITON_INTERPRET could be set (full-suite runs), as test_kernels does: otherwise they would only ever skip."""
    if CUDA or K.interpreting():
        pytest.skip("the interpreter tests run in-process (or the GPU tests cover the kernels)")
    import subprocess

    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "table_layout_dequantize_is_bit_identical or under_the_interpreter"],
                       capture_output=True, text=True, timeout=patience(600),
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    assert "3 passed" in last and "skipped" not in last, r.stdout[-2000:]


@pytest.mark.skipif(CUDA, reason="the GPU tests above cover this on CUDA")
def test_our_layout_backends_under_the_interpreter(cache):
    """qerl.kernels.gemm's own logic (scratch reuse, transposed views, autograd) on the CPU: Triton's interpreter runs the
    kernels (fp16: its bf16 dots are unreliable), cuBLAS's place is taken by torch's CPU matmul."""
    if not K.interpreting():
        pytest.skip("triton was imported before TRITON_INTERPRET could be set")
    context = GemmContext(tuning="defaults", cache=cache)
    n, k = 64, 128
    t = codec.quantize(torch.randn(n, k) * 0.05)
    g = gemm.NVFP4Gemm(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], dtype=torch.float16,
                       context=context)
    assert g.layout == "qerl"
    w = codec.dequantize(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], torch.float64)
    x = torch.randn(3, k, dtype=torch.float16)
    dy = torch.randn(3, n, dtype=torch.float16)
    for backend in ("triton", "dequant_cublas"):
        y = g.forward(x, backend).double()
        assert ((y - x.double() @ w.T).norm() / (x.double() @ w.T).norm()).item() < 2e-3, backend
        dx = g.grad_input(dy, backend).double()
        assert ((dx - dy.double() @ w).norm() / (dy.double() @ w).norm()).item() < 2e-3, backend
    w16 = codec.dequantize(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], torch.float16)
    assert torch.equal(g.dequantize(torch.float16), w16)
    assert g.dequantize(torch.float16).data_ptr() == context.scratch(1, torch.float16, x.device).data_ptr()  # reused
    xg = x.clone().requires_grad_()
    bias = torch.randn(n, dtype=torch.float16, requires_grad=True)
    gemm.linear(xg, g, bias).backward(dy)
    assert ((xg.grad.double() - dy.double() @ w).norm() / (dy.double() @ w).norm()).item() < 2e-3
    assert torch.allclose(bias.grad, dy.float().sum(0).half())


def test_table_layout_dequantize_passes_the_compiler_frontend_for_sm90():
    """The new kernel lowers to TTIR for an H100 with no GPU: typing errors the interpreter lets through fail here.
    (In a fresh process: this module may have switched Triton to its interpreter, which cannot lower.)"""
    import subprocess
    import textwrap

    code = textwrap.dedent("""
        import sys
        try:
            from triton._C.libtriton import ir
            from triton.backends.compiler import GPUTarget
            from triton.backends.nvidia.compiler import CUDABackend
            from triton.compiler import ASTSource
            target = GPUTarget("cuda", 90, 32)
            backend = CUDABackend(target)
        except Exception as e:  # internal API of another Triton version
            print("SKIP", e); sys.exit(0)
        from qerl.kernels import _triton_nvfp4 as tk
        sig = {"w_ptr": "*i32", "s_ptr": "*u8", "gs_ptr": "*fp32", "code_tbl_ptr": "*i32", "scale_tbl_ptr": "*i32",
               "out_ptr": "*bf16", "N": "i32", "K": "i32", "XOR": "i32", "BLOCK_KB": "constexpr",
               "BLOCK_NB": "constexpr", "TRANSPOSED": "constexpr"}
        for transposed in (False, True):
            options = backend.parse_options({"num_warps": 4})
            context = ir.context()
            ir.load_dialects(context)
            backend.load_dialects(context)
            ASTSource(tk.table_layout_dequant_kernel, sig,
                      constexprs={"BLOCK_KB": 4, "BLOCK_NB": 2, "TRANSPOSED": transposed}).make_ir(
                target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.getcwd()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=patience(300))
    if res.stdout.startswith("SKIP"):
        pytest.skip(res.stdout)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
