"""How kvcli's commands are declared: the choices shared by every command that loads a model
(enums Typer turns into ``--device auto|cpu|cuda`` and so on), the options they share, declared
once, the model's options as one group (:func:`loads_a_model` declares them on a command, which
gets them as one :class:`ModelChoice`), and the help format (:class:`KvcliCommand`)."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING

import typer
from typer.core import TyperCommand

from .. import kv_bits as kv_quant
from ..answer import policy
from ..errors import UsageError
from ..model.names import MODEL_ENV
from ..runtime.lookup import MAX_DRAFT
from ..runtime.threads import ENV as THREADS_ENV
from ..runtime.threads import parse_threads, requested_threads
from ..store.capacity import CAP_ENV
from . import vocabulary

if TYPE_CHECKING:
    from .. import api


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Quant(
    str, Enum
):  # spelled as bits, as AskOptions.quant and --json spell them (kvcli.model.names.QUANT_SPELLINGS)
    auto = "auto"
    none = "none"
    four = "4"
    eight = "8"


class Offload(str, Enum):
    none = "none"
    cpu = "cpu"


KvBits = Enum("KvBits", {f"b{b}": str(b) for b in (*kv_quant.KV_BITS, kv_quant.AUTO)}, type=str)  # --kv-bits


class Attn(str, Enum):
    sdpa = "sdpa"
    eager = "eager"
    flash = "flash"


# --- options several commands declare alike ---------------------------------------------------
MODEL_HELP = "An embedded model (`kvcli models` lists them; by default the best one installed), an HF id, a model folder or a .gguf file"
ModelOpt = typer.Option(None, "--model", "-m", envvar=vocabulary.env(MODEL_ENV), help=MODEL_HELP)
DeviceOpt = typer.Option(Device.auto, help="Where to run")


def _quant_checked(value: str) -> Quant:
    """``--quant`` spelled in bits (``8``; the old ``8bit`` with a note)."""
    try:
        return Quant(vocabulary.quant_value(value))
    except UsageError as e:
        raise typer.BadParameter(str(e).removeprefix("--quant ")) from None


QuantOpt = typer.Option(
    "auto",
    metavar="[" + "|".join(vocabulary.QUANT_CHOICES) + "]",
    callback=lambda value: _quant_checked(value),
    help="Weights in 8 or 4 bits: on the CPU PyTorch's int4 / int8 kernels with bfloat16 activations and KV, "
    "on CUDA bitsandbytes (nf4 / int8); auto: on the CPU 8 for the embedded SmolLM2 and Qwen models "
    "(measured; none for Gemma) and for a GGUF of 4-6-bit blocks, none elsewhere; "
    "none: the weights in --dtype (speed and accuracy of each: docs/cpu.md)",
)
AttnOpt = typer.Option(Attn.sdpa, help="Attention kernel (flash needs CUDA and flash-attn)")
DtypeOpt = typer.Option(
    "auto",
    help="auto (float32 on the CPU, bfloat16 with 4/8-bit weights; on CUDA bfloat16 where supported, "
    "else float16), float32, bfloat16 or float16",
)
TemplateOpt = typer.Option("qa", help="Prompt template name in prompts/ or a path")
QuietOpt = typer.Option(False, "--quiet", "-q", help="Nothing on stderr but errors")
CompressorOpt = typer.Option(
    "auto",
    "--compressor",
    "-c",
    envvar=vocabulary.env("KVCLI_COMPRESSOR"),
    help=f"Method spec, e.g. full or snapkv:budget=0.25; auto: {policy.DESCRIPTION} (see docs/methods.md); "
    "`kvcli compressors` lists the methods",
)
SourcesOpt = typer.Option(
    None,
    "--sources/--no-sources",
    show_default=False,
    help="After the answer, the document's pages (or lines) it comes from: on a terminal by default, in a pipe "
    "with --sources (stdout is then the answer alone); in JSON always (sources); --no-sources: none, and nothing "
    "read for them",
)


def sources_wanted(sources: bool | None, as_json: bool, terminal: bool) -> tuple[bool, bool]:
    """(compute, print) for ``--sources/--no-sources`` (None: neither given): JSON always holds them, text
    shows them after the answer on a terminal and, in a pipe, only with ``--sources`` (stdout is the answer
    alone, as a script captures it); ``--no-sources`` computes none."""
    if sources is False:
        return False, False
    shown = not as_json and (sources is True or terminal)
    return as_json or shown, shown


AnswerGuardOpt = typer.Option(
    True,
    "--answer-guard/--no-answer-guard",
    help="End the answer at an invented next question or a repeated sentence, and after its last whole sentence at the token limit; after a completion prompt's 'Answer:' (a model without a chat template) start it on that line",
)
NoCacheOpt = typer.Option(False, "--no-cache", help="Neither read nor write the disk KV cache")
LookupOpt = typer.Option(
    MAX_DRAFT,
    "--lookup",
    min=0,
    help="Draft up to N tokens of the answer from the text read (where the answer's last words occur in it) "
    "and check them in one pass of the model: the same greedy answer in fewer passes, faster where it "
    "quotes the document; full attention and the eviction methods (docs/methods.md); 0: a pass a token",
)
CheckOpt = typer.Option(
    True,
    "--check/--no-check",
    help="After the answer, run it again after the question alone, without the document: a warning on stderr "
    "when the model gives it as readily (the answer may not come from the document), and in JSON "
    "grounding/grounded; on the models whose threshold was measured (the Qwen models), one short pass; "
    "the 1.5B Qwen is also asked whether the document supports its answer (docs/methods.md)",
)


def checked_as_parsed(check, option: str, env: str):
    """A Typer callback running ``check(value, source)`` as the option is parsed, ``source`` naming
    where the value came from (``option``, or the variable ``env``), so that a bad value is one line
    naming it, before anything loads."""

    def callback(ctx, param, value):
        if value is not None:
            source = ctx.get_parameter_source(param.name)
            check(value, env if getattr(source, "name", "") == "ENVIRONMENT" else option)
        return value

    return callback


def _cap_checked(value: str, source: str) -> None:
    from ..store import NO_CAP, parse_size

    if value.strip().lower() not in NO_CAP:
        parse_size(value, source)


CacheMaxOpt = typer.Option(
    None,
    "--cache-max",
    envvar=vocabulary.env(CAP_ENV),
    callback=checked_as_parsed(_cap_checked, "--cache-max", CAP_ENV),
    help="Cap of the disk KV cache, e.g. 2G, or none; the least recently used entries go after each write "
    "(default: the smaller of 10 GiB and a quarter of the space the cache may use: the free disk plus its entries)",
)


def kv_bits_help() -> str:
    """``--kv-bits``'s help: the precisions, and what ``auto`` is for each method (its class's
    ``auto_kv_bits``, read from the catalog: no method is imported)."""
    from ..method_catalog import methods

    sixteen = ", ".join(f"-c {name}" for name, method in sorted(methods().items()) if method.auto_kv_bits == 16)
    return (
        f"{kv_quant.KV_BITS_HELP}; auto: 8 for every method whose KV layout is quantized (as accurate as 16 "
        f"on every check made, about half the memory and disk: docs/kv-bits.md), 16 for {sixteen}"
    )


KvBitsOpt = typer.Option(
    KvBits(str(kv_quant.DEFAULT_KV_BITS)),
    "--kv-bits",
    envvar=vocabulary.env(kv_quant.ENV_KV_BITS),
    help=kv_bits_help(),
)


ThreadsOpt = typer.Option(
    None,
    "--threads",
    envvar=vocabulary.env(THREADS_ENV),
    callback=checked_as_parsed(parse_threads, "--threads", THREADS_ENV),
    show_default=False,
    help=(
        "CPU threads: auto (reading the prompt and decoding each on the cores other processes leave "
        "free; docs/cpu.md) or a number; default: auto"
    ),
)


def cache_dir_option(what: str = "converted models and the disk KV cache are kept"):
    """``--cache-dir``: ``what`` the folder holds for this command."""
    return typer.Option(
        None,
        "--cache-dir",
        envvar=vocabulary.env("KVCLI_CACHE_DIR"),
        help=f"Where {what} (default: $XDG_CACHE_HOME/kvcli)",
    )


def max_new_tokens_option(
    default: int = 64, help: str = "Longest answer, in tokens", envvar: str | None = "KVCLI_MAX_NEW_TOKENS"
):
    return typer.Option(
        default, "--max-new-tokens", min=1, envvar=None if envvar is None else vocabulary.env(envvar), help=help
    )


CacheDirOpt = cache_dir_option()


@dataclass(frozen=True)
class ModelChoice:
    """Which model every command that loads one runs, and how: the options :func:`loads_a_model`
    declares, as the command line gave them."""

    model: str | None
    device: Device
    quant: Quant
    attn: Attn
    dtype: str
    threads: str | None
    kv_bits: KvBits

    def ask_options(self, **settings) -> api.AskOptions:
        """The library's options: this model and a command's ``settings`` (``AskOptions`` fields);
        ``--threads`` or ``$KVCLI_THREADS`` checked, one line before the model loads (``--cache-max``
        is checked as it is parsed)."""
        from .. import api  # the library (and PyTorch): a command that loads a model, not --help

        requested_threads(self.threads)
        return api.AskOptions(
            model=self.model,
            device=self.device.value,
            quant=Quant(self.quant).value,
            attn=self.attn.value,
            dtype=self.dtype,
            threads=self.threads,
            kv_bits=kv_quant.check_bits(self.kv_bits.value),
            **settings,
        )


# ModelChoice's options, as its fields and in the order a command's help lists them
MODEL_OPTIONS = (
    ("model", str | None, ModelOpt),
    ("device", Device, DeviceOpt),
    ("quant", str, QuantOpt),
    ("attn", Attn, AttnOpt),
    ("dtype", str, DtypeOpt),
    ("threads", str | None, ThreadsOpt),
    ("kv_bits", KvBits, KvBitsOpt),
)


class _ModelOptionsHere:
    def __repr__(self) -> str:
        return "ModelOptions"


ModelOptions = _ModelOptionsHere()  # the default of a command's ``load: ModelChoice`` parameter


def loads_a_model(command):
    """``command`` (under ``@app.command``) with :data:`MODEL_OPTIONS` declared where its parameter
    ``load: ModelChoice = ModelOptions`` is, and given to it as one :class:`ModelChoice` value."""
    signature = inspect.signature(command)
    params = list(signature.parameters.values())
    at = [p.name for p in params].index("load")
    assert params[at].default is ModelOptions, f"{command.__name__}: load: ModelChoice = ModelOptions"
    declared = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=option, annotation=annotation)
        for name, annotation, option in MODEL_OPTIONS
    ]

    @functools.wraps(command)
    def with_model(**values):
        vocabulary.say_renamed(bool(values.get("quiet")))  # --quant 8bit's note, once --quiet is known
        load = ModelChoice(**{name: values.pop(name) for name, _, _ in MODEL_OPTIONS})
        if not (load.model or "").strip():  # no -m, no $KVCLI_MODEL: the best embedded model installed
            from ..model.catalog import default_model

            load = replace(load, model=default_model())
        return command(load=load, **values)

    with_model.__signature__ = signature.replace(parameters=params[:at] + declared + params[at + 1 :])
    annotations = {name: annotation for name, annotation, _ in MODEL_OPTIONS}
    with_model.__annotations__ = {
        **{k: v for k, v in command.__annotations__.items() if k != "load"},
        **annotations,
    }
    return with_model


class KvcliCommand(TyperCommand):
    """A command whose help names its arguments by their metavar (``DOCUMENT... QUESTION``), in
    the usage line and the Arguments section, as click does; ``usage`` lists alternative usage
    lines (without the command path)."""

    usage: tuple[str, ...] = ()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:  # a name for each option's value, instead of a type (<str>)
            if param.param_type_name == "option" and param.metavar is None and not getattr(param, "is_flag", False):
                param.metavar = METAVARS.get(param.name)

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        return pieces + [_argument_label(p) for p in self.get_params(ctx) if p.param_type_name == "argument"]

    def format_usage(self, ctx, formatter) -> None:
        if not self.usage:
            return super().format_usage(ctx, formatter)
        for i, line in enumerate(self.usage):
            formatter.write_usage(ctx.command_path, line, prefix="Usage: " if i == 0 else "   or: ")

    def format_options(self, ctx, formatter) -> None:
        arguments, options = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                arguments.append((_argument_label(param), record[1]))
            else:
                options.append(record)
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


# the value names of options, by parameter name (an option not listed shows Typer's type)
METAVARS = {
    "questions_file": "FILE",
    "compressor": "SPEC",
    "model": "MODEL",
    "dtype": "DTYPE",
    "max_new_tokens": "N",
    "template": "NAME",
    "cache_dir": "DIR",
    "tokens": "K",
    "seed": "N",
    "induction": "FRACTION",
    "echo": "FRACTION",
    "score": "NAME",
    "html_file": "FILE",
    "needle": "TEXT",
    "needle_test": "N",
    "depth": "DEPTH",
    "haystack": "NAME",
    "k": "K",
    "plot": "FILE",
    "key": "KEY",
    "max_size": "SIZE",
    "cache_max": "SIZE",
    "ray_address": "ADDRESS",
    "workers": "N",
    "threads": "N",
}


def _argument_label(param) -> str:
    if param.metavar:
        return param.metavar
    return param.name.upper() + ("..." if param.nargs != 1 else "")


def usage(*lines: str):
    """``cls=`` for a command with these usage lines."""
    return type("KvcliCommand", (KvcliCommand,), {"usage": lines})
