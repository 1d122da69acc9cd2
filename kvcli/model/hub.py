"""Model names: a Hugging Face hub id (used offline when the hub is unreachable) or a local folder."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

from ..errors import ModelError, one_line

MODELS_HINT = "`kvcli models` lists the embedded models and what else -m takes"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9_.-]+)?$")


def looks_like_path(spec: str) -> bool:
    if spec.startswith(("/", "./", "../", "~", ".\\", "..\\")) or "\\" in spec:
        return True
    if re.match(r"^[A-Za-z]:[\\/]", spec):  # C:\...
        return True
    return not _HUB_ID.match(spec) or ".." in spec or "--" in spec


def _hub_reachable() -> bool:
    """False when offline mode is on or the hub's host name does not resolve (fast check).

    Without this, a missing model on a machine without network waits ~25 s in
    huggingface_hub's retries before failing. With a proxy configured, assume reachable.
    """
    try:
        import huggingface_hub.constants as hc

        offline = hc.is_offline_mode() if hasattr(hc, "is_offline_mode") else hc.HF_HUB_OFFLINE
        if offline:
            return False
        endpoint = hc.ENDPOINT
    except Exception:  # pragma: no cover
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if any(
        os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
    ):
        return True
    host = urlparse(endpoint).hostname
    if not host:
        return True
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False


def hub_load(fn, spec: str, what: str, **kw):
    """Call ``fn(spec, ...)`` from the local HF cache first, then (if needed) from the network."""
    try:
        return fn(spec, local_files_only=True, **kw)
    except OSError:
        pass  # not (completely) cached
    if not _hub_reachable():
        raise ModelError(
            f"cannot load model '{spec}': not a local path and not in the Hugging Face cache "
            f"(no network?); {MODELS_HINT}"
        )
    try:
        return fn(spec, **kw)
    except OSError as e:
        raise ModelError(f"cannot load {what} of model '{spec}': {one_line(e)}; {MODELS_HINT}") from e


def hub_snapshot_dir(spec: str) -> Path | None:
    """The local snapshot folder a hub model was loaded from, if it can be found."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(spec, "config.json")
    except Exception:  # pragma: no cover
        return None
    return Path(found).parent if isinstance(found, str) else None


def check_local_folder(spec: str, folder: Path) -> None:
    if folder.is_file():
        if folder.suffix.lower() == ".gguf":
            raise ModelError(
                f"cannot load model '{spec}': GGUF files are supported only for the embedded "
                "model; pass a Hugging Face model folder (config.json + weights) or a hub id"
            )
        raise ModelError(f"cannot load model '{spec}': it is a file, not a model folder")
    if not (folder / "config.json").is_file():
        raise ModelError(f"cannot load model '{spec}': not a Hugging Face model folder (no config.json)")
