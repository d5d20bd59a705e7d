"""Engine core: request lifecycle, block accounting and scheduling. Plain Python, no torch."""
