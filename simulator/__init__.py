"""Floor 3: a vLLM engine model timed by the perf model; an HTTP worker face and a cluster-simulator face."""
