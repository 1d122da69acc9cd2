"""``-c auto``, the default: which method answers a prompt, chosen by its length.

Compression saves little on a short prompt and costs answers (README, "Accuracy": on RULER at 1k-2k
tokens every method at 2x-8x loses points against full attention on the embedded model), so the
policy is:

* the prompt and the answer fit the model's window and the prompt is at most ``FULL_UP_TO`` tokens:
  **full attention**;
* longer, still within the window: ``LONG`` — the method and compression that kept full
  attention's RULER accuracy best at >= 4x on the benchmark (the disk store still serves a repeat
  question: its prefix state is full attention's KV);
* longer than the window: ``BEYOND_WINDOW``, Finch, which reads the document chunk by chunk into a
  cache that fits.

The choice is reported: ``kvcli ask --json``'s ``compressor`` is the resolved spec and ``policy``
says ``auto``. Any explicit ``-c`` overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL_UP_TO = 3072  # prompt tokens
LONG = "snapkv:budget=0.25,kernel=63"
BEYOND_WINDOW = "finch"
NAME = "auto"


@dataclass
class AutoPolicy:
    full_up_to: int = FULL_UP_TO
    long: str = LONG
    beyond_window: str = BEYOND_WINDOW

    def choose(self, n_prompt: int, max_context: int | None, max_new_tokens: int) -> str:
        """The spec for a prompt of ``n_prompt`` tokens on a model with a ``max_context`` window."""
        if max_context and n_prompt + max_new_tokens > max_context:
            return self.beyond_window
        if n_prompt <= self.full_up_to:
            return "full"
        return self.long
