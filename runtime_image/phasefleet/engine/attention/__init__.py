"""Paged attention: metadata built once per step, and the backends that read the KV pool."""
