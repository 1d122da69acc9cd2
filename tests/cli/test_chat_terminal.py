"""``kvcli chat`` in a real terminal (tmux: keys sent, the screen read back) on the embedded
SmolLM2: the spinner names the method and the document's length while it is read, Ctrl-C cancels
that answer and the chat goes on, an answer is printed, Up recalls the last question (readline
history) whose answer then comes from the stored prefix, Ctrl-D leaves with exit code 0."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUESTION = "Who keeps the lighthouse?"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install tmux)"),
]


class Pane:
    def __init__(self, name: str) -> None:
        self.name = name

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def screen(self) -> str:
        return subprocess.run(
            ["tmux", "capture-pane", "-p", "-J", "-S", "-200", "-t", self.name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    def wait(self, predicate, what: str, timeout: float = 300.0) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; the screen:\n{self.screen()}")


def _prompts(screen: str) -> int:
    return sum(1 for line in screen.splitlines() if line.startswith("> ") or line == ">")


def _cache_dir(tmp_path: Path) -> Path:
    """A fresh KV store and history, with the embedded model already converted in the user's cache
    (linked, not converted again)."""
    from kvcli.model import default_cache_dir

    cache = tmp_path / "cache"
    cache.mkdir()
    for name in ("models", "gguf-sha256.json"):
        if (default_cache_dir() / name).exists():
            (cache / name).symlink_to(default_cache_dir() / name)
    return cache


def test_chat_in_a_terminal(tmp_path):
    cache = _cache_dir(tmp_path)
    exit_file = tmp_path / "exit"
    name = f"kvcli-chat-{os.getpid()}"
    command = (
        f"cd {shlex.quote(str(REPO))} && PYTHONPATH={shlex.quote(str(REPO))} {shlex.quote(sys.executable)} -m kvcli chat examples/lighthouse.md "
        f"--cache-dir {shlex.quote(str(cache))} --max-new-tokens 32; echo $? > {shlex.quote(str(exit_file))}; sleep 600"
    )
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "150", "-y", "50", command], check=True)
    pane = Pane(name)
    try:
        pane.wait(lambda s: _prompts(s) == 1, "the first prompt")
        assert "lighthouse.md" in pane.screen() and "Ctrl-D leaves" in pane.screen()

        # reading the document (a stored prefix does not exist yet): the spinner says what, then Ctrl-C
        pane.keys(QUESTION, "Enter")
        screen = pane.wait(lambda s: "full attention · " in s, "the spinner naming the method")
        assert "tokens" in screen.split("full attention · ", 1)[1].splitlines()[0]
        pane.keys("C-c")
        screen = pane.wait(
            lambda s: "(answer cancelled)" in s and _prompts(s) == 2, "the cancelled answer and a new prompt"
        )
        assert "Traceback" not in screen and not exit_file.exists()

        # asked again: answered (and the document's KV stored)
        pane.keys(QUESTION, "Enter")
        screen = pane.wait(lambda s: " · cache " in s and _prompts(s) == 3, "the answer and its figures", timeout=600)
        lines = screen.splitlines()
        stats = [i for i, line in enumerate(lines) if " · cache " in line]
        assert len(stats) == 1 and "cache miss" in lines[stats[0]]
        asked = [i for i in range(stats[0]) if lines[i] == f"> {QUESTION}"][-1]
        answer = lines[asked + 1]
        assert answer.strip() and not answer.startswith(">")
        # then its sources, before the figures: lines of the document (a .md has no pages)
        assert any(line.lstrip().startswith("line ") for line in lines[asked + 2 : stats[0]]), screen

        # Up: the last question again (readline history); answered from the stored prefix
        pane.keys("Up")
        pane.wait(lambda s: s.rstrip().splitlines()[-1] == f"> {QUESTION}", "the question recalled by Up")
        pane.keys("Enter")
        screen = pane.wait(lambda s: s.count(" · cache ") == 2 and _prompts(s) == 4, "the second answer")
        lines = screen.splitlines()
        stats = [i for i, line in enumerate(lines) if " · cache " in line]
        assert "cache hit" in lines[stats[1]]
        again = [i for i in range(stats[1]) if lines[i] == f"> {QUESTION}"][-1]
        assert lines[again + 1] == answer  # greedy, same prefix: the same answer

        pane.keys("C-d")
        deadline = time.monotonic() + 60
        while not exit_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert exit_file.read_text().strip() == "0", pane.screen()
        assert QUESTION in (cache / "chat_history").read_text()
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
