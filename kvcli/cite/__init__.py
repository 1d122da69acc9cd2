"""Where an answer comes from: what the answer's decoding steps read of the prompt
(:mod:`.attribution`), the document's sentences ranked from it and from the question's BM25
(:mod:`.sources`; BM25 is :mod:`kvcli.retrieval.bm25`).
"""
