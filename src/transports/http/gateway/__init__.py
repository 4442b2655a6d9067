"""The gateway between a parsed HTTP request and a pipeline: keys, the served models and their
supervision, the window fit, admission.

Modules: ``gateway`` (:class:`~transports.http.gateway.gateway.Gateway`, which holds the
others), ``door`` (what is decided before a body is parsed, refusals and retry waits).
"""
