"""Pipeline-parallel fan-out: typed messages, CurveZMQ transport, the ordered
decision stream and the group view (protocol in docs/pp.md)."""
