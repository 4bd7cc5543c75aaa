"""`python -m phalanx <command>`: the same as the `phalanx` console script."""

from __future__ import annotations

from phalanx.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
