"""Floor 2: online decisions as pure, synchronous policies (no I/O, no clock; `now` and an RNG come in)."""
