"""Compile bik's Triton kernels for real GPU targets on a machine without a GPU.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` produces the same cubin a
launch on that GPU would, provided the signature is specialised the way a launch specialises
it (pointers and ints divisible by 16 carry a divisibility hint; an int equal to 1 becomes a
constant). :func:`launch_like_signature` does that from example argument values.

triton.compile does not reject shared-memory overruns, so :func:`compile_kernel` reports
``metadata.shared`` against the per-block limit, reads registers, stack and local memory of the
cubin Triton produced with the wheel's ``cuobjdump --dump-resource-usage``, and spill bytes with
its ``ptxas -v`` on the same PTX (that report cached on disk by the PTX's hash:
build_cache.py; Triton caches its own compiles).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import build_cache
import torch

__all__ = ["REGISTERS_PER_SM", "SHARED_LIMIT", "SHARED_PER_SM", "CompileRecord", "Desc", "Ptr", "compile_kernel",
           "launch_like_signature"]

# Max dynamic shared memory per block (opt-in), from the CUDA programming guide.
SHARED_LIMIT = {90: 232_448, 80: 166_912}
# Per SM (CUDA programming guide, compute capabilities table): shared memory, and the 1 KiB the
# system reserves per resident block; 64K 32-bit registers, allocated per warp in units of 256.
SHARED_PER_SM = {90: 233_472, 80: 167_936}
SHARED_RESERVED_PER_BLOCK = 1024
REGISTERS_PER_SM = 65_536

_TRITON_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                 torch.int32: "i32", torch.int64: "i64"}


class Ptr(NamedTuple):
    """An example pointer argument: only its element dtype matters (assumed 16-B aligned)."""

    dtype: torch.dtype


class Desc(NamedTuple):
    """An example host TensorDescriptor argument (TMA): element dtype and block shape."""

    dtype: torch.dtype
    block: tuple[int, ...]


class CompileRecord(NamedTuple):
    kernel: str
    arch: int
    config: dict
    shared: int
    shared_limit: int
    registers: int
    stack: int  # bytes of stack frame per thread (cuobjdump)
    local: int  # bytes of local memory per thread (cuobjdump)
    spill_stores: int
    spill_loads: int
    mma: tuple[str, ...] = ()  # the distinct tensor-core instructions in the PTX
    tma: bool = False  # the PTX loads through TMA (cp.async.bulk.tensor)
    # Per scf.for loop of the TTGIR that holds a dot: the fewest async copies its waits leave
    # in flight (-1: no wait inside). One entry per pipelined K loop of a tile.
    dot_loops: tuple[int, ...] = ()


    @property
    def fits(self) -> bool:
        return self.shared <= self.shared_limit

    @property
    def ctas_per_sm(self) -> int:
        """Resident blocks per SM allowed by registers and shared memory (not by the block
        limit, never the binding one here)."""
        warps = self.config["num_warps"]
        per_warp = -(-self.registers * 32 // 256) * 256
        by_regs = REGISTERS_PER_SM // (per_warp * warps)
        by_shared = SHARED_PER_SM[self.arch] // (self.shared + SHARED_RESERVED_PER_BLOCK)
        return min(by_regs, by_shared)


def launch_like_signature(kernel, args: dict, constexprs: dict):
    """Signature, constants and attrs as a launch with ``args`` would specialise them."""
    signature, constants, attrs = {}, dict(constexprs), {}
    unspecialised = {p.name for p in kernel.params if p.do_not_specialize}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = args[name]
        if isinstance(value, Ptr):
            signature[name] = "*" + _TRITON_DTYPE[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, Desc):
            signature[name] = (f"tensordesc<{_TRITON_DTYPE[value.dtype]}"
                               f"[{','.join(map(str, value.block))}]>")
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int) and name in unspecialised:
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
        elif isinstance(value, int):
            if value == 1:
                signature[name] = "constexpr"
                constants[name] = 1
                continue
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot specialise example value {value!r}")
    return signature, constants, attrs


def _nvidia_tool(name: str) -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def _cubin_usage(cubin: bytes) -> tuple[int, int, int]:
    """(registers, stack bytes, local bytes) of the one kernel in ``cubin``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([str(_nvidia_tool("cuobjdump")), "--dump-resource-usage",
                               str(path)], capture_output=True, text=True, check=True).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    return int(usage.group(1)), int(usage.group(2)), int(usage.group(3))


def _ptxas_spills(ptx: str) -> tuple[int, int]:
    """Spill stores and loads in ``ptxas -v``'s report on ``ptx`` (the report is cached on
    disk by the PTX's hash and ptxas's version: build_cache.py)."""
    ptxas = str(_nvidia_tool("ptxas"))
    target = re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE).group(1)

    def report() -> bytes:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "k.ptx"
            src.write_text(ptx)
            res = subprocess.run([ptxas, f"-arch={target}", "-v", str(src), "-o",
                                  str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                                 check=True)
        return (res.stdout + res.stderr).encode()

    key = build_cache.digest("ptxas-v", target, build_cache.tool_version(ptxas), _code_of(ptx))
    text = build_cache.cached_bytes("ptxas.txt", key, report).decode()
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return int(spills.group(1)), int(spills.group(2))


def compile_kernel(kernel, args: dict, constexprs: dict, *, arch: int, num_warps: int,
                   num_stages: int, options: dict | None = None) -> CompileRecord:
    """Compile ``kernel`` for sm_``arch`` as a launch with ``args`` would, and measure it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants, attrs = launch_like_signature(kernel, args, constexprs)
    compiled = triton.compile(
        ASTSource(kernel, signature, constants, attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps, "num_stages": num_stages} | (options or {}),
    )
    regs, stack, local = _cubin_usage(compiled.asm["cubin"])
    spill_st, spill_ld = _ptxas_spills(compiled.asm["ptx"])
    config = {k: v for k, v in constexprs.items()} | {"num_warps": num_warps,
                                                      "num_stages": num_stages}
    return CompileRecord(kernel.__name__, arch, config, compiled.metadata.shared,
                         SHARED_LIMIT[arch], regs, stack, local, spill_st, spill_ld,
                         mma_instructions(compiled.asm["ptx"]),
                         "cp.async.bulk.tensor" in compiled.asm["ptx"],
                         dot_loops(compiled.asm["ttgir"]))


_DOT = re.compile(r"\b(ttng\.warp_group_dot|tt\.dot|ttng\.tc_gen5_mma)\b")
_WAIT = re.compile(r"ttg\.async_wait\b.*\{num = (\d+)")


def dot_loops(ttgir: str) -> tuple[int, ...]:
    """For each scf.for of ``ttgir`` whose own body (not a nested loop's) holds a dot: the
    smallest ``num`` of the async waits in that body (the copies left in flight while the dot
    waits), or -1 without one. A K loop pipelined across a tile is one entry; a loop per K
    split nested in a loop over splits is two (the first split's and the loop's)."""
    stack: list[int | None] = []  # innermost region last: a loop's index, or None
    with_dot: set[int] = set()
    in_flight: dict[int, int] = {}
    loops = 0
    for line in ttgir.splitlines():
        text = line.strip()
        if text.startswith("}"):
            stack.pop()
        loop = next((i for i in reversed(stack) if i is not None), None)
        if loop is not None and _DOT.search(text):
            with_dot.add(loop)
        wait = _WAIT.search(text)
        if loop is not None and wait:
            in_flight[loop] = min(in_flight.get(loop, 1 << 30), int(wait.group(1)))
        if text.endswith("{"):
            stack.append(loops if "scf.for" in text and not text.startswith("}") else None)
            loops += "scf.for" in text and not text.startswith("}")
    return tuple(in_flight.get(i, -1) for i in sorted(with_dot))


def _code_of(ptx: str) -> str:
    """The PTX without its debug information (``.file`` / ``.loc`` and the DWARF sections, which
    spell out the kernel's source by absolute path, so two clones' PTX differ there): what
    ptxas's register and spill report depends on, and so the part its cache key hashes."""
    ptx = re.sub(r"^\s*\.section\s+\.debug\w*\s*\{.*?^\s*\}", "", ptx, flags=re.M | re.S)
    return re.sub(r"^\s*\.(?:file|loc)\b.*$", "", ptx, flags=re.M)


def mma_instructions(ptx: str) -> tuple[str, ...]:
    """The distinct MMA opcodes (wgmma on sm_90, mma.sync before) with their shapes and types:
    what decides how a tile's products are summed inside one K step."""
    return tuple(sorted(set(re.findall(r"\b(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", ptx))))
