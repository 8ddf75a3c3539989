"""KV budget reservation: footprint model, ledger (the router's Reserve step), batch admission. docs/kv.md."""
