"""Kubernetes operator for Pagoda model servers (the operator itself arrives with the operator issue)."""

__version__ = "0.1.0"
