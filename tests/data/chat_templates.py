"""Chat templates written in the style of the open families' own, for the tests: each with
`{% generation %}` blocks around what the assistant writes (as TRL's training templates
have them), from which `plain()` gives the same template without them (as the checkpoints
ship it). Each keeps the trait of its family that masking has to survive."""

from __future__ import annotations

from tokenizers import Tokenizer

GEN, END = "{% generation %}", "{% endgeneration %}"

# Qwen's assistant turn after its header (the content, calls as <tool_call> JSON, the end)
# and its tool results inside a user turn
QWEN_CALLS = (
    "{{- message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' "
    "+ call.function.arguments | tojson + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}" + END + "{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content "
    "+ '\\n</tool_response><|im_end|>\\n' }}"
)

# Qwen3-Coder's assistant turn: calls as <function=...> markup, a string parameter written
# as itself and any other as JSON (Qwen3.6's way)
QWEN_XML_CALLS = QWEN_CALLS.replace(
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' "
    "+ call.function.arguments | tojson + '}\\n</tool_call>' }}",
    "{{- '\\n<tool_call>\\n<function=' + call.function.name + '>\\n' }}"
    "{%- for key, value in call.function.arguments.items() %}"
    "{{- '<parameter=' + key + '>\\n' + (value if value is string else value | tojson) "
    "+ '\\n</parameter>\\n' }}"
    "{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}")

# Qwen2.5: ChatML turns, a default system prompt, tools listed in the system turn, calls as
# <tool_call> JSON, tool results inside a user turn
CHATML = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' + (messages[0].content if messages[0].role == 'system' "
    "else 'You are a helpful assistant.') + '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not tools %}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}" + GEN + QWEN_CALLS +
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN3_CODER = CHATML.replace(QWEN_CALLS, QWEN_XML_CALLS)
assert "<parameter=" in QWEN3_CODER  # the calls above were found and replaced

# Qwen3: ChatML with reasoning and Qwen2.5's tools; a turn after the last user message
# (tool results are not one) shows its <think> block (an empty one when it is the last
# turn), earlier turns drop theirs; enable_thinking=false puts an empty block in the
# generation prompt
QWEN3 = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' + (messages[0].content + '\\n\\n' if messages[0].role == "
    "'system' else '') + '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}" + GEN +
    "{%- if loop.index0 > ns.last_user and (loop.last or message.reasoning_content) %}"
    "{{- '<think>\\n' + (message.reasoning_content or '') + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    + QWEN_CALLS +
    "{%- elif not (message.role == 'system' and tools) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# Llama 3: BOS from the template, header tokens, trimmed contents, <|eot_id|>
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
    "{%- if message.role == 'assistant' %}"
    + GEN + "{{- message.content | trim + '<|eot_id|>' }}" + END +
    "{%- else %}{{- message.content | trim + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Gemma: BOS, the system prompt folded into the first user turn, the assistant called
# "model", roles that must alternate
GEMMA = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}"
    "{%- set first = messages[0].content + '\\n\\n' %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set first = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- for message in turns %}"
    "{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{%- endif %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<start_of_turn>model\\n' }}" + GEN
    + "{{- message.content | trim + '<end_of_turn>' }}" + END + "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<start_of_turn>user\\n' + (first if loop.first else '') + message.content | trim "
    "+ '<end_of_turn>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

# Phi-3: <|role|> headers and <|end|>, and the end-of-text token after a conversation that
# does not ask for a reply
PHI3 = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|assistant|>\\n' }}" + GEN + "{{- message.content + '<|end|>' }}" + END
    + "{{- '\\n' }}"
    "{%- else %}{{- '<|' + message.role + '|>\\n' + message.content + '<|end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- else %}{{- eos_token }}"
    "{%- endif %}"
)

# Mistral v0.3: [INST] turns with no generation prompt, replies closed by EOS, and the
# system prompt joined to the last user message only
MISTRAL = (
    "{%- if messages[0].role == 'system' %}"
    "{%- set system = messages[0].content %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set turns = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in turns %}"
    "{%- if message.role == 'user' %}"
    "{%- if loop.last and system is defined %}"
    "{{- '[INST] ' + system + '\\n\\n' + message.content + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message.content + '[/INST]' }}{%- endif %}"
    "{%- elif message.role == 'assistant' %}"
    + GEN + "{{- ' ' + message.content + eos_token }}" + END +
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported') }}"
    "{%- endif %}"
    "{%- endfor %}"
)

# Mistral-Nemo: [INST] turns with no space before a reply, the tools listed before the
# last user message, calls as a [TOOL_CALLS] JSON list closed by EOS, results in
# [TOOL_RESULTS]; the system prompt joins the last user message only where the conversation
# ends on it, and user and assistant turns must alternate, calls and results aside
MISTRAL_NEMO = (
    "{%- if messages[0].role == 'system' %}"
    "{%- set system = messages[0].content %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set turns = messages %}{%- endif %}"
    "{%- set users = turns | selectattr('role', 'equalto', 'user') | list %}"
    "{%- set ns = namespace(index=0) %}"
    "{%- for message in turns if message.role != 'tool' and not message.tool_calls %}"
    "{%- if (message.role == 'user') != (ns.index % 2 == 0) %}"
    "{{- raise_exception('user and assistant turns must alternate') }}{%- endif %}"
    "{%- set ns.index = ns.index + 1 %}"
    "{%- endfor %}"
    "{{- bos_token }}"
    "{%- for message in turns %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and message == users[-1] %}"
    "{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- if loop.last and system is defined %}"
    "{{- '[INST]' + system + '\\n\\n' + message.content + '[/INST]' }}"
    "{%- else %}{{- '[INST]' + message.content + '[/INST]' }}{%- endif %}"
    "{%- elif message.tool_calls %}"
    + GEN + "{{- '[TOOL_CALLS]' + message.tool_calls | map(attribute='function') | list "
    "| tojson + eos_token }}" + END +
    "{%- elif message.role == 'assistant' %}"
    + GEN + "{{- message.content + eos_token }}" + END +
    "{%- elif message.role == 'tool' %}"
    "{{- '[TOOL_RESULTS]{\"content\": ' + message.content + ', \"call_id\": \"' "
    "+ message.tool_call_id + '\"}[/TOOL_RESULTS]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)

# Mistral Small 3.2 (Magistral, Devstral): [INST] turns, the tools before the last user
# message, each call as [TOOL_CALLS]name[ARGS] and its arguments' JSON, closed by EOS
MISTRAL_ARGS = (
    "{{- bos_token }}"
    "{%- set users = messages | selectattr('role', 'equalto', 'user') | list %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{{- '[SYSTEM_PROMPT]' + message.content + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message.role == 'user' %}"
    "{%- if tools and message == users[-1] %}"
    "{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST]' + message.content + '[/INST]' }}"
    "{%- elif message.role == 'assistant' %}" + GEN +
    "{{- message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set arguments = call.function.arguments %}"
    "{{- '[TOOL_CALLS]' + call.function.name + '[ARGS]' "
    "+ (arguments if arguments is string else arguments | tojson) }}"
    "{%- endfor %}"
    "{{- eos_token }}" + END +
    "{%- elif message.role == 'tool' %}"
    "{{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)

# GLM-4.5: no end-of-turn token; an assistant turn ends where the next turn's opener
# starts (<|user|>, or <|observation|> before tool results), and those openers are end ids
# of its generation config. The shipped template writes each opener in the turn it opens;
# its generation-block version moves the opener into the assistant turn before it (and
# writes <|user|> after a last assistant turn), as TRL's training templates place it.
GLM4_TURNS = (
    "{{- '[gMASK]<sop>' }}"
    "{%- if tools %}{{- '<|system|>\n# Tools\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{%- if OPENS_USER %}{{- '<|user|>' }}{%- endif %}{{- '\n' + m.content }}"
    "{%- elif m.role == 'system' %}{{- '<|system|>\n' + m.content }}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|assistant|>' }}" + GEN + "{{- '\n<think></think>\n' + (m.content or '') }}"
    "{%- for call in m.tool_calls or [] %}"
    "{{- '\n<tool_call>' + call.function.name }}"
    "{%- for k, v in call.function.arguments.items() %}"
    "{{- '\n<arg_key>' + k + '</arg_key>\n<arg_value>' + (v if v is string else v | tojson) "
    "+ '</arg_value>' }}"
    "{%- endfor %}{{- '\n</tool_call>' }}"
    "{%- endfor %}"
    "ASSISTANT_END" + END +
    "{%- elif m.role == 'tool' %}"
    "{%- if OPENS_TOOL %}{{- '<|observation|>' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)
# SmolLM3: a system turn it always writes (today's date and the reasoning mode, then the
# custom instructions or a default), "/no_think" or "/think" in the system prompt switching
# the mode and taken out of it, in /no_think an empty think block opening every assistant
# turn and the generation prompt, tool results as user turns; its own generation blocks hold
# the whole assistant turn, header and closing newline included (copies without them, as
# Unsloth's, are what a checkpoint may ship instead)
SMOLLM3 = (
    "{%- set mode = '/think' if enable_thinking is not defined or enable_thinking "
    "else '/no_think' %}"
    "{%- set custom = '' %}"
    "{%- if messages[0].role == 'system' %}"
    "{%- set text = messages[0].content %}"
    "{%- if '/no_think' in text %}{%- set mode = '/no_think' %}"
    "{%- elif '/think' in text %}{%- set mode = '/think' %}{%- endif %}"
    "{%- set custom = text.replace('/no_think', '').replace('/think', '').rstrip() %}"
    "{%- endif %}"
    "{%- set opening = '' if mode == '/think' else '<think>\\n\\n</think>\\n' %}"
    "{{- '<|im_start|>system\\n## Metadata\\n\\nToday Date: ' + strftime_now('%d %B %Y') "
    "+ '\\nReasoning Mode: ' + mode + '\\n\\n## Custom Instructions\\n\\n' "
    "+ (custom or 'You are a helpful AI assistant named SmolLM.') + '\\n\\n<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}" + GEN +
    "{{- '<|im_start|>assistant\\n' + opening + content.lstrip('\\n') + '<|im_end|>\\n' }}"
    + END +
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' + opening }}{%- endif %}"
)

AFTER_ASSISTANT = "(loop.first or messages[loop.index0 - 1].role != 'assistant')"
GLM4 = (GLM4_TURNS.replace("OPENS_USER", AFTER_ASSISTANT).replace("OPENS_TOOL", AFTER_ASSISTANT)
        .replace("ASSISTANT_END", "{%- if m.tool_calls %}{{- '<|observation|>' }}"
                                  "{%- else %}{{- '<|user|>' }}{%- endif %}"))
GLM4_SHIPPED = (GLM4_TURNS.replace("OPENS_USER", "true")
                .replace("OPENS_TOOL", "(messages[loop.index0 - 1].role != 'tool')")
                .replace("ASSISTANT_END", "").replace(GEN, "").replace(END, ""))

FAMILIES = {
    # name: (template, bos, eos)
    "chatml": (CHATML, None, "<|im_end|>"),
    "qwen3": (QWEN3, None, "<|im_end|>"),
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "gemma": (GEMMA, "<bos>", "<end_of_turn>"),
    "phi3": (PHI3, None, "<|endoftext|>"),
    "mistral": (MISTRAL, "<s>", "</s>"),
    "mistral_nemo": (MISTRAL_NEMO, "<s>", "</s>"),
    "glm4": (GLM4, None, "<|endoftext|>"),
    "smollm3": (SMOLLM3, None, "<|im_end|>"),
}
# generation_config.json's end ids, where they are more than the eos_token
END_TOKENS = {"glm4": ["<|endoftext|>", "<|user|>", "<|observation|>"],
              "phi3": ["<|end|>", "<|endoftext|>"]}

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                  "</tool_call>", "<|begin_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>", "<bos>", "<start_of_turn>",
                  "<end_of_turn>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
                  "<|endoftext|>", "<s>", "</s>", "[INST]", "[/INST]", "[gMASK]", "<sop>",
                  "<|observation|>"]


def plain(template: str) -> str:
    """The template without its generation blocks, as a checkpoint would ship it."""
    if template == GLM4:
        return GLM4_SHIPPED
    return template.replace(GEN, "").replace(END, "")


def trained_text(tokenizer: Tokenizer, ids: list[int], mask: list[bool]) -> list[str]:
    """The masked runs of a tokenized conversation, decoded."""
    runs, current = [], []
    for token, trained in zip(ids, mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]
