"""Actuators carry out scaling decisions. They are the only I/O in `scheduler/` (DESIGN.md).

`kubernetes` patches the scale subresource of each pool's Deployment; `dry-run` only records. The
`embedded` actuator (start/stop simulated workers inside the live gateway) lives in `server/`, the floor
that owns the worker processes.
"""
