"""Autoscaling: a pure policy, metric sources and actuators."""
