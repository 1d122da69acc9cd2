"""One llama.cpp measurement (llama-cpp-python, see common.py), run in .peers/llamacpp:
``python worker_llamacpp.py CASE full [--save-prefix FILE | --load-prefix FILE]``.

The model is the case's GGUF itself, the file kvcli converts (the embedded SmolLM2-135M-Instruct's
Q4_1, or a chunked model's assembled by run.py --model), ``n_threads`` = the machine's cores,
llama-cpp-python's default batch (512). The case's prompt ids are evaluated as given (no
tokenizing), greedy decoding over the logits of the last position; ``gguf_tokenizer_same`` says
whether the GGUF's own tokenizer gives the document's ids from its text (checked before the run).
``--save-prefix FILE``: after the question-agnostic prefix, save the context state to FILE
(``llama_state_save_file``, what ``llama-cli --prompt-cache`` writes); ``--load-prefix FILE``: a
fresh process restores it (``llama_state_load_file``) and evaluates only the question — the
repeat-question row, timed from before the load."""

from __future__ import annotations

import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402
from common import Clock, emit, read_case, reset_peak  # noqa: E402


def last_logits(llm) -> np.ndarray:
    """Logits of the last evaluated position (the only one llama.cpp computes without logits_all)."""
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))


def main() -> None:
    case, spec, extra = read_case()
    if spec != "full":
        raise SystemExit(f"llama.cpp runs full attention only, not {spec}")
    save = extra[extra.index("--save-prefix") + 1] if "--save-prefix" in extra else None
    load = extra[extra.index("--load-prefix") + 1] if "--load-prefix" in extra else None
    threads = os.cpu_count()
    llm = llama_cpp.Llama(
        model_path=case["gguf"], n_ctx=case["n_ctx"], n_threads=threads, n_threads_batch=threads, verbose=False
    )
    ids, prefix = case["ids"], case["prefix_len"]
    llm.eval(ids[:64])  # warm-up
    llm.reset()
    # kvcli's tokenizer (the converted folder's) against the GGUF's, on the document's text (the
    # whole prompt's text would not do: kvcli tokenizes the template's pieces and the question apart)
    doc_ids = ids[case["doc_start"] : case["doc_end"]]
    same = llm.tokenize(case["document"].encode(), add_bos=False, special=False) == doc_ids
    reset_peak()
    clock = Clock()
    if load is not None:
        tokens = (llama_cpp.llama_token * case["n_ctx"])()
        n = ctypes.c_size_t(0)
        if not llama_cpp.llama_state_load_file(llm._ctx.ctx, load.encode(), tokens, case["n_ctx"], ctypes.byref(n)):
            raise SystemExit(f"could not load {load}")
        if list(tokens[: n.value]) != ids[:prefix]:
            raise SystemExit("the saved prompt cache is of another prefix")
        llm.input_ids[: n.value] = ids[:prefix]
        llm.n_tokens = n.value
        llm.eval(ids[prefix:])
    else:
        llm.eval(ids[:prefix])
        if save is not None:
            arr = (llama_cpp.llama_token * prefix)(*ids[:prefix])
            if not llama_cpp.llama_state_save_file(llm._ctx.ctx, save.encode(), arr, prefix):
                raise SystemExit(f"could not save {save}")
        llm.eval(ids[prefix:])
    generated = [int(np.argmax(last_logits(llm)))]
    clock.first()
    for _ in range(case["new_tokens"] - 1):
        llm.eval([generated[-1]])
        generated.append(int(np.argmax(last_logits(llm))))
    clock.done()
    emit(
        case,
        clock,
        generated,
        llama_cpp_python=llama_cpp.__version__,
        threads=threads,
        gguf_tokenizer_same=same,
        prompt_cache=os.path.getsize(save or load) if (save or load) else None,
    )


if __name__ == "__main__":
    main()
