"""One module per `mosaic` sub-command; each exposes `register(app: typer.Typer) -> None`."""
