"""Run ``kvcli`` in-process, as the tests of every command do, and check what it printed."""

from __future__ import annotations

import sys

from kvcli.cli import main


def run_cli(args, capsys, monkeypatch) -> tuple[int, str, str]:
    """Run ``kvcli *args`` in-process; return (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["kvcli", *map(str, args)])
    capsys.readouterr()  # drop whatever an earlier step printed
    try:
        main()
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:  # sys.exit("message"): Python prints it and exits 1
            print(e.code, file=sys.stderr)
            code = 1
    out, err = capsys.readouterr()
    return code, out, err


HEAVY = ("torch", "transformers")  # what a model's run needs and help does not (~4 s to import on 2 cores)


def heavy_imports(args, env: dict | None = None):
    """Run ``python -X importtime -m kvcli *args`` in a new process: (the finished process, the
    modules of PyTorch or transformers it imported)."""
    import os
    import subprocess

    env = {**os.environ, "COLUMNS": "100", **(env or {})}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kvcli", *map(str, args)], capture_output=True, text=True, env=env
    )
    modules = [line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert done.returncode != 0 or "kvcli.cli" in modules  # the import times are there at all
    return done, [m for m in modules if m.split(".")[0] in HEAVY]


PNG = b"\x89PNG\r\n\x1a\n"


def assert_png(path) -> None:
    assert path.is_file() and path.stat().st_size > 1000, path
    assert path.read_bytes()[:8] == PNG, path


def assert_one_line_error(result, code, *needles) -> None:
    """``result`` of ``cli(...)``: exit ``code``, nothing on stdout, one ``kvcli: error:`` line
    on stderr holding every needle."""
    got, out, err = result
    assert got == code, (got, out, err)
    assert out == "" and "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcli: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def assert_user_error(result, code: int, *needles: str) -> str:
    """Exit ``code``, nothing on stdout, stderr one line ``kvcli: error: ...`` containing ``needles``."""
    got, out, err = result
    assert "Traceback" not in out + err
    assert got == code, (got, out, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith("kvcli: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]
