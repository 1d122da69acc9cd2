"""Running the model: the engine that drives a transformers model's decoder layers one by one
(:mod:`.engine`), the prompt's passes (:mod:`.prefill`) and the decoding step (:mod:`.decode`), the
attention function and its kernels (:mod:`.attention`, :mod:`.kernels`), RoPE re-rotation
(:mod:`.rope`), each layer's sliding window (:mod:`.windows`), the device's facts
(:mod:`.accelerator`), the CPU threads of each phase (:mod:`.threads`) and what a run costs
(:mod:`.measure`). Nothing here knows a method or a
document: the methods (:mod:`kvcli.compressors`) act through the engine's hooks and observers.
"""
