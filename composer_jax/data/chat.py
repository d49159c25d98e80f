"""The chat / tool-call text format shared by SFT, the RL agent and evaluation.

One message list renders to token ids plus a loss mask that is 1 exactly on the tokens the assistant
produced (its text, its tool calls and its closing ``<|im_end|>``, so the model learns to stop) and
0 on everything it was given (system, user, tool results and the role headers). The layout follows
Kimi K2's chat template with its special tokens:

  <|im_user|>user<|im_middle|>fix the bug<|im_end|>
  <|im_assistant|>assistant<|im_middle|>Let me look.<|tool_calls_section_begin|>
    <|tool_call_begin|>functions.view:0<|tool_call_argument_begin|>{"path": "a.py"}<|tool_call_end|>
  <|tool_calls_section_end|><|im_end|>
  <|im_system|>tool<|im_middle|>## Return of functions.view:0
  1  import os<|im_end|>

A message is ``{"role": "system"|"user"|"assistant"|"tool", "content": str}``; an assistant message
may carry ``"tool_calls": [{"id": str, "name": str, "arguments": dict | str}]`` and a tool message
carries ``"tool_call_id"``. ``parse_tool_calls`` inverts the assistant rendering so the RL agent can
read the calls back out of sampled text.
"""

from __future__ import annotations

import json
import re

EOS = "<|endoftext|>"
PAD = "<|pad|>"
IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"
CALLS_BEGIN = "<|tool_calls_section_begin|>"
CALLS_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
CALL_ARGS = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

# Order matters: trained tokenizers give these the first ids (0..n-1).
SPECIAL_TOKENS = [EOS, PAD, IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END, CALLS_BEGIN,
                  CALLS_END, CALL_BEGIN, CALL_ARGS, CALL_END]

_HEADER = {"system": IM_SYSTEM, "user": IM_USER, "assistant": IM_ASSISTANT, "tool": IM_SYSTEM}
_ROLES = tuple(_HEADER)


class ChatFormatError(ValueError):
  """A malformed message list; the message says which message and what is wrong."""


def _call_id(call: dict, index: int) -> str:
  return call.get("id") or f"functions.{call['name']}:{index}"


def render_tool_calls(calls: list[dict]) -> str:
  parts = [CALLS_BEGIN]
  for i, call in enumerate(calls):
    args = call.get("arguments", {})
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    parts += [CALL_BEGIN, _call_id(call, i), CALL_ARGS, args, CALL_END]
  parts.append(CALLS_END)
  return "".join(parts)


def render_segments(messages: list[dict]) -> list[tuple[str, bool]]:
  """Split a conversation into ``(text, trained)`` pieces in order."""
  segs: list[tuple[str, bool]] = []
  for i, msg in enumerate(messages):
    role = msg.get("role")
    if role not in _ROLES:
      raise ChatFormatError(f"message {i}: role {role!r} must be one of {list(_ROLES)}")
    content = msg.get("content") or ""
    if not isinstance(content, str):
      raise ChatFormatError(f"message {i}: content must be a string")
    name = "tool" if role == "tool" else role
    segs.append((f"{_HEADER[role]}{name}{IM_MIDDLE}", False))
    if role == "assistant":
      body = content + (render_tool_calls(msg["tool_calls"]) if msg.get("tool_calls") else "")
      segs.append((body + IM_END, True))
    elif role == "tool":
      segs.append((f"## Return of {msg.get('tool_call_id', '')}\n{content}{IM_END}", False))
    else:
      segs.append((content + IM_END, False))
  return segs


def generation_prompt() -> str:
  """The text that opens an assistant turn (what the sampler appends before generating)."""
  return f"{IM_ASSISTANT}assistant{IM_MIDDLE}"


_CALL_RE = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(CALL_ARGS) + r"(.*?)"
                      + re.escape(CALL_END), re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
  """Split sampled assistant text into (content, tool calls); arguments parsed as JSON when valid."""
  text = text.split(IM_END)[0]
  if CALLS_BEGIN not in text:
    return text, []
  content, rest = text.split(CALLS_BEGIN, 1)
  calls = []
  for call_id, raw in _CALL_RE.findall(rest):
    name = call_id.split(".", 1)[-1].rsplit(":", 1)[0]
    try:
      args = json.loads(raw)
    except json.JSONDecodeError:
      args = raw
    calls.append({"id": call_id, "name": name, "arguments": args})
  return content, calls
