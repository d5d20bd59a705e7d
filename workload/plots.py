"""matplotlib for the plots of the benches and the simulator: an optional dependency (the ``bench`` extra).

Every plotting function starts with ``plt = pyplot()`` and returns its "no plot" value (None, False, []) when that
is None, so the runtime and the benches without ``--plot`` work without matplotlib. Nothing here or in a caller
imports matplotlib at import time."""

from __future__ import annotations

import sys
from types import ModuleType

MISSING = "no plot: matplotlib is not installed (pip install 'baton[bench]')"


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (files only, no display), or None with one line
    on stderr when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print(MISSING, file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
