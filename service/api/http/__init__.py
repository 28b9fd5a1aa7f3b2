"""OpenAI-compatible HTTP beside gRPC, over the same :class:`~switchyard.service.api.server.DecodeApp`:
``app.py`` (the routes, the server's life), ``openai_api.py`` (requests into RequestSpecs, responses
and chunks as OpenAI shapes them), ``sse.py`` (server-sent events), ``chat_template.py`` (a
checkpoint's chat template), ``errors.py`` (errors as OpenAI-shaped JSON with their HTTP status),
``metrics.py`` (Prometheus ``/metrics``)."""
