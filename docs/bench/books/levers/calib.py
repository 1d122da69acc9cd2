"""The filter layer chosen on needles, never on the books: per layer, the rank of the needle's block
under the question's attention summed over the layer's heads (the filter_layer selection)."""
import json, sys, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from kvcli.api import AskOptions, Session, parse_pipeline
from kvcli.documents import document_from_text
from kvcli.caches.book import BookCache
from kvcli.bench.needle import make_case

session = Session.open(AskOptions(use_cache=False, max_new_tokens=1))
rec = {}
orig = BookCache.choose
def choose(self, layer, q_mem, scaling=None):
    if not self.reading and q_mem.shape[2] > 1:
        rec[layer] = self._attention_scores(layer, q_mem, self.n_blocks, scaling).sum(0)
    return orig(self, layer, q_mem, scaling)
BookCache.choose = choose
n_tokens = int(sys.argv[1]); depths = [float(x) for x in sys.argv[2].split(',')]
for seed, depth in enumerate(depths):
    case = make_case(session.lm.tokenizer, n_tokens, depth, seed=seed)
    rec.clear()
    r = session.ask(document_from_text(case.text), case.question, parse_pipeline('infllm:filter_layer=-1'))
    book, prompt = r.cache, r.prompt
    pos = {prompt.doc_start + next(i for i, (_, e) in enumerate(prompt.doc_offsets) if e > c) for c in range(case.needle_start, case.needle_end)}
    blocks = sorted({(p - book.initial) // book.block_size for p in pos if book.initial <= p < book.origin})
    ranks = []
    for l in sorted(rec):
        order = torch.argsort(rec[l], descending=True)
        where = torch.empty_like(order); where[order] = torch.arange(len(order))
        ranks.append(int(where[blocks].min()))
    print(json.dumps({"depth": depth, "n_blocks": book.n_blocks, "needle_blocks": blocks, "rank_per_layer": ranks}), flush=True)
