"""``-c auto``, the default: which method answers a prompt, chosen by what the benchmark measured.

kvcli's promise is the same answer, faster, so the default compresses only where the accuracy
benchmark (``kvcli bench ruler``, docs/benchmarks.md "Accuracy") shows it keeps full attention's answers. On
the embedded SmolLM2-135M it does not: at 4k tokens every compressing method measured at 4x
(SnapKV with the paper's or a 63-token vote pool, GemFilter with kernel 5/31/63, PyramidKV,
StreamingLLM, H2O, AdaKV, Finch) scores 17-50 points below full attention on RULER's needle tasks,
and at 2x only GemFilter matches it, without saving time to first token. So the policy is:

* the prompt and the answer fit the model's window: **full attention**;
* longer than the window: ``BEYOND_WINDOW``, InfLLM (``-c infllm``), which reads the document once
  in chunks with a bounded span and stores it, so every later question on it starts from the
  stored book: on the books benchmark (docs/books.md) it answered as many questions as Finch
  (both at the model's floor there) and the first answer on a 113-page manual in ~3 minutes, a
  later one in ~7 s, where Finch reads the whole book again for every question. Where InfLLM
  cannot read the prompt (a sliding-window hybrid, a window too small for its span), ``FALLBACK``:
  Finch, which reads the document chunk by chunk into a cache that fits.

The choice is reported: ``kvcli ask --json``'s ``compressor`` is the resolved spec and ``policy``
says ``auto``. Any explicit ``-c`` overrides it. ``AutoPolicy(compress_from=N, long=SPEC)`` is the
hook for a model where compression measures lossless: prompts over N tokens then use SPEC.
"""

from __future__ import annotations

from dataclasses import dataclass

BEYOND_WINDOW = "infllm"
FALLBACK = "finch"
NAME = "auto"
# what the default policy does, in one sentence: `kvcli ask --help` (-c) shows it, the docs say the same
DESCRIPTION = (
    f"full attention where the prompt and the answer fit the model's window; past it {BEYOND_WINDOW} "
    f"(the document read once and stored, so later questions start from it), or {FALLBACK} where "
    f"{BEYOND_WINDOW} cannot read the prompt"
)


@dataclass
class AutoPolicy:
    compress_from: int | None = None  # prompt tokens from which ``long`` answers; None: never
    long: str = "full"
    beyond_window: str = BEYOND_WINDOW

    def choose(self, n_prompt: int, max_context: int | None, max_new_tokens: int, reads=None) -> str:
        """The spec for a prompt of ``n_prompt`` tokens on a model with a ``max_context`` window;
        ``reads(spec)``: whether that method can read this prompt on this model (:func:`reads`)."""
        if max_context and n_prompt + max_new_tokens > max_context:
            if reads is not None and not reads(self.beyond_window):
                return FALLBACK
            return self.beyond_window
        if self.compress_from is not None and n_prompt >= self.compress_from:
            return self.long
        return "full"


def reads(spec: str, lm, prompt, max_new_tokens: int) -> bool:
    """Whether ``spec`` can read ``prompt`` on ``lm``: its knobs configure on the model (InfLLM
    refuses sliding-window hybrids) and the span it needs fits the model's window."""
    from .compressors import parse_one
    from .errors import UsageError

    try:
        method = parse_one(spec)
        method.configure(lm)
    except UsageError:
        return False
    return method.window_needed(lm, prompt.n_tokens, prompt.n_after_document, max_new_tokens) <= (lm.max_context or 0)
