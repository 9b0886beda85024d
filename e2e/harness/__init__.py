"""A real Kubernetes control plane on this machine for end-to-end tests."""
