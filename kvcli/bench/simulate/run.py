"""One simulated cell: a real model config on ``meta``, asked a question through kvcli's own
:class:`kvcli.api.Session` (the layer ``kvcli ask`` runs: pipeline, engine, caches, compressors),
with the :class:`~.tracker.Tracker` and the CUDA SDPA model (:class:`~.sdpa.CudaSdpa`) on.

A row of ``memory.json``: config, weights, method, tokens (prompt + generated: the KV length at
the end), peak_bytes (the simulated accelerator's peak, weights included), weights_bytes, kv_bytes
(what the cache holds when decoding starts, ``cache.nbytes()``), held_after_prefill_bytes (every
accelerator byte still live then, weights excluded), syncs / h2d copies per decode step (the
largest count over the steps) and per prefill layer (the prefill's total / the model's layers),
the SDPA backends taken per phase, what the run answered with fixed values, and ``error``: None,
or why the method cannot run there (with the line of kvcli that raised).

Decoding runs ``steps`` tokens with the stop tokens ignored (``force_tokens``), so every method
decodes the same number of steps; each step's token is the fixed value the tracker answers
``argmax`` with (token id 0 by default).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ...answer.question import QuestionOptions
from ...caches.quant import AUTO
from ...runtime.decode import DecodeStep
from ...runtime.engine import Engine
from .models import CONFIGS, SimTokenizer, build_model, weight_tensors
from .report import bits_key
from .sdpa import CudaSdpa
from .tracker import Tracker, kvcli_line

QUESTION = "What is the special magic number mentioned in the document?"
DEFAULT_STEPS = 8
HOST_LIMIT = 4 * 2**30  # real CPU memory a simulated run may hold (Tracker.host_limit)
MAX_OPS = 1_500_000  # ATen ops a cell may dispatch (Tracker.max_ops): minutes of this CPU
MEMORY_KEY = ("config", "weights", "method", "tokens", "kv_offload", "kv_bits")  # kv_bits: absent at 16


class SimEngine(Engine):
    """kvcli's engine, marking the phases for the tracker: ``prefill`` (``prefill:L<i>`` inside
    decoder layer i) until decoding starts, then ``decode:<j>`` from the start of step j to the
    start of step j+1 (its forward and the read of the token it produced)."""

    tracker: Tracker
    at_decode: dict

    def decode(self, *args, **kwargs):
        # bound by name, so a change of Engine.decode's signature elsewhere keeps this working
        bound = inspect.signature(Engine.decode).bind(self, *args, **kwargs)
        call = {k: v for k, v in bound.arguments.items() if k != "self"}
        cache, inner = call.get("cache"), call.get("step")
        tracker = self.tracker
        self.at_decode = {
            "kv_bytes": int(cache.nbytes()) if hasattr(cache, "nbytes") else None,
            "live": dict(tracker.live),
        }
        tracker.phase = "decode:first-token"
        count = 0
        inner = DecodeStep.full_attention(self) if inner is None else inner

        def step(*step_args, **step_kwargs):
            nonlocal count
            tracker.phase = f"decode:{count}"
            count += 1
            return inner.run(*step_args, **step_kwargs)

        # the step the loop runs (a method's own, or the engine's), taking the token as it did
        call["step"] = DecodeStep(step, device_token=inner.device_token)
        return super().decode(**call)


@functools.lru_cache(maxsize=2)
def _model(config: str, weights: str):
    return build_model(config, weights)


@dataclass
class SimModel:
    """A simulated model ready to be asked: its engine and session (no disk store)."""

    config: str
    weights: str
    session: object
    engine: SimEngine
    weights_list: list


def open_model(
    config: str, weights: str, kv_offload: str = "none", cache_dir: Path | None = None, kv_bits: int | str = AUTO
) -> SimModel:
    """A session on the simulated ``config`` (a key of :data:`~.models.CONFIGS`) with ``weights``, its
    KV in ``kv_bits`` (as ``kvcli ask --kv-bits``; by default auto, as kvcli ask's)."""
    model = _model(config, weights)
    return open_loaded(model, config, weights, CONFIGS[config][0], kv_offload, cache_dir, kv_bits=kv_bits)


def open_loaded(
    model,
    config: str,
    weights: str,
    name: str,
    kv_offload: str = "none",
    cache_dir: Path | None = None,
    engine_cls: type = SimEngine,
    kv_bits: int | str = AUTO,
) -> SimModel:
    """A session on ``model`` (any device: meta for the simulation, the CPU for the fidelity test,
    a GPU for ``benchmarks/gpu_measure.py`` with ``engine_cls=Engine``: no tracker), with the
    simulator's tokenizer and no disk store."""
    from ...answer.prompt import load_template
    from ...api import AskOptions, Session
    from ...model import LoadedModel

    cfg = model.config
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, (list, tuple)) else (cfg.eos_token_id or 2)
    param = next(model.parameters())
    lm = LoadedModel(
        model=model,
        tokenizer=SimTokenizer(cfg.vocab_size, bos_id=cfg.bos_token_id or 1, eos_id=eos),
        name=name,
        family=cfg.model_type,
        fingerprint=f"simulated:{config}:{weights}",
        device=param.device,
        dtype=torch.bfloat16 if weights in ("bf16", "nf4") else param.dtype,
        quant="4bit" if weights == "nf4" else "none",
        attn="sdpa",
        source=f"simulated {config}",
    )
    engine = engine_cls(lm)
    cache_dir = cache_dir or Path(tempfile.mkdtemp(prefix="kvcli-sim-"))
    # no sources: a meta run has no attention weights to cite from (their memory, a float per prompt token
    # and one layer's step weights, is within the simulator's error)
    options = AskOptions(
        model=lm.name,
        kv_offload=kv_offload,
        use_cache=False,
        answer_guard=False,
        cache_dir=cache_dir,
        sources=False,
        kv_bits=kv_bits,
    )
    session = Session(lm=lm, engine=engine, options=options, template=load_template(options.template), store=None)
    return SimModel(config, weights, session, engine, weight_tensors(model))


def document_of(tokenizer, tokens: int, steps: int, template: str):
    """A document whose prompt (template + question) is ``tokens - steps`` tokens long."""
    from ...answer.prompt import build_prompt
    from ...documents import document_from_text

    overhead = build_prompt(tokenizer, "w0", QUESTION, template).n_tokens - 1
    n_doc = tokens - steps - overhead
    if n_doc < 1:
        raise ValueError(
            f"{tokens} tokens leave no room for a document ({overhead} of template and question, {steps} generated)"
        )
    words = " ".join(f"w{i % 9973}" for i in range(n_doc))
    return document_from_text(words, source=f"simulated-{tokens}")


def _layer_hooks(engine: SimEngine):
    tracker = engine.tracker
    handles = []
    for i, layer in enumerate(engine.layers):

        def pre(_module, _args, i=i):
            if tracker.phase.startswith("prefill"):
                tracker.phase = f"prefill:L{i}"

        def post(_module, _args, _out):
            if tracker.phase.startswith("prefill"):
                tracker.phase = "prefill"

        handles.append(layer.register_forward_pre_hook(pre))
        handles.append(layer.register_forward_hook(post))
    return handles


@contextlib.contextmanager
def _bias_outside_modes():
    """PyTorch cannot make a tensor subclass under a ``TorchDispatchMode`` ("the raw Tensor object
    is already associated to a python object"), and off the CPU :func:`kvcli.runtime.kernels.causal` hands
    SDPA one: the lower-right ``CausalBias``. It holds no data, so the simulation makes it outside
    the tracker (:class:`~.sdpa.CudaSdpa` then runs it as CUDA would)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from ...runtime import kernels

    made = kernels.causal_lower_right

    def outside(*args):
        with _disable_current_modes():
            return made(*args)

    kernels.causal_lower_right = outside
    try:
        yield
    finally:
        kernels.causal_lower_right = made


@contextlib.contextmanager
def _book_in_a_mapped_file(tracker: Tracker):
    """``-c infllm`` reads the document into a book in host memory, the size of the document's
    KV (4 GiB at 32k tokens of Llama-3.1-8B), over :data:`HOST_LIMIT` of real memory. In the
    simulation its tensors are a sparse temporary file mapped shared: what is written goes to
    the page cache (reclaimable, backed by the file), never the process's memory; the rest of
    the run is as kvcli runs it (host tensors, their copies to the device counted), and the
    tracker books the book's bytes as ``mapped`` (the row's ``book_host_bytes``)."""
    import math

    from torch.utils._python_dispatch import _disable_current_modes

    from ...caches import bookfile

    made = bookfile.InMemory.start
    folder = tempfile.TemporaryDirectory(prefix="kvcli-sim-book-")

    def start(self, specs: dict, room: int, new):
        tensors = {}
        with _disable_current_modes():
            for i, (name, (dtype, shape)) in enumerate(specs.items()):
                numel = math.prod(int(n) for n in shape)
                path = Path(folder.name) / f"{i}.bin"
                with open(path, "wb") as f:  # sparse: no block written until a row is
                    f.truncate(max(1, numel) * torch.empty((), dtype=dtype).element_size())
                tensors[name] = torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)
                path.unlink()  # the mapping keeps the file: gone when the book is
        tracker.adopt_mapped(tensors.values())
        return new(bookfile.MemoryStorage(specs, tensors))

    bookfile.InMemory.start = start
    try:
        yield
    finally:
        bookfile.InMemory.start = made
        folder.cleanup()


def simulate(
    sim: SimModel,
    method: str,
    tokens: int,
    steps: int = DEFAULT_STEPS,
    *,
    sdpa: str | None = None,
    efficient_gqa: bool = False,
    fixed_token: int = 0,
) -> dict:
    """Run ``method`` on a ``tokens``-long sequence (prompt + ``steps`` generated) of ``sim``;
    returns the row (``error`` set when the method cannot run on the simulated device)."""
    from ... import notices
    from ...answer.pipeline import Pipeline

    session, engine = sim.session, sim.engine
    lm = session.lm
    device = engine.device.type
    # --kv-offload cpu: the offloaded KV is host memory the simulation never writes (a copy from
    # meta leaves its target as it was), so it is address space, not resident: no host limit
    offload = session.options.kv_offload == "cpu"
    pipeline = Pipeline.parse(method)
    tracker = Tracker(device, fixed_value=fixed_token, host_limit=None if offload else HOST_LIMIT, max_ops=MAX_OPS)
    engine.tracker = tracker
    engine.at_decode = {}
    weights_bytes = tracker.adopt(sim.weights_list)
    tracker.reset_peak()
    mode = CudaSdpa(backend=sdpa, efficient_gqa=efficient_gqa, tracker=tracker)
    row: dict = {
        "config": sim.config,
        "weights": sim.weights,
        "method": method,
        "tokens": tokens,
        "kv_offload": session.options.kv_offload,
        **bits_key(pipeline.kv_bits(session.options.kv_bits)),  # the bits it holds (auto: the method's)
        "model": lm.name,
        "steps": steps,
        "weights_bytes": weights_bytes,
        "error": None,
    }
    handles = _layer_hooks(engine)
    notices.reset()  # each cell is a run of its own: warnings said once per run, not per process
    try:
        document = document_of(lm.tokenizer, tokens, steps, session.template)
        tracker.phase = "prefill"
        with _bias_outside_modes(), _book_in_a_mapped_file(tracker), mode, tracker:
            cold = QuestionOptions(max_new_tokens=steps, force_tokens=True, use_store=False)
            result = session.ask(document, QUESTION, pipeline, cold)
        row["method_spec"] = result.extra.get("compressor")
        row["n_prompt_tokens"] = result.prompt.n_tokens
    except Exception as e:  # the row says why the method cannot run on the simulated device
        where = kvcli_line(e.__traceback__)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        row["error"] = f"{type(e).__name__}: {first}" + (f" [at {where}]" if where else "")
    finally:
        for h in handles:
            h.remove()
    warned = notices.drain()
    if any("--kv-offload cpu has no effect" in w for w in warned) and row["error"] is None:
        row["error"] = (
            "--kv-offload cpu is ignored on the simulated device: kvcli/compressors/blocksparse.py offloads only when engine.device.type == 'cuda'"
        )
    row.update(_measures(tracker, engine, lm.n_layers, weights_bytes, mode, steps))
    if row["error"]:  # the peak up to the failure only: not the method's
        row["peak_bytes_before_error"], row["peak_bytes"] = row["peak_bytes"], None
    row["warnings"] = warned
    engine.tracker = tracker  # kept for the caller (the fidelity test reads its events)
    return row


def _measures(
    tracker: Tracker, engine: SimEngine, n_layers: int, weights_bytes: int, mode: CudaSdpa, steps: int
) -> dict:
    dev = tracker.device
    decode = [tracker.phases[f"decode:{j}"] for j in range(steps - 1) if f"decode:{j}" in tracker.phases]
    prefill = tracker.counts("prefill")
    at = engine.at_decode or {}
    live_then = at.get("live", {}).get(dev)
    backends: dict = {}
    for (phase, backend), n in sorted(mode.calls.items()):
        key = "decode" if phase.startswith("decode") else "prefill"
        backends.setdefault(key, {}).setdefault(backend, 0)
        backends[key][backend] += n
    last = decode[-1] if decode else None
    return {
        "peak_bytes": int(tracker.peak[dev]),
        "peak_phase": tracker.peak_phase.get(dev),
        "kv_bytes": at.get("kv_bytes"),
        "held_after_prefill_bytes": None if live_then is None else int(live_then - weights_bytes),
        "host_peak_bytes": int(tracker.peak["cpu"]),
        "book_host_bytes": int(tracker.peak["mapped"]),  # -c infllm's book: host memory, mapped in the simulation
        "syncs_per_decode_step": max((c.syncs for c in decode), default=None),
        "h2d_copies_per_decode_step": max((c.h2d for c in decode), default=None),
        "decode_steps_measured": len(decode),
        "ops_per_decode_step": max((c.ops for c in decode), default=None),
        "ops_prefill": prefill.ops,
        "syncs_per_prefill_layer": round(prefill.syncs / n_layers, 3),
        "h2d_copies_per_prefill_layer": round(prefill.h2d / n_layers, 3),
        "syncs_prefill": prefill.syncs,
        "h2d_copies_prefill": prefill.h2d,
        "decode_sync_sites": dict(last.sync_sites) if last else {},
        "decode_h2d_sites": dict(last.h2d_sites) if last else {},
        "prefill_sync_sites": dict(prefill.sync_sites.most_common(8)),
        "sdpa_backends": backends,
        "answered": dict(tracker.answered),
        # values the simulation made up besides the token read of each step: sizes that depend
        # on them (per-head counts, selected indices) are the fixed value's, not the method's
        "reads_answered": max(0, sum(tracker.answered.values()) - steps),
    }
