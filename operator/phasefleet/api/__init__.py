"""The InferenceService API (serving.phasefleet.dev/v1alpha1): pydantic models, CRD."""
