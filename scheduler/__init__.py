"""The scheduler service (DESIGN §6): telemetry windows, circuit breakers, rebalancing.

- :mod:`scheduler.windows` — worker telemetry → one sample per group per tick, sliding windows.
- :mod:`scheduler.breaker` — the per-group breaker, a pure state machine.
- :mod:`scheduler.rebalancer` — desired replicas and replica moves, a pure decision.
- :mod:`scheduler.history` — hour-of-week demand history (``history.<group>``).
- :mod:`scheduler.lease` — which replica acts (``sched.lease``).
- :mod:`scheduler.records` — the ``breaker.<group>`` / ``desired.<group>`` values.
- :mod:`scheduler.alerts`, :mod:`scheduler.metrics` — alerts and ``qos_*`` metrics.
- :mod:`scheduler.service` — the NATS loop that ties them together; ``python -m scheduler``.
"""
