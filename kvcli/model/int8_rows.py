"""kvcli's own decoding products for int8 weights (``int8_rows.cpp``), exact by default.

A decoding step of a quantised model on the CPU is its int8 products (88% of the 1.5B Qwen's
step). PyTorch's kernel for them (``_weight_int8pack_mm``) reads the weights at 11-14 GB/s where
the memory gives 30-50. kvcli's kernels read kvcli's int8 rows as stored (no packing), four weight
rows a tile with the next tile fetched ahead, in one of two arithmetics (``KVCLI_INT8_KERNEL``):

* ``exact`` (the default): the activations as they come (bfloat16 widens to float32 exactly) times
  each weight widened to float32 (exact), summed in float32: PyTorch's products in another order of
  summation, so the logits differ from its kernel's by float32 rounding alone (the answers held out:
  docs/cpu.md). AVX-512 or AVX2 with FMA.
* ``8bit``: each row of activations quantised to int8 per block of 64 inputs (the block's largest
  magnitude at 127), as llama.cpp's q8 blocks do, and the CPU's integer dot products (AVX-512 VNNI
  ``vpdpbusd``, AVX2 ``vpmaddubsw``): ~10% faster than ``exact``, but the logits round differently
  and the 1.5B Qwen answered two held-out questions fewer in 100: opt-in.
* ``pytorch``: PyTorch's kernel.

``exact`` runs every pass of fewer rows than the weights are made dense for (32: decoding, drafts
checked, a short question after a stored document); the weights made dense (:func:`dense`) for
the passes from there too; ``8bit`` only passes of
up to :data:`ROWS` rows (decoding, drafts checked), a prompt's pieces on PyTorch's. The C++ source is compiled once per machine, PyTorch and source (~10 s: the C++ compiler
with PyTorch's headers) into ``<cache>/kernels/`` and loaded as ``torch.ops.kvcli``; where it cannot
be (no compiler, no AVX2) PyTorch's kernel runs, with a note.
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
EXACT_STEP = 32  # inputs the exact kernel takes an iteration (the source's EXACT_STEP): a multiple it needs
ROWS = 8  # the most rows a pass multiplies with 8-bit activations: decoding's (a step, a draft's check)
ENV = "KVCLI_INT8_KERNEL"
MODES = ("exact", "8bit", "pytorch")  # the first the default (module docstring)
KERNELS_FOLDER = "kernels"
NO_COMPILER = "no-compiler.noted"  # in the kernels folder: the missing compiler's note was given once
PATHS = {1: "AVX2", 2: "AVX-512 VNNI"}  # the source's Path values (8bit)
EXACT_PATHS = {1: "AVX2", 2: "AVX-512"}  # int8_rows_exact_cpu_path's values


def mode() -> str:
    """``$KVCLI_INT8_KERNEL``: exact (unset: the default), 8bit or pytorch (module docstring)."""
    value = os.environ.get(ENV, "").strip().lower() or MODES[0]
    if value not in MODES:
        from kvcli.errors import UsageError

        raise UsageError(f"{ENV} must be {', '.join(MODES[:-1])} or {MODES[-1]}, not '{value}'")
    return value


def step(chosen: str) -> int:
    """The multiple of inputs a layer needs for ``chosen``'s kernel."""
    return BLOCK if chosen == "8bit" else EXACT_STEP


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


def no_compiler(folder: Path) -> bool:
    """Whether no C++ compiler is found (``$CXX``, else ``c++``), saying so once a cache folder
    (:data:`NO_COMPILER` in ``folder``; a folder that cannot take the mark says it each time): a
    user who will not install one is not told at every question, and one installed since is used."""
    if shutil.which(os.environ.get("CXX", "c++")) is not None:
        return False
    noted = folder / NO_COMPILER
    if not noted.exists():
        _note("no C++ compiler (install g++)")
        try:
            atomic_write(noted, lambda tmp: Path(tmp).write_text("noted\n"))
        except OSError:
            pass
    return True


@functools.cache
def _loaded(folder: Path) -> bool:
    """Whether the library is loaded, loading it once a process (:func:`load`). A compile that
    failed leaves ``<library>.failed`` with its reason: later processes do not try again (delete it
    to), and say nothing. Without a C++ compiler the note is given once a cache folder
    (:data:`NO_COMPILER`); a compiler installed since is used at the next load."""
    import torch

    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    target = folder / library_name()
    failed = target.with_suffix(".failed")
    if not hasattr(torch.ops.kvcli, "int8_rows"):
        if not target.exists() and failed.exists():
            return False
        if not target.exists() and no_compiler(folder):
            return False
        try:
            torch.ops.load_library(str(build(folder)))
        except OSError as e:
            reason = str(e)
            atomic_write(failed, lambda tmp: Path(tmp).write_text(reason + "\n"))
            _note(f"its compile failed ({reason}; delete {failed} to try again)")
            return False
    return True


def load(cache_dir: Path | None = None, chosen: str | None = None) -> str | None:
    """The instructions ``chosen``'s kernel (default: :func:`mode`'s) runs on this CPU: "AVX-512
    VNNI" or "AVX2" for 8bit, "AVX-512" or "AVX2" for exact, compiling and loading the library
    first (once a process); None where PyTorch's kernel runs instead (module docstring)."""
    import torch

    chosen = chosen or mode()
    if chosen == "pytorch" or not _loaded(cache_folder(cache_dir) / KERNELS_FOLDER):
        return None
    if chosen == "8bit":
        return PATHS.get(int(torch.ops.kvcli.int8_rows_cpu_path()))
    return EXACT_PATHS.get(int(torch.ops.kvcli.int8_rows_exact_cpu_path()))


def product(rows: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """8bit: (rows, in) activations times int8 ``codes`` (out, in) and their row ``scale``: (rows,
    out) in the activations' dtype. Needs :func:`load` to have returned a path."""
    import torch

    return torch.ops.kvcli.int8_rows(rows, codes, scale).to(rows.dtype)


def exact(rows: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """exact: the same product with the activations as they come (module docstring)."""
    import torch

    return torch.ops.kvcli.int8_rows_exact(rows, codes, scale).to(rows.dtype)


def dense(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 ``codes`` (out, in) times their row ``scale`` in ``dtype`` (bfloat16 or float32): the
    bits of ``torch.mul(codes, scale.to(dtype)[:, None])`` in one pass (the source's
    ``int8_rows_dense``: the 1.5B's 8960 x 1536 matrix in 1.1 ms against 2.6; docs/cpu.md). Needs :func:`load` to have returned a path."""
    import torch

    return torch.ops.kvcli.int8_rows_dense(codes, scale, dtype == torch.bfloat16, 0)
