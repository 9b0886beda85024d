"""One worker's HTTP server: the OpenAI API and the internal prefill/decode endpoints."""
