"""NVFP4 Triton kernels: CPU (TRITON_INTERPRET=1, tiny fp16/fp32 shapes) and GPU (@pytest.mark.gpu) checks.

Oracles: the project codec (qerl.quant.nvfp4) for quantization (bit-exact), and the exact fp64 weight the
format encodes for the GEMMs (error within bf16/fp16 output rounding). Every kernel output is pre-filled
with NaN so an unwritten tile fails.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from qerl.quant import nvfp4 as codec

CUDA = torch.cuda.is_available()
# Without CUDA the kernels run in Triton's CPU interpreter, which is chosen when @triton.jit runs (triton's
# own library included): possible in-process only if nothing imported triton yet, else in a subprocess.
# (It must stay set: triton reads it again when it lazily imports parts of itself at launch.)
if not CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
from qerl.kernels import nvfp4_ops  # noqa: E402
from qerl.kernels import nvfp4 as K  # noqa: E402
from qerl.kernels.reference import quantize_ref, weight_fp64  # noqa: E402
from tests.patience import patience  # noqa: E402

INTERP_ACTIVE = not CUDA and K.interpreting()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def make_weight(kind: str, n: int, k: int, dtype: torch.dtype, device="cpu", seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        w = torch.randn(n, k, generator=g) * 0.02
    elif kind == "heavy":  # blocks across many binades, subnormal e4m3 scales
        w = torch.distributions.StudentT(1.5).sample((n, k)) * 0.01
    elif kind == "outliers":  # most block scales underflow -> the 0.125 floor; all-zero blocks
        w = torch.randn(n, k, generator=g) * 1e-3
        w[n // 3, k // 5] = 40.0
        w[1:3] = 0.0
    else:
        raise AssertionError(kind)
    return w.to(dtype).to(device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), f"{out.isnan().sum().item()} NaN outputs (unwritten tiles?)"
    return ((out.double() - ref).norm() / ref.norm()).item()


def assert_same_quant(ours, ref) -> None:
    for name, a, b in zip(("packed", "scale", "global_scale"), ours, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        a8, b8 = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
        assert (a8 != b8).sum().item() == 0, f"{name}: {(a8 != b8).sum().item()} of {a8.numel()} bytes differ"


# ----------------------------------------------------------------------------------------------- CPU

@pytest.fixture
def interp():
    if CUDA:
        pytest.skip("CUDA present: the GPU tests cover the kernels")
    if not INTERP_ACTIVE:
        pytest.skip("triton was imported without TRITON_INTERPRET: runs in test_interpreter_subprocess")


def test_interpreter_subprocess():
    """The interpreter tests, in a fresh process when this one imported triton for the GPU (full-suite runs)."""
    if CUDA or INTERP_ACTIVE:
        pytest.skip("interpreter tests run in-process (or the GPU tests cover the kernels)")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", "interp"],
                       capture_output=True, text=True, timeout=patience(600),
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1].replace("1 skipped", ""), r.stdout[-2000:]


def test_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None; import torch; from qerl.kernels import nvfp4_ops; "
            "assert not nvfp4_ops.available(); from qerl.quant import nvfp4; w = torch.randn(8, 32); "
            "q = nvfp4_ops.nvfp4_quantize(w); y = nvfp4_ops.nvfp4_linear(torch.randn(2, 32), *q); "
            "assert y.shape == (2, 8)")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=patience(120))
    assert r.returncode == 0, r.stderr


def _h2f(h: int, bf16: bool) -> float:
    """16-bit pattern -> python float."""
    t = torch.tensor([h & 0xFFFF], dtype=torch.int32).to(torch.int16)
    return t.view(torch.bfloat16 if bf16 else torch.float16).item()


def _f2h(v: float, bf16: bool) -> int:
    return torch.tensor([v], dtype=torch.float64).to(torch.bfloat16 if bf16 else torch.float16).view(
        torch.int16).item() & 0xFFFF


def _run_ptx(asm: str, regs: dict[str, int], bf16: bool) -> dict[str, int]:
    """Interpret the few PTX opcodes our inline asm uses; regs maps '$n' -> 32-bit value; returns all regs."""
    regs = dict(regs)
    val = lambda t: int(t, 16) if t.startswith("0x") else (int(t) if t.isdigit() else regs[t])  # noqa: E731
    for stmt in asm.replace("\n", " ").split(";"):
        stmt = stmt.strip().lstrip("{").strip()
        if not stmt or stmt.startswith(".reg") or stmt == "}":
            continue
        op, rest = stmt.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # unpack a 32-bit register into two 16-bit ones
            lo, hi = [t.strip() for t in rest[1:rest.index("}")].split(",")]
            src = val(rest.split("}")[1].strip(" ,"))
            regs[lo], regs[hi] = src & 0xFFFF, src >> 16
            continue
        dst, args = (t.strip() for t in rest.split(",", 1))
        if op == "mov.b32" and "{" in args:  # pack two 16-bit registers
            lo, hi = [val(t.strip()) for t in args.strip()[1:-1].split(",")]
            regs[dst] = (lo & 0xFFFF) | (hi << 16)
            continue
        a = [val(t.strip()) for t in args.split(",")]
        if op == "mov.b32":
            regs[dst] = a[0]
        elif op == "shl.b32":
            regs[dst] = (a[0] << a[1]) & 0xFFFFFFFF
        elif op == "shr.b32":
            regs[dst] = a[0] >> a[1]
        elif op == "and.b32":
            regs[dst] = a[0] & a[1]
        elif op == "or.b32":
            regs[dst] = a[0] | a[1]
        elif op == "add.u32":
            regs[dst] = (a[0] + a[1]) & 0xFFFFFFFF
        elif op == "mul.lo.u32":
            regs[dst] = (a[0] * a[1]) & 0xFFFFFFFF
        elif op == "prmt.b32":  # default mode: selector nibble = byte index | 8 (replicate that byte's sign)
            src = [(a[0] >> (8 * i)) & 0xFF for i in range(4)] + [(a[1] >> (8 * i)) & 0xFF for i in range(4)]
            out = 0
            for i in range(4):
                nib = (a[2] >> (4 * i)) & 0xF
                byte = src[nib & 7]
                out |= ((0xFF if byte & 0x80 else 0) if nib & 8 else byte) << (8 * i)
            regs[dst] = out
        elif op == "cvt.rn.f16x2.e4m3x2":
            halves = [torch.tensor([(a[0] >> sh) & 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn).half()
                      .view(torch.int16).item() & 0xFFFF for sh in (0, 8)]
            regs[dst] = halves[0] | (halves[1] << 16)
        elif op.startswith("fma.rn."):
            halves = [_f2h(_h2f(a[0] >> sh, bf16) * _h2f(a[1] >> sh, bf16) + _h2f(a[2] >> sh, bf16), bf16)
                      for sh in (0, 16)]
            regs[dst] = halves[0] | (halves[1] << 16)
        else:
            raise AssertionError(f"unknown PTX op {op}")
    return regs


def _e4m3(b: int) -> float:
    return torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()


@pytest.mark.parametrize("bf16", [True, False])
def test_scale_ptx(bf16):
    """e4m3 scale bytes -> s * 2^119 (bf16) / s * 2^7 (fp16), exact; zero stays zero."""
    from qerl.kernels import _triton_nvfp4 as tk

    asm = (tk.SCALE_BF16 if bf16 else tk.SCALE_FP16).value
    codes = list(range(0, 0x7F)) + [0x00, 0x01, 0x7E, 0x20]
    for i in range(0, len(codes) - 3, 4):
        quad = codes[i:i + 4]
        out = _run_ptx(asm, {"$2": sum(c << (8 * j) for j, c in enumerate(quad))}, bf16)
        got = [out["$0"] & 0xFFFF, out["$0"] >> 16, out["$1"] & 0xFFFF, out["$1"] >> 16]
        for c, h in zip(quad, got):
            assert _h2f(h, bf16) == _e4m3(c) * (2.0**119 if bf16 else 2.0**7), (hex(c), hex(h))


@pytest.mark.parametrize("bf16", [True, False])
def test_dequant_ptx(bf16):
    """The inline-PTX decode (run only on GPUs): slot j of words (w0, w1) / (w2, w3) -> e2m1 * s * 2^-7."""
    from qerl.kernels import _triton_nvfp4 as tk

    asm = (tk.DEQ_BF16 if bf16 else tk.DEQ_FP16).value
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 2**32, (64,), generator=g, dtype=torch.int64).tolist()
    words += [sum(c << (4 * j) for j in range(8)) for c in range(16)]  # every code in every slot
    scales = [0.125, 448.0, 2.0**-9, 0.3125, 6.0]  # e4m3 values incl. subnormal and max
    factor = 2.0**119 if bf16 else 2.0**7
    for i in range(0, len(words), 4):
        w = words[i:i + 4]
        sa, sb = scales[i % 5], scales[(i + 1) % 5]
        pair = lambda v: _f2h(v * factor, bf16) * 0x10001  # noqa: E731
        regs = {"$16": w[0], "$17": w[1], "$18": w[2], "$19": w[3], "$20": pair(sa), "$21": pair(sb)}
        out = _run_ptx(asm, regs, bf16)
        for j in range(8):
            for half, s in ((0, sa), (1, sb)):
                r = out[f"${2 * j + half}"]
                for word, h in ((w[2 * half], r & 0xFFFF), (w[2 * half + 1], r >> 16)):
                    code = (word >> (4 * j)) & 15
                    want = codec.e2m1_decode(torch.tensor([code])).item() * s * 2.0**-7
                    assert _h2f(h, bf16) == want, (hex(word), j, code, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["normal", "heavy", "outliers"])
def test_quantize_bit_exact_interp(interp, kind, dtype):
    w = make_weight(kind, 19, 144, dtype)  # ragged rows and columns vs the 16x128 tile
    assert_same_quant(K.quantize(w), quantize_ref(w))


def test_quantize_ties_and_signs_interp(interp):
    """Exact E2M1 ties (scale 1): nearest-even per compressed-tensors, -0 keeps its sign bit, saturation."""
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -5.0, -0.0, 0.1, -0.1, 5.5, -6.0]
    w = torch.tensor([vals, [v / 2 for v in vals]], dtype=torch.float32)
    gs = torch.tensor([1.0])
    assert_same_quant(K.quantize(w, gs), quantize_ref(w, gs))


LINEAR_CASES = [  # (M, config): swap / plain, split-K, ragged N=72 and K=112 (not multiples of the tiles)
    (1, K.Config(16, 32, 32, 4, 1, swap_ab=True, split_k=1)),
    (7, K.Config(16, 32, 32, 4, 1, swap_ab=True, split_k=3)),
    (33, K.Config(16, 32, 64, 4, 1, split_k=1)),
    (20, K.Config(32, 16, 64, 4, 1, split_k=2)),
    (40, K.Config(32, 16, 64, 4, 1, swap_ab=True, split_k=1)),
    (6, K.Config(16, 32, 32, 4, 1, swap_ab=True, split_k=2, x_mode="pre")),  # K=112 ragged: falls back to gather
    (17, K.Config(16, 16, 16, 4, 1, split_k=1, x_mode="pre")),  # K % 16 == 0: x permuted on the host
    (5, K.Config(16, 32, 64, 4, 1, swap_ab=True, split_k=1, x_mode="gather")),
]


@pytest.mark.parametrize("M,cfg", LINEAR_CASES, ids=[c.short() for _, c in LINEAR_CASES])
def test_linear_interp(interp, M, cfg):
    g = torch.Generator().manual_seed(M)
    p, s, gs = quantize_ref(make_weight("normal", 72, 112, torch.float32, seed=M))
    x = torch.randn(M, 112, generator=g).half()
    b = torch.randn(72, generator=g).half()
    y = torch.full((M, 72), float("nan"), dtype=torch.float16)
    K.linear_forward(x, p, s, gs, b, out=y, config=cfg)
    ref = x.double() @ weight_fp64(p, s, gs).T + b.double()
    assert rel_err(y, ref) < 1e-3


@pytest.mark.parametrize("M,cfg", [(5, K.Config(16, 32, 32, 4, 1)), (40, K.Config(32, 16, 64, 4, 1))])
def test_grad_input_interp(interp, M, cfg):
    g = torch.Generator().manual_seed(M)
    p, s, gs = quantize_ref(make_weight("heavy", 72, 112, torch.float32))
    dy = torch.randn(M, 72, generator=g).half()
    dx = torch.full((M, 112), float("nan"), dtype=torch.float16)
    K.grad_input(dy, p, s, gs, out=dx, config=cfg)
    assert rel_err(dx, dy.double() @ weight_fp64(p, s, gs)) < 1e-3


def test_autograd_interp(interp):
    p, s, gs = quantize_ref(make_weight("normal", 40, 64, torch.float32))
    x = torch.randn(2, 3, 64).half().requires_grad_()
    b = torch.randn(40).half().requires_grad_()
    y = nvfp4_ops.nvfp4_linear(x, p, s, gs, bias=b)
    dy = torch.randn_like(y)
    y.backward(dy)
    w64 = weight_fp64(p, s, gs)
    assert rel_err(y, x.detach().double() @ w64.T + b.detach().double()) < 1e-3
    assert rel_err(x.grad, dy.double() @ w64) < 1e-3
    assert rel_err(b.grad, dy.double().sum((0, 1))) < 1e-3


def test_dequantize_interp(interp):
    p, s, gs = quantize_ref(make_weight("heavy", 19, 144, torch.float32))
    ours = K.dequantize(p, s, gs, torch.float16)
    torch.testing.assert_close(ours.double(), weight_fp64(p, s, gs).half().double(), rtol=2**-10, atol=0)


def test_reference_fallback_fp32():
    """fp32 activations (and CPU without the interpreter) take the PyTorch reference path."""
    p, s, gs = quantize_ref(make_weight("normal", 24, 32, torch.float32))
    x = torch.randn(3, 32)
    torch.testing.assert_close(nvfp4_ops.nvfp4_linear(x, p, s, gs), x @ codec.dequantize(p, s, gs, torch.float32).T)


# ----------------------------------------------------------------------------------------------- GPU

REAL = [(4608, 3584), (3584, 18944), (37888, 3584)]  # 7B qkv, down, gate_up
RAGGED = [(1000, 272), (72, 112)]
TOL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}  # output rounding of the dtype, with margin


def _gpu_weight(n, k, kind="normal", seed=0):
    w = make_weight(kind, n, k, torch.bfloat16, seed=seed).cuda() if n * k < 2**20 else (
        torch.randn(n, k, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)) * 0.02).bfloat16()
    p, s, gs = quantize_ref(w)
    return p, s, gs, weight_fp64(p, s, gs)


@pytest.fixture(scope="module")
def gpu_weights():
    return {nk: _gpu_weight(*nk) for nk in REAL + RAGGED}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["normal", "heavy", "outliers"])
def test_quantize_bit_exact_gpu(kind, dtype):
    for n, k in [(1000, 272), (4608, 3584)] if kind == "normal" else [(1000, 272)]:
        w = make_weight(kind, n, k, dtype, device="cuda")
        assert_same_quant(nvfp4_ops.nvfp4_quantize(w), quantize_ref(w))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("M", [1, 7, 64, 300, 2048])
@pytest.mark.parametrize("nk", REAL + RAGGED[:1], ids=lambda nk: f"{nk[0]}x{nk[1]}")
def test_linear_gpu(gpu_weights, M, nk):
    p, s, gs, w64 = gpu_weights[nk]
    if nk == (37888, 3584) and M in (7, 300):
        pytest.skip("covered by the other M")
    g = torch.Generator("cuda").manual_seed(M)
    x = torch.randn(M, nk[1], device="cuda", generator=g).bfloat16()
    b = torch.randn(nk[0], device="cuda", generator=g).bfloat16() if M % 2 else None
    y = torch.full((M, nk[0]), float("nan"), device="cuda", dtype=torch.bfloat16)
    K.linear_forward(x, p, s, gs, b, out=y)
    ref = x.double() @ w64.T + (b.double() if b is not None else 0)
    assert rel_err(y, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("M", [1, 7, 64, 300, 2048])
@pytest.mark.parametrize("nk", REAL[:2] + RAGGED[:1], ids=lambda nk: f"{nk[0]}x{nk[1]}")
def test_grad_input_gpu(gpu_weights, M, nk):
    p, s, gs, w64 = gpu_weights[nk]
    dy = torch.randn(M, nk[0], device="cuda", generator=torch.Generator("cuda").manual_seed(M)).bfloat16()
    dx = torch.full((M, nk[1]), float("nan"), device="cuda", dtype=torch.bfloat16)
    K.grad_input(dy, p, s, gs, out=dx)
    assert rel_err(dx, dy.double() @ w64) < TOL[torch.bfloat16]


ALL_FWD = K.DECODE_CONFIGS + K.PREFILL_CONFIGS


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cfg", ALL_FWD, ids=[c.short() for c in ALL_FWD])
@pytest.mark.parametrize("nk", [(1000, 272), (4608, 3584)], ids=lambda nk: f"{nk[0]}x{nk[1]}")
def test_every_fwd_config_gpu(gpu_weights, cfg, nk):
    """Whatever the autotuner picks is right: each candidate on ragged and real shapes, split-K included."""
    p, s, gs, w64 = gpu_weights[nk]
    decode = cfg in K.DECODE_CONFIGS
    for M in ([1, 37] if decode else [300]):
        variants = [cfg, dataclasses.replace(cfg, x_mode="pre", split_k=3), dataclasses.replace(cfg, x_mode="gather")]
        for c in (variants if decode else [cfg]):
            x = torch.randn(M, nk[1], device="cuda").bfloat16()
            y = torch.full((M, nk[0]), float("nan"), device="cuda", dtype=torch.bfloat16)
            K.linear_forward(x, p, s, gs, out=y, config=c)
            assert rel_err(y, x.double() @ w64.T) < TOL[torch.bfloat16], (M, c.short())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cfg", K.BWD_CONFIGS, ids=[c.short() for c in K.BWD_CONFIGS])
def test_every_bwd_config_gpu(gpu_weights, cfg):
    for nk in [(1000, 272), (4608, 3584)]:
        p, s, gs, w64 = gpu_weights[nk]
        dy = torch.randn(300, nk[0], device="cuda").bfloat16()
        dx = torch.full((300, nk[1]), float("nan"), device="cuda", dtype=torch.bfloat16)
        K.grad_input(dy, p, s, gs, out=dx, config=cfg)
        assert rel_err(dx, dy.double() @ w64) < TOL[torch.bfloat16]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("use_asm", [True, False])
@pytest.mark.parametrize("M", [5, 300])
def test_fp16_and_pure_triton_path_gpu(gpu_weights, use_asm, M):
    p, s, gs, w64 = gpu_weights[(1000, 272)]
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(M, 272, device="cuda").to(dtype)
        y = torch.full((M, 1000), float("nan"), device="cuda", dtype=dtype)
        K.linear_forward(x, p, s, gs, out=y, use_asm=use_asm)
        assert rel_err(y, x.double() @ w64.T) < TOL[dtype]
        dy = torch.randn(M, 1000, device="cuda").to(dtype)
        dx = torch.full((M, 272), float("nan"), device="cuda", dtype=dtype)
        K.grad_input(dy, p, s, gs, out=dx, use_asm=use_asm)
        assert rel_err(dx, dy.double() @ w64) < TOL[dtype]


@pytest.mark.gpu
@gpu
def test_dequantize_gpu(gpu_weights):
    for nk in [(1000, 272), (4608, 3584)]:
        p, s, gs, w64 = gpu_weights[nk]
        torch.testing.assert_close(K.dequantize(p, s, gs).double(), w64.bfloat16().double(), rtol=2**-8, atol=0)


@pytest.mark.gpu
@gpu
def test_autograd_gpu(gpu_weights):
    p, s, gs, w64 = gpu_weights[(4608, 3584)]
    x = torch.randn(2, 150, 3584, device="cuda").bfloat16().requires_grad_()
    b = torch.randn(4608, device="cuda").bfloat16().requires_grad_()
    y = nvfp4_ops.nvfp4_linear(x, p, s, gs, bias=b)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert rel_err(y, x.detach().double() @ w64.T + b.detach().double()) < TOL[torch.bfloat16]
    assert rel_err(x.grad, dy.double() @ w64) < TOL[torch.bfloat16]
    assert rel_err(b.grad, dy.double().sum((0, 1))) < TOL[torch.bfloat16]


@pytest.mark.gpu
@gpu
def test_split_k_in_cuda_graph(gpu_weights):
    """Split-K counters reset themselves: graph replays with new inputs stay right (and deterministic)."""
    p, s, gs, w64 = gpu_weights[(3584, 18944)]
    x = torch.randn(4, 18944, device="cuda").bfloat16()
    nvfp4_ops.nvfp4_linear(x, p, s, gs)  # warm-up: compile, counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = nvfp4_ops.nvfp4_linear(x, p, s, gs)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        first = y.clone()
        graph.replay()
        assert torch.equal(first, y)
        assert rel_err(y, x.double() @ w64.T) < TOL[torch.bfloat16]


@pytest.mark.parametrize("inter", [24, 1030])  # one partial column block; two, the second ragged
def test_swiglu_on_fused_halves_interp(interp, inter):
    """kernels/swiglu.py in the interpreter (fp32): silu(gate) * up read from a fused [rows, 2I] gate/up output, and
    its gradient written into that layout, as eager autograd computes them on the two halves."""
    from qerl.kernels import swiglu

    g = torch.Generator().manual_seed(inter)
    fused = torch.randn(3, 2, 2 * inter, generator=g).requires_grad_()
    weight = torch.randn(3, 2, inter, generator=g)
    out = swiglu.SiluMulFused.apply(fused)
    (grad,) = torch.autograd.grad((out * weight).sum(), fused)
    gate, up = fused.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    (ref_grad,) = torch.autograd.grad((ref * weight).sum(), fused)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6) and torch.allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("vocab,temperature", [(50, 1.0), (5000, 0.7)])  # one block; two, the second ragged
def test_vocab_softmax_row_stats_interp(interp, vocab, temperature):
    """kernels/vocab_softmax.py in the interpreter (fp32): each row's log-prob of its token, log-sum-exp, entropy and
    softmax (written over the logits) at the temperature, as float64 PyTorch computes them, with a row whose
    maximum lies in its last block (the running sums rescale)."""
    from qerl.kernels import vocab_softmax

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=g) * 4
    logits[1, -7] = 30.0
    ids = torch.tensor([0, vocab - 7, vocab // 2])
    log_p = (logits.double() / temperature).log_softmax(-1)
    work = logits.clone()
    logp, lse, entropy = vocab_softmax.row_stats(work, ids, temperature, want_entropy=True, probs_in_place=True)
    torch.testing.assert_close(logp.double(), log_p.gather(1, ids[:, None])[:, 0], rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), (logits.double() / temperature).logsumexp(-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(entropy.double(), -(log_p.exp() * log_p).sum(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(work.double(), log_p.exp(), rtol=1e-5, atol=1e-8)
    logp_only, _, none = vocab_softmax.row_stats(logits, ids, temperature, want_entropy=False, probs_in_place=False)
    assert none is None and torch.equal(logp_only, logp)


def test_vocab_softmax_chunks_fit_its_budget():
    """The head's chunk of tokens: the largest power of two whose logits fit CHUNK_BYTES, never under the floor."""
    from qerl.kernels import vocab_softmax

    for vocab, itemsize in [(152064, 2), (49152, 2), (128256, 4), (10**9, 2)]:
        rows = vocab_softmax.chunk_rows(vocab, itemsize)
        assert rows & (rows - 1) == 0 and rows >= 128
        assert rows == 128 or (rows * vocab * itemsize <= vocab_softmax.CHUNK_BYTES
                               < 2 * rows * vocab * itemsize)
    assert vocab_softmax.chunk_rows(152064, 2) == 1024


@pytest.mark.parametrize("tables", ["per-row", "shared"])
def test_rope_forward_and_backward_interp(interp, tables):
    """kernels/rope.py in the interpreter (fp32): the rotation of a transposed [B, H, T, D] view (as the update's
    q and k are) and its gradient, as eager autograd computes them on the eager expression."""
    from qerl.kernels import rope
    from qerl.execution.training_ops import rope_eager

    g = torch.Generator().manual_seed(7)
    b, h, t, d = 2, 3, 5, 16
    x = torch.randn(b, t, h, d, generator=g).transpose(1, 2).requires_grad_()
    angles = torch.randn(b if tables == "per-row" else 1, 1, t, d // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    weight = torch.randn(b, h, t, d, generator=g)
    assert rope.supports(x, cos)
    out = rope.Rope.apply(x, cos, sin)
    (grad,) = torch.autograd.grad((out * weight).sum(), x)
    ref = rope_eager(x, cos, sin)
    (ref_grad,) = torch.autograd.grad((ref * weight).sum(), x)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6) and torch.allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)
