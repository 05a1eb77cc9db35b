"""The Responses API's stored responses: what `store` keeps, `previous_response_id`
continues, GET / DELETE /v1/responses/{id} read and remove and GET
/v1/responses/{id}/input_items lists — in the server's memory, bounded.

Each entry is one response with its own input items (the ones its request sent, without
the instructions, which OpenAI does not carry over) and the id of the response it
continued. A conversation is rebuilt by walking that chain back, so an agent's long run
holds each turn once, not its whole history again at every turn. The oldest entries go
first once more than `max_responses` are held or their JSON passes `max_bytes`; a
chain that reaches a response no longer held names that response."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


class MissingResponse(KeyError):
    """A response a chain needs is not held (never stored, deleted or evicted)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    previous_id: str | None
    size: int  # bytes of its JSON


class ResponseStore:
    def __init__(self, max_responses: int, max_bytes: int) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]],
            previous_id: str | None) -> bool:
        """Keep `response`; False when it alone is larger than the whole store."""
        size = len(json.dumps(response)) + len(json.dumps(input_items))
        if size > self.max_bytes:
            return False
        with self._lock:
            replaced = self._entries.pop(response["id"], None)  # a background one's update
            if replaced is not None:
                self._bytes -= replaced.size
            self._entries[response["id"]] = StoredResponse(response, input_items, previous_id,
                                                           size)
            self._bytes += size
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                _, oldest = self._entries.popitem(last=False)
                self._bytes -= oldest.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, marked as recently used (a conversation in use stays)."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self._bytes -= entry.size
            return entry is not None

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The items of the chain ending at `response_id`, oldest first: each response's
        input items, then its output items. MissingResponse names the first link not held."""
        chain = []
        link: str | None = response_id
        while link is not None:
            entry = self.get(link)
            if entry is None:
                raise MissingResponse(link)
            chain.append(entry)
            link = entry.previous_id
        return [item for entry in reversed(chain)
                for item in (*entry.input_items, *entry.response["output"])]
