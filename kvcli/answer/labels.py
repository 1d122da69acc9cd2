"""What a status line calls a pipeline: :func:`method_label` ("full attention", "gemfilter +
snapkv") and :func:`spec_label` (a resolved spec with only the knobs the user set). ``kvcli ask``,
``kvcli chat``, ``kvcli inspect`` and the batch's summary all label a method with these."""

from __future__ import annotations

from .pipeline import SEPARATOR, Pipeline


def method_label(pipeline: Pipeline) -> str:
    """What a person calls the method(s) of a resolved pipeline: "full attention", "finch",
    "gemfilter + snapkv" (the knobs: ``pipeline.spec()``)."""
    return " + ".join("full attention" if s.name == "full" else s.name for s in pipeline.stages)


def spec_label(spec: str, given: Pipeline | None = None) -> str:
    """A resolved spec (``Result.extra["compressor"]``, every knob spelled out) as a status line
    shows it: each stage's name and only the knobs the user set in ``given`` (the pipeline as
    parsed; ``-c auto`` sets none): "infllm:answer_topk=50", not InfLLM's 230 characters. The whole
    spec is in ``--json``."""
    explicit = {s.name: s.explicit_knobs for s in (given.stages if given is not None else ())}
    parts = []
    for stage in spec.split(SEPARATOR):
        name, _, knobs = stage.partition(":")
        mine = [kv for kv in knobs.split(",") if kv and kv.partition("=")[0] in explicit.get(name, ())]
        parts.append(name + (":" + ",".join(mine) if mine else ""))
    return SEPARATOR.join(parts)
