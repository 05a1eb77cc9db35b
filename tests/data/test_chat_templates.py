"""Training ids and assistant masks through foreign chat templates, against transformers'
`apply_chat_template(..., return_assistant_tokens_mask=True)`: with `{% generation %}`
blocks lathe takes the same spans; without them it derives the mask by rendering turn by
turn and gets the same tokens, or refuses the template by name — never an all-zero mask.
Tool calls and reasoning round-trip; the prompt a chat trains on is the one the server
renders."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from lathe.core.errors import ConfigError
from lathe.data.chat_encoding import ChatEncoder, ChatMaskError, overlap_mask
from lathe.data.chat_template import ChatTemplate
from lathe.data.formats import Chat, load_chat_dataset
from lathe.data.template_worker import TemplateWorker
from lathe.data.tokenizer import train_tokenizer
from tests.data.chat_templates import (
    END_TOKENS,
    FAMILIES,
    SPECIAL_TOKENS,
    plain,
    trained_text,
)
from tests.data.corpus import prose

SYSTEM = {"role": "system", "content": "You answer briefly."}
SINGLE = Chat([{"role": "user", "content": "What is 12 + 30?"},
               {"role": "assistant", "content": "It is 42."}], where="single")
MULTI = Chat([SYSTEM, {"role": "user", "content": "Name a river. "},
              {"role": "assistant", "content": "  The old mill river.\n"},
              {"role": "user", "content": "And a colour? 🙂"},
              {"role": "assistant", "content": "Blue, like the water."}], where="multi")
NO_SYSTEM = Chat(MULTI.messages[1:], where="no system")
CALL = {"type": "function", "id": "c1",
        "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}]
TOOL_CHAT = Chat([{"role": "user", "content": "What is 2 + 3?"},
                  {"role": "assistant", "tool_calls": [CALL]},
                  {"role": "tool", "tool_call_id": "c1", "content": "5"},
                  {"role": "assistant", "content": "The sum is 5."}], TOOLS, "tools")
# the system prompt moves to the last user message, and the call's turn is then found
SYSTEM_TOOL_CHAT = Chat([SYSTEM, *TOOL_CHAT.messages], TOOLS, "system and tools")
# and a later user turn, before which the tools are then listed: the call's turn moves
TOOLS_THEN_CHAT = Chat([*SYSTEM_TOOL_CHAT.messages, {"role": "user", "content": "Thanks."},
                        {"role": "assistant", "content": "You are welcome."}], TOOLS,
                       "tools then chat")
REASONING = Chat([{"role": "user", "content": "What is 2 + 3?"},
                  {"role": "assistant", "content": "5",
                   "reasoning_content": "Two and three make five."}], where="reasoning")

# SmolLM3's switch: "/no_think" in the system prompt puts an empty think block in every
# assistant turn and in the generation prompt
NO_THINK = Chat([{"role": "system", "content": "You answer briefly. /no_think"},
                 *MULTI.messages[1:]], where="no think")

# Qwen3's hard case: reasoning in an earlier turn, which the template drops once a later
# user message follows, and in the last one, which it shows
MULTI_REASONING = Chat([MULTI.messages[1], {**MULTI.messages[2], "reasoning_content": "Rivers."},
                        MULTI.messages[3], {**MULTI.messages[4], "reasoning_content": "Sky."}],
                       where="multi reasoning")

# and with tools: a call and an answer that reason, then a second question
TOOL_TURNS = Chat([{**m, "reasoning_content": "Let me add."} if m["role"] == "assistant" else m
                   for m in TOOL_CHAT.messages]
                  + [{"role": "user", "content": "And 4 + 4?"},
                     {"role": "assistant", "content": "8.", "reasoning_content": "Easy."}],
                  TOOLS, "tool turns")

# what the template without generation blocks gives: the same tokens as transformers on
# the template with them, or a refusal (the template rewrites a turn depending on what
# follows, where the turn cannot be found in the whole rendering: Mistral moves the system
# prompt to the last turn)
CASES = [
    ("chatml", SINGLE, True), ("chatml", MULTI, True), ("chatml", TOOL_CHAT, True),
    ("qwen3", SINGLE, True), ("qwen3", REASONING, True), ("qwen3", MULTI, True),
    ("qwen3", MULTI_REASONING, True), ("qwen3", TOOL_CHAT, True), ("qwen3", TOOL_TURNS, True),
    ("llama3", SINGLE, True), ("llama3", MULTI, True),
    ("gemma", SINGLE, True), ("gemma", MULTI, True),
    ("phi3", SINGLE, True), ("phi3", MULTI, True),
    ("mistral", SINGLE, True), ("mistral", NO_SYSTEM, True), ("mistral", MULTI, True),
    ("mistral_nemo", MULTI, True), ("mistral_nemo", TOOL_CHAT, True),
    ("mistral_nemo", SYSTEM_TOOL_CHAT, True), ("mistral_nemo", TOOLS_THEN_CHAT, True),
    ("glm4", SINGLE, True), ("glm4", MULTI, True), ("glm4", TOOL_CHAT, True),
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tokenizer = train_tokenizer([prose(i, paragraphs=2) for i in range(40)], vocab_size=500,
                                show_progress=False)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def specials(family: str) -> dict[str, str]:
    _, bos, eos = FAMILIES[family]
    return {key: value for key, value in (("bos_token", bos), ("eos_token", eos)) if value}


def encoder(tokenizer: Tokenizer, family: str, blocks: bool, **kwargs) -> ChatEncoder:
    template, _, eos = FAMILIES[family]
    ends = [tokenizer.token_to_id(token) for token in END_TOKENS.get(family, [eos])]
    return ChatEncoder(tokenizer, ChatTemplate(template if blocks else plain(template),
                                               specials(family)), f"the {family} template",
                       kwargs, ends)


def transformers_encoding(tokenizer: Tokenizer, family: str, chat: Chat,
                          **kwargs) -> tuple[list[int], list[bool]]:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.to_str()),
                                 **specials(family))
    out = hf.apply_chat_template(chat.messages, tools=chat.tools, chat_template=FAMILIES[family][0],
                                 tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True, **kwargs)
    return out["input_ids"], [bool(m) for m in out["assistant_masks"]]


@pytest.mark.parametrize(("family", "chat", "derivable"), CASES,
                         ids=[f"{f}-{c.where}" for f, c, _ in CASES])
def test_ids_and_masks_equal_transformers(tokenizer, family, chat, derivable):
    expected = transformers_encoding(tokenizer, family, chat)
    assert any(expected[1])
    assert encoder(tokenizer, family, blocks=True).conversation(chat) == expected
    derived = encoder(tokenizer, family, blocks=False)
    if derivable:
        assert derived.conversation(chat) == expected
    else:
        with pytest.raises(ChatMaskError, match=f"{chat.where}: the {family} template gives "
                                                "no assistant mask .* --chat_template FILE"):
            derived.conversation(chat)


@pytest.mark.parametrize("chat", [SINGLE, MULTI, NO_THINK], ids=lambda chat: chat.where)
def test_smollm3_blocks_train_the_whole_turn_and_a_copy_without_them_the_reply(tokenizer,
                                                                               chat):
    """SmolLM3's own blocks hold each assistant turn from its header to the newline after
    <|im_end|>, and lathe takes them as transformers does. A copy of the template without
    blocks (Unsloth's) trains what the model writes after the generation prompt the server
    renders: the reply and <|im_end|>, not the think block /no_think puts in that prompt."""
    ids, mask = transformers_encoding(tokenizer, "smollm3", chat)
    assert encoder(tokenizer, "smollm3", blocks=True).conversation(chat) == (ids, mask)
    opening = "<think>\n\n</think>\n" if chat is NO_THINK else ""
    replies = [m["content"] for m in chat.messages if m["role"] == "assistant"]
    assert trained_text(tokenizer, ids, mask) == [
        f"<|im_start|>assistant\n{opening}{reply}<|im_end|>\n" for reply in replies]
    derived_ids, derived_mask = encoder(tokenizer, "smollm3", blocks=False).conversation(chat)
    assert derived_ids == ids
    assert trained_text(tokenizer, derived_ids, derived_mask) == [
        f"{reply}<|im_end|>" for reply in replies]


def test_a_tool_call_round_trips_through_training_tokens(tokenizer, tmp_path):
    record = {"tools": TOOLS, "messages": [
        *TOOL_CHAT.messages[:1],
        {"role": "assistant", "content": None, "tool_calls": [
            {**CALL, "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        *TOOL_CHAT.messages[2:]]}
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(record) + "\n")
    chat = load_chat_dataset(str(path))[0]
    ids, mask = encoder(tokenizer, "chatml", blocks=False).conversation(chat)
    call, answer = trained_text(tokenizer, ids, mask)
    body = call.removeprefix("\n<tool_call>\n").removesuffix("\n</tool_call><|im_end|>")
    assert json.loads(body) == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert answer == "The sum is 5.<|im_end|>"
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert '"description": "Add two integers."' in text and "<tool_response>\n5\n" in text


def test_reasoning_is_trained_inside_the_think_block(tokenizer):
    ids, mask = encoder(tokenizer, "qwen3", blocks=False).conversation(REASONING)
    assert trained_text(tokenizer, ids, mask) == [
        "<think>\nTwo and three make five.\n</think>\n\n5<|im_end|>"]
    reasoning = Chat([REASONING.messages[0], {"role": "assistant", "content": "5",
                                              "reasoning": "Two and three make five."}])
    assert encoder(tokenizer, "qwen3", blocks=False).conversation(reasoning) == (ids, mask)


@pytest.mark.parametrize(("family", "chat", "what"), [
    ("llama3", REASONING, "reasoning"), ("llama3", TOOL_CHAT, "tool calls"),
    ("chatml", Chat(SINGLE.messages, TOOLS), None)])
def test_a_field_the_template_ignores_is_an_error_not_a_silent_drop(tokenizer, family, chat,
                                                                   what):
    if what is None:  # the ChatML template renders tools: no error
        encoder(tokenizer, family, blocks=False).conversation(chat)
        return
    with pytest.raises(ConfigError, match=f"does not render {what}"):
        encoder(tokenizer, family, blocks=False).conversation(chat)


def test_blocks_that_mark_nothing_are_refused(tokenizer):
    empty = ChatEncoder(tokenizer, ChatTemplate("{% generation %}{% endgeneration %}"
                                                "{% for m in messages %}{{ m.content }}"
                                                "{% endfor %}", {}), "the odd template")
    with pytest.raises(ChatMaskError, match="blocks mark nothing"):
        empty.conversation(SINGLE)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_prompt_a_chat_trains_on_is_what_the_server_renders(tokenizer, family):
    chat = {"gemma": MULTI, "qwen3": SINGLE, "smollm3": NO_THINK}.get(family, NO_SYSTEM)
    template = plain(FAMILIES[family][0])
    ids, mask = ChatEncoder(tokenizer, ChatTemplate(template, specials(family)),
                            family).conversation(chat)
    worker = TemplateWorker(template, specials(family))
    try:
        first_turn = chat.messages[:chat.messages.index(
            next(m for m in chat.messages if m["role"] == "assistant"))]
        served = tokenizer.encode(worker.render(first_turn), add_special_tokens=False).ids
    finally:
        worker.close()
    assert ids[:len(served)] == served and mask.index(True) == len(served)


def test_thinking_off_is_a_template_variable(tokenizer):
    from transformers import PreTrainedTokenizerFast

    quiet = encoder(tokenizer, "qwen3", blocks=False, enable_thinking=False)
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.to_str()))
    prompt = SINGLE.messages[:1]
    assert quiet.prompt(prompt) == hf.apply_chat_template(
        prompt, chat_template=FAMILIES["qwen3"][0], add_generation_prompt=True,
        enable_thinking=False)["input_ids"]
    ids, mask = quiet.conversation(SINGLE)
    assert trained_text(tokenizer, ids, mask) == ["It is 42.<|im_end|>"]


def test_preference_replies_split_where_the_rendered_prompt_ends(tokenizer):
    qwen3 = encoder(tokenizer, "qwen3", blocks=False)
    history = [MULTI.messages[1], {**MULTI.messages[2], "reasoning_content": "Rivers."},
               MULTI.messages[3]]
    reply = [{"role": "assistant", "content": "Blue."}]
    prompt, completion = qwen3.continuation(history, reply)
    assert prompt == qwen3.prompt(history)
    assert tokenizer.decode(completion, skip_special_tokens=False) == \
        "<think>\n\n</think>\n\nBlue.<|im_end|>"
    # Mistral's system prompt joins the last user message only where the conversation ends
    # on it: the prompt as served, then the reply as the template writes it
    mistral = encoder(tokenizer, "mistral", blocks=False)
    prompt, completion = mistral.continuation(MULTI.messages[:2], reply)
    assert prompt == mistral.prompt(MULTI.messages[:2])
    assert SYSTEM["content"] in tokenizer.decode(prompt)
    assert tokenizer.decode(completion, skip_special_tokens=False) == " Blue.</s>"
    # a generation prompt the conversation does not show (QwQ's <think>) cannot be split
    thinks = ChatEncoder(tokenizer, ChatTemplate(
        "{% for m in messages %}{% if m.role == 'user' %}U: {{ m.content }}\n"
        "{% else %}A: {{ m.content }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}A: <think>\n{% endif %}", {}), "a thinking template")
    with pytest.raises(ChatMaskError, match="pair 0: a thinking template renders the prompt "
                                            "differently once the reply follows"):
        thinks.continuation(MULTI.messages[1:2], reply, where="pair 0")


def test_a_token_is_trained_when_it_overlaps_a_span_as_transformers_counts_it():
    offsets = [(0, 3), (3, 5), (5, 8), (8, 9), (9, 12)]
    assert overlap_mask(offsets, [(4, 6), (11, 12)]) == [False, True, True, False, True]
    assert overlap_mask(offsets, [(3, 3)]) == [False] * 5


def test_a_system_prompt_the_template_leaves_out_is_counted(tokenizer):
    """Mistral's template writes the system prompt only into a conversation that ends on a
    user turn, so a training chat's is not in its tokens (transformers renders it so too):
    SFT's start line counts such chats rather than dropping them silently."""
    from lathe.posttrain.chats import ChatFit, tokenize

    mistral, chatml = (encoder(tokenizer, family, blocks=False) for family in ("mistral",
                                                                                "chatml"))
    assert mistral.drops_system(MULTI) and not mistral.drops_system(NO_SYSTEM)
    assert SYSTEM["content"] not in tokenizer.decode(mistral.conversation(MULTI)[0])
    assert not chatml.drops_system(MULTI)
    fit = ChatFit()
    tokenize(mistral, [MULTI, NO_SYSTEM, MULTI], 512, fit)
    assert fit.system_dropped == 2
    assert "2 chats' system prompts are not in their tokens" in fit.report()
    assert "system prompts" not in ChatFit(whole=3).report()


def test_a_processors_chat_template_json_is_the_template_where_the_tokenizer_has_none(
        tmp_path):
    """Gemma 3 from 4B up, like other multimodal checkpoints, may keep its template in the
    processor's chat_template.json: it is read after tokenizer_config.json's and
    chat_template.jinja, and one that is not a string is refused by name."""
    from lathe.core.errors import CheckpointError
    from lathe.data.chat_template import checkpoint_chat_template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>"}))
    assert checkpoint_chat_template(tmp_path) is None
    source = "{% for m in messages %}<start_of_turn>{{ m.content }}{% endfor %}"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": source}))
    assert checkpoint_chat_template(tmp_path) == source
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert checkpoint_chat_template(tmp_path) == "{{ messages[0].content }}"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(CheckpointError, match="chat_template.json: chat_template must be a "
                                              "string"):
        checkpoint_chat_template(tmp_path)


def test_named_templates_render_as_transformers_picks_them(tokenizer, tmp_path):
    """A tokenizer_config.json whose chat_template is transformers' list of named templates
    (Hermes 3's, Command R's): a chat with tools renders through `tool_use`, one without
    through `default`, as `apply_chat_template` picks them — to the character, the
    templates' own leading newline and trailing spaces kept."""
    from transformers import AutoTokenizer

    from lathe.core.errors import CheckpointError
    from lathe.data.chat_template import ChatTemplate
    default = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|>{% endif %}   ")
    tool_use = ("\n{{ tools | length }} tools: {% for t in tools %}{{ t.function.name }} "
                "{% endfor %}\n{% for m in messages %}[{{ m.role }}] {{ m.content }}\n"
                "{% endfor %}")
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                  "chat_template": [{"name": "default", "template": default},
                                                    {"name": "tool_use", "template": tool_use}]}))
    ours, theirs = ChatTemplate.from_checkpoint(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for tools in (None, TOOLS):
        assert ours.render(MULTI.messages, tools=tools) == theirs.apply_chat_template(
            MULTI.messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.render(MULTI.messages, tools=TOOLS).startswith("\n1 tools: add")
    config.write_text(json.dumps({"chat_template": [{"name": "default", "template": default}]}))
    assert ChatTemplate.from_checkpoint(tmp_path).render(SINGLE.messages).endswith(
        "<|assistant|>   ")
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": tool_use}]}))
    with pytest.raises(CheckpointError, match=r"names \['tool_use'\] but no \"default\""):
        ChatTemplate.from_checkpoint(tmp_path)
