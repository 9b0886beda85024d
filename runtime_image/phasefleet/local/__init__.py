"""`phasefleet serve`: router, workers and autoscaler as local processes."""
