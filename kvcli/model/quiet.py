"""Keeping transformers', huggingface_hub's and bitsandbytes' logs, warnings and progress bars off
the user's terminal while a model loads (the CLI shows its own progress)."""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings


def quiet_libraries() -> None:
    """Turn the libraries' logging to errors only and transformers' progress bars off."""
    import transformers.utils.logging as tlog

    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        import huggingface_hub.utils.logging as hlog

        hlog.set_verbosity_error()  # e.g. "Retrying in 1s" when the network is flaky
    except Exception:  # pragma: no cover - depends on the huggingface_hub version
        pass
    # bitsandbytes logs through plain `logging`, e.g. "MatMul8bitLt: inputs will be cast ..."
    # on every forward of an 8-bit model, and a kernels-community hint on import.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


@contextlib.contextmanager
def quiet_load():
    """Silence Python warnings and GGUF's own tqdm bar while loading."""
    quiet_libraries()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import transformers.modeling_gguf_pytorch_utils as gguf_utils
        except Exception:  # pragma: no cover - gguf support missing
            gguf_utils = None
        # The GGUF dequantizer uses tqdm.auto directly, which transformers' switch misses.
        old_tqdm = getattr(gguf_utils, "tqdm", None)
        if old_tqdm is not None:
            gguf_utils.tqdm = functools.partial(old_tqdm, disable=True)
        try:
            yield
        finally:
            if old_tqdm is not None:
                gguf_utils.tqdm = old_tqdm
