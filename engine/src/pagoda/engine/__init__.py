"""The step-level engine, output processing and detokenization."""
