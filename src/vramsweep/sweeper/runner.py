"""``python -m vramsweep.sweeper.runner --overhead [--n 5] [--isolation fork spawn]``: the per-trial overhead
probe (:mod:`.overhead`).

Only the command-line entry lives here and nothing imports this module: trial processes (fork server,
spawn) re-run the main module, and runpy warns when it finds the module already imported.
"""

from __future__ import annotations

import sys

from vramsweep.sweeper.overhead import main, measure_overhead, noop_trial  # noqa: F401 - the probe's API

if __name__ == "__main__":
    sys.exit(main())
