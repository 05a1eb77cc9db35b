"""The Responses API's store: bounded by count and bytes, oldest dropped first, a
conversation rebuilt along its chain, a missing link named."""

from __future__ import annotations

import pytest

from lathe.serve.response_store import MissingResponse, ResponseStore


def response(response_id: str, text: str) -> dict:
    return {"id": response_id, "object": "response",
            "output": [{"type": "message", "role": "assistant", "content": text}]}


def said(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def test_a_conversation_is_its_chain_of_inputs_and_outputs_oldest_first():
    store = ResponseStore(max_responses=10, max_bytes=1 << 20)
    store.put(response("a", "A1"), [said("q1")], None)
    store.put(response("b", "A2"), [said("q2"), said("q2b")], "a")
    store.put(response("c", "A3"), [said("q3")], "b")
    assert [item["content"] for item in store.conversation("c")] == [
        "q1", "A1", "q2", "q2b", "A2", "q3", "A3"]
    assert [item["content"] for item in store.conversation("a")] == ["q1", "A1"]
    assert store.delete("b") and not store.delete("b")
    with pytest.raises(MissingResponse) as missing:
        store.conversation("c")
    assert missing.value.response_id == "b"


def test_the_oldest_go_first_past_the_count_or_the_bytes_and_use_keeps_one():
    store = ResponseStore(max_responses=3, max_bytes=1 << 20)
    for name in "abc":
        store.put(response(name, name), [said(name)], None)
    assert store.get("a") is not None  # used: now the newest
    store.put(response("d", "d"), [said("d")], None)
    assert [name for name in "abcd" if store.get(name)] == ["a", "c", "d"]
    small = ResponseStore(max_responses=100, max_bytes=600)
    for name in "wxyz":
        assert small.put(response(name, name * 100), [said(name)], None)
    assert len(small) == 2 and small.get("z") and small.get("y") and not small.get("x")
    assert not small.put(response("huge", "h" * 1000), [], None)  # alone past the bound
    assert small.get("huge") is None and len(small) == 2
