"""The chat framing shared by SFT, the RL agent and evaluation; tool calls are protocol.py's XML.

One message list renders to token ids plus a loss mask that is 1 exactly on the tokens the assistant
produced (its text, its tool calls and its closing ``<|im_end|>``, so the model learns to stop) and
0 on everything it was given (system, user, tool results and the role headers). Role headers follow
Kimi K2's chat template; tool calls are the XML calls of ``composer_jax.env.protocol`` written inside
the assistant's content (the ONE tool-call format), and tool results are the observation text:

  <|im_user|>user<|im_middle|>fix the bug<|im_end|>
  <|im_assistant|>assistant<|im_middle|>Let me look.
  <tool_call name="view">
  <path>a.py</path>
  </tool_call><|im_end|>
  <|im_system|>tool<|im_middle|><observation tool="view" status="ok">
  1  x = 1/0
  </observation><|im_end|>

A message is ``{"role": "system"|"user"|"assistant"|"tool", "content": str}``. Episodes
(``env/episode.py``) write the calls straight into the assistant content; for convenience an
assistant message may instead carry ``"tool_calls": [{"name": str, "arguments": dict}]``, which is
rendered with ``protocol.format_call`` after the content (a thin adapter, same text). ``parse_tool_calls``
reads the calls back with ``protocol.parse``.
"""

from __future__ import annotations

from composer_jax.env import protocol

EOS = "<|endoftext|>"
PAD = "<|pad|>"
IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"
# No longer used by the format (calls are protocol.py's XML); kept so the special-token ids of
# trained tokenizers and checkpoints do not shift.
CALLS_BEGIN = "<|tool_calls_section_begin|>"
CALLS_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
CALL_ARGS = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

# Order matters: trained tokenizers give these the first ids (0..n-1). Never reorder or remove.
SPECIAL_TOKENS = [EOS, PAD, IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END, CALLS_BEGIN,
                  CALLS_END, CALL_BEGIN, CALL_ARGS, CALL_END]

_HEADER = {"system": IM_SYSTEM, "user": IM_USER, "assistant": IM_ASSISTANT, "tool": IM_SYSTEM}
_ROLES = tuple(_HEADER)


class ChatFormatError(ValueError):
  """A malformed message list; the message says which message and what is wrong."""


def render_tool_calls(calls: list[dict]) -> str:
  """``[{"name", "arguments": dict}]`` as protocol XML calls, one after another."""
  return "\n".join(protocol.format_call(c["name"], dict(c.get("arguments") or {})) for c in calls)


def assistant_text(msg: dict) -> str:
  """The assistant's whole text: content, then any ``tool_calls`` in the XML format."""
  content = msg.get("content") or ""
  if not msg.get("tool_calls"):
    return content
  sep = "\n" if content and not content.endswith("\n") else ""
  return content + sep + render_tool_calls(msg["tool_calls"])


def render_segments(messages: list[dict]) -> list[tuple[str, bool]]:
  """Split a conversation into ``(text, trained)`` pieces in order (header, body per message)."""
  segs: list[tuple[str, bool]] = []
  for i, msg in enumerate(messages):
    role = msg.get("role")
    if role not in _ROLES:
      raise ChatFormatError(f"message {i}: role {role!r} must be one of {list(_ROLES)}")
    content = msg.get("content") or ""
    if not isinstance(content, str):
      raise ChatFormatError(f"message {i}: content must be a string")
    calls = msg.get("tool_calls")
    if calls:
      if role != "assistant":
        raise ChatFormatError(f"message {i}: only assistant messages may carry tool_calls")
      if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
        raise ChatFormatError(f"message {i}: tool_calls must be a list of {{'name', 'arguments'}}")
    segs.append((f"{_HEADER[role]}{role}{IM_MIDDLE}", False))
    body = assistant_text(msg) if role == "assistant" else content
    # An assistant turn marked "train": false is context only (a recovery run's flawed edit).
    segs.append((body + IM_END, role == "assistant" and msg.get("train", True) is not False))
  return segs


def encode_segments(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
  """Token ids and loss mask (1 on assistant-produced tokens) of a conversation.

  Each segment is encoded on its own and the pieces concatenated, so a conversation's ids are the
  concatenation of its messages' ids: the RL agent, which encodes one observation message at a
  time, sees exactly the tokens SFT trained on.
  """
  ids: list[int] = []
  mask: list[int] = []
  for text, trained in render_segments(messages):
    piece = tokenizer.encode(text)
    ids += piece
    mask += [int(trained)] * len(piece)
  return ids, mask


def generation_prompt() -> str:
  """The text that opens an assistant turn (what the sampler appends before generating)."""
  return f"{IM_ASSISTANT}assistant{IM_MIDDLE}"


def parse_tool_calls(text: str, specs: dict | None = None) -> tuple[str, list[dict]]:
  """Split sampled assistant text into (content, tool calls ``{"name", "arguments"}``).

  Parsing is ``protocol.parse`` against ``specs`` (default: the product's tools), so integer
  arguments come back as ints; malformed calls are left out (the episode reports them). The content
  is the text outside the calls, stripped.
  """
  if specs is None:
    from composer_jax.env.tools import SPECS as specs
  text = text.split(IM_END)[0]
  result = protocol.parse(text, specs)
  content = text
  for item in result.items:
    if item.raw:
      content = content.replace(item.raw, "", 1)
  calls = [{"name": c.name, "arguments": dict(c.args)} for c in result.calls]
  return content.strip(), calls
