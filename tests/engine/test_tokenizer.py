"""Tokenizer loading (local files only) and chat-template rendering."""

import socket
from pathlib import Path

import pytest

from pagoda.tokenizer import apply_chat_template, get_tokenizer

MODEL_DIR = Path(__file__).resolve().parents[2] / "engine/src/pagoda/assets/models/stories260K"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if tools %}tools: {{ tools | map(attribute='name') | join(',') }}\n{% endif %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the tokenizer tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(MODEL_DIR)


def test_loads_the_local_tokenizer_without_the_network(no_network: None) -> None:
    tokenizer = get_tokenizer(str(MODEL_DIR))
    assert tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert tokenizer.eos_token_id == 2


def test_a_missing_directory_is_a_clear_error_not_a_hub_download(no_network: None, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        get_tokenizer("meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises((OSError, ValueError)):
        get_tokenizer(tmp_path)  # a directory without tokenizer files


def test_unknown_tokenizer_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="tokenizer_mode must be one of auto, slow"):
        get_tokenizer(MODEL_DIR, tokenizer_mode="mistral")


def test_a_model_without_chat_template_needs_one_passed() -> None:
    tokenizer = get_tokenizer(MODEL_DIR)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match=r"this model has no chat template; pass chat_template=\.\.\."):
        apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])


def test_the_builtin_model_turns_a_chat_into_a_story_opening(tokenizer) -> None:
    messages = [{"role": "system", "content": "A story."}, {"role": "user", "content": "Once upon a time"}]
    ids = apply_chat_template(tokenizer, messages)
    assert ids[:2] == [1, 410] and tokenizer.decode(ids) == "<s> A story.\nOnce upon a time"


def test_a_given_chat_template_is_rendered_and_tokenized_once(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Tell a story."}]
    ids = apply_chat_template(tokenizer, messages, chat_template=TEMPLATE)
    rendered = "<s>[system] Be kind.\n[user] Tell a story.\n[assistant]"
    assert ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert ids[0] == 1 and ids[1] != 1  # the template's BOS, not a second one from encode()
    without_prompt = apply_chat_template(tokenizer, messages, chat_template=TEMPLATE, add_generation_prompt=False)
    assert tokenizer.decode(without_prompt).endswith("Tell a story.\n")


def test_the_tokenizers_own_template_is_used_by_default() -> None:
    tokenizer = get_tokenizer(MODEL_DIR)
    tokenizer.chat_template = TEMPLATE
    assert apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}]) == tokenizer.encode(
        "<s>[user] hi\n[assistant]", add_special_tokens=False
    )


def test_tools_reach_the_template(tokenizer) -> None:
    tools = [{"name": "get_weather"}, {"name": "add"}]
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "x"}], chat_template=TEMPLATE, tools=tools)
    assert "tools: get_weather,add" in tokenizer.decode(ids)


def test_text_parts_are_joined(tokenizer) -> None:
    content = [{"type": "text", "text": "Once upon"}, {"type": "text", "text": "a time"}]
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": content}], chat_template=TEMPLATE)
    assert ids == apply_chat_template(
        tokenizer, [{"role": "user", "content": "Once upon\na time"}], chat_template=TEMPLATE
    )


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "messages must be a non-empty list"),
        ([{"content": "no role"}], "message 0 must be a dict with a string 'role'"),
        (["hello"], "message 0 must be a dict"),
        ([{"role": "user", "content": 5}], "message 0: content must be a string or a list of text parts"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "only text content parts are supported, got a 'image_url' part",
        ),
    ],
)
def test_bad_messages_raise_value_error(tokenizer, messages: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        apply_chat_template(tokenizer, messages, chat_template=TEMPLATE)
