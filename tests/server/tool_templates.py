"""Chat templates that write assistant tool calls the way each family's published template does (the
parts that matter to the parsers: turn markers, tool-call syntax, thinking markers), and tokenizers
that carry each family's markers as special tokens, built from the demo tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers

from hybridlm.models.tokenizer import Tokenizer

# Qwen3.5 / Qwen3-Coder: XML calls; scalar values as text, objects and arrays as JSON.
QWEN_XML = """{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
<|im_start|>assistant
{% if m.reasoning_content is defined %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content or '' }}
{%- for tc in m.tool_calls or [] -%}
{%- if m.content or not loop.first %}{{ '\\n' }}{% endif -%}
<tool_call>
<function={{ tc.function.name }}>
{% for k, v in tc.function.arguments | items -%}
<parameter={{ k }}>
{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}
</parameter>
{% endfor -%}
</function>
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif -%}"""

# LFM2: a pythonic call list between its tool-call tokens.
LFM2 = """{{- bos_token -}}
{%- if tools %}<|im_start|>system
List of tools: <|tool_list_start|>{{ tools | tojson }}<|tool_list_end|><|im_end|>
{% endif -%}
{%- for m in messages -%}
<|im_start|>{{ m.role }}
{% if m.role == 'tool' %}<|tool_response_start|>{{ m.content }}<|tool_response_end|>{% else -%}
{%- if m.tool_calls %}<|tool_call_start|>[
{%- for tc in m.tool_calls -%}
{{ tc.function.name }}(
{%- for k, v in tc.function.arguments | items -%}
{{ k }}={{ v | tojson }}{{ ', ' if not loop.last }}
{%- endfor -%}
){{ ', ' if not loop.last }}
{%- endfor -%}
]<|tool_call_end|>{% endif -%}
{{ m.content or '' }}{% endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""

# Gemma 4: `call:name{key:value}` between its tool-call tokens, strings between <|"|> quote tokens.
GEMMA4 = """{%- macro arg(v) -%}
{%- if v is string -%}<|"|>{{ v }}<|"|>
{%- elif v is mapping -%}{ {%- for k, x in v | items -%}
{{ k }}:{{ arg(x) }}{{ ',' if not loop.last }}
{%- endfor -%} }
{%- elif v is sequence -%}[{%- for x in v -%}{{ arg(x) }}{{ ',' if not loop.last }}{%- endfor -%}]
{%- elif v is sameas true %}true{% elif v is sameas false %}false{% elif v is none %}null
{%- else %}{{ v }}{% endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
<|turn>model
{% if m.reasoning_content is defined %}<|channel>thought
{{ m.reasoning_content }}<channel|>{% endif -%}
{%- for tc in m.tool_calls or [] -%}
<|tool_call>call:{{ tc.function.name }}{{ arg(tc.function.arguments) }}<tool_call|>
{%- endfor -%}
{{ m.content or '' }}<turn|>
{% elif m.role == 'tool' -%}
<|turn>user
<|tool_response>response:{{ m.content }}<tool_response|><turn|>
{% else -%}
<|turn>{{ m.role }}
{{ m.content }}<turn|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|turn>model
{% endif -%}"""

# Llama 3.1: the assistant message is the JSON call ({"name", "parameters"}); "; " between calls.
LLAMA3 = """{{- bos_token -}}
{%- for m in messages -%}
<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>

{% if m.tool_calls -%}
{%- for tc in m.tool_calls -%}
{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}
{{- '; ' if not loop.last }}
{%- endfor -%}
{%- else %}{{ m.content }}{% endif %}<|eot_id|>
{%- endfor -%}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif -%}"""

# Kimi K2 / Kimi-Linear: a section of calls, each id'd `functions.NAME:INDEX`, JSON arguments.
KIMI = """{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
<|im_assistant|>assistant<|im_middle|>{{ m.content or '' }}
{%- if m.tool_calls -%}
<|tool_calls_section_begin|>
{%- for tc in m.tool_calls -%}
<|tool_call_begin|>functions.{{ tc.function.name }}:{{ loop.index0 }}<|tool_call_argument_begin|>
{{- tc.function.arguments | tojson }}<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- endif -%}
<|im_end|>
{%- elif m.role == 'tool' -%}
<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}
{{ m.content }}<|im_end|>
{%- else -%}
<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif -%}"""

# Ling 3.0 (and GLM-4.5's calls): key / value pairs after the function's name, scalars as text,
# other types as JSON; the turn markers of Ling's `<role>` templates.
LING3 = """{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
<role>ASSISTANT</role>{{ m.content or '' }}
{%- for tc in m.tool_calls or [] -%}
{%- if m.content or not loop.first %}{{ '\\n' }}{% endif -%}
<tool_call>{{ tc.function.name }}
{%- for k, v in tc.function.arguments | items %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v if v is string else v | tojson }}</arg_value>
{%- endfor %}
</tool_call>
{%- endfor -%}
<|role_end|>
{%- elif m.role == 'tool' -%}
<role>OBSERVATION</role>
<tool_response>
{{ m.content }}
</tool_response><|role_end|>
{%- elif m.role == 'user' -%}
<role>HUMAN</role>{{ m.content }}<|role_end|>
{%- else -%}
<role>{{ m.role | upper }}</role>{{ m.content }}<|role_end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<role>ASSISTANT</role>{% endif -%}"""

FAMILIES = {
    # family: (template, format name, special marker tokens, assistant turn start, assistant turn end)
    "qwen3.5": (
        QWEN_XML,
        "qwen3_xml",
        ["<|im_start|>", "<|im_end|>"],
        "<|im_start|>assistant\n",
        "<|im_end|>",
    ),
    "lfm2": (
        LFM2,
        "pythonic",
        ["<|im_start|>", "<|im_end|>", "<|tool_call_start|>", "<|tool_call_end|>"],
        "<|im_start|>assistant\n",
        "<|im_end|>",
    ),
    "gemma4": (
        GEMMA4,
        "gemma4",
        ["<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>"],
        "<|turn>model\n",
        "<turn|>",
    ),
    "kimi": (
        KIMI,
        "kimi",
        [
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_system|>",
            "<|im_middle|>",
            "<|im_end|>",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ],
        "<|im_assistant|>assistant<|im_middle|>",
        "<|im_end|>",
    ),
    "ling3": (
        LING3,
        "glm45",
        ["<role>", "</role>", "<|role_end|>", "<tool_call>", "</tool_call>"],
        "<role>ASSISTANT</role>",
        "<|role_end|>",
    ),
    "llama3": (
        LLAMA3,
        "llama3_json",
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"],
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|eot_id|>",
    ),
}


def family_tokenizer(demo_dir: Path, family: str, out: Path) -> Tokenizer:
    """The demo tokenizer plus the family's markers as special tokens, with the family's template."""
    template, _, special, _, end = FAMILIES[family]
    backend = tokenizers.Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    backend.add_special_tokens(special)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    config = {"chat_template": template, "eos_token": end, "bos_token": "<|endoftext|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(out)
