"""Chat templates zserve's test models carry (launcher/tiny_model.py).

`CHATML_TOOLS`, the tiny models' template, is ChatML with tool calling in Qwen2.5's (Hermes)
layout, for `--tool-call-parser hermes`. Without tools, tool calls or tool messages it renders
exactly what the plain `CHATML` does (the template the models carried before):

- `tools` go into a system turn (merged with the first system message) as JSON lines
  inside `<tools></tools>`, with the instruction to answer in `<tool_call>` tags;
- an assistant turn's `tool_calls` follow its text, one
  `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` each (`arguments` as a dict,
  or as given when it is already a string);
- consecutive `tool` messages become one user turn of `<tool_response>` blocks.
"""

from __future__ import annotations

# List-of-parts content is joined text; `enable_thinking=False` closes an empty think block
# the way Qwen3's template does, so tests can see chat_template_kwargs reach the template.
CHATML = r"""
{%- for message in messages -%}
    {%- if message.content is string -%}
        {%- set content = message.content -%}
    {%- elif message.content is not defined or message.content is none -%}
        {%- set content = '' -%}
    {%- else -%}
        {%- set content = message.content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}
    {%- endif -%}
    {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
""".strip()

CHATML_TOOLS = r"""
{%- macro text(message) -%}
    {%- if message.content is string -%}
        {{- message.content -}}
    {%- elif message.content is not defined or message.content is none -%}
    {%- else -%}
        {{- message.content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -}}
    {%- endif -%}
{%- endmacro -%}
{%- set first_is_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if first_is_system -%}
        {{- text(messages[0]) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if loop.first and first_is_system and tools -%}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + text(message) + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + text(message) -}}
        {%- if message.role == 'assistant' and message.tool_calls -%}
            {%- for call in message.tool_calls -%}
                {%- set call = call.function if call.function is defined else call -%}
                {%- if (loop.first and text(message)) or not loop.first -%}
                    {{- '\n' -}}
                {%- endif -%}
                {{- '<tool_call>\n{"name": ' + (call.name | tojson) + ', "arguments": ' -}}
                {%- if call.arguments is string -%}
                    {{- call.arguments -}}
                {%- else -%}
                    {{- call.arguments | tojson -}}
                {%- endif -%}
                {{- '}\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
""".strip()
