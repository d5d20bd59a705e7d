"""The OpenAI-compatible HTTP front (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``).

Owns: ``http`` (the aiohttp server and handlers, SSE streaming), ``request`` (OpenAI JSON -> the core's
request and parameters, with 400s naming the field), ``logprobs`` (OpenAI's logprobs shapes). May import the
serving core (frontend, relay, errors) and engine's torch-free modules; not ``router.admin``.
"""
