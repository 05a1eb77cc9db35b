"""lathe's own chat format: the special tokens a lathe tokenizer is trained with and the
Jinja template it ships in `tokenizer_config.json`. Nothing renders it specially: every
stage renders whatever template its checkpoint carries (`lathe.data.chat_template`), and
this is simply the one lathe's checkpoints carry.

    <|begin_of_text|><|system|>\nYou are terse.<|end_of_turn|><|user|>\nHi<|end_of_turn|>
    <|assistant|>\nHello.<|end_of_turn|>

(one line in reality). A generation prompt is `<|assistant|>\n`; a model's turn ends
with `<|end_of_turn|>`, which is therefore the chat EOS token.
"""

from __future__ import annotations

BOS = "<|begin_of_text|>"
END_OF_TURN = "<|end_of_turn|>"
PAD = "<|pad|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = [BOS, END_OF_TURN, PAD] + [f"<|{role}|>" for role in ROLES]


CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '" + END_OF_TURN + "' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
