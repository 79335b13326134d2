"""Fixtures shared by the engine tests."""

import pytest
from tiny_checkpoints import TinyCheckpoints, session_checkpoints


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    """Tiny random-weight Llama/Mistral/Qwen2/Qwen3 checkpoints, each built once per session."""
    return session_checkpoints(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_chat_qwen3(tmp_path_factory: pytest.TempPathFactory):
    """The directory (a ``Path``) of a tiny random-weight Qwen3 with a byte-level BPE tokenizer and a
    Qwen-style chat template (see ``tiny_chat_model``), built once per session."""
    from tiny_chat_model import build_tiny_chat_qwen3

    return build_tiny_chat_qwen3(tmp_path_factory.mktemp("tiny_chat_qwen3"))
