"""The compression methods' catalog: what the command line says of each method without importing
it (nor PyTorch, which the methods import; so it sits outside kvcli.compressors, whose package
imports every method): ``kvcli compressors`` (its docstring, paper, knobs with their defaults and meanings) and
``--kv-bits``'s help (the bits ``auto`` holds its KV in). The class states each fact (:func:`describe`
reads them off it); ``python -m kvcli.cli.reference`` copies them below its marker, in
:data:`kvcli.compressors.REGISTRY`'s order, and ``tests/test_docs.py`` fails when the copy is not
what the classes say. A new method is still its file: run the command, as for docs/methods.md's
table (:func:`methods` adds a method registered in this process that the copy lacks)."""

from __future__ import annotations

import re
import sys
from typing import NamedTuple


class Knob(NamedTuple):
    name: str
    default: str  # as a spec writes it (kvcli.compressors.base.knob_text: auto, true, 0.25)
    help: str


class Method(NamedTuple):
    name: str
    doc: str  # the class docstring, its lines joined
    paper: str
    auto_kv_bits: int  # Compressor.auto_kv_bits
    knobs: tuple[Knob, ...]


def summary(method: Method) -> str:
    """A method's one line: the first sentence of its docstring after "Name (Authors, year): "."""
    doc = method.doc.replace("``", "")
    _, colon, rest = doc.partition("): ")
    first = re.split(r"(?<=\.)\s", rest if colon else doc, maxsplit=1)[0]
    return first[:1].upper() + first[1:]


def knob_text(value) -> str:
    """A knob's value as a spec writes it (None: auto; booleans: true/false)."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def describe(cls) -> Method:
    """What the command line says of the method class ``cls`` (a registered Compressor)."""
    knobs = tuple(Knob(f.name, knob_text(f.default), f.metadata.get("help", "")) for f in cls.knobs())
    return Method(cls.name, " ".join((cls.__doc__ or "").split()), cls.paper, cls.auto_kv_bits, knobs)


def methods() -> dict[str, Method]:
    """Every method: the copy below, and those registered in this process (a method defined at run
    time; a method's module already imported), read off their classes; nothing is imported here."""
    base = sys.modules.get("kvcli.compressors.base")
    registered = {} if base is None else {name: describe(cls) for name, cls in base.REGISTRY.items()}
    return {**METHODS, **registered}


MARKER = "# --- written by python -m kvcli.cli.reference from the method classes: do not edit below ---"
# --- written by python -m kvcli.cli.reference from the method classes: do not edit below ---
# fmt: off
METHODS: dict[str, Method] = {
    "full": Method(
        "full",
        "Full attention (no compression): the reference all methods must reproduce when told to keep everything.",
        "Vaswani et al. 2017, Attention Is All You Need",
        8,
        (),
    ),
    "gemfilter": Method(
        "gemfilter",
        "GemFilter (Shi et al., 2024): layers 0..r of the model choose k input tokens, the full model then reads only those. arXiv:2409.17422.",
        "Shi et al. 2024, Discovering the Gems in Early Layers, arXiv:2409.17422",
        8,
        (
            Knob("layer", "auto", "filter layer index r (0-based, the official code's select_layer_idx): layers 0..r run on the whole prompt and layer r's queries and keys score it; auto = the paper's (Llama-3.1-8B 13, Mistral-Nemo 19, Phi-3.5-mini 19), the measured one (SmolLM2-135M 15), else ~13/32 of the depth"),
            Knob("k", "auto", "number of prompt tokens kept for the second pass; auto = 1024 (the paper's), or the value measured for the model"),
            Knob("kernel", "5", "width of the average pool over the scores (odd; 1 = none)"),
            Knob("keep_question", "true", "always keep every token after the document (instructions, question, chat template tail)"),
            Knob("span", "1", "keep whole windows of this many tokens around the best scores (1 = plain top-k)"),
        ),
    ),
    "pages": Method(
        "pages",
        "Pages: the question's best pages by BM25 on stems fused with a sentence embedding (:mod:`kvcli.retrieval.ranking`), read whole with full attention (two passes, GemFilter's shape with pages as the unit; Robertson & Zaragoza 2009).",
        "Robertson & Zaragoza 2009, The Probabilistic Relevance Framework: BM25 and Beyond; two passes as GemFilter, arXiv:2409.17422",
        8,
        (
            Knob("pages", "1", "passages read whole: the question's best this many by BM25 fused with the sentence embedding (a PDF's pages, else page-sized passages); 1 answers best on the manuals measured (docs/bench/cite)"),
            Knob("skim", "2", "passages after the ones read whole, in the same order, of which only the best sentences are read (skim_tokens each): further sources at little cost; 2 cites the answer's page among three as often as BM25 does and answers as one page does (docs/bench/cite)"),
            Knob("skim_tokens", "64", "tokens read of a skimmed passage: its best sentence by BM25, widened by whole neighbours"),
            Knob("candidates", "30", "BM25's best passages the sentence embedding re-ranks; the others follow in BM25's order, and only these are embedded; 0: every passage is embedded and ranked (a book's first question then embeds the whole book); chosen on the tuning questions (docs/bench/retrieval)"),
            Knob("budget", "auto", "most prompt tokens read before the question (the template's head and the passages); auto = half the model's window, at most 4,096"),
        ),
    ),
    "snapkv": Method(
        "snapkv",
        "SnapKV (Li et al., 2024): an observation window at the end of the prompt selects, per KV head, the entries to keep. arXiv:2404.14469.",
        "Li et al. 2024, SnapKV: LLM Knows What You are Looking for Before Generation, arXiv:2404.14469",
        8,
        (
            Knob("budget", "1024", "entries kept per layer: a token count (>= 1) or a ratio of the prompt (0 < x < 1)"),
            Knob("window", "32", "observation window: the last prompt tokens whose attention votes (always kept)"),
            Knob("kernel", "7", "width of the pool over the votes (odd; 1 = none)"),
            Knob("pool", "max", "pooling of the votes: max or avg"),
        ),
    ),
    "pyramidkv": Method(
        "pyramidkv",
        "PyramidKV (Cai et al., 2024): SnapKV's selection with per-layer budgets decreasing arithmetically with depth (same total). arXiv:2406.02069.",
        "Cai et al. 2024, PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling, arXiv:2406.02069",
        8,
        (
            Knob("budget", "1024", "entries kept per layer: a token count (>= 1) or a ratio of the prompt (0 < x < 1)"),
            Knob("window", "32", "observation window: the last prompt tokens whose attention votes (always kept)"),
            Knob("kernel", "7", "width of the pool over the votes (odd; 1 = none)"),
            Knob("pool", "max", "pooling of the votes: max or avg"),
            Knob("beta", "20.0", "the top layer selects (budget - window) / beta entries; larger = steeper pyramid"),
        ),
    ),
    "h2o": Method(
        "h2o",
        "H2O (Zhang et al., 2023): keep the heavy hitters (most accumulated attention) and the most recent tokens. arXiv:2306.14048.",
        "Zhang et al. 2023, H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models, arXiv:2306.14048",
        8,
        (
            Knob("budget", "1024", "entries kept per layer: a token count (>= 1) or a ratio of the prompt (0 < x < 1)"),
            Knob("recent", "0.5", "fraction of the budget given to the most recent tokens (the rest: heavy hitters)"),
        ),
    ),
    "streamingllm": Method(
        "streamingllm",
        "StreamingLLM (Xiao et al., 2023): keep the attention sinks and the most recent tokens. arXiv:2309.17453.",
        "Xiao et al. 2023, Efficient Streaming Language Models with Attention Sinks, arXiv:2309.17453",
        8,
        (
            Knob("budget", "1024", "entries kept per layer: a token count (>= 1) or a ratio of the prompt (0 < x < 1)"),
            Knob("sinks", "4", "first tokens always kept (attention sinks)"),
        ),
    ),
    "razor": Method(
        "razor",
        "RazorAttention (Tang et al., 2024): retrieval heads (echo + induction heads found once per model) keep their full KV cache; the other heads keep 4 sink tokens, a recent window and one compensation token. order=paper compresses after a full-attention prefill of the whole prompt (Algorithm 1); order=prefix compresses the document before the question, so the compressed cache serves every later question from the disk store. arXiv:2407.15891.",
        "Tang et al. 2024, RazorAttention: Efficient KV Cache Compression Through Retrieval Heads, arXiv:2407.15891",
        16,
        (
            Knob("order", "paper", "paper: prefill the whole prompt with full attention, compress before decoding (Algorithm 1; first answer token = full attention's); prefix: compress the document before the question (question-agnostic, the compressed cache is stored for any question)"),
            Knob("induction", "0.14", "fraction of all query heads protected for their induction score (paper: top 14%)"),
            Knob("echo", "0.01", "fraction of all query heads protected for their echo score (paper: top 1%)"),
            Knob("sinks", "4", "sink tokens N_0 kept at the start by every non-retrieval head"),
            Knob("window", "auto", "S_0: non-retrieval heads keep the last max(S_0, N/C) tokens; auto = 4000 scaled to the model's context (32k -> 4000)"),
            Knob("ratio", "5.0", "C: compression ratio of the window, L_h = max(S_0, N/C) (paper: 5)"),
            Knob("compensate", "true", "merge the dropped tokens into one compensation token (equation 5); false = just drop them"),
            Knob("tokens", "auto", "K random tokens of the head probe (repeated 4 times); auto = 512 under 1B parameters, 1024 under 4B, else 2500"),
            Knob("seed", "0", "seed of the head probe's random tokens"),
        ),
    ),
    "finch": Method(
        "finch",
        "Finch (Corallo & Papotti, 2024): the document is read chunk by chunk; after each chunk the attention of the user prompt (instructions + question, never compressed) keeps, per layer, the most relevant KV pairs (re-positioned with RoPE), so a document longer than the window fits a ``target``-token cache. TACL 2024, doi 10.1162/tacl_a_00716 (arXiv:2408.00167).",
        "Corallo & Papotti 2024, FINCH: Prompt-guided Key-Value Cache Compression, TACL (arXiv:2408.00167)",
        8,
        (
            Knob("target", "auto", "KV cache size the context (template head + document) is compressed to: a token count (>= 1) or a ratio of it (0 < x < 1); auto = 1024 tokens (at most a quarter of the window)"),
            Knob("chunk", "1024", "context tokens read per step (the paper: 64-2,048; 1024 for single-document QA); shrinks to fit a small window"),
            Knob("kernel", "21", "width of a max pool over the scores before the top-k, as SnapKV's (odd; 1 = the paper's: none; 21 measured best on RULER, docs/finch.md)"),
        ),
    ),
    "lazyllm": Method(
        "lazyllm",
        "LazyLLM (Fu et al., 2024): at a few pruning layers the last token's attention in the layer before keeps the most important tokens (fewer in later layers); pruned tokens stop being computed, and every decoding step selects again (``reselect``: every N-th step), reviving tokens from an Aux Cache of hidden states. arXiv:2407.14057.",
        "Fu et al. 2024, LazyLLM: Dynamic Token Pruning for Efficient Long Context LLM Inference, arXiv:2407.14057",
        16,
        (
            Knob("layers", "auto", "pruning layers, '/'-separated, increasing, 0-based in 1..n_layers-1: layer L and later see only the tokens kept by the last token's attention at layer L-1; auto = 1/4, 1/2, 3/4 of the depth"),
            Knob("keep", "auto", "share of all tokens kept at each pruning layer, '/'-separated, non-increasing, in (0, 1]; auto = evenly from 0.7 down to 0.3 (0.7/0.5/0.3)"),
            Knob("reselect", "1", "decoding steps per selection: 1 = select again at every step (the paper); N > 1 = at every N-th step, the steps between reuse the last selection plus the new tokens (no scoring, no revival); 0 = keep the prefill's selection"),
        ),
    ),
    "blocksparse": Method(
        "blocksparse",
        "Block-sparse retrieval attention (KTransformers long-context framework, generalising InfLLM arXiv:2402.04617 and Quest arXiv:2406.10774): the whole KV is kept; each decoding step attends to Initial + the top-k Context blocks (scored by representative keys) + Local.",
        "KTransformers 2024, KVCache Long Context (framework of InfLLM, Xiao et al. 2024, arXiv:2402.04617, and Quest, Tang et al. 2024, arXiv:2406.10774)",
        16,
        (
            Knob("preset", "none", "none, snapkv (block_size 1 + preselect = SnapKV without pooling) or quest (quest representatives, separate heads); fills knobs not set"),
            Knob("block_size", "128", "tokens per Context block (article: 128)"),
            Knob("initial", "128", "Initial tokens at the start, always attended (InfLLM: 128)"),
            Knob("local_window", "auto", "Local tokens at the end of the prompt, always attended; auto = the article's 4096 of 128K scaled to the model's window"),
            Knob("topk", "auto", "Context blocks attended per step; auto = the article's 96 blocks of 128 tokens (of 128K) scaled to the model's window"),
            Knob("representative", "dynamic", "representative keys of a block: max, mean, quest, dynamic (the article's: attention of the last window prompt queries, i.e. the question's), infllm (InfLLM's eq. 1: mean q·k from each token's local_window successors in the prefill, question-independent) or fixed"),
            Knob("representative_num", "1", "representatives per block (max/mean: pieces of the block; quest: always 2)"),
            Knob("preselect", "false", "SnapKV-style preselection of blocks by the question before decoding"),
            Knob("preselect_blocks", "auto", "blocks kept by the preselection; auto = 2 * topk"),
            Knob("window", "32", "observation window: last prompt tokens whose queries vote (preselect, dynamic; SnapKV: 32)"),
            Knob("dense_layers", "0", "first layers that attend to everything (article: 0; 2 in its best kvretrieval setup)"),
            Knob("layer_step", "1", "select every this many layers; the layers in between reuse the selection"),
            Knob("token_step", "1", "select every this many tokens; the tokens in between reuse the selection"),
            Knob("head_select", "shared", "shared (all KV heads of a layer pick the same blocks) or separate (per KV head)"),
            Knob("chunk", "4096", "prefill chunk in tokens (article: 4096)"),
        ),
    ),
    "infllm": Method(
        "infllm",
        "InfLLM (Xiao et al. 2024, arXiv:2402.04617): the whole document read once in chunks with a bounded attention span (Initial + retrieved Memory blocks + Local), its KV stored question-free; each question retrieves the blocks its queries score highest.",
        "Xiao et al. 2024, InfLLM: Training-Free Long-Context Extrapolation for LLMs with an Efficient Context Memory (arXiv:2402.04617)",
        8,
        (
            Knob("preset", "auto", "auto (cpu on the CPU, paper on an accelerator), cpu (local_window=1024, topk=8, retrieval=question) or paper (InfLLM's 4096, 16, step); fills the knobs not given"),
            Knob("block_size", "128", "tokens per Memory block (InfLLM: 128)"),
            Knob("initial", "128", "Initial tokens, always attended (InfLLM: n_init 128)"),
            Knob("local_window", "auto", "Local window in tokens (InfLLM: n_local 4096); auto = the preset's (cpu 1024, paper 4096), at most half the model's window"),
            Knob("topk", "auto", "Memory blocks each chunk / step retrieves (InfLLM: 16); auto = the preset's (cpu 8, paper 16), at most a quarter of the window"),
            Knob("answer_topk", "auto", "Memory blocks a question (and a decoding step) retrieves; auto = topk (InfLLM: the same)"),
            Knob("repr_topk", "4", "representative tokens per block (InfLLM: repr_topk 4)"),
            Knob("chunk", "512", "tokens read per pass (InfLLM: exc_block_size 512)"),
            Knob("kv_dtype", "float16", "stored KV precision: float16, bfloat16 or model (the model's dtype)"),
            Knob("retrieval", "auto", "answering: step (each decoding step retrieves, InfLLM) or question (the question's blocks for the whole answer, KTransformers); auto = the preset's (cpu question, paper step)"),
            Knob("answer_scores", "representatives", "how the question scores a block: representatives (InfLLM's equation 2), tokens (its best token against the question's summed queries) or attention (the question's attention over every stored key, KTransformers' preselection); tokens and attention read every stored key"),
            Knob("filter_layer", "auto", "answering: a probe pass of the question selects answer_topk blocks once, by the attention of this layer's queries over every stored key (GemFilter's filter layer), and every layer attends to them; -1 = each layer retrieves its own (InfLLM); auto = the preset's (cpu: the model's measured filter layer, else -1; paper: -1)"),
            Knob("answer_positions", "auto", "answering: same (InfLLM: every Initial and Memory token at distance local_window) or ordered (Initial, the retrieved blocks in document order and Local at consecutive positions, within the model's window); auto = ordered with a filter layer (one set of blocks, as GemFilter re-positions its selection), else same"),
        ),
    ),
    "tova": Method(
        "tova",
        "TOVA (Oren et al., 2024): each layer keeps the keys the last token attends to most, averaged over the layer's heads (the same tokens in every head). arXiv:2401.06104.",
        "Oren et al. 2024, Transformers are Multi-State RNNs (TOVA), arXiv:2401.06104",
        8,
        (
            Knob("budget", "1024", "entries kept per layer: a token count (>= 1) or a ratio of the prompt (0 < x < 1)"),
        ),
    ),
    "knorm": Method(
        "knorm",
        "KNorm (Devoto et al., 2024): each KV head keeps the keys of lowest L2 norm (plus the last window prompt tokens). arXiv:2406.11430.",
        "Devoto et al. 2024, A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression, arXiv:2406.11430",
        8,
        (
            Knob("budget", "1024", "entries kept per layer: a token count (>= 1) or a ratio of the prompt (0 < x < 1)"),
            Knob("window", "32", "last prompt tokens always kept (the question); 0 = the paper's rule alone"),
        ),
    ),
    "keydiff": Method(
        "keydiff",
        "KeyDiff (Park et al., 2025): each KV head keeps the keys least similar (cosine) to its mean normalised key (plus the last window prompt tokens). arXiv:2504.15364.",
        "Park et al. 2025, KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference, arXiv:2504.15364",
        8,
        (
            Knob("budget", "1024", "entries kept per layer: a token count (>= 1) or a ratio of the prompt (0 < x < 1)"),
            Knob("window", "32", "last prompt tokens always kept (the question); 0 = the paper's rule alone"),
        ),
    ),
    "adakv": Method(
        "adakv",
        "AdaKV (Feng et al., 2024): a base scorer's entries chosen per layer across its KV heads — budget x KV heads entries a layer, split by score, at least safeguard x budget per head. arXiv:2407.11550.",
        "Feng et al. 2024, Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference, arXiv:2407.11550",
        16,
        (
            Knob("budget", "1024", "entries kept per layer: a token count (>= 1) or a ratio of the prompt (0 < x < 1)"),
            Knob("base", "snapkv", "the scorer: snapkv, pyramidkv, tova, knorm, keydiff or streamingllm, its knobs after ':' separated by ';'"),
            Knob("safeguard", "0.2", "every KV head keeps at least this fraction of the per-head budget (its own best entries)"),
        ),
    ),
    "expectedattention": Method(
        "expectedattention",
        "Expected Attention (Devoto et al., 2025): keep the prefix entries that future queries — modelled as a Gaussian of the queries seen, rotated to future positions — are expected to attend to, weighted by the value norm. Question-agnostic: the compressed cache serves every later question. arXiv:2510.00636.",
        "Devoto, Jeblick & Jégou 2025, Expected Attention: KV Cache Compression by Estimating Attention from Future Queries Distribution, arXiv:2510.00636",
        16,
        (
            Knob("budget", "1024", "entries kept per layer and KV head of the document prefix (the question is never compressed): a token count or a ratio of the prefix"),
            Knob("allocation", "uniform", "uniform: every KV head keeps budget; adaptive: AdaKV, budget x KV heads per layer split by score; global: budget x KV heads x layers over the whole model"),
            Knob("safeguard", "0.2", "adaptive: every KV head keeps at least this fraction of the budget"),
            Knob("sinks", "4", "first tokens always kept and left out of the statistics and the softmax"),
            Knob("future", "512", "future positions the query rotation is averaged over"),
            Knob("queries", "auto", "statistics from the last N prefix tokens' queries; auto = every token after the sinks"),
            Knob("covariance", "true", "use the queries' covariance (false: the mean alone)"),
            Knob("vnorm", "true", "weight the expected attention by the value norm"),
            Knob("epsilon", "0.0", "vnorm: scores are (expected attention + epsilon) x value norm (kvpress; its leaderboard uses 0.01)"),
        ),
    ),
    "kvzip": Method(
        "kvzip",
        "KVzip (Kim et al., 2025): each prefix KV pair scored by the most attention it gets while the model reconstructs the context; the best over all layers and heads are kept. Question-agnostic: the compressed cache serves every later question. arXiv:2505.23416.",
        "Kim et al. 2025, KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction, arXiv:2505.23416",
        16,
        (
            Knob("budget", "1024", "entries kept per layer and KV head of the document prefix (the question is never compressed): a token count or a ratio of the prefix"),
            Knob("allocation", "global", "global: budget x KV heads x layers over the whole model (the paper); adaptive: per layer (AdaKV split); uniform: every KV head keeps budget"),
            Knob("safeguard", "0.2", "adaptive: every KV head keeps at least this fraction of the budget"),
            Knob("sinks", "auto", "first tokens never evicted and in every chunk's softmax; auto = the chat template's head (system prompt + user turn start)"),
            Knob("chunk", "2000", "context tokens reconstructed per pass"),
            Knob("overlap", "8", "tokens of the previous chunk quoted in the next chunk's prompt"),
        ),
    ),
    "duo": Method(
        "duo",
        "DuoAttention (Xiao et al., 2024): retrieval KV heads keep the whole cache, streaming heads the first sinks and the last recent tokens; heads estimated once per model (kvpress's on-the-fly scores). Question-agnostic: the compressed cache serves every later question. arXiv:2410.10819.",
        "Xiao et al. 2024, DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads, arXiv:2410.10819",
        16,
        (
            Knob("streaming", "0.5", "fraction of the KV heads (whole model) made streaming heads: the lowest scores"),
            Knob("sinks", "128", "first tokens a streaming head keeps (the paper's patterns: 128)"),
            Knob("recent", "256", "last tokens of the document a streaming head keeps (the paper's patterns: 256)"),
            Knob("tokens", "auto", "calibration tokens of the head estimate; auto = 2048, at most the model's window"),
            Knob("length", "500", "positions of the head estimate (kvpress: 500)"),
        ),
    ),
    "decoding": Method(
        "decoding",
        "Decoding-time compression (NVIDIA kvpress's DecodingPress): every interval generated tokens, an eviction scorer keeps the best budget entries per KV head.",
        "NVIDIA kvpress DecodingPress (Devoto et al. 2025, arXiv:2510.00636, decoding-phase compression)",
        16,
        (
            Knob("base", "knorm", "the scorer: snapkv, pyramidkv, tova, knorm, keydiff or streamingllm, its knobs after ':' separated by ';'"),
            Knob("budget", "1024", "entries each KV head keeps after a compression: a token count or a ratio of the prompt"),
            Knob("interval", "64", "decoding steps between compressions"),
            Knob("buffer", "256", "the last decoding steps (since the previous compression) whose queries score the keys"),
        ),
    ),
}
# fmt: on
