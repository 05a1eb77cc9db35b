"""lathe.serve: the inference engine (scheduler, paged KV cache, sampling), quantization,
the OpenAI-compatible HTTP server, the chat CLI and exports (see DESIGN.md). Never imports
a training package."""
