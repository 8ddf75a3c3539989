"""Request routing: a small scheduling framework (PreFilter, Filter, Score, Pick, Reserve) over a FleetView.

`framework.py` holds the cycle runner and the extension-point Protocols, `reasons.py` the reason enums
and the reject table, `filters.py` / `scorers.py` / `pickers.py` the plugins, `profiles.py` the policies
and the P/D decider, `config.py` the pydantic config and `build_router`. See docs/routing.md.
"""

from scheduler.routing.config import RoutingConfig, RoutingConfigError, build_router, parse_routing_config
from scheduler.routing.framework import (
    Decision,
    Filter,
    FitChecker,
    Picker,
    PreFilter,
    Reservation,
    ReservePlugin,
    Router,
    RouteRequest,
    Scorer,
)
from scheduler.routing.prefix import block_hashes, text_block_hashes
from scheduler.routing.reasons import REJECT_TABLE, FilterReason, Outcome, Reject, RejectRule

__all__ = [
    "REJECT_TABLE",
    "Decision",
    "Filter",
    "FilterReason",
    "FitChecker",
    "Outcome",
    "Picker",
    "PreFilter",
    "Reject",
    "RejectRule",
    "Reservation",
    "ReservePlugin",
    "RouteRequest",
    "Router",
    "RoutingConfig",
    "RoutingConfigError",
    "Scorer",
    "block_hashes",
    "build_router",
    "parse_routing_config",
    "text_block_hashes",
]
