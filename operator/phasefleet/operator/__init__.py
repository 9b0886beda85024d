"""The kopf operator: handlers, child-resource builders and status."""
