"""The Gluon NVFP4 decode GEMM (kernels/gluon_nvfp4.py).

CPU: the shuffled weight layout is an exact permutation of the compressed-tensors tensors; the stream-K schedule
gives each program an equal share and every unit to one program; a PyTorch emulation of the kernel's own dataflow
(its word and scale tiles, nibble order, joins, A_PERMUTE, segments and contributor slots) reproduces x @ W^T;
the layout's dequantize (Triton, run by the interpreter) is bit-identical to the codec's; the kernel compiles for sm_90a with the ptxas Triton ships (the compile asserts the decode needs no data movement
between threads), and its SASS has no spills, reads codes with 128-bit shared loads and multiplies with wgmma.
GPU: the kernel against the PyTorch reference at every M bucket, tiles whole and shared among programs; a layer held in the
"gluon" layout (qerl.kernels.gemm) runs forward and backward through the dispatch and keeps its canonical tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qerl.kernels import gluon_nvfp4 as G
from qerl.quant import nvfp4 as codec
from tests.patience import patience

HAS_GLUON = G.IMPORT_ERROR is None


def random_weight(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    d = codec.quantize(w)
    return d["weight_packed"], d["weight_scale"], d["weight_global_scale"]


def test_shuffle_is_an_exact_permutation():
    packed, scale, _ = random_weight(192, 384)
    codes, scales = G.shuffle_weight(packed, scale)
    assert codes.shape == (3, 3, 1024) and codes.dtype == torch.int32
    assert scales.shape == (3, 3, 256) and scales.dtype == torch.int16
    back_packed, back_scale = G.unshuffle_weight(codes, scales)
    assert torch.equal(back_packed, packed)
    assert torch.equal(back_scale.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(torch.sort(scales.view(torch.uint8).flatten()).values,
                       torch.sort(scale.view(torch.uint8).flatten()).values)


def test_decode_asm_is_exact_for_every_code_and_scale():
    """The kernel's inline PTX, run by a CPU interpreter of its instructions (tests/ptx_subset.py): element i of a
    word is e2m1(nibble i) * scale(row g if (i >> 1) & 1 == 0 else g + 8) * 2^-7, bit for bit in bf16 (signed zeros,
    zero and subnormal scales included); the two-step path (SCALE_ASM, then DECODE_SCALED_ASM) agrees."""
    from tests import ptx_subset as ptx
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double().tolist()

    def expect(code, sbyte):
        return ptx._bf16_bits(e2m1[code] * e4m3[sbyte] * 2.0 ** -7)

    words = [0x76543210, 0xFEDCBA98, 0x89ABCDEF]  # every code in every nibble position
    for s_g, s_h in [(b, 0x38) for b in range(0x7F)] + [(0x38, b) for b in range(0x7F)]:
        pair = s_g | (s_h << 8)
        lo, hi = ptx.run(G._SCALE_ASM, {2: pair}, 2)
        for word in words:
            got = ptx.run(G._DECODE_ASM, {8: word, 9: pair}, 8)
            want = [expect((word >> (4 * i)) & 15, s_h if (i >> 1) & 1 else s_g) for i in range(8)]
            assert got == want, (hex(word), hex(pair), got, want)
            assert ptx.run(G._DECODE_SCALED_ASM, {8: word, 9: lo, 10: hi}, 8) == want


def test_shapes_the_layout_cannot_hold_are_refused():
    packed, scale, _ = random_weight(96, 128)
    with pytest.raises(ValueError, match="N % 64 == 0 and K % 128 == 0, got 96x128"):
        G.shuffle_weight(packed, scale)


def decode_tile(codes, scales, tile: int, kb: int, w: int):
    """The A operand [64 w, 128] of one (tile, K step), computed the way the kernel computes it: the word tile
    [w, 2, 2, 2, 8, 4, 4] and the scale-pair tile [w, 2, 2, 2, 8, 1, 4] (broadcast over q), 8 nibbles per word
    (nibble i scaled by byte (i >> 1) & 1 of its pair), joined b0, b1, b2, permuted by A_PERMUTE, reshaped."""
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    rb = tile * w
    words = codes[rb:rb + w, kb].reshape(w, 2, 2, 2, 8, 4, 4).long() & 0xFFFFFFFF
    pairs = scales[rb:rb + w, kb].reshape(w, 2, 2, 2, 8, 1, 4).contiguous().view(torch.uint8)
    pairs = pairs.reshape(w, 2, 2, 2, 8, 1, 4, 2).expand(w, 2, 2, 2, 8, 4, 4, 2)
    pair_scale = pairs.view(torch.float8_e4m3fn).float()
    elems = [e2m1[(words >> (4 * i)) & 15] * pair_scale[..., (i >> 1) & 1] for i in range(8)]
    joined = torch.stack([torch.stack([torch.stack([elems[b0 + 2 * b1 + 4 * b2] for b0 in (0, 1)], -1)
                                       for b1 in (0, 1)], -1) for b2 in (0, 1)], -1)
    return joined.permute(G.A_PERMUTE).reshape(G.ROWS * w, G.BK)


def emulate_kernel(x, codes, scales, gs, w: int, programs: int):
    """y = x @ W^T the way the kernel's programs compute it: each program's stream-K segments accumulate in fp32;
    a whole tile is stored, a shared one goes to its contributor slot and the slots are summed in slot order."""
    tiles, k_iters = codes.shape[0] // w, codes.shape[1]
    m, n = x.shape[0], codes.shape[0] * G.ROWS
    slots = torch.full((G.max_contributors(tiles, k_iters, programs), m, n), float("nan"))
    y = torch.full((m, n), float("nan"))
    for segs in G.schedule(tiles, k_iters, programs):
        for tile, kb0, kb1, slot, n_contrib in segs:
            acc = torch.zeros(G.ROWS * w, m)
            for kb in range(kb0, kb1):
                acc += decode_tile(codes, scales, tile, kb, w) @ x[:, kb * G.BK:(kb + 1) * G.BK].float().t()
            cols = slice(tile * w * G.ROWS, (tile + 1) * w * G.ROWS)
            if n_contrib == 1:
                y[:, cols] = acc.t()
            else:
                slots[slot, :, cols] = acc.t()
                y[:, cols] = slots[:n_contrib, :, cols].sum(0)  # the last contributor's sum (all slots written)
    return y / gs.float()


def test_schedule_covers_every_unit_once_and_slots_fit():
    for tiles, k_iters, programs in [(296, 28, 132), (36, 28, 132), (28, 148, 132), (3, 5, 7), (1, 1, 1), (5, 3, 15)]:
        seen = torch.zeros(tiles, k_iters, dtype=torch.long)
        contrib = {}
        sched = G.schedule(tiles, k_iters, programs)
        per = [sum(kb1 - kb0 for _, kb0, kb1, _, _ in segs) for segs in sched]
        assert max(per) - min(per) <= 1  # equal work per program: no tail wave
        for segs in sched:
            for tile, kb0, kb1, slot, n in segs:
                seen[tile, kb0:kb1] += 1
                contrib.setdefault(tile, set()).add((slot, n))
        assert bool((seen == 1).all())
        bound = G.max_contributors(tiles, k_iters, programs)
        for tile, s in contrib.items():
            n = {c for _, c in s}
            assert len(n) == 1 and sorted(sl for sl, _ in s) == list(range(n.pop())) and len(s) <= bound


@pytest.mark.parametrize("w,programs", [(1, 1), (2, 2), (1, 5), (2, 7)])
def test_kernel_dataflow_reproduces_the_gemm(w, programs):
    n, k = 256, 384
    packed, scale, gs = random_weight(n, k, seed=w)
    x = torch.randn(5, k).to(torch.bfloat16)
    codes, scales = G.shuffle_weight(packed, scale)
    got = emulate_kernel(x, codes, scales, gs, w, programs)
    want = x.double() @ codec.dequantize(packed, scale, gs, dtype=torch.float32).double().t()
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4)


DEQUANT_SCRIPT = textwrap.dedent("""
    import torch
    from qerl.kernels import gluon_nvfp4 as G
    from qerl.quant import nvfp4 as codec
    w = torch.randn(192, 256, generator=torch.Generator().manual_seed(0))
    w[0, :16] = 0
    w[1, :3] = -0.0  # E2M1's -0 must stay -0
    d = codec.quantize(w)
    codes, scales = G.shuffle_weight(d["weight_packed"], d["weight_scale"])
    # bf16: the interpreter's fp32 -> bf16 cast is not the GPU's (environment notes); checked on the GPU instead
    for dt, bits in ((torch.float32, torch.int32), (torch.float16, torch.int16)):
        ref = codec.dequantize(d["weight_packed"], d["weight_scale"], d["weight_global_scale"], dtype=dt)
        got = G.dequantize(codes, scales, d["weight_global_scale"], dt)
        assert torch.equal(got.view(bits), ref.view(bits)), (dt, (got.float() - ref.float()).abs().max())
        out = torch.empty(256 * 192, dtype=dt)
        got_t = G.dequantize(codes, scales, d["weight_global_scale"], dt, transposed=True, out=out)
        assert got_t.data_ptr() == out.data_ptr() and torch.equal(got_t.view(bits), ref.t().view(bits))
    # the FP8 update path's per-row factors, applied in fp32 before the rounding (here to fp32: exact)
    ref = codec.dequantize(d["weight_packed"], d["weight_scale"], d["weight_global_scale"], dtype=torch.float32)
    inv_n, inv_k = torch.rand(192) + 0.5, torch.rand(256) + 0.5
    got = G.dequantize(codes, scales, d["weight_global_scale"], torch.float32, inv_scale=inv_n)
    assert torch.equal(got, ref * inv_n[:, None])
    got_t = G.dequantize(codes, scales, d["weight_global_scale"], torch.float32, transposed=True, inv_scale=inv_k)
    assert torch.equal(got_t, ref.t() * inv_k[:, None])
    print("ok")
""")


def test_layout_dequantize_is_bit_identical_to_the_codec():
    """Under Triton's CPU interpreter (in a subprocess: the interpreter is chosen when triton is imported)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    res = subprocess.run([sys.executable, "-c", DEQUANT_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=patience(600))
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_layout_choice_is_validated():
    from qerl.kernels.gemm import NVFP4Gemm
    packed, scale, gs = random_weight(128, 256)
    with pytest.raises(ValueError, match="unknown NVFP4 layout 'marlin'"):
        NVFP4Gemm(packed, scale, gs, prefer="marlin")
    if not G.available():
        with pytest.raises(RuntimeError, match="the Gluon layout needs Gluon on an sm_90 GPU"):
            NVFP4Gemm(packed, scale, gs, prefer="gluon")
    odd_packed, odd_scale, odd_gs = random_weight(160, 256)  # no 64-row tiles: the run's choice falls back
    with pytest.warns(UserWarning, match="such layers keep the default layout"):  # quant.gpu_layout: the same
        assert NVFP4Gemm(odd_packed, odd_scale, odd_gs, layout="gluon").layout in ("qerl", "humming")
    assert NVFP4Gemm(packed, scale, gs, layout="qerl").layout == "qerl"


def test_padded_m_and_default_config():
    assert [G.padded_m(m) for m in (1, 8, 9, 16, 17, 64)] == [8, 8, 16, 16, 32, 64]
    with pytest.raises(ValueError, match="1..64 rows, got 65"):
        G.padded_m(65)
    assert G.default_config(37888, 3584, 64).w == 2 and G.default_config(4032, 3584, 64).w == 1
    assert G.default_config(37888, 3584, 1).sub == 2 and G.default_config(4096, 4224, 1).sub == 1  # 4224 = 33 x 128
    for n, k in ((37888, 3584), (4032, 4224)):  # every default fits in one SM's shared memory, per_sm times over
        for m in (1, 16, 32, 64):
            cfg = G.default_config(n, k, m)
            assert cfg.per_sm * (G.shared_bytes(cfg, G.padded_m(m)) + 1024) <= 228 * 1024, (n, k, m, cfg)
    assert G.n_programs(G.Config(), tiles=296, k_iters=28) == 132  # one per SM (132 without a GPU to ask)
    assert G.n_programs(G.Config(per_sm=3), tiles=296, k_iters=28) == 396
    assert G.n_programs(G.Config(), tiles=2, k_iters=8) == 4  # at least 4 K steps per program
    assert G.n_programs(G.Config(programs=1000), tiles=2, k_iters=8) == 16


COMPILE_SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys, tempfile
    import triton
    from qerl.kernels import gluon_nvfp4 as G
    out = {}
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for m, n, k, w, stages, lanes, sub, rank in json.loads(sys.argv[1]):
        ck = G.compile_sm90(m, n, k, G.Config(w=w, stages=stages, scale_lanes=lanes, sub=sub), rank,
                            bias=m > 1)  # the bias epilogue in every case but M = 1
        f = tempfile.NamedTemporaryFile(suffix=".cubin", delete=False)
        f.write(ck.asm["cubin"]); f.close()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        os.unlink(f.name)
        ops = ("HGMMA", "LDS.128", "LDL", "STL")
        out[f"{m},{w},{lanes},{rank},{sub}"] = {"sass": {op: sass.count(op) for op in ops},
                                                "local": "LOCAL:0" in res, "shared": ck.metadata.shared}
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    for transposed, out_type in ((False, "*bf16"), (True, "*bf16"), (False, "*fp8e4nv"), (True, "*fp8e4nv")):
        # the layout's dequantize through the whole compiler too, and its FP8 form (per-row factors)
        triton.compile(ASTSource(G.shuffled_block_dequant_kernel,
                                 {"codes_ptr": "*i32", "scales_ptr": "*u8", "gs_ptr": "*fp32", "out_ptr": out_type,
                                  "inv_ptr": "*fp32", "N": "i32", "K": "i32", "TRANSPOSED": "constexpr",
                                  "SCALED": "constexpr"},
                                 constexprs={"TRANSPOSED": transposed, "SCALED": out_type == "*fp8e4nv"}),
                       target=GPUTarget("cuda", 90, 32))
    print(json.dumps(out))
""")


@pytest.mark.skipif(not HAS_GLUON, reason=f"Triton without Gluon: {G.IMPORT_ERROR}")
def test_kernel_compiles_for_sm90_without_spills():
    # the last field: LoRA's rank in the epilogue (0: none)
    cases = [(1, 4096, 4096, 2, 4, False, 1, 0), (64, 4096, 4096, 2, 3, True, 1, 0), (16, 1024, 4096, 1, 6, True, 1, 0),
             (8, 1024, 4096, 1, 4, True, 2, 0), (8, 1024, 4096, 1, 4, True, 2, 16), (32, 1024, 4096, 1, 4, True, 2, 48)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real compiler, not the interpreter
    env["PYTHONPATH"] = os.getcwd()
    res = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, json.dumps(cases)], capture_output=True, text=True,
                         env=env, timeout=patience(600))
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr.lower():
        pytest.skip("Triton's ptxas is not installed")
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for key, r in out.items():
        assert r["local"] and r["sass"]["LDL"] == 0 and r["sass"]["STL"] == 0, (key, r)  # no register spills
        assert r["sass"]["HGMMA"] >= 8 * int(key.split(",")[-1]), (key, r)  # 8 wgmma K steps per 128 of K
        assert r["sass"]["LDS.128"] >= 2, (key, r)  # a thread's 8 code words: two 128-bit shared loads
        assert r["shared"] < 227 * 1024, (key, r)


gpu = pytest.mark.skipif(not (HAS_GLUON and G.available()), reason="needs Gluon on an sm_90 GPU")


@gpu
@pytest.mark.parametrize("m", [1, 3, 8, 16, 33, 64])
@pytest.mark.parametrize("n,k,programs", [(4096, 4096, None), (1024, 4096, 3), (4608, 3584, 1000), (192, 256, 1)])
def test_gpu_kernel_matches_reference(m, n, k, programs):
    packed, scale, gs = random_weight(n, k, seed=m)
    packed, scale, gs = packed.cuda(), scale.cuda(), gs.cuda()
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    codes, scales = G.shuffle_weight(packed, scale)
    sub = {None: 1, 3: 2, 1000: 4, 1: 2}[programs]
    cfg = None if programs is None else G.Config(w=2 if n % 128 == 0 and sub < 4 else 1, stages=2 if sub == 4 else 3,
                                                 programs=programs, scale_lanes=programs % 2 == 1, sub=sub)
    y = G.linear_forward(x, codes, scales, gs, cfg)
    want = x.double() @ codec.dequantize(packed, scale, gs, dtype=torch.float32).double().t()
    err = (y.double() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), err
    y2 = G.linear_forward(x, codes, scales, gs, cfg)  # counters were reset: a second launch agrees bit for bit
    assert torch.equal(y, y2)
    wide = torch.zeros(m, k + 8, device="cuda", dtype=torch.bfloat16)
    wide[:, 1:k + 1] = x  # a view whose rows start off the 16-byte grid TMA needs
    assert torch.equal(G.linear_forward(wide[:, 1:k + 1], codes, scales, gs, cfg), y)
    bias = (torch.randn(n, device="cuda") * want.abs().max().item()).to(torch.bfloat16)
    yb = G.linear_forward(x, codes, scales, gs, cfg, bias=bias)  # in the epilogue, before the one rounding
    err = (yb.double() - (want + bias.double())).abs().max().item()
    assert err <= 2e-2 * (want + bias.double()).abs().max().item(), err
    assert (yb.double() - y.double() - bias.double()).abs().max() <= 2 ** -7 * yb.double().abs().max()


@gpu
@pytest.mark.parametrize("m", [1, 8, 33, 64, 100, 256])
@pytest.mark.parametrize("n,k,rank,programs", [(4608, 3584, 48, None), (1024, 4096, 16, 3), (192, 256, 8, 1),
                                               (4096, 4096, 24, 1000)])
def test_gpu_low_rank_epilogue_adds_loras_update(m, n, k, rank, programs):
    """y = x W^T + s h B^T with LoRA's update added in the epilogue: the reference within the bf16 rounding of y,
    whole tiles and tiles summed by their last contributor, M chunked past 64, the same bits on a second launch."""
    packed, scale, gs = (t.cuda() for t in random_weight(n, k, seed=m + rank))
    codes, scales = G.shuffle_weight(packed, scale)
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    h = torch.randn(m, rank, device="cuda", generator=g).to(torch.bfloat16)
    b = (torch.randn(n, rank, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    cfg = None if programs is None else G.Config(w=1, stages=4, programs=programs, scale_lanes=True)
    y = G.linear_forward(x, codes, scales, gs, cfg, low_rank=(h, b, 0.75))
    w = codec.dequantize(packed, scale, gs, dtype=torch.float32).double()
    want = x.double() @ w.t() + 0.75 * h.double() @ b.double().t()
    err = (y.double() - want).abs().max().item()
    assert err <= 1e-2 * want.abs().max().item(), err
    base = G.linear_forward(x, codes, scales, gs, cfg)
    assert (y.double() - base.double()).abs().max() > 0  # the update was added, not dropped
    assert torch.equal(G.linear_forward(x, codes, scales, gs, cfg, low_rank=(h, b, 0.75)), y)


@gpu
@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_gpu_gluon_layout_layer_forward_backward_and_canonical(m):
    from qerl.kernels.gemm import NVFP4Gemm, linear
    packed, scale, gs = (t.cuda() for t in random_weight(1024, 2048, seed=7))
    gemm = NVFP4Gemm(packed, scale, gs, prefer="gluon")
    assert gemm.layout == "gluon" and gemm.nbytes == packed.numel() + scale.numel() + 4
    ref_bf16 = codec.dequantize(packed, scale, gs, dtype=torch.bfloat16)
    assert torch.equal(gemm.dequantize(torch.bfloat16).view(torch.int16), ref_bf16.view(torch.int16))
    canon = gemm.canonical()
    assert torch.equal(canon["weight_packed"], packed) and torch.equal(canon["weight_scale"].view(torch.uint8),
                                                                       scale.view(torch.uint8))
    x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = codec.dequantize(packed, scale, gs, dtype=torch.float32)
    y = linear(x, gemm)
    assert gemm.backend_for("fwd", x.detach()) in (("gluon", "dequant_cublas") if m <= 64 else ("dequant_cublas",))
    want = x.detach().double() @ w.double().t()
    assert (y.double() - want).abs().max() <= 2e-2 * want.abs().max()
    y.float().square().sum().backward()
    dx_want = (2 * y.detach().float()) @ w
    assert (x.grad.float() - dx_want).abs().max() <= 2e-2 * dx_want.abs().max()


@gpu
@pytest.mark.parametrize("layout", ["gluon", "qerl"])
@pytest.mark.parametrize("m", [2048, 4099])  # 4099: not a multiple of 16 (_scaled_mm's), as most micro-batches
def test_gpu_fp8_update_gemms_match_the_exact_product(m, layout):
    """In the FP8 update (its context's update_precision) a layer's forward and dx run dequantize-to-FP8 (one scale
    per row; from the Gluon layout directly, from the others through bf16) + _scaled_mm: within FP8's rounding of
    the exact products (E4M3 keeps 3 mantissa bits: ~3% per element, averaged over K in a dot product)."""
    from qerl.kernels.gemm import NVFP4Gemm, linear
    packed, scale, gs = (t.cuda() for t in random_weight(1024, 2048, seed=3))
    layer = NVFP4Gemm(packed, scale, gs, prefer=layout)
    assert layer.layout == layout
    w = codec.dequantize(packed, scale, gs, dtype=torch.float32).double()
    x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with layer.context.update_precision("fp8"):
        assert layer.backend_for("fwd", x.detach()) == "dequant_fp8"
        y = linear(x, layer)
        dy = torch.randn_like(y)
        y.backward(dy)
    want, dx_want = x.detach().double() @ w.t(), dy.double() @ w
    rel = lambda got, ref: ((got.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    assert rel(y, want) <= 0.04 and rel(x.grad, dx_want) <= 0.04, (rel(y, want), rel(x.grad, dx_want))
    with torch.no_grad():  # outside the block: bf16 again
        assert rel(linear(x.detach(), layer), want) <= 0.01


@gpu
@pytest.mark.parametrize("layout", ["gluon", "qerl"])
def test_gpu_resident_fp8_copy_serves_inference_and_never_the_bf16_update(layout):
    """quant.fp8_weights: a layer keeps an E4M3 copy of W (one scale per row, exact from the block scales); outside
    the update, the dispatch may run a forward on it ("fp8_weight", within FP8's rounding of the exact product);
    inside the bf16 update no GEMM reads it; the FP8 update's forward reads it instead of dequantizing."""
    from qerl.kernels import gemm as G8
    packed, scale, gs = (t.cuda() for t in random_weight(1024, 2048, seed=5))
    layer = G8.NVFP4Gemm(packed, scale, gs, prefer=layout, fp8_weights=True)
    plain = G8.NVFP4Gemm(packed, scale, gs, prefer=layout)
    assert layer.fp8_weight is not None and layer.fp8_weight.dtype == torch.float8_e4m3fn
    assert layer.nbytes == plain.nbytes + 1024 * 2048
    w = codec.dequantize(packed, scale, gs, dtype=torch.float32).double()
    x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    want = x.double() @ w.t()
    rel = lambda got: ((got.double() - want).norm() / want.norm()).item()  # noqa: E731
    y = layer.forward(x, backend="fp8_weight")
    assert torch.isfinite(y).all() and rel(y) <= 0.04, rel(y)
    assert "fp8_weight" in layer._backends("fwd") and "fp8_weight" not in plain._backends("fwd")
    with layer.context.update_precision("bf16"):
        assert "fp8_weight" not in layer._backends("fwd")
        assert rel(layer.forward(x)) <= 0.01  # bf16 numerics in the bf16 update
    with layer.context.update_precision("fp8"):  # the resident copy, bit for bit: no dequantize
        torch.testing.assert_close(layer.forward(x, backend="dequant_fp8"), y, rtol=0, atol=0)
