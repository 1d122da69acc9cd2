"""kvcli's own decoding product for int8 weights: 8-bit activations (``int8_rows.cpp``).

A decoding step of a quantised model on the CPU is its int8 products (88% of the 1.5B Qwen's
step). PyTorch's kernel for them (``_weight_int8pack_mm``) keeps the activations exact and widens
every weight to a float before multiplying: it reads the weights at 11-14 GB/s where the memory
gives 50. Quantising each row of activations to int8 per block of 64 inputs (the block's largest
magnitude at 127) lets the CPU's integer dot products do the work, as llama.cpp's q8 blocks do:
AVX-512 VNNI (``vpdpbusd``) or AVX2 (``vpmaddubsw``), on the int8 rows as kvcli stores them, with
no packing. The logits round differently (docs/cpu.md has the measured answers and speed).

Not the default: held out, the 1.5B Qwen answered one question fewer in 50 with it (a near tie in
a user's words), and a default never buys speed with answers. ``KVCLI_INT8_KERNEL=kvcli`` turns
it on: the C++ source is compiled once per machine, PyTorch and source (~10 s: g++ with PyTorch's
headers) into ``<cache>/kernels/`` and loaded as ``torch.ops.kvcli.int8_rows``. Where it cannot be
(no compiler, neither instruction set) PyTorch's kernel runs, as without it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvcli.files import atomic_write, cache_folder

if TYPE_CHECKING:
    import torch

# PyTorch is imported where the kernel is built or run: kvcli's help names ENV without loading it
SOURCE = Path(__file__).with_name("int8_rows.cpp")
BLOCK = 64  # inputs per activation scale (the source's BLOCK): a layer's inputs must be a multiple
ROWS = 8  # the most rows a pass multiplies so: decoding's (a step, a draft's check), not a prompt's
ENV = "KVCLI_INT8_KERNEL"  # "pytorch" (the default) or "kvcli" (kvcli's, where it loads)
KERNELS_FOLDER = "kernels"
PATHS = {1: "AVX2", 2: "AVX-512 VNNI"}  # the source's Path values


def wanted() -> bool:
    """Whether the environment asks for kvcli's kernel (``$KVCLI_INT8_KERNEL=kvcli``; unset or
    ``pytorch``: PyTorch's)."""
    value = os.environ.get(ENV, "pytorch").strip().lower()
    if value not in ("kvcli", "pytorch", ""):
        from kvcli.errors import UsageError

        raise UsageError(f"{ENV} must be pytorch or kvcli, not '{value}'")
    return value == "kvcli"


def library_name() -> str:
    """The compiled file's name: what changes the binary (the source, PyTorch, the machine's
    architecture and Python) hashed into it, so a new PyTorch compiles its own."""
    import torch

    key = "\n".join([SOURCE.read_text(), torch.__version__, platform.machine(), sys.version])
    return f"int8_rows-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def compile_command(source: Path, out: Path) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        os.environ.get("CXX", "c++"),
        *["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp"],
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *includes,
        str(source),
        "-o",
        str(out),
        *[f"-L{p}" for p in libs],
        *[f"-Wl,-rpath,{p}" for p in libs],
        "-lc10",
        "-ltorch_cpu",
    ]


def build(folder: Path) -> Path:
    """The compiled library in ``folder``, compiled there first if missing (written to a temporary
    name and renamed, :func:`kvcli.files.atomic_write`: processes compiling at once each leave a
    whole file). A failed compile raises OSError with the compiler's first error line."""
    target = folder / library_name()
    if target.exists():
        return target
    print("kvcli: compiling its int8 decoding kernel once (~10 s)", file=sys.stderr, flush=True)
    atomic_write(target, _compile)
    return target


def _compile(out: str) -> None:
    done = subprocess.run(compile_command(SOURCE, Path(out)), capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "error" in line]
        raise OSError((errors or ["the compiler failed"])[0].strip())


def _note(why: str) -> None:
    print(f"kvcli: note: decoding runs PyTorch's int8 kernel, not kvcli's faster one: {why}", file=sys.stderr)


@functools.cache
def _loaded(folder: Path) -> str | None:
    """Load once a process (:func:`load`). A compile that failed leaves ``<library>.failed`` with
    its reason: later processes do not try again (delete it to), and say nothing."""
    import torch

    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    target = folder / library_name()
    failed = target.with_suffix(".failed")
    if not hasattr(torch.ops.kvcli, "int8_rows"):
        if not target.exists() and failed.exists():
            return None
        if not target.exists() and shutil.which(os.environ.get("CXX", "c++")) is None:
            _note("no C++ compiler (install g++)")
            return None
        try:
            torch.ops.load_library(str(build(folder)))
        except OSError as e:
            reason = str(e)
            atomic_write(failed, lambda tmp: Path(tmp).write_text(reason + "\n"))
            _note(f"its compile failed ({reason}; delete {failed} to try again)")
            return None
    global _op
    _op = torch.ops.kvcli.int8_rows
    return PATHS.get(int(torch.ops.kvcli.int8_rows_cpu_path()))


def load(cache_dir: Path | None = None) -> str | None:
    """Which of the kernel's paths runs on this CPU ("AVX-512 VNNI", "AVX2"), compiling and loading
    it first (once a process); None where PyTorch's kernel runs instead (module docstring)."""
    if not wanted():
        return None
    return _loaded(cache_folder(cache_dir) / KERNELS_FOLDER)


def product(rows: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(rows, in) activations times int8 ``codes`` (out, in) and their row ``scale``: (rows, out) in
    the activations' dtype. Needs :func:`load` to have returned a path."""
    return _op(rows, codes, scale).to(rows.dtype)


def _op(*args):  # torch.ops.kvcli.int8_rows once loaded (:func:`_loaded` sets it)
    raise RuntimeError("kvcli's int8 kernel was not loaded: int8_rows.load() first")
