"""lathe's own chat format: the special tokens a lathe tokenizer is trained with and the
Jinja template it ships in `tokenizer_config.json`. Nothing renders it specially: every
stage renders whatever template its checkpoint carries (`lathe.data.chat_template`), and
this is simply the one lathe's checkpoints carry.

    <|begin_of_text|><|system|>\nYou are terse.<|end_of_turn|><|user|>\nHi<|end_of_turn|>
    <|assistant|>\nHello.<|end_of_turn|>

(one line in reality). A generation prompt is `<|assistant|>\n`; a model's turn ends
with `<|end_of_turn|>`, which is therefore the chat EOS token.

Tools follow Hermes/Qwen's convention (the server's `hermes` tool-call parser reads them):
a request's tools are listed one JSON definition a line in the system turn; an assistant
calls them as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks after
any text; a tool's result comes back in a user turn as `<tool_response>\n...\n
</tool_response>`. So tool use needs no special tokens beyond the six above.
"""

from __future__ import annotations

BOS = "<|begin_of_text|>"
END_OF_TURN = "<|end_of_turn|>"
PAD = "<|pad|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = [BOS, END_OF_TURN, PAD] + [f"<|{role}|>" for role in ROLES]


CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set conversation = messages %}"
    "{% if tools %}"
    "{{ '<|system|>\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\\n\\n' }}{% set conversation = messages[1:] %}"
    "{% endif %}"
    "{{ 'Tools:' }}"
    "{% for tool in tools %}"
    "{{ '\\n' }}{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}"
    "{% endfor %}"
    "{{ '" + END_OF_TURN + "' }}"
    "{% endif %}"
    "{% for message in conversation %}"
    "{% if message['role'] in ['system', 'user'] %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '" + END_OF_TURN + "' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' }}{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\\\"name\\\": ' + call['name'] | tojson + ', \\\"arguments\\\": ' }}"
    "{{ call['arguments'] if call['arguments'] is string else call['arguments'] | tojson }}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '" + END_OF_TURN + "' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|user|>\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>"
    + END_OF_TURN + "' }}"
    "{% else %}"
    "{{ raise_exception('role must be system, user, assistant or tool, got ' + "
    "message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
