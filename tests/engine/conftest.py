"""Fixtures shared by the engine tests."""

import pytest
from tiny_checkpoints import TinyCheckpoints, session_checkpoints


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    """Tiny random-weight Llama/Mistral/Qwen2/Qwen3 checkpoints, each built once per session."""
    return session_checkpoints(tmp_path_factory)
