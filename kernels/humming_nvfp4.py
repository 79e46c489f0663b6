"""NVFP4 weights held in humming-kernels' layout: its W4A16 GEMM, and our dequantize of that same copy.

humming-kernels (PyPI `humming-kernels`, vllm-project/humming, Apache-2.0) JIT-compiles CUDA GEMMs that read
the compressed-tensors `nvfp4-pack-quantized` scheme, which is our checkpoint format: its `transform()` repacks
our packed codes and e4m3 block scales into its own tiled layout with no round trip through bf16 (load, don't
requantize). It beats our Triton kernel at M >= 64 (BENCHMARKS.md); training shapes (M >= 256) and the
backward dx, which it has no kernel for, dequantize the *same* repacked copy with our table kernel
(`_triton_nvfp4.table_layout_dequant_kernel`) and call cuBLAS. So a layer keeps one copy of its 4-bit weight.

The repack is a fixed permutation within each 16 (k) x 64 (n) patch (humming's `weight_repack_nk`, and the 8x8
transpose of the block scales): rather than re-deriving it from the library's CUDA source, `layout_tables`
probes it once per process by transforming weights whose codes spell their own positions, checks that it is
periodic, and turns it into two small lookup tables. If a future humming release changes the layout in a way
the probe cannot describe, the probe fails and the caller keeps our own layout (one warning line).

Optional: importing this module never fails; `available()` says whether humming imports and a GPU is present.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging

import torch

log = logging.getLogger(__name__)

try:  # optional extra: pip install -e ".[gpu]"
    from humming.layer import HummingLayer
except Exception as _e:  # not installed, or no CUDA toolchain behind it
    HummingLayer = None
    IMPORT_ERROR: Exception | None = _e
else:
    IMPORT_ERROR = None

# The compressed-tensors scheme our checkpoints use (qerl.quant.checkpoint writes it).
CT_SCHEME = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "type": "float",
             "num_bits": 4, "strategy": "tensor_group", "group_size": 16, "symmetric": True}
PATCH_N, PATCH_K = 64, 16  # the repack's period: one patch = 1024 codes in 128 int32 words


def version() -> str | None:
    try:
        return importlib.metadata.version("humming-kernels")
    except importlib.metadata.PackageNotFoundError:
        return None


def available() -> bool:
    return HummingLayer is not None and torch.cuda.is_available()


def fits(n: int, k: int) -> bool:
    """Shapes whose repack needs no padding (padding would break the one-copy dequantize)."""
    return n % 64 == 0 and k % 64 == 0


def _transform(packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor, dtype: torch.dtype):
    """HummingLayer holding (packed, scale, gs) repacked; the caller's tensors are not kept."""
    n, k = packed.shape[0], packed.shape[1] * 2
    with torch.cuda.device(packed.device), torch.device(packed.device):  # its params are born on the GPU
        layer = HummingLayer(shape_n=n, shape_k=k, weight_config=dict(CT_SCHEME), torch_dtype=dtype)
        layer.load_from_tensors({"weight_packed": packed, "weight_scale": scale.view(torch.float8_e4m3fn),
                                 "weight_global_scale": gs.reshape(1).float()})
        layer.transform()
    return layer


@functools.cache
def layout_tables(device_index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(code table [64 * 16] int32 = word * 8 + nibble, scale table [64] int32, xor mask) of humming's repack,
    probed on this GPU. Raises RuntimeError if the layout is not the periodic permutation we decode."""
    dev = torch.device("cuda", device_index)
    n, k = 128, 64  # 2 x 4 patches: enough to check that every patch uses the same permutation
    pos = torch.arange(n * k, device=dev, dtype=torch.int64).view(n, k)

    def weight_with_codes(codes: torch.Tensor) -> torch.Tensor:
        codes = codes.to(torch.uint8)
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # even column in the low nibble (compressed-tensors)
        scale = torch.full((n, k // 16), 0x38, dtype=torch.uint8, device=dev)  # 1.0
        layer = _transform(packed, scale, torch.ones(1, device=dev), torch.bfloat16)
        w = layer.weight.detach().contiguous().view(torch.int32)
        if w.numel() * 8 != n * k:
            raise RuntimeError(f"repacked weight holds {w.numel() * 8} codes, expected {n * k}")
        shifts = torch.arange(0, 32, 4, device=dev, dtype=torch.int32)
        return ((w.reshape(-1, 1) >> shifts) & 15).reshape(-1)  # code at flat (word * 8 + nibble)

    base = weight_with_codes(torch.zeros(n, k, device=dev))
    xor = int(base[0])
    if not bool((base == xor).all()):
        raise RuntimeError("repack is not a plain permutation of codes (non-uniform code transform)")
    where = torch.zeros(n * k, dtype=torch.int64, device=dev)  # flat output slot -> source position
    for digit in range(4):  # 4 bits of the source position per probe
        out = weight_with_codes((pos >> (4 * digit)) & 15) ^ xor
        where |= out.to(torch.int64) << (4 * digit)
    if not bool((torch.sort(where).values == torch.arange(n * k, device=dev)).all()):
        raise RuntimeError("repack is not a permutation of code positions")
    slot_of = torch.empty_like(where)
    slot_of[where] = torch.arange(n * k, device=dev)  # source position (n * k_total + k) -> output slot
    slot = slot_of.view(n, k)
    nn = torch.arange(n, device=dev)[:, None]
    kk = torch.arange(k, device=dev)[None, :]
    patch_base = (kk // PATCH_K) * (16 * n) + (nn // PATCH_N) * 1024  # in nibbles: 2N words per 16-k row
    rel = slot - patch_base
    table = rel[:PATCH_N, :PATCH_K]
    if not bool((rel.view(n // PATCH_N, PATCH_N, k // PATCH_K, PATCH_K) == table[None, :, None, :]).all()):
        raise RuntimeError("repack permutation is not periodic over 16 x 64 patches")

    # Block scales: probe with distinct normal e4m3 values spelled in base 64 (bytes 0x08..0x47, no NaN).
    groups = n * (k // 16)
    spos = torch.arange(groups, device=dev).view(n, k // 16)
    where_s = torch.zeros(groups, dtype=torch.int64, device=dev)
    for digit in range(2):
        sc = (((spos >> (6 * digit)) & 63) + 8).to(torch.uint8)
        layer = _transform(torch.zeros(n, k // 2, dtype=torch.uint8, device=dev), sc, torch.ones(1, device=dev),
                           torch.bfloat16)
        s = layer.weight_scale.detach().contiguous()
        if s.element_size() != 1 or s.numel() != groups:
            raise RuntimeError(f"repacked scales are {s.dtype} x {s.numel()}, expected {groups} e4m3 bytes")
        where_s |= (s.view(torch.uint8).reshape(-1).to(torch.int64) - 8) << (6 * digit)
    sslot = torch.empty_like(where_s)
    sslot[where_s] = torch.arange(groups, device=dev)
    sslot = sslot.view(n, k // 16)  # [n, kb] -> flat slot in a [K/16, N] array
    kb = torch.arange(k // 16, device=dev)[None, :]
    srel = sslot - kb * n - (nn // PATCH_N) * PATCH_N
    scale_table = srel[:PATCH_N, 0]
    if not bool((srel == scale_table.repeat(n // PATCH_N)[:, None]).all()):
        raise RuntimeError("repacked block scales are not a periodic permutation over 64 rows")
    return table.to(torch.int32).contiguous(), scale_table.to(torch.int32).contiguous(), xor


class HummingWeight:
    """One frozen NVFP4 weight [N, K], repacked for humming-kernels; `forward` is its GEMM, `dequantize`
    ours over the same bytes, `canonical` gives back the compressed-tensors tensors (exports, state dicts)."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor, dtype=torch.bfloat16):
        self.n, self.k = packed.shape[0], packed.shape[1] * 2
        self.device = packed.device
        self.dtype = dtype
        self.global_scale = gs.reshape(1).float().clone()  # ours (a divisor); humming keeps 1 / gs
        self.tables = layout_tables(packed.device.index or 0)
        self.layer = _transform(packed, scale, gs, dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.layer.weight, self.layer.weight_scale))

    def forward(self, x2: torch.Tensor) -> torch.Tensor:
        return self.layer(x2)

    def dequantize(self, out: torch.Tensor, transposed: bool) -> torch.Tensor:
        """W [N, K] (or W^T [K, N] if transposed) into `out` (bf16/fp16), bit-identical to the codec's."""
        from . import _triton_nvfp4 as tk

        code_tbl, scale_tbl, xor = self.tables
        grid = (-(-self.k // (4 * PATCH_K)), -(-self.n // (2 * PATCH_N)))
        tk.table_layout_dequant_kernel[grid](
            self.layer.weight.view(torch.int32), self.layer.weight_scale.view(torch.uint8), self.global_scale,
            code_tbl, scale_tbl, out, self.n, self.k, xor, BLOCK_KB=4, BLOCK_NB=2, TRANSPOSED=transposed,
            num_warps=8)  # 8 warps: 180 vs 225 us on the 7B gate_up (H200, bench_kernels.py --dequant-only)
        return out

    @torch.no_grad()
    def canonical(self) -> dict[str, torch.Tensor]:
        """weight_packed / weight_scale / weight_global_scale in the compressed-tensors layout, exactly as loaded."""
        code_tbl, scale_tbl, xor = self.tables
        n, k, dev = self.n, self.k, self.device
        shifts = torch.arange(0, 32, 4, device=dev, dtype=torch.int32)
        words = self.layer.weight.view(torch.int32).reshape(k // PATCH_K, 2 * n)
        nn = torch.arange(n, device=dev)
        rel = code_tbl.view(PATCH_N, PATCH_K).long()[nn % PATCH_N]  # [n, 16] nibble slot within the patch
        slot = rel + ((nn // PATCH_N) * 1024)[:, None]
        codes = torch.empty(n, k, dtype=torch.uint8, device=dev)
        for kb in range(k // PATCH_K):  # one 16-column stripe at a time: the index stays small
            nibbles = ((words[kb].reshape(-1, 1) >> shifts) & 15).reshape(-1)
            codes[:, kb * PATCH_K:(kb + 1) * PATCH_K] = (nibbles[slot] ^ xor).to(torch.uint8)
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
        s = self.layer.weight_scale.view(torch.uint8).reshape(k // PATCH_K, n)
        srow = (nn - nn % PATCH_N) + scale_tbl.long()[nn % PATCH_N]
        scale = s[:, srow].t().contiguous().view(torch.float8_e4m3fn)
        return {"weight_packed": packed.contiguous(), "weight_scale": scale,
                "weight_global_scale": self.global_scale.clone()}
