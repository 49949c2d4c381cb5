"""Observability, apart from the engine it watches (as vLLM's v1/metrics): the engine's counters
and step observers (stats.py), the step tracer and its rendering (tracer.py, trace_render.py),
the web page's engine view (engine_view.py) and the Prometheus metrics (prometheus.py).

Layering: the engine imports this package; this package reads the core's scheduler and block
manager but never imports the engine.
"""
