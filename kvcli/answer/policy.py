"""``-c auto``, the default: which method answers a prompt, chosen by what the benchmark measured.

kvcli's promise is the same answer, faster, so the default compresses only where the accuracy
benchmark (``kvcli bench ruler``, docs/benchmarks.md "Accuracy") shows it keeps full attention's answers. On
the embedded SmolLM2-135M it does not: at 4k tokens every compressing method measured at 4x
(SnapKV with the paper's or a 63-token vote pool, GemFilter with kernel 5/31/63, PyramidKV,
StreamingLLM, H2O, AdaKV, Finch) scores 17-50 points below full attention on RULER's needle tasks,
and at 2x only GemFilter matches it, without saving time to first token. So the policy is:

* the prompt and the answer fit the model's window: **full attention** — on a CPU, for an embedded
  model that reads slowly there (``EmbeddedModel.cpu_full_until``: the Qwen models, 4,096 tokens),
  only up to that length, ``BEYOND_WINDOW`` after it (:meth:`AutoPolicy.on`): the 1.5B's first
  question took 150 s at 4.7k tokens on 2 AVX2 cores and over an hour at 30k, where ``pages``
  answers in 30-50 s and answered 21 of 25 held-out manual questions (docs/bench/qwen); the Qwen
  models read three pages whole there instead where EmbeddingGemma ranks them
  (``EmbeddedModel.auto_pages``: held out, in both wordings, 38 of 50 against 31 on the 1.5B, 23
  against 19 on the 0.5B, for about twice the wait);
* longer than the window: ``BEYOND_WINDOW``, ``pages`` (``-c pages``): the document's page (or
  page-sized passage) that BM25 ranks first for the question, read whole with full attention, and the best
  sentences of the next two. On 63 questions about six Debian manuals (docs/bench/cite, "Pages") it
  answered 17 (one page alone 18) — as many as the oracle reading, the answer's page handed over
  (17) — where InfLLM's stored book, the default before it, answered 8, taking a median 3.7 s a
  question on 2 cores where the stored book's first answer took 4-11 minutes. Its sources hit the
  answer's page first for 81% of the questions, among three for 90%. Where its budget does not fit
  the window, ``FALLBACK``: Finch, which reads the document chunk by chunk into a cache that fits.

The choice is reported: ``kvcli ask --json``'s ``compressor`` is the resolved spec and ``policy``
says ``auto``. Any explicit ``-c`` overrides it. ``AutoPolicy(compress_from=N, long=SPEC)`` is the
hook for a model where compression measures lossless: prompts over N tokens then use SPEC.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

BEYOND_WINDOW = "pages"
FALLBACK = "finch"
NAME = "auto"
# what the default policy does, in one sentence: `kvcli ask --help` (-c) shows it, the docs say the same
DESCRIPTION = (
    f"full attention where the prompt and the answer fit the model's window (on a CPU, the Qwen models: "
    f"up to the length `kvcli models` gives); past it {BEYOND_WINDOW} "
    f"(the page the question's words point to, read whole, and the best sentences of the next two; "
    f"a model's own reading where `kvcli models` gives one), or {FALLBACK} where {BEYOND_WINDOW} cannot read the prompt"
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
            return self.long if reads is None or reads(self.long) else "full"
        return "full"

    def on(self, lm) -> AutoPolicy:
        """This policy for ``lm``: an embedded model's own reading past full attention
        (``EmbeddedModel.auto_pages``: the Qwen models read three pages whole where EmbeddingGemma
        ranks them) instead of :data:`BEYOND_WINDOW`; where it reads slowly on the CPU
        (``EmbeddedModel.cpu_full_until``: the Qwen models), prompts longer than that within the
        window go through that reading as well; else unchanged."""
        from ..model.catalog import embedded

        model = embedded(lm.name)
        if model is None or self.compress_from is not None:
            return self
        policy = self
        if model.auto_pages and self.beyond_window == BEYOND_WINDOW and _ranks(model.auto_pages_ranked_by):
            policy = replace(policy, beyond_window=model.auto_pages)
        if model.cpu_full_until is None or lm.device.type != "cpu":
            return policy
        return replace(policy, compress_from=model.cpu_full_until + 1, long=policy.beyond_window)


def _ranks(name: str | None) -> bool:
    """Whether the sentence-embedding model ``name`` ranks the pages (None: whichever does)."""
    from ..retrieval.embedders import asked, short

    return name is None or short(asked()).lower() == name.lower()


def reads(spec: str, lm, prompt, max_new_tokens: int) -> bool:
    """Whether ``spec`` can read ``prompt`` on ``lm``: its knobs configure on the model (InfLLM
    refuses sliding-window hybrids) and the span it needs fits the model's window."""
    from ..compressors import parse_one
    from ..errors import UsageError

    try:
        method = parse_one(spec)
        method.configure(lm)
    except UsageError:
        return False
    return method.window_needed(lm, prompt.n_tokens, prompt.n_after_document, max_new_tokens) <= (lm.max_context or 0)
