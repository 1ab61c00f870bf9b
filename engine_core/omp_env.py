"""Settings an engine process needs before torch loads (torch-free, so a launcher or the
engine bench can apply them first)."""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

# How long torch's OpenMP threads (libgomp) spin for the next parallel region before they
# sleep: 300,000 rounds by default, milliseconds during which a waiting thread holds a core
# that the API server and the engine's own Python need. zserve on 2 cores, standard load,
# 3 alternating rounds (BENCHMARKS.md §1): 10,000 rounds against the default, c=1 477 vs
# 473 out tok/s, c=32 3711 vs 3626, c=128 5671 vs 4974 (ITL p99 44 vs 57 ms); 3,000 made
# c=1 slower (411), no spin at all a batch-1 decode step 1.55 -> 3.45 ms.
ENGINE_GOMP_SPINCOUNT = "10000"


def set_up_engine_threads() -> None:
    """Before torch loads in an engine process: libgomp's spin, unless the user chose
    one (GOMP_SPINCOUNT or OMP_WAIT_POLICY in the environment)."""
    if "torch" in sys.modules:
        log.warning("torch was loaded before the engine's thread settings; GOMP_SPINCOUNT unset")
        return
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = ENGINE_GOMP_SPINCOUNT
