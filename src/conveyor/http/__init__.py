"""The HTTP face of Conveyor: an OpenAI-compatible API and the Prometheus scrape endpoint.

It runs as a process of its own (``http``, started by bin/serve with ``--http-port`` or
``--metrics-port``) that is a client of the frontend over the client protocol, so HTTP
parsing and JSON/SSE encoding never run on the frontend's event loop, and the frontend stays
the one place requests are validated. Modules: :mod:`.main` (the process), :mod:`.app` (the
aiohttp applications and routes), :mod:`.request_fields` (every request field's
treatment), :mod:`.openai_requests` (OpenAI bodies -> generate fields, by that table),
:mod:`.generation` (the completion handlers: streamed and not),
:mod:`.openai_responses` (response objects and SSE chunks), :mod:`.errors` (the OpenAI
error object and status mapping), :mod:`.link` (the frontend link: client, readiness,
serialized queries), :mod:`.prometheus` (the exposition).
"""
