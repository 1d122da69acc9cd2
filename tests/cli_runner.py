"""Run ``kvcli`` in-process, as the tests of every command do."""

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
