"""Tensor parallelism: one worker's model split over N ranks, one process per device."""
