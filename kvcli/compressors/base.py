"""What a compressor is, where it may act, and how users name it.

A compressor is a small ``@dataclass`` whose fields are its knobs (each with a ``help`` in its
field metadata) and whose class docstring cites its paper. It acts through optional hooks, called
by :mod:`kvcli.answer.pipeline` in this order:

``select_tokens(engine, prompt_ids, protected, prefix, prompt) -> Selection``
    Before prefill: choose a sub-sequence of the prompt (GemFilter). The chosen tokens are re-run
    with fresh, contiguous positions. Several selectors may chain; each is called the same way,
    and the first is handed the ``prompt`` (:class:`kvcli.answer.prompt.Prompt`: the document's
    passages, the question), the later ones None (they see the first one's selection, not the
    prompt). A selector that ranks the document's passages by the question declares it
    (``reads_passages``: ``pages``): the pipeline then puts it first and cites one source per
    passage it read.
``prefill(engine, ids, prefix, protected) -> (cache, first_logits, next_position)``
    Own the prefill loop (chunked or pruned prefill). At most one method per pipeline.
    ``protected``: the tokens after the document (instructions, question, generation prompt), as
    for ``select_tokens``. A prefill owner that reads the
    prompt first may read documents longer than the window (``window_needed``, Finch).
``compress(engine, cache) -> cache``
    After the prefill, shrink the KV cache (SnapKV, H2O, StreamingLLM, PyramidKV). Scores come from
    observers the method attaches to the final prefill pass (``prefill_observers``: per layer,
    ``fn(query, key)`` with the queries of the tokens run in that pass — at least the last
    ``query_window(lm)`` prompt tokens — and every key). Several may chain, in the order written.
    A method whose layers are chosen independently also evicts each layer as soon as that pass has
    run it (``compresses_by_layer``/``compress_layer``), so the uncompressed KV of every layer is
    never held at once; ``compress`` then finishes.
``decode_step(engine, token, position, cache) -> logits``
    Own each greedy decoding step: run ``token`` at ``position`` on ``cache`` and return the next
    logits (vocab,) (LazyLLM's dynamic pruning, block-sparse retrieval). At most one per pipeline;
    default :func:`kvcli.runtime.decode.step` (full attention over the cache).

What a method computes from the question-agnostic prompt prefix (the document and the template
around it, ``Prompt.prefix_len`` tokens) is its *prefix state*; the disk store (:mod:`kvcli.store`)
keeps it so a second question starts from it:

``prefix_state(lm) -> dict | None``
    The parameters that state depends on (hashed into the store key), or None when the method has
    no reusable state (it needs the question to read the document, e.g. Finch). Default: the KV of
    every layer — full attention's, and that of methods which compress after seeing the question.
``build_prefix(engine, prefix_ids) -> cache``
    Compute the state for ``prefix_ids`` (n,) at positions 0..n-1. Default: the KV of the first
    ``prefix_state(lm)["layers"]`` layers (:func:`kvcli.runtime.prefill.prefix_kv`). A method whose
    state is a compressed cache (question-agnostic, e.g. RazorAttention) overrides it and returns
    any cache object with ``to_tensors()`` / ``from_tensors()`` (see :mod:`kvcli.caches`).
    At most one method per pipeline may override it.

The pipeline hands the state to the stage that reads the whole prompt first (the first selector,
else the prefill owner, else the first stage) as a :class:`kvcli.answer.prefix.Prefix`: ``prefix.take()``
returns the state for the run to extend (loaded from the store, or computed; its own copy where the
store keeps it) and ``prefix.ids`` the tokens. A method whose state is a book written into its store
entry while the document is read (InfLLM) says so with ``writes_prefix``.

A method that overrides a hook *owns* that phase; :func:`owned_phases` reads it off the class, so
the pipeline can refuse two methods that would both own the prefill loop.

Registration: a subclass that states its own ``name`` in its body registers itself under it in
:data:`REGISTRY` when the class is defined (:meth:`Compressor.__init_subclass__`; a base without
a name, ``scoring.Eviction``, does not); a new method is its file, imported by
:mod:`kvcli.compressors`. Users write ``name:knob=value,knob=value``. Every registered class must
declare, in its own body, ``keep_all``: the knobs with which it keeps every entry (see
:attr:`Compressor.keep_all`); :func:`register` refuses a class without it, and ``tests/compressors/test_contract.py`` holds every registered method to reproducing full
attention with it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from ..caches import quant
from ..caches.qkv import QuantKVCache
from ..errors import UsageError
from ..method_catalog import knob_text
from ..runtime import windows
from .selection import Selection

REGISTRY: dict[str, type[Compressor]] = {}

# hooks that at most one method of a pipeline may own
EXCLUSIVE_PHASES = ("build_prefix", "prefill", "decode_step")
PHASES = ("select_tokens", "build_prefix", "prefill", "compress", "decode_step")


def knob(default, help: str):
    """A compressor knob: a dataclass field with a default and a one-line help."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Runtime:
    """The run's settings every method is handed (by :meth:`Pipeline.configure`, before
    :meth:`Compressor.configure`), whatever its knobs: not part of a method's spec, set by the
    command line or the library's ``AskOptions``. The device, dtype and kernel are the model's
    (``lm.device`` ...)."""

    cache_dir: Path | None = None  # per-model data (head profiles); None: kvcli.model.default_cache_dir()
    kv_offload: str = "none"  # "cpu": methods with ``holds_whole_kv`` keep the KV in CPU memory (--kv-offload)
    kv_bits: int = 16  # bits the KV is held and stored in (--kv-bits resolved: Pipeline.kv_bits): 16, 8 or 4
    # bits decoding reads the KV in (Pipeline.decode_bits): kv_bits, but 16 under --kv-bits auto on a CPU
    decode_bits: int | None = None  # None: kv_bits
    # the document, as the files a method keeps in the cache folder record it (the page vectors:
    # ``kvcli cache ls`` names it, ``kvcli cache rm DOCUMENT`` finds them): its path and sha256
    document: str | None = None
    document_sha256: str | None = None
    # while a method embeds the document's passages (pages' retrieval, the first question on a
    # document): ``on_embed(done, total)`` windows embedded so far (the CLI shows it on stderr)
    on_embed: Callable[[int, int], None] | None = dataclasses.field(default=None, compare=False)
    # a file a method wrote into the cache folder (the page vectors): the disk store makes room for
    # it under its cap (:meth:`kvcli.store.KVStore.make_room`); None: no store, nothing to do
    on_stored: Callable[[Path], None] | None = dataclasses.field(default=None, compare=False)


@dataclass
class Compressor:
    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    # the method keeps the whole KV and can hold it in CPU memory (--kv-offload cpu): blocksparse
    holds_whole_kv: ClassVar[bool] = False
    # a selector that ranks the document's passages against the question (``prompt.passages`` and
    # ``prompt.question`` in :meth:`select_tokens`): it must come first (the one handed the prompt)
    reads_passages: ClassVar[bool] = False
    # a selector that retrieves what the model reads instead of compressing the prompt (pages): its
    # Selection says what it read (``read``: :class:`~kvcli.compressors.selection.Read`), which is
    # reported instead of a compression ratio, and the progress counts the tokens it reads
    retrieves: ClassVar[bool] = False
    # the bits ``--kv-bits auto`` (the default) holds and stores the method's KV in: 8 where its
    # layout is quantized (plain KV, evictions' kept KV, InfLLM's book), measured as accurate as 16
    # (docs/kv-bits.md); 16 for a layout that is not (the default here: a new method says 8 itself)
    auto_kv_bits: ClassVar[int] = 16
    # the prefix state is a book read straight into its disk-store entry, whose size is known before
    # it is read (InfLLM): the store then calls :meth:`read`, :meth:`stored_bytes` and
    # :meth:`storage_precision` instead of :meth:`build_prefix`
    writes_prefix: ClassVar[bool] = False
    # The knob text (after ``name:``) with which the method keeps every entry of the prompt, so that
    # it must reproduce full attention's logits (tests/compressors/test_contract.py); "" for the defaults.
    # ``{n}`` stands for the prompt's token count and ``{prefix}`` for its question-agnostic prefix
    # (:func:`keep_all_spec`), for a knob that must cover the prompt exactly (an explicit count
    # larger than the prompt is refused). Each registered class declares its own (``register``).
    keep_all: ClassVar[str]
    # --- what the tests' tables and docs/methods.md's table read off the class -----------------
    # A spec that compresses the tests' short documents (one paragraph, ~100-200 tokens), written
    # whole: a chain where the method acts after another (``snapkv:...+decoding:...``). The tests run
    # every method with it (tests/helpers/specs.py: ``COMPRESSING``). Each registered class declares its own.
    short_document_spec: ClassVar[str]
    # it holds every prompt token's KV whatever its knobs (compression ratio 1): it saves by attending to
    # a few blocks, not by evicting (full, blocksparse, infllm)
    holds_every_token: ClassVar[bool] = False
    # why the method refuses a model with sliding-window layers (Gemma 2 / 3), "" when it runs on them:
    # its :meth:`configure` calls :meth:`refuse_hybrids`, which says it in one line
    hybrid_refusal: ClassVar[str] = ""
    # docs/methods.md's table, one row per method in the order the methods are imported
    # (``python -m kvcli.cli.reference`` writes it; markdown): the method's name in prose, what it
    # does where in the pipeline, the positions its kept tokens run at, what the disk store keeps.
    # Each registered class declares its own.
    title: ClassVar[str]
    acts: ClassVar[str]
    positions: ClassVar[str]
    disk_cache: ClassVar[str]
    # the knobs the row's spec spells out with their defaults, in declaration order ("..." where the
    # others are elided); None: every knob. ``spec_note``: said after the spec.
    table_knobs: ClassVar[tuple[str, ...] | None] = None
    spec_note: ClassVar[str] = ""
    # knobs the user set explicitly (filled by parse_one); defaults may adapt, explicit values may not
    explicit_knobs: frozenset = dataclasses.field(default=frozenset(), init=False, repr=False, compare=False)
    # the run's settings (Pipeline.configure hands them over; not a knob)
    runtime: Runtime = dataclasses.field(default_factory=Runtime, init=False, repr=False, compare=False)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if vars(cls).get("name"):  # a method, not a base it is built on: it registers itself
            register(cls)

    def configure(self, lm) -> None:
        """Resolve model-dependent defaults and validate knobs against the model ``lm``.

        Raise :class:`UsageError` for knob values that cannot work with this model.
        """

    def refuse_hybrids(self, lm) -> None:
        """Raise, in one line, when the method declares a :attr:`hybrid_refusal` and ``lm`` has
        sliding-window layers (its :meth:`configure` calls it first)."""
        if self.hybrid_refusal and lm.windows.hybrid:
            raise UsageError(
                f"{self.name}: {lm.name} has sliding-window layers ({lm.windows.shortest} tokens); {self.hybrid_refusal}"
            )

    def select_tokens(
        self, engine, prompt_ids: torch.Tensor, protected: int = 0, prefix=None, prompt=None
    ) -> Selection:
        """Choose prompt tokens to keep: a Selection of sorted indices into ``prompt_ids`` (n,)
        (and the per-token scores, if any). The last ``protected`` tokens are the user prompt after the
        document (instructions, question) and
        the generation prompt; the method's own rule decides whether they are forced in.
        ``prefix``: the state of ``prompt_ids[:prefix.n_tokens]`` (see the module docstring), or None;
        ``prompt``: the :class:`~kvcli.answer.prompt.Prompt` ``prompt_ids`` are (the first selector),
        else None."""
        raise NotImplementedError

    def prefill(self, engine, ids: torch.Tensor, prefix=None, protected: int = 0):
        """Run the prompt ``ids`` (n,) and return ``(cache, first_logits (vocab,), next_position)``;
        ``prefix`` as for :meth:`select_tokens`; the last ``protected`` tokens of ``ids`` are the
        instructions, question and generation prompt after the document (``Prompt.n_after_document``),
        as for :meth:`select_tokens`."""
        raise NotImplementedError

    def window_needed(self, lm, n_prompt: int, n_suffix: int, max_new_tokens: int) -> int:
        """The most positions the model must hold at once for a prompt of ``n_prompt`` tokens (the
        last ``n_suffix`` of them after the document) and ``max_new_tokens`` to generate, when this method
        reads the prompt first (:meth:`kvcli.answer.pipeline.Pipeline.reader`); checked against the model's
        window. Default: everything. Methods that read documents longer than the window chunk by
        chunk (Finch) return less."""
        return n_prompt + max_new_tokens

    def reading_note(self, lm, n_prompt: int) -> str:
        """How this method reads a prompt of ``n_prompt`` tokens longer than the model's window (it
        reads the prompt first and :meth:`window_needed` is less than all of it), for the warning the
        pipeline says before it starts."""
        return f"{self.name} reads it chunk by chunk, which takes a while (every token runs through the model)"

    def compress(self, engine, cache):
        """Return the compressed cache (after the prefill of the whole prompt, before decoding)."""
        raise NotImplementedError

    def compresses_by_layer(self) -> bool:
        """Whether :meth:`compress_layer` compresses each layer during the final prefill pass."""
        return False

    def compress_layer(self, engine, cache, layer: int) -> None:
        """Called in the final prefill pass right after layer ``layer`` ran (when
        :meth:`compresses_by_layer`): compress that layer now — the pass no longer reads its KV —
        exactly as :meth:`compress` would; :meth:`compress` then does the rest."""

    # decode_step takes the token as the (1,) tensor on the model's device that the last step's
    # argmax left there (no host -> device copy), not as an id
    device_token: ClassVar[bool] = False

    def decode_step(self, engine, token: int | torch.Tensor, position: int, cache) -> torch.Tensor:
        """One decoding step: the logits (vocab,) after ``token`` (at ``position``) on ``cache``,
        the cache this pipeline's prefill (and compressors) produced. ``token``: an id, or with
        :attr:`device_token` a (1,) tensor on the model's device."""
        raise NotImplementedError

    def prefill_observers(self, lm, n_tokens: int) -> dict:
        """Observers ``{layer: [fn(query, key)]}`` for the final prefill pass of ``n_tokens`` prompt
        tokens (used by :meth:`compress`); query: (1, n_heads, q_len, d), key: (1, n_kv, kv_len, d)."""
        return {}

    def query_window(self, lm) -> int:
        """How many of the last prompt tokens the final prefill pass must run (so that observers see
        their queries) even when an earlier prefix state exists; 0: none needed."""
        return 0

    # --- the reusable state of the question-agnostic prefix (kvcli.store) ----------------------
    def prefix_state(self, lm) -> dict | None:
        """What :meth:`build_prefix` computes, as the JSON-able parameters it depends on: with
        the bits and their codec too (:func:`kvcli.caches.quant.state`: the KV is built and stored in
        those bits; an entry of another codec is never read)."""
        return {"kind": "kv", "layers": lm.n_layers, **quant.state(self.runtime.kv_bits)}

    def prefix_device(self, engine) -> torch.device:
        """Where the prefix state is handed to this method (and loaded from the disk store): the
        model's device; the host for a method that keeps its KV there (``--kv-offload cpu``)."""
        return engine.device

    def build_prefix(self, engine, prefix_ids: torch.Tensor):
        """The prefix state of ``prefix_ids`` (n,) at positions 0..n-1 (default: a KVCache; a
        hybrid's sliding layers keep their window and :data:`~kvcli.runtime.windows.PREFIX_WINDOW_ROOM`
        entries more, all that a question pass on top reads)."""
        room = windows.PREFIX_WINDOW_ROOM
        state = self.prefix_state(engine.lm)
        bits = state.get("kv_bits", 16)
        cache = None if bits == 16 else QuantKVCache(bits)  # quantized chunk by chunk, as it is read
        return engine.prefix_kv(prefix_ids, state["layers"], window_room=room, cache=cache)

    # --- a prefix state written into its store entry while it is read (``writes_prefix``) ------
    def read(self, engine, ids: torch.Tensor, into=None):
        """Read ``ids`` (the prefix, positions 0..n-1) into the method's state, written where ``into``
        (a :class:`kvcli.caches.bookfile.Destination`) puts it: a new file, or the disk store's partial
        entry, which a read that stops keeps and the next one resumes; ``into`` None: in memory.
        Only a method with :attr:`writes_prefix` has one (the store calls it instead of
        :meth:`build_prefix`)."""
        raise self._not_written()

    def stored_bytes(self, lm, n: int) -> int:
        """Bytes of the store entry :meth:`read` writes for an ``n``-token prefix, known before it is
        read (the store makes room first). Only with :attr:`writes_prefix`."""
        raise self._not_written()

    def storage_precision(self, lm) -> str:
        """The stored keys' and values' precision in words (``float16``, ``8-bit``), for the line that
        says what the store keeps while :meth:`read` writes it. Only with :attr:`writes_prefix`."""
        raise self._not_written()

    def _not_written(self) -> NotImplementedError:
        return NotImplementedError(f"{self.name} does not write its prefix state while reading (writes_prefix)")

    # --- introspection --------------------------------------------------------------------------
    @classmethod
    def knobs(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.init]

    def spec(self) -> str:
        """The canonical spec string, every knob spelled out: ``gemfilter:k=1024,kernel=5,...``."""
        parts = [f"{f.name}={knob_text(getattr(self, f.name))}" for f in self.knobs()]
        return self.name + (":" + ",".join(parts) if parts else "")

    def knob_values(self) -> dict:
        return {f.name: getattr(self, f.name) for f in self.knobs()}


def require_full_layers(lm, method: str) -> None:
    """A method that compresses full-attention layers (the others keep their window) cannot apply
    to a model whose every layer slides over a window (Mistral v0.1-style): say so in one line."""
    if not lm.windows.full_layers:
        w = lm.windows.shortest
        raise UsageError(
            f"{method}: every layer of {lm.name} uses sliding-window attention ({w} tokens): there is no "
            "full-attention layer to compress, the window already bounds the KV (use -c full)"
        )


def owned_phases(cls: type[Compressor]) -> set[str]:
    return {p for p in PHASES if getattr(cls, p) is not getattr(Compressor, p)}


def register(cls: type[Compressor]) -> type[Compressor]:
    """Add ``cls`` to :data:`REGISTRY` under its ``name`` (a named subclass calls it itself, when
    it is defined); a class without ``keep_all`` of its own is refused."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if not isinstance(vars(cls).get("keep_all"), str):
        raise TypeError(
            f'{cls.__name__} ({cls.name}) declares no keep_all: give it `keep_all: ClassVar[str] = "..."`, '
            'the knobs with which it keeps every entry ("" for the defaults; see Compressor.keep_all)'
        )
    REGISTRY[cls.name] = cls
    return cls


def keep_all_spec(cls: type[Compressor], n_prompt: int, n_prefix: int) -> str:
    """The spec with which ``cls`` keeps everything (:attr:`Compressor.keep_all`) on a prompt of
    ``n_prompt`` tokens whose question-agnostic prefix is ``n_prefix`` tokens."""
    knobs = cls.keep_all.format(n=n_prompt, prefix=n_prefix)
    return cls.name + (":" + knobs if knobs else "")


def _parse_value(cls: type[Compressor], field: dataclasses.Field, text: str):
    hints = typing.get_type_hints(cls)
    kind = hints[field.name]
    args = typing.get_args(kind)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), kind)
    text = text.strip()
    if optional and text.lower() in ("auto", "none", ""):
        return None
    try:
        if base is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base is int:
            return int(text)
        if base is float:
            return float(text)
        return text
    except ValueError:
        raise UsageError(
            f"{cls.name}: knob '{field.name}' expects {base.__name__}{' or auto' if optional else ''}, got '{text}'"
        ) from None


def describe_knobs(cls: type[Compressor]) -> str:
    return ", ".join(f"{f.name} (default {knob_text(f.default)})" for f in cls.knobs()) or "no knobs"


def parse_one(spec: str) -> Compressor:
    """``'gemfilter:layer=13,k=1024'`` -> ``GemFilter(layer=13, k=1024)``; clear errors otherwise."""
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in REGISTRY:
        known = ", ".join(sorted(REGISTRY))
        raise UsageError(f"unknown compressor '{name}'; available: {known} (see `kvcli compressors`)")
    cls = REGISTRY[name]
    fields = {f.name: f for f in cls.knobs()}
    values = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq:
            raise UsageError(f"{name}: expected knob=value, got '{item}'")
        if not fields:
            raise UsageError(f"{name} takes no knobs, got '{item}'; give it as '{name}'")
        if key not in fields:
            raise UsageError(f"{name}: unknown knob '{key}'; knobs: {describe_knobs(cls)}")
        if key in values:
            raise UsageError(f"{name}: knob '{key}' is given twice; give each knob once")
        values[key] = _parse_value(cls, fields[key], val)
    obj = cls(**values)
    obj.explicit_knobs = frozenset(values)
    return obj
