"""Floor 4: the FastAPI gateway, its config, worker registry, discovery and the `mosaic` CLI."""
