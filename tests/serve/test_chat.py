"""`lathe chat`: the conversation loop's commands and history, locally and against a server."""

from __future__ import annotations

from lathe.serve.chat import LocalChat, chat_loop
from lathe.serve.sampling_params import SamplingParams

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 4, "seed": None}


class Recording(LocalChat):
    """The real local backend, remembering the conversations it was sent."""

    def __init__(self, checkpoint):
        super().__init__(checkpoint)
        self.sent: list[list[dict[str, str]]] = []

    def reply(self, messages, sampling):
        self.sent.append([dict(m) for m in messages])
        yield from super().reply(messages, sampling)


def test_history_reset_and_system_commands(checkpoint):
    backend = Recording(checkpoint)
    lines = iter(["Hello", "again", "/reset", "/system Be brief.", "new topic", "/quit"])
    written: list[str] = []
    history = chat_loop(backend, GREEDY, None, read=lambda _: next(lines),
                        write=written.append)
    first, second, third = backend.sent
    assert [m["content"] for m in first] == ["Hello"]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    engine = backend.engine
    expected = engine.generate([backend.encoder.prompt(first)],
                               SamplingParams(**GREEDY))[0].outputs[0].text
    assert second[1]["content"] == expected
    assert third == [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "new topic"}]
    assert [m["role"] for m in history] == ["user", "assistant"]
    assert "(conversation cleared)\n" in written and backend.engine.block_manager.usage == 0
