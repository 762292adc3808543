"""The capture endpoint: an OpenAI-compatible HTTP server over a Tinker sampling client that
writes every returned sequence to the capture store (``prefect-tinker capture serve``).

Modules: :mod:`.requests` (request validation, OpenAI errors, chat messages for the renderer),
:mod:`.model` (sampling client, tokenizer, renderer, context), :mod:`.generate` (chat and
completions -> choices, usage, capture rows), :mod:`.responses` (JSON and SSE bodies),
:mod:`.recorder` (the timed-flush writer thread), :mod:`.app` (FastAPI routes and auth),
:mod:`prefect_tinker.cli.capture` (the command line). Reading captures back as training conversations:
:func:`prefect_tinker.recipes.capture_data.read_captured_conversations`.
"""
