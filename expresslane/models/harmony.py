"""The harmony format of gpt-oss: its special tokens and a chat template that renders it, for
the model directories make-model writes (the shipped checkpoints bring their own template).

A conversation is a run of messages ``<|start|>{role}<|channel|>{channel}<|message|>{text}<|end|>``;
the assistant thinks on the `analysis` channel, answers on `final` (ending its turn with
``<|return|>``) and calls a tool on `commentary` with a recipient,
``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}<|call|>``. The
generation prompt is ``<|start|>assistant``: the model writes its channel first.
"""

from __future__ import annotations

STARTOFTEXT, ENDOFTEXT = "<|startoftext|>", "<|endoftext|>"
START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
SPECIAL_TOKENS = (STARTOFTEXT, ENDOFTEXT, START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
STOP_TOKENS = (RETURN, CALL, ENDOFTEXT)  # the ends of an assistant's turn

# system: the channels (and the tool namespace when there are tools); developer: the request's
# system messages and the tools as a TypeScript-like namespace; then the turns. Earlier tool
# calls go back as commentary messages, tool results as messages from functions.NAME.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_call='') -%}"
    "<|start|>system<|message|>You are a helpful assistant.\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{%- if tools %}{{ '\\n' }}Calls to these tools must go to the commentary channel: 'functions'.{%- endif %}<|end|>"
    "{%- set instructions = messages | selectattr('role', 'in', ['system', 'developer']) | map(attribute='content')"
    " | join('\n') -%}"
    "{%- if instructions or tools -%}"
    "<|start|>developer<|message|>"
    "{%- if instructions %}# Instructions{{ '\\n\\n' }}{{ instructions }}{%- endif %}"
    "{%- if tools %}{% if instructions %}{{ '\\n\\n' }}{% endif %}# Tools\n\n## functions\n\nnamespace functions "
    "{{ '{\\n' }}{%- for tool in tools %}{%- set f = tool.function if tool.function is defined else tool %}"
    "{{ '\\n' }}// {{ f.description | default('') }}{{ '\\n' }}type {{ f.name }} = "
    "(_: {{ f.parameters | default({}) | tojson }}) => any;{{ '\\n' }}"
    "{%- endfor %}{{ '\\n} // namespace functions' }}{%- endif %}<|end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- for call in m.tool_calls | default([]) -%}{%- set ns.last_call = call.function.name -%}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ call.function.name }} <|constrain|>json<|message|>"
    "{{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}"
    "<|call|>"
    "{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}"
    "<|start|>functions.{{ m.name | default(ns.last_call) }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
