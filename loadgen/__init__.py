"""Floor 1: trace readers and synthesis, the async OpenAI streaming client, metrics, reports, plots."""
