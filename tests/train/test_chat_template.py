"""fsdpp's chat templates (src/train/text/chat_template.hpp) against transformers' own renderer.

The template strings of the families in wide use, as their tokenizer_config.json files publish them,
rendered by fsdpp_chat_probe and by transformers' render_jinja_template for the same conversations,
with and without add_generation_prompt: the text must be identical, a conversation a template refuses
must be refused by both (with the template's own message), and {% generation %} ranges must be
transformers' assistant ranges.
  test_chat_template.py PROBE
"""
import json
import subprocess
import sys
import tempfile

from transformers.utils.chat_template_utils import render_jinja_template

CHATML_SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

QWEN2_5 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

# Mistral v0.3: the system prompt goes into the last user turn.
MISTRAL_V3 = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message["role"] == "user") != (loop.index0 % 2 == 0) %}
        {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

# SmolLM3-style ChatML with the assistant turns marked for training masks, and a namespace.
CHATML_GENERATION = """{%- set ns = namespace(turns=0) -%}
{%- for message in messages -%}
{%- set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }}
{% if message.role == 'assistant' -%}
{% generation %}{{ message.content | trim }}<|im_end|>{% endgeneration %}
{% else -%}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif -%}
{# {{ ns.turns }} turns #}
turns: {{ ns.turns }}, {{ messages | length }} messages, last {{ (messages | last).role | upper }}, {{ messages[-2:] | map(attribute='role') | join('/') }}
"""

TEMPLATES = {"chatml-smollm2": CHATML_SMOLLM2, "qwen2.5": QWEN2_5, "llama3": LLAMA3, "mistral": MISTRAL,
             "mistral-v0.3": MISTRAL_V3, "gemma": GEMMA, "chatml-generation": CHATML_GENERATION}

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}


def conversations():
    hostile = "  line one\n\tline \"two\" with 'quotes' — ünïcödé 東京 🚀 {{ not a tag }} {% neither %}  \n"
    yield [{"role": "user", "content": "Hello!"}]
    yield [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    yield [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Hello, how can I help? "},
           {"role": "user", "content": hostile}]
    yield [{"role": "user", "content": hostile}, {"role": "assistant", "content": hostile}]
    yield [{"role": "system", "content": "sys"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
           {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    yield [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]       # not alternating
    yield [{"role": "user", "content": "q"}, {"role": "tool", "content": "{\"x\": 1}"}]   # a role some refuse
    yield [{"role": "user", "content": "weather?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2.5}}}]},
           {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "warm"},
           {"role": "assistant", "content": "Sunny and warm."}]
    yield [{"role": "user", "content": ""}]


def main():
    probe = sys.argv[1]
    failures, checked = [], 0
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    for name, template in TEMPLATES.items():
        cases, expected = [], []
        for conv in conversations():
            for gen in (False, True):
                for tool_list in ([None, tools] if name == "qwen2.5" else [None]):
                    variables = dict(SPECIAL, messages=conv, add_generation_prompt=gen, tools=tool_list, documents=None)
                    cases.append(variables)
                    try:
                        texts, indices = render_jinja_template([conv], chat_template=template, add_generation_prompt=gen,
                                                               tools=tool_list, return_assistant_tokens_mask=True,
                                                               **SPECIAL)
                        expected.append({"text": texts[0], "generated": [list(r) for r in indices[0]]})
                    except Exception as e:  # noqa: BLE001: the template's own refusal
                        expected.append({"error": str(e)})
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"template": template, "cases": cases}, f)
        p = subprocess.run([probe, f.name], capture_output=True, text=True)
        if p.returncode != 0:
            failures.append(f"{name}: probe exit {p.returncode}: {p.stdout} {p.stderr}")
            continue
        got = json.loads(p.stdout)
        for k, (g, e) in enumerate(zip(got, expected)):
            checked += 1
            what = f"{name} case {k} (add_generation_prompt={cases[k]['add_generation_prompt']})"
            if "error" in e:
                if "error" not in g or e["error"] not in g["error"]:
                    failures.append(f"{what}: transformers refused ({e['error']}), fsdpp gave {g}")
                continue
            if "error" in g:
                failures.append(f"{what}: fsdpp refused ({g['error']}), transformers rendered {e['text']!r}")
                continue
            if g["text"] != e["text"]:
                failures.append(f"{what}: text differs:\n  fsdpp        {g['text']!r}\n  transformers {e['text']!r}")
                continue
            # fsdpp's ranges are in bytes, transformers' in characters.
            raw = g["text"].encode()
            chars = [[len(raw[:b].decode()), len(raw[:end].decode())] for b, end in g["generated"]]
            if chars != e["generated"]:
                failures.append(f"{what}: generation ranges {chars} != {e['generated']}")
    # A template outside the subset is refused at parse time, naming the line.
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"template": "line one\n{% macro m() %}x{% endmacro %}", "cases": []}, f)
    p = subprocess.run([probe, f.name], capture_output=True, text=True)
    if p.returncode != 2 or "line 2" not in p.stdout or "macro" not in p.stdout:
        failures.append(f"unsupported statement: exit {p.returncode}, {p.stdout.strip()}")
    # A number past 64 bits (which the chat fuzzer found ending the process) is refused by line.
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"template": "{{ 1 }}\n{%- set n = 66666666666666666666666666 -%}", "cases": []}, f)
    p = subprocess.run([probe, f.name], capture_output=True, text=True)
    if p.returncode != 2 or "line 2" not in p.stdout or "out of range" not in p.stdout:
        failures.append(f"a number out of range: exit {p.returncode}, {p.stdout.strip()}")
    for f in failures:
        print("FAIL " + f)
    print(f"{checked} renders of {len(TEMPLATES)} templates compared; {len(failures)} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
