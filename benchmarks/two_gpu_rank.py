"""One rank of benchmarks/two_gpu_check.sh under torchrun: the CLI's ``run``, plus per-rank changes.

``torchrun --nproc-per-node 2 benchmarks/two_gpu_rank.py EXITDIR [--on-rank R "FLAGS"]... [--stall-rank R SECONDS] -- run ...``

- ``--on-rank R "FLAGS"``: rank R appends FLAGS (split on spaces) to the ``run`` arguments (a per-rank divergence).
- ``--stall-rank R SECONDS``: rank R sleeps SECONDS on entering resolve (its heartbeats say
  ``doing: injected sleep (two_gpu_check)``), so the other rank's wait must name it ``rank_stalled``.

Each rank writes its exit code to EXITDIR/exit.rank<R> and then leaves with status 0, so torchrun does
not tear the other rank down before it has written its own last records.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str]) -> None:
    exitdir, rest = Path(argv[0]), argv[1:]
    cut = rest.index("--")
    opts, cli = rest[:cut], rest[cut + 1:]
    rank = int(os.environ.get("RANK", "0"))
    i = 0
    while i < len(opts):
        if opts[i] == "--on-rank":
            if int(opts[i + 1]) == rank:
                cli += opts[i + 2].split()
            i += 3
        elif opts[i] == "--stall-rank":
            if int(opts[i + 1]) == rank:
                _stall_in_resolve(float(opts[i + 2]))
            i += 3
        else:
            raise SystemExit(f"unknown option {opts[i]!r}")
    from pipeline.cli import main as cli_main

    code = cli_main(cli)
    exitdir.mkdir(parents=True, exist_ok=True)
    (exitdir / f"exit.rank{rank}").write_text(str(code))
    sys.stdout.flush()
    os._exit(0)


def _stall_in_resolve(seconds: float) -> None:
    """Sleep ``seconds`` on entering resolve's decision (``states.resolve.decide_for_run``, which the setup table
    calls in state resolve), with heartbeats saying ``doing: injected sleep (two_gpu_check)``."""
    from pipeline.core.heartbeat import doing
    from states import resolve

    real = resolve.decide_for_run

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003 - the decision's own arguments, passed on
        with doing("injected sleep (two_gpu_check)"):
            time.sleep(seconds)
        return real(*args, **kwargs)

    resolve.decide_for_run = slow


if __name__ == "__main__":
    main(sys.argv[1:])
