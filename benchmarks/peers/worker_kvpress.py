"""One NVIDIA kvpress 0.5.5 measurement (see common.py), run in .peers/kvpress:
``python worker_kvpress.py CASE SPEC``; SPEC: full, snapkv, streamingllm, pyramidkv or finch at
the case's compression ratio (``compression_ratio`` = 1 - 1/ratio, kvpress's convention).

The generation is kvpress's own pipeline (``KVPressTextGenerationPipeline._forward`` and
``generate_answer``), written out so the prompt token ids are the case's and the clock stops at the
first answer token: the context (kvcli's question-agnostic prefix: template head, document,
instructions) is prefilled with the press by ``model.model`` (no LM head), then the question
(the question and the generation prompt) runs on the compressed cache with ``logits_to_keep=1``
and greedy decoding follows. Finch is run as kvpress runs it: the question is part of the
compressed context after the ``<|finch_sep|>`` delimiter (its window), and the keys are
re-rotated; the generation prompt follows. The model is kvcli's converted folder of the
embedded GGUF (the same weights), float32, SDPA attention."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvpress  # noqa: E402
import torch  # noqa: E402
from common import Clock, emit, read_case, reset_peak  # noqa: E402
from kvpress import FinchPress, PyramidKVPress, SnapKVPress, StreamingLLMPress  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402


def make_press(spec: str, ratio: float):
    cr = 1.0 - 1.0 / ratio
    return {
        "full": None,
        "snapkv": lambda: SnapKVPress(compression_ratio=cr),
        "streamingllm": lambda: StreamingLLMPress(compression_ratio=cr),
        "pyramidkv": lambda: PyramidKVPress(compression_ratio=cr),
        "finch": lambda: FinchPress(compression_ratio=cr),
    }[spec]


@torch.inference_mode()
def generate(model, press, context_ids, question_ids, new_tokens, clock=None):
    cache = DynamicCache()
    if press is not None:
        with press(model):
            model.model(input_ids=context_ids, past_key_values=cache)
    else:
        model.model(input_ids=context_ids, past_key_values=cache)
    context_length = cache.get_seq_length() if isinstance(press, FinchPress) else context_ids.shape[1]
    position_ids = torch.arange(context_length, context_length + question_ids.shape[1]).unsqueeze(0)
    out = model(input_ids=question_ids, past_key_values=cache, position_ids=position_ids, logits_to_keep=1)
    generated = [int(out.logits[0, -1].argmax())]
    if clock is not None:
        clock.first()
    position = position_ids[:, -1:] + 1
    for i in range(new_tokens - 1):
        out = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache, position_ids=position + i)
        generated.append(int(out.logits[0, -1].argmax()))
    return generated, cache


def main() -> None:
    case, spec, _ = read_case()
    tokenizer = AutoTokenizer.from_pretrained(case["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(
        case["model_dir"], dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    factory = make_press(spec, case["ratio"])
    press = factory() if factory else None
    ids = case["ids"]
    prefix, question_end = case["prefix_len"], case["question_end"]
    if isinstance(press, FinchPress):
        press.update_model_and_tokenizer(model, tokenizer)
        sep = [press.delimiter_token_id]
        context = ids[:prefix] + sep + ids[prefix:question_end]
        question = ids[question_end:]
    else:
        context, question = ids[:prefix], ids[prefix:]
    as_tensor = lambda x: torch.tensor([x], dtype=torch.long)  # noqa: E731
    # warm-up on a short prompt (one-time costs are not the method's)
    warm = ids[:200] + (sep if isinstance(press, FinchPress) else []) + ids[prefix:question_end]
    generate(
        model,
        press,
        as_tensor(warm),
        as_tensor(ids[question_end:] if isinstance(press, FinchPress) else ids[prefix:]),
        2,
    )
    reset_peak()
    clock = Clock()
    generated, cache = generate(model, press, as_tensor(context), as_tensor(question), case["new_tokens"], clock)
    clock.done()
    # prompt entries held: mean over layers of the cache length before the decoded tokens
    held = sum(cache.get_seq_length(l) for l in range(len(cache))) / len(cache) - (case["new_tokens"] - 1)
    emit(
        case,
        clock,
        generated,
        kvpress_version=getattr(kvpress, "__version__", "0.5.5"),
        compression_ratio=round(len(ids) / held, 3),
        threads=torch.get_num_threads(),
    )


if __name__ == "__main__":
    main()
