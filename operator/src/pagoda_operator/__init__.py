"""Kubernetes operator for Pagoda model servers (run with ``kopf run -m pagoda_operator.main`` or
``python -m pagoda_operator.run``)."""

from pagoda_operator.version import __version__

__all__ = ["__version__"]
