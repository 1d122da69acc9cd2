"""What a run asks of an accelerator, counted op by op: a ``TorchDispatchMode`` that tracks live
storage bytes per device (and their peak), host->device copies and host synchronisations,
attributed to the phase the run is in.

Counted, for every ATen op that reaches the dispatcher:

* **allocations**: a tensor output whose storage the tracker has not seen is a new allocation of
  ``storage.nbytes()`` (views share their base's storage: not counted). It stays live until its
  storage is freed (a weak reference's callback), as a CUDA caching allocator's "allocated" bytes
  do. Sizes are rounded as the CUDA allocator rounds blocks (multiples of 512 bytes,
  :func:`cuda_block`) for the live/peak figures; the raw sizes are kept in :attr:`Tracker.allocations`.
  Storages the run did not make through an op (a ``torch.tensor(..., device=)`` literal) are
  counted when an op first reads them.
* **host->device copies** (``h2d``): ``_to_copy`` / ``copy_`` from the CPU to the accelerator, and
  an op on the accelerator that takes a CPU tensor of more than one element (advanced indexing
  with CPU indices copies them implicitly).
* **host syncs**: ``_local_scalar_dense`` of an accelerator tensor (``.item()``, ``int(t)``,
  ``bool(t)``, ``if t:``), a copy from the accelerator to the CPU (``.cpu()``, ``.tolist()``), and
  the ops whose output shape depends on the data (``nonzero``, boolean masks, ``unique``...).

On the ``meta`` device the values do not exist: ``_local_scalar_dense`` is answered with
:attr:`Tracker.fixed_value` (an integer read gets that token id, a float 0.0, a bool ``False``)
and a copy to the CPU with zeros (left uninitialised above :data:`ZERO_LIMIT` bytes: nothing reads
those values but other copies) — the run goes on, and the row says what was answered. Data-dependent
shapes cannot be answered: the op raises, and :func:`kvcli_line` names the line of kvcli that
called it.
"""

from __future__ import annotations

import traceback
import weakref
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops whose output shape depends on the values of their input: a sync on CUDA, no answer on meta
DATA_DEPENDENT = {
    "nonzero",
    "nonzero_static",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "bincount",
    "histc",
    "repeat_interleave",
}
# ops that take CPU indices into a device tensor on CUDA (copied over implicitly): the indices
# only (the tensor indexed and the values put must be on the device)
CPU_INDICES_OK = {"index", "index_put_", "index_put", "_index_put_impl_"}
# ops that are not elementwise (no TensorIterator) yet read a 0-dim CPU tensor as a scalar on CUDA
CPU_SCALAR_OK = {"masked_fill", "masked_fill_", "fill_", "fill", "index_fill", "index_fill_"}
ZERO_LIMIT = 1 << 20  # a device->host answer up to this size is zeros; larger ones are left uninitialised
PACKAGE = Path(__file__).resolve().parents[2]  # kvcli/
SIM_DIR = Path(__file__).resolve().parent


def _tensors(values, out: list) -> list:
    """The tensors in an op's arguments or outputs (tensors, lists/tuples of them, a dict of
    keyword arguments): pytree's flatten, without its cost on every op."""
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            _tensors(v, out)
    return out


def cuda_block(nbytes: int) -> int:
    """The bytes the CUDA caching allocator books for an allocation of ``nbytes``: a multiple of
    512 (at least 512); nothing for an empty tensor."""
    return 0 if nbytes <= 0 else -(-nbytes // 512) * 512


def kvcli_line(tb=None) -> str | None:
    """``path:line (function)`` of the innermost frame of kvcli outside this simulator, in the
    traceback ``tb`` (default: the current stack)."""
    frames = traceback.extract_tb(tb) if tb is not None else traceback.extract_stack()
    for frame in reversed(frames):
        path = Path(frame.filename).resolve()
        if PACKAGE in path.parents and SIM_DIR not in path.parents and path.parent != SIM_DIR:
            return f"{path.relative_to(PACKAGE.parent)}:{frame.lineno} ({frame.name})"
    return None


_READS = (
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__float__,
    torch.Tensor.__bool__,
    torch.Tensor.item,
)


class _MetaReads(TorchFunctionMode):
    """Python reads of a meta tensor's value (``int(t)``, ``t.item()``, ``if t:``) sent to the
    dispatcher as ``_local_scalar_dense``, where the tracker counts and answers them (under
    ``torch.inference_mode`` PyTorch refuses them before the dispatcher)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta":
            value = aten._local_scalar_dense.default(args[0])
            if func is torch.Tensor.__float__:
                return float(value)
            if func is torch.Tensor.__bool__:
                return bool(value)
            return value if func is torch.Tensor.item else int(value)
        return func(*args, **(kwargs or {}))


@dataclass
class Allocation:
    nbytes: int
    device: str
    op: str
    phase: str


@dataclass
class PhaseCounts:
    syncs: int = 0
    h2d: int = 0
    ops: int = 0
    d2h: int = 0
    allocations: int = 0
    sync_sites: Counter = field(default_factory=Counter)  # "op at kvcli/x.py:N" -> count
    h2d_sites: Counter = field(default_factory=Counter)


class Tracker(TorchDispatchMode):
    """``with Tracker("meta") as t: ...`` — counts what the work inside asks of device ``device``.

    ``host``: also keep live/peak bytes of CPU tensors (the fidelity test compares a CPU run with a
    meta run that way). ``phase`` (settable at any time) is where events are attributed."""

    def __init__(
        self,
        device: str = "meta",
        *,
        fixed_value: int = 0,
        sites: bool = True,
        host_limit: int | None = None,
        max_ops: int | None = None,
    ) -> None:
        super().__init__()
        # ATen ops dispatched (each a kernel launch on a GPU, views aside); past max_ops the run stops
        self.ops, self.max_ops = 0, max_ops
        # CPU tensors of a simulated run are real: past this many live bytes the run stops
        # (--kv-offload cpu at 128k would hold 16 GiB of KV in this machine's memory)
        self.host_limit = host_limit
        self.device = torch.device(device).type
        self.fixed_value = fixed_value
        self.sites = sites  # find the kvcli line of each sync / copy (a stack walk each)
        self.phase = "setup"
        self.live: dict[str, int] = defaultdict(int)  # device type -> booked bytes
        self.peak: dict[str, int] = defaultdict(int)
        self.peak_phase: dict[str, str] = {}
        self.allocations: list[Allocation] = []
        # (+1 allocated / -1 freed, the allocation), in order; storages adopted are not in it
        self.events: list[tuple[int, Allocation]] = []
        self.phases: dict[str, PhaseCounts] = defaultdict(PhaseCounts)
        self.answered: Counter = Counter()  # what the meta run answered with a fixed value
        self._storages: dict[int, tuple[str, int, weakref.ref]] = {}

    def __enter__(self):
        self._reads = _MetaReads()
        self._reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._reads.__exit__(*exc)

    # --- storages --------------------------------------------------------------------------
    def adopt(self, tensors, phase: str | None = None) -> int:
        """Count tensors made before tracking began (the weights) as live, not as allocations of
        the run. Returns their booked bytes on the tracked devices."""
        total = 0
        for t in tensors:
            if isinstance(t, torch.Tensor):
                total += self._register(t, record=False)
        return total

    def adopt_mapped(self, tensors) -> int:
        """Host tensors over a mapped file (the simulated book of ``-c infllm``): their bytes are
        booked as ``live["mapped"]`` (with its peak), never against ``host_limit`` — they are the
        run's host bytes, but the simulating machine holds them in its page cache, not its memory."""
        return sum(self._register(t, record=False, as_device="mapped") for t in tensors if isinstance(t, torch.Tensor))

    def _register(self, t: torch.Tensor, record: bool = True, op: str = "", as_device: str | None = None) -> int:
        dev = t.device.type
        if t.is_sparse or dev not in (self.device, "cpu"):
            return 0
        dev = as_device or dev
        st = t.untyped_storage()
        key = st._cdata
        known = self._storages.get(key)
        nbytes = st.nbytes()
        if known is not None:
            if nbytes <= known[1]:
                return 0
            # a storage grown in place (resize_): the difference is a new allocation
            booked = cuda_block(nbytes) - cuda_block(known[1])
            self._storages[key] = (dev, nbytes, known[2])
            self._book(dev, booked, nbytes - known[1], record, op)
            return booked
        booked = cuda_block(nbytes)
        live, events = self.live, self.events
        alloc = self._book(dev, booked, nbytes, record, op)

        def freed(_ref, key=key, dev=dev, alloc=alloc) -> None:
            entry = self._storages.pop(key, None)
            if entry is not None:
                live[dev] -= cuda_block(entry[1])
                if alloc is not None:
                    events.append((-1, alloc))

        self._storages[key] = (dev, nbytes, weakref.ref(st, freed))
        return booked

    def _book(self, dev: str, booked: int, nbytes: int, record: bool, op: str) -> Allocation | None:
        self.live[dev] += booked
        if dev == "cpu" and self.host_limit is not None and self.device != "cpu" and self.live[dev] > self.host_limit:
            raise MemoryError(
                f"the simulation would hold more than {self.host_limit / 2**30:.1f} GiB of real host memory "
                f"(host tensors are real; this run keeps {self.live[dev] / 2**30:.1f} GiB on the CPU)"
            )
        if self.live[dev] > self.peak[dev]:
            self.peak[dev] = self.live[dev]
            self.peak_phase[dev] = self.phase
        if not record or nbytes <= 0:
            return None
        alloc = Allocation(nbytes, dev, op, self.phase)
        self.allocations.append(alloc)
        self.events.append((1, alloc))
        self.phases[self.phase].allocations += 1
        return alloc

    def reset_peak(self) -> None:
        """Start the peaks afresh from what is live now."""
        for dev, v in self.live.items():
            self.peak[dev] = v
            self.peak_phase[dev] = self.phase

    # --- events ----------------------------------------------------------------------------
    def _site(self, what: str) -> str:
        return f"{what} at {kvcli_line() or '?'}" if self.sites else what

    def _sync(self, what: str) -> None:
        counts = self.phases[self.phase]
        counts.syncs += 1
        counts.sync_sites[self._site(what)] += 1

    def _h2d(self, what: str) -> None:
        counts = self.phases[self.phase]
        counts.h2d += 1
        counts.h2d_sites[self._site(what)] += 1

    def _accelerated(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == self.device and self.device != "cpu"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.removeprefix("aten::")
        self.ops += 1
        self.phases[self.phase].ops += 1
        if self.max_ops is not None and self.ops > self.max_ops:
            raise RuntimeError(
                f"over {self.max_ops:,} ATen ops dispatched: too many to simulate here (each is a kernel launch on a GPU)"
            )
        tensors = _tensors(kwargs.values(), _tensors(args, []))
        for t in tensors:  # storages made outside any op (literals on the device)
            self._register(t, op="(literal)")
        on_device = any(self._accelerated(t) for t in tensors)
        label = name

        if name == "_local_scalar_dense" and self._accelerated(args[0]):
            self._sync(f"{name} ({args[0].dtype})")
            if args[0].device.type == "meta":
                return self._answer_scalar(args[0].dtype)
        elif name in ("_to_copy", "copy_", "to", "_copy_from"):
            src, dst = self._copy_ends(name, args, kwargs)
            if src == "cpu" and dst == self.device and self.device != "cpu":
                self._h2d(name)
                label = f"h2d {name}"
            elif src == self.device and dst == "cpu" and self.device != "cpu":
                self.phases[self.phase].d2h += 1
                self._sync(f"{name} to cpu")
                if src == "meta":
                    return self._answer_copy(name, args, kwargs)
        elif on_device:
            if name in DATA_DEPENDENT or (name.startswith("index") and any(t.dtype == torch.bool for t in tensors[1:])):
                self._sync(f"{name} (data-dependent shape)")
            self._check_devices(name, func, args, tensors)

        out = func(*args, **kwargs)
        for t in _tensors(out if isinstance(out, (list, tuple)) else (out,), []):
            self._register(t, op=label)
        return out

    def _check_devices(self, name: str, func, args, tensors) -> None:
        """CUDA's rule for one op over CPU and device tensors, for every op (``bmm``, ``cat``,
        ``index_select``, ``embedding``, SDPA... as for the elementwise ones):

        * advanced indexing (:data:`CPU_INDICES_OK`) copies CPU *indices* over (an implicit
          host->device copy); the tensor indexed and the values put must be on the device (a 0-dim
          CPU value is a scalar);
        * an elementwise op (ATen's ``pointwise`` tag: TensorIterator) or one of
          :data:`CPU_SCALAR_OK` reads a 0-dim CPU tensor as a scalar, unless its output is that CPU
          tensor (an in-place op on it);
        * any other CPU tensor, 0-dim included, raises on CUDA, so it raises here."""
        cpu = [t for t in tensors if t.device.type == "cpu"]
        if not cpu:
            return
        inplace_on_cpu = name.endswith("_") and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"
        if (
            name in CPU_INDICES_OK
            and not inplace_on_cpu
            and not (isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu")
        ):
            indices = _tensors(args[1:2], [])
            values = _tensors(args[2:3], [])
            if any(t.device.type == "cpu" and t.dim() > 0 for t in values):
                cpu = [t for t in values if t.device.type == "cpu"]
            else:
                if any(t.device.type == "cpu" and t.dim() > 0 for t in indices):
                    self._h2d(f"{name} (implicit: CPU indices into a device op)")
                return
        elif (
            not inplace_on_cpu
            and (torch.Tag.pointwise in func.tags or name in CPU_SCALAR_OK)
            and all(t.dim() == 0 for t in cpu)
        ):
            return
        raise RuntimeError(
            f"Expected all tensors to be on the same device: aten.{name} mixes a CPU tensor "
            f"{tuple(cpu[0].shape)} {cpu[0].dtype} with tensors on the accelerator (raises on CUDA)"
        )

    @staticmethod
    def _copy_ends(name: str, args, kwargs) -> tuple[str, str]:
        if name == "copy_":
            return args[1].device.type, args[0].device.type
        src = args[0].device.type
        dst = kwargs.get("device")
        if dst is None and name == "_copy_from":
            dst = args[1].device
        if dst is None and name == "to" and len(args) > 1:  # to.device(self, device, ...) / to.other(self, other)
            dst = (
                args[1].device
                if isinstance(args[1], torch.Tensor)
                else args[1]
                if isinstance(args[1], (torch.device, str))
                else None
            )
        return src, torch.device(dst).type if dst is not None else src

    def _answer_scalar(self, dtype: torch.dtype):
        if dtype == torch.bool:
            self.answered["bool read -> False"] += 1
            return False
        if dtype.is_floating_point or dtype.is_complex:
            self.answered["float read -> 0.0"] += 1
            return 0.0
        self.answered[f"integer read -> {self.fixed_value}"] += 1
        return self.fixed_value

    def _answer_copy(self, name: str, args, kwargs):
        src = args[1] if name == "copy_" else args[0]
        if name == "copy_":  # into an existing CPU tensor: its values stay as they were
            self.answered["device->host copy into a CPU tensor: left as it was"] += 1
            return args[0]
        dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None) or src.dtype
        nbytes = src.numel() * torch.empty((), dtype=dtype).element_size()
        make = torch.zeros if nbytes <= ZERO_LIMIT else torch.empty
        self.answered[
            "device->host copy -> zeros" if make is torch.zeros else "device->host copy (large) -> uninitialised"
        ] += 1
        out = make(src.shape, dtype=dtype, device="cpu")
        self._register(out, op=f"d2h {name}")
        return out

    # --- reading it ------------------------------------------------------------------------
    def counts(self, prefix: str) -> PhaseCounts:
        """The events of every phase whose name starts with ``prefix``, summed."""
        total = PhaseCounts()
        for name, c in self.phases.items():
            if name.startswith(prefix):
                total.syncs += c.syncs
                total.h2d += c.h2d
                total.d2h += c.d2h
                total.allocations += c.allocations
                total.ops += c.ops
                total.sync_sites.update(c.sync_sites)
                total.h2d_sites.update(c.h2d_sites)
        return total


@contextmanager
def phase(tracker: Tracker | None, name: str):
    """``with phase(t, "decode:3"):`` attributes the events inside to ``name``."""
    if tracker is None:
        yield
        return
    before, tracker.phase = tracker.phase, name
    try:
        yield
    finally:
        tracker.phase = before
