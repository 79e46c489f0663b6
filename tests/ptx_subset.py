"""A CPU interpreter for the handful of PTX instructions our inline-asm decoders use (kernels/gluon_nvfp4.py), so
the tests can run the asm strings themselves, bit for bit, on every code and scale before any GPU time is spent.

Semantics are PTX ISA 8.x's: `prmt.b32` default mode (byte i of the result = byte sel_i of {b, a}, or its sign
replicated when bit 3 of sel_i is set), `cvt.rn.f16x2.e4m3x2` (the low byte converts to the low half),
`fma.rn.bf16x2` (per half, exact product + addend rounded to nearest even, subnormals kept), and integer ops
modulo 2^32. Registers are Python ints; `.b16` values are 16-bit.
"""

from __future__ import annotations

import re

import torch

MASK = 0xFFFFFFFF


def _bf16_bits(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float64).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def _bf16_value(bits: int) -> float:
    return torch.tensor([bits if bits < 0x8000 else bits - 0x10000], dtype=torch.int16).view(torch.bfloat16).item()


def _e4m3_to_f16_bits(byte: int) -> int:
    v = torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float16)
    return int(v.view(torch.int16).item()) & 0xFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        byte = src[n & 7]
        if n & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def _fma_bf16x2(a: int, b: int, c: int) -> int:
    out = 0
    for half in (0, 1):
        x, y, z = ((v >> (16 * half)) & 0xFFFF for v in (a, b, c))
        r = _bf16_value(x) * _bf16_value(y) + _bf16_value(z)  # exact in float64 for bf16 operands
        out |= _bf16_bits(r) << (16 * half)
    return out


def run(asm: str, inputs: dict[int, int], n_outputs: int) -> list[int]:
    """Execute `asm` (an inline_asm_elementwise string) with $i = inputs[i]; returns $0..$(n_outputs - 1)."""
    regs: dict[str, int] = {f"${i}": v for i, v in inputs.items()}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok, 0)

    body = asm.strip().strip("{}")
    for stmt in (s.strip() for s in body.replace("\n", " ").split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if op == "mov.b32" and "{" in rest:  # unpack a b32 into two b16 outputs
            m = re.match(r"\{\s*(\S+)\s*,\s*(\S+)\s*\}\s*,\s*(\S+)", rest)
            v = val(m.group(3))
            regs[m.group(1)], regs[m.group(2)] = v & 0xFFFF, (v >> 16) & 0xFFFF
            continue
        args = [t.strip() for t in rest.split(",")]
        d, srcs = args[0], [val(t) for t in args[1:]]
        if op == "mov.b32":
            r = srcs[0]
        elif op == "and.b32":
            r = srcs[0] & srcs[1]
        elif op == "shr.b32":
            r = (srcs[0] & MASK) >> srcs[1]
        elif op == "shl.b32":
            r = (srcs[0] << srcs[1]) & MASK
        elif op in ("add.u32",):
            r = (srcs[0] + srcs[1]) & MASK
        elif op == "mul.lo.u32":
            r = (srcs[0] * srcs[1]) & MASK
        elif op == "prmt.b32":
            r = _prmt(srcs[0], srcs[1], srcs[2])
        elif op == "cvt.rn.f16x2.e4m3x2":
            r = _e4m3_to_f16_bits(srcs[0] & 0xFF) | (_e4m3_to_f16_bits((srcs[0] >> 8) & 0xFF) << 16)
        elif op == "fma.rn.bf16x2":
            r = _fma_bf16x2(*srcs)
        else:
            raise NotImplementedError(f"PTX op {op!r} in {stmt!r}")
        regs[d] = r & MASK
    return [regs[f"${i}"] for i in range(n_outputs)]


def bf16(bits: int) -> float:
    return _bf16_value(bits)
