"""The prompt templates (``kvcli/prompts/*.txt``) and their rendering through a model's chat
template: what :mod:`kvcli.answer.prompt` builds every prompt from, and what KVzip's
reconstruction prompt (:mod:`kvcli.compressors.kvzip`) repeats."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import UsageError

TEMPLATE_DIR = Path(__file__).resolve().parent / "prompts"
DEFAULT_TEMPLATE = "qa"
_DOC, _QUESTION = "\x00KVCLI_DOCUMENT\x00", "\x00KVCLI_QUESTION\x00"
_ANSWER = "\x00KVCLI_ANSWER\x00"
# the chat templates' end-of-turn markers: a generation ends on one (:func:`stop_token_ids`)
STOP_TOKEN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>", "<end_of_turn>")


def load_template(name_or_path: str = DEFAULT_TEMPLATE) -> str:
    """A template by name (``qa``: ``prompts/qa.txt``) or by path (any file, with or without an
    extension: a name with a folder in it, or one that exists, is a path)."""
    path = Path(name_or_path).expanduser()
    is_name = not path.suffix and "/" not in name_or_path and os.sep not in name_or_path and not path.is_file()
    if is_name:
        path = TEMPLATE_DIR / f"{name_or_path}.txt"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        names = ", ".join(sorted(p.stem for p in TEMPLATE_DIR.glob("*.txt")))
        what = f"prompt template '{name_or_path}'" if is_name else f"prompt template file {path}"
        raise UsageError(f"{what} not found; templates by name: {names}, or give the path of a file") from None
    except UnicodeDecodeError:
        raise UsageError(f"prompt template {path} is not UTF-8 text") from None
    except OSError as e:
        raise UsageError(f"prompt template {path} cannot be read: {e.strerror or e}") from None
    if (
        text.count("{document}") != 1
        or text.count("{question}") != 1
        or text.index("{document}") > text.index("{question}")
    ):
        raise UsageError(f"prompt template {path}: needs one {{document}} followed by one {{question}}")
    return text


def is_completion(tokenizer) -> bool:
    """Whether this tokenizer's model has no chat template: its prompt is then a completion that
    ends on kvcli's own ``Answer:`` line (:func:`render_pieces`)."""
    return not getattr(tokenizer, "chat_template", None)


def render_pieces(tokenizer, template: str) -> tuple[str, str, str]:
    """Render the template through the chat template (a completion ending ``\nAnswer:`` without
    one); return (head, middle, tail) strings."""
    message = template.strip("\n").replace("{document}", _DOC).replace("{question}", _QUESTION)
    if not is_completion(tokenizer):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
    else:
        bos = tokenizer.bos_token or ""
        text = f"{bos}{message}\nAnswer:"
    head, rest = text.split(_DOC)
    middle, tail = rest.split(_QUESTION)
    return head, middle, tail


def rendered_ids(tokenizer, template: str, document: str, question: str) -> list[int]:
    """``template`` rendered (:func:`render_pieces`) around ``document`` and ``question`` (stripped),
    tokenized whole: a short prompt of kvcli's own (the answer's check, the passage written to
    rank pages with); the answer's prompt keeps its pieces' offsets instead (kvcli.answer.prompt)."""
    head, middle, tail = render_pieces(tokenizer, template)
    return tokenizer(head + document + middle + question.strip() + tail, add_special_tokens=False)["input_ids"]


def follow_up_ids(tokenizer, question: str) -> list[int] | None:
    """What a chat appends to the model's answer to ask ``question`` next: the end of its turn, the
    user's turn, and the start of its reply, as the chat template renders them around a stand-in
    answer (ChatML: ``<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``).
    None for a model without a chat template."""
    if is_completion(tokenizer):
        return None
    chat = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": _ANSWER},
        {"role": "user", "content": question},
    ]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return tokenizer(text.split(_ANSWER, 1)[1], add_special_tokens=False)["input_ids"]


def stop_token_ids(tokenizer, generation_config=None) -> set[int]:
    """Token ids that end an answer: eos ids of tokenizer and generation config, chat end markers."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    for text in STOP_TOKEN_TEXTS:  # looked up one by one: get_vocab() copies the vocabulary (0.4 s for Qwen's 151k)
        i = tokenizer.convert_tokens_to_ids(text)
        if isinstance(i, int) and (i != tokenizer.unk_token_id or text == tokenizer.unk_token):  # unk: not there
            ids.add(i)
    return ids
