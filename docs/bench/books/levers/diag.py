"""How each layer would rank the block holding the answer (the stored books, InfLLM's retrieval
running): per layer, the scores of representatives (eq. 2), tokens, attention, attmax, GemFilter's
last query, its softmax; per head, summed over heads, and summed over layer ranges."""
import json, re, sys, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from benchmarks.books import page_text, store_dir, QUESTIONS
from kvcli.api import AskOptions, Session, parse_pipeline
from kvcli.documents import load_document
from kvcli.caches.book import BookCache
from kvcli.store import KVStore

files = {'camlidl': 'camlidl-1.04.doc.pdf', 'R-data': 'R-data.pdf', 'R-intro': 'R-intro.pdf'}
docs = sys.argv[1].split(',')
cache_dir = store_dir(Path(sys.argv[2] if len(sys.argv) > 2 else '/tmp/books3-store'))  # the kept store of the runs
session = Session.open(AskOptions(cache_dir=cache_dir, max_new_tokens=1, cache_max="none"))
rec = {}
orig = BookCache.choose
def choose(self, layer, q_mem, scaling=None):
    if not self.reading and q_mem.shape[2] > 1:
        nb = self.n_blocks
        q = q_mem[0].to(torch.float32).sum(dim=1)
        q = q.reshape(self.n_kv, -1, q.shape[-1]).sum(dim=1).cpu()
        rep = torch.einsum("hd,hbd->hb", q, self.repsum[layer][:, :nb])
        tok = self._token_scores(layer, q, nb)
        lo, bs = self.initial, self.block_size
        keys = torch.stack([self.storage.read(f"k.{layer}", h, lo, lo + nb * bs) for h in range(self.n_kv)]).to(torch.float32)
        qq = q_mem[0].to(torch.float32)  # (n_heads, c, d)
        g = qq.shape[0] // self.n_kv
        qq = qq.reshape(self.n_kv, g * qq.shape[1], -1)
        w = torch.softmax(qq @ keys.transpose(1, 2) / qq.shape[-1] ** 0.5, dim=-1).sum(1)  # (n_kv, nb*bs)
        att = w.view(self.n_kv, nb, bs).sum(-1)
        attmax = w.view(self.n_kv, nb, bs).amax(-1)
        last = q_mem[0, :, -1].to(torch.float32).reshape(self.n_kv, g, -1)  # (n_kv, g, d): the last query
        gem = torch.einsum("hgd,htd->t", last, keys)  # GemFilter: summed over all heads
        gemmax = gem.view(nb, bs).amax(-1).expand(self.n_kv, nb)
        # softmax of the last query only, summed over heads
        w1 = torch.softmax(torch.einsum("hgd,htd->hgt", last, keys) / last.shape[-1] ** 0.5, dim=-1).sum((0, 1))
        last_att = w1.view(nb, bs).sum(-1).expand(self.n_kv, nb)
        rec[layer] = (rep, tok, att, attmax, gemmax, last_att)
    return orig(self, layer, q_mem, scaling)
BookCache.choose = choose
spec = json.loads(QUESTIONS.read_text())
out = []
for d in spec['documents']:
    if d['name'] not in docs: continue
    document = load_document(Path(sys.argv[3] if len(sys.argv) > 3 else '/tmp/books') / files[d['name']])
    for q in d['questions']:
        rec.clear()
        r = session.ask(document, q['q'], parse_pipeline('infllm:filter_layer=-1'))
        book, prompt = r.cache, r.prompt
        lo = list(document.page_starts)[q['page'] - 1]
        text = page_text(document, q['page']).lower()
        chars = [lo + m.start() for a in q['accept'] for m in re.finditer(r"(?<![a-z0-9])" + re.escape(a.lower()), text)]
        positions = {prompt.doc_start + next(i for i, (_, e) in enumerate(prompt.doc_offsets) if e > c) for c in chars}
        blocks = sorted({(p - book.initial) // book.block_size for p in positions if book.initial <= p < book.origin})
        if not blocks or not rec:
            print(d['name'], q['page'], 'not in Memory'); continue
        nb = book.n_blocks
        def rank(s):  # best rank of an answer block (0 = top)
            order = torch.argsort(s, descending=True)
            pos = torch.empty_like(order); pos[order] = torch.arange(len(order))
            return int(pos[blocks].min())
        res = {'doc': d['name'], 'page': q['page'], 'nb': nb}
        for kind, i in (('rep', 0), ('tok', 1), ('att', 2), ('attmax', 3), ('gem', 4), ('lastatt', 5)):
            per = {l: [rank(rec[l][i][h]) for h in range(book.n_kv)] for l in sorted(rec)}
            res[kind + '_per_layer_best'] = [min(v) for v in per.values()]
            res[kind + '_per_layer_sum'] = [rank(rec[l][i].sum(0)) for l in sorted(rec)]
            z = (lambda s: (s - s.mean(dim=-1, keepdim=True)) / (s.std(dim=-1, keepdim=True) + 1e-6)) if i in (0, 1, 4) else (lambda s: s)
            agg = sum(z(rec[l][i]).sum(0) for l in rec)
            res[kind + '_shared_all'] = rank(agg)
            res[kind + '_median_rank'] = float(torch.tensor([r for v in per.values() for r in v]).float().median())
            for lo_, hi_ in ((0, 10), (10, 20), (20, 30)):
                res[f'{kind}_shared_{lo_}_{hi_}'] = rank(sum(z(rec[l][i]).sum(0) for l in rec if lo_ <= l < hi_))
        print(json.dumps(res), flush=True)
