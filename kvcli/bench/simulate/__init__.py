"""The simulated accelerator (``kvcli bench memory --simulate``; docs/gpu-sim.md).

kvcli's own session, pipeline, engine, caches and methods run a real model config built on
PyTorch's ``meta`` device, under a dispatch-mode tracker that counts what an accelerator would
hold and cross. One module per idea: :mod:`.tracker` (live bytes and peak, syncs, host->device
copies, phases), :mod:`.sdpa` (the SDPA kernel CUDA would pick, and what it allocates),
:mod:`.models` (the published configs, bf16 / nf4 weights as bitsandbytes stores them, a word-level
tokenizer), :mod:`.run` (one cell through :class:`kvcli.api.Session`), :mod:`.report` (cells,
table, the memory targets (simulated Llama-3.1-8B, nf4)).
"""
