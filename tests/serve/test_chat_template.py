"""The server renders the checkpoint's Jinja chat template exactly like lathe's formatter."""

from __future__ import annotations

import pytest

from lathe.data.chat import format_chat
from lathe.data.chat_template import ChatTemplate, ChatTemplateError


def test_checkpoint_template_matches_the_python_formatter(checkpoint):
    template = ChatTemplate.from_checkpoint(checkpoint)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi\n"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
    assert template.render(messages) == format_chat(messages, add_generation_prompt=True)
    assert template.render(messages, add_generation_prompt=False) == format_chat(messages)
    with pytest.raises(ChatTemplateError, match="role must be system, user or assistant"):
        template.render([{"role": "tool", "content": "x"}])
