"""The HTTP server: routes and request flow, uvicorn and its wire protocols, deadlines, limits,
the request-side pool, the error map, settings and health.

Modules: ``app`` (routes and request flow), ``generation`` (a request's choices started, and
its answer or stream encoder), ``choices`` (``n`` generations per request), ``inbox`` (a
choice's deltas with keep-alive pings), ``server`` (uvicorn), ``wire`` (below the app, in
uvicorn's protocols), ``timeouts`` (read deadlines), ``limits`` (what one request may ask for),
``work`` (the bounded request-side pool), ``errors`` (the one map from the exception tree to
statuses and bodies), ``config`` (settings and API keys), ``health``.
"""
