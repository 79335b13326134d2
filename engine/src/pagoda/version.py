"""The package version, in a module of its own: the engine's modules (the server's ``/version``, the capability
contract) read it without importing the ``pagoda`` facade above them, and the build reads it statically
(``engine/pyproject.toml``'s dynamic version)."""

__version__ = "0.1.0"
