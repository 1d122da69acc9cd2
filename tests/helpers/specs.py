"""A spec that compresses, for every registered method, on the tests' short documents."""

from __future__ import annotations

COMPRESSING = {
    "full": "full",
    "gemfilter": "gemfilter:k=60,layer=1",  # layer 1: a full-attention layer of the tiny hybrids too
    "pages": "pages:budget=60",  # the tests' documents are one paragraph: its first tokens
    "snapkv": "snapkv:budget=0.25,window=8",
    "pyramidkv": "pyramidkv:budget=0.25,window=8",
    "h2o": "h2o:budget=0.25",
    "streamingllm": "streamingllm:budget=0.25",
    "razor": "razor:window=16,sinks=4",
    "finch": "finch:target=60",
    "lazyllm": "lazyllm:keep=0.5/0.4/0.3",
    "blocksparse": "blocksparse:block_size=8,initial=8,local_window=16,topk=2",
    "tova": "tova:budget=0.25",
    "knorm": "knorm:budget=0.25,window=8",
    "keydiff": "keydiff:budget=0.25,window=8",
    "adakv": "adakv:budget=0.25,base=snapkv:window=8",
    "expectedattention": "expectedattention:budget=0.25",
    "kvzip": "kvzip:budget=0.25",
    "duo": "duo:streaming=0.5,sinks=4,recent=16",
    "infllm": "infllm:block_size=8,initial=8,local_window=16,topk=2,chunk=16,repr_topk=2",
    # decoding-time compression: the prefill's method compresses, decoding keeps it under budget
    "decoding": "snapkv:budget=0.25,window=8+decoding:budget=0.25",
}


HOLDS_EVERYTHING = {"full", "blocksparse", "infllm"}  # blocksparse and infllm keep all, attend a few blocks per step


# methods that refuse hybrid (sliding-window) models, in one line: the contract test checks the refusal
NOT_ON_HYBRIDS = {"infllm": "its block memory reads every layer; sliding layers are not built in yet"}
