"""The router: the OpenAI front door that picks workers and hands requests from prefill to decode.

Modules, one noun each: `config` (settings), `policy` (worker choice, pure functions), `discovery`
(static list, DNS) and `endpointslices` (the Kubernetes API) for where workers are, `pool` (a
pool's workers, readiness and load), `upstream` (the shared HTTP client, SSE framing, load
polls), `dispatch` (one request: choose, retry, relay), `metrics`, `app` (FastAPI) and `cli`
(`phasefleet router`). See docs/router.md.
"""
