"""``-c auto``, the default: which method answers a prompt, chosen by what the benchmark measured.

kvcli's promise is the same answer, faster, so the default compresses only where the accuracy
benchmark (``kvcli bench ruler``, docs/benchmarks.md "Accuracy") shows it keeps full attention's answers. On
the embedded SmolLM2-135M it does not: at 4k tokens every compressing method measured at 4x
(SnapKV with the paper's or a 63-token vote pool, GemFilter with kernel 5/31/63, PyramidKV,
StreamingLLM, H2O, AdaKV, Finch) scores 17-50 points below full attention on RULER's needle tasks,
and at 2x only GemFilter matches it, without saving time to first token. So the policy is:

* the prompt and the answer fit the model's window: **full attention**;
* longer than the window: ``BEYOND_WINDOW``, Finch, which reads the document chunk by chunk into a
  cache that fits (the only method that can; a refusal would lose the answer for sure).

The choice is reported: ``kvcli ask --json``'s ``compressor`` is the resolved spec and ``policy``
says ``auto``. Any explicit ``-c`` overrides it. ``AutoPolicy(compress_from=N, long=SPEC)`` is the
hook for a model where compression measures lossless: prompts over N tokens then use SPEC.
"""

from __future__ import annotations

from dataclasses import dataclass

BEYOND_WINDOW = "finch"
NAME = "auto"


@dataclass
class AutoPolicy:
    compress_from: int | None = None  # prompt tokens from which ``long`` answers; None: never
    long: str = "full"
    beyond_window: str = BEYOND_WINDOW

    def choose(self, n_prompt: int, max_context: int | None, max_new_tokens: int) -> str:
        """The spec for a prompt of ``n_prompt`` tokens on a model with a ``max_context`` window."""
        if max_context and n_prompt + max_new_tokens > max_context:
            return self.beyond_window
        if self.compress_from is not None and n_prompt >= self.compress_from:
            return self.long
        return "full"
