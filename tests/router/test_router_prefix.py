"""The router's view of a prompt: one canonical text per request body, and chain hashes of its full chunks."""

from __future__ import annotations

import time

import pytest

from pagoda_operator.router.prefix import chunk_hashes, prompt_text

SYSTEM = "You are a careful assistant. " * 20


def chat(*messages: tuple[str, object], **extra: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": role, "content": content} for role, content in messages], **extra}


def test_a_conversation_that_grows_keeps_its_text_as_a_prefix() -> None:
    first = prompt_text("/v1/chat/completions", chat(("system", SYSTEM), ("user", "hi")))
    longer = prompt_text(
        "/v1/chat/completions", chat(("system", SYSTEM), ("user", "hi"), ("assistant", "hello"), ("user", "more"))
    )
    assert SYSTEM in first and "hi" in first
    assert longer.startswith(first)


def test_roles_contents_and_tools_all_shape_the_chat_text() -> None:
    base = prompt_text("/v1/chat/completions", chat(("user", "hi")))
    assert prompt_text("/v1/chat/completions", chat(("assistant", "hi"))) != base
    assert prompt_text("/v1/chat/completions", chat(("user", "ho"))) != base
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    with_tools = prompt_text("/v1/chat/completions", chat(("user", "hi"), tools=tools))
    assert "lookup" in with_tools and with_tools.index("lookup") < with_tools.index("hi")


def test_text_parts_read_as_their_text_and_other_parts_still_count() -> None:
    parts = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]
    text = prompt_text("/v1/chat/completions", chat(("user", parts)))
    assert "describe" in text and "http://x/a.png" in text
    other_image = [parts[0], {"type": "image_url", "image_url": {"url": "http://x/b.png"}}]
    assert prompt_text("/v1/chat/completions", chat(("user", other_image))) != text


def test_completions_prompts_strings_batches_and_token_ids() -> None:
    assert prompt_text("/v1/completions", {"prompt": "once upon"}) == "once upon"
    assert prompt_text("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert prompt_text("/v1/completions", {"prompt": [1, 22, 333]}) == "1 22 333"
    assert prompt_text("/v1/completions", {"prompt": [[5, 6], [7]]}) == "5 6"


def test_responses_put_the_instructions_before_the_input() -> None:
    text = prompt_text("/v1/responses", {"instructions": "be brief", "input": "what is 2+2"})
    assert text.index("be brief") < text.index("what is 2+2")
    items = prompt_text(
        "/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "q"}]}]}
    )
    assert "q" in items and "user" in items


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/models", {"prompt": "x"}),
        ("/v1/completions", {"prompt": 7}),
        ("/v1/completions", {}),
        ("/v1/chat/completions", {"messages": "not a list"}),
        ("/v1/chat/completions", {"messages": [None, 3, {"role": 1, "content": {"weird": object()}}]}),
        ("/v1/responses", {"input": 3.5}),
        ("/v1/chat/completions", []),
    ],
)
def test_odd_bodies_never_raise(path: str, body: object) -> None:
    assert isinstance(prompt_text(path, body), str)  # type: ignore[arg-type]


def test_paths_with_query_strings_and_trailing_slashes_are_the_same_route() -> None:
    assert prompt_text("/v1/completions/?x=1", {"prompt": "p"}) == "p"


def test_only_full_chunks_are_hashed() -> None:
    assert chunk_hashes("a" * 127, 128) == []
    assert len(chunk_hashes("a" * 128, 128)) == 1
    assert len(chunk_hashes("a" * 1000, 128)) == 7


def test_each_hash_commits_to_everything_before_it() -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(128 * 6))
    other = text[:100] + "Z" + text[101:]  # differs inside the first chunk only
    same_start = text[: 128 * 3] + "Q" * (128 * 3)
    hashes = chunk_hashes(text, 128)
    assert all(a != b for a, b in zip(hashes, chunk_hashes(other, 128), strict=True))
    assert chunk_hashes(same_start, 128)[:3] == hashes[:3]
    assert chunk_hashes(same_start, 128)[3:] != hashes[3:]
    # the same chunk at another position gets another hash: identical chunks never alias
    repeated = chunk_hashes("x" * 256, 128)
    assert repeated[0] != repeated[1]
    assert all(0 <= value < 2**64 for value in hashes)


def test_chunk_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        chunk_hashes("abc", 0)


def test_hashing_a_long_prompt_is_fast() -> None:
    text = "lorem ipsum dolor sit amet " * 40_000  # ~1 MB, ~8400 chunks
    start = time.perf_counter()
    hashes = chunk_hashes(text, 128)
    assert len(hashes) == len(text) // 128
    assert time.perf_counter() - start < 0.5
