"""An Ollama Modelfile for an exported GGUF: FROM the file, the chat template translated from the
GGUF's Jinja template into Ollama's Go template, and its stop tokens.

Only the shapes most small models use are translated, recognised by their turn markers: ChatML
(`<|im_start|>`, SmolLM2, Qwen), Gemma (`<start_of_turn>`) and Llama 3 (`<|start_header_id|>`).
A literal default system prompt in a ChatML template (SmolLM2 has one) becomes SYSTEM. For any
other template the Modelfile has no TEMPLATE and says so in a comment (Ollama then falls back to
its own detection from the GGUF).
"""

from __future__ import annotations

import re
from pathlib import Path

CHATML = """{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}
{{- range .Messages }}{{ if ne .Role "system" }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}{{ end }}<|im_start|>assistant
"""

GEMMA = """{{- range $i, $m := .Messages }}
{{- if eq $m.Role "assistant" }}<start_of_turn>model
{{ $m.Content }}<end_of_turn>
{{ else if ne $m.Role "system" }}<start_of_turn>user
{{ if and $.System (eq $i 0) }}{{ $.System }}

{{ end }}{{ $m.Content }}<end_of_turn>
{{ end }}{{ end }}<start_of_turn>model
"""

LLAMA3 = """{{- if .System }}<|start_header_id|>system<|end_header_id|>

{{ .System }}<|eot_id|>
{{- end }}
{{- range .Messages }}{{ if ne .Role "system" }}<|start_header_id|>{{ .Role }}<|end_header_id|>

{{ .Content }}<|eot_id|>
{{- end }}{{ end }}<|start_header_id|>assistant<|end_header_id|>

"""

#: marker in the Jinja template -> (shape, Go template, stop tokens)
SHAPES = [("<|im_start|>", "chatml", CHATML, ["<|im_end|>", "<|im_start|>"]),
          ("<start_of_turn>", "gemma", GEMMA, ["<end_of_turn>", "<start_of_turn>"]),
          ("<|start_header_id|>", "llama3", LLAMA3, ["<|eot_id|>", "<|start_header_id|>"])]


def translate(jinja: str | None) -> tuple[str | None, str | None, list[str], str | None]:
    """(shape, Go template, stop tokens, default system prompt) for a Jinja chat template; shape
    None when it is none of the known ones."""
    for marker, shape, go, stops in SHAPES:
        if jinja and marker in jinja:
            system = None
            if shape == "chatml":
                m = re.search(r"<\|im_start\|>system(?:\n|\\n)([^{}'\"]+?)<\|im_end\|>", jinja)
                system = m.group(1).replace("\\n", "\n") if m else None
            return shape, go, list(stops), system
    return None, None, [], None


def _quoted(text: str) -> str:
    return '"""' + text.replace('"""', '\\"\\"\\"') + '"""'


def modelfile(gguf_path: Path, jinja: str | None, eos: str | None = None) -> tuple[str, str | None]:
    """The Modelfile's text and the template shape it translated (None: not recognised)."""
    shape, go, stops, system = translate(jinja)
    lines = [f"# written by retrograd export; ollama create NAME -f {gguf_path.with_suffix('.Modelfile').name}",
             f"FROM {gguf_path.resolve()}"]
    if go is None:
        lines.append("# the GGUF's chat template is none of the shapes retrograd translates (ChatML, Gemma, "
                     "Llama 3): add a TEMPLATE by hand, or leave it to Ollama's own detection")
    else:
        lines.append(f"TEMPLATE {_quoted(go)}")
    if system:
        lines.append(f"SYSTEM {_quoted(system)}")
    if eos and eos not in stops:
        stops.append(eos)
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    return "\n".join(lines) + "\n", shape
