"""Request routing: a small scheduling framework (PreFilter, Filter, Score, Pick, Reserve) over a FleetView.

`framework.py` holds the cycle runner and the extension-point Protocols, `reasons.py` the reason enums
and the reject table, `filters.py` / `scorers.py` / `pickers.py` the plugins, `profiles.py` the policies
and the P/D decider, `config.py` the pydantic config and `build_router`. See docs/routing.md.
"""
