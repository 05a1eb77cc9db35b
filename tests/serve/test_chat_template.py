"""The server's checkpoint renders its chat template as transformers does."""

from __future__ import annotations

import pytest

from lathe.data.chat_template import ChatTemplate, ChatTemplateError


def test_checkpoint_template_renders_as_transformers_does(checkpoint):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(checkpoint)
    template = ChatTemplate.from_checkpoint(checkpoint)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi\n"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
    for gen in (True, False):
        assert template.render(messages, add_generation_prompt=gen) == \
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    with pytest.raises(ChatTemplateError, match="role must be system, user, assistant or tool"):
        template.render([{"role": "narrator", "content": "x"}])
