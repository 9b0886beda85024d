"""The router: the OpenAI front door that hands requests from prefill to decode workers."""
