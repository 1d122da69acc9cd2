"""Answering a question: the prompt (:mod:`.prompt`), the document's reusable prefix state
(:mod:`.prefix`), the pipeline of methods that selects, prefills, compresses and decodes
(:mod:`.pipeline`), which method ``-c auto`` picks (:mod:`.policy`), what was kept as document
spans and pages (:mod:`.selection`), where an answer ends (:mod:`.stopping`) and how it is streamed
(:mod:`.streaming`).
"""
