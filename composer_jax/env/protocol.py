"""The text protocol for tool calls in the model's output and the observations fed back.

One format serves SFT data, RL rollouts and evaluation. An assistant message is free text (thinking,
explanations) with zero or more tool calls; each call is

    <tool_call name="str_replace">
    <path>src/pkg/mod.py</path>
    <old>
        return a + b
    </old>
    <new>
        return a - b
    </new>
    </tool_call>

Arguments are child tags named after the argument; their text is taken raw (no escaping, so code can
be pasted as is), except that ONE newline right after the opening tag and ONE right before the closing
tag are dropped, so the multi-line layout above means exactly the lines in between. An argument value
cannot contain its own closing tag (``</old>``) nor the opening of a new call (``<tool_call``: an
unclosed call must not swallow the next one); everything else, ``</tool_call>`` included, is fine
because arguments are read one by one. Integer arguments are decimal numbers.

Calls run in order. Each result comes back, in one message of role ``tool``, as

    <observation tool="view" status="ok">
    ...text...
    </observation>

with ``status="error"`` for a failed call. A malformed call (unclosed tag, unknown argument, missing
required argument, non-integer where an integer is due) or an unknown tool becomes an error
observation that says what was wrong; ``ParseResult.errors`` counts them for later rewards.
"""

from __future__ import annotations

import dataclasses
import re

CALL_OPEN = re.compile(r'<tool_call\s+name\s*=\s*"([^"]*)"\s*>')
CALL_OPEN_LOOSE = re.compile(r"<tool_call\b[^>]*>?")
ARG_OPEN = re.compile(r"<([A-Za-z_][A-Za-z0-9_]*)>")
CALL_CLOSE = "</tool_call>"
_SPACE = re.compile(r"\s*")


@dataclasses.dataclass(frozen=True)
class Arg:
  name: str
  kind: str = "str"  # "str" | "int"
  required: bool = True
  doc: str = ""


@dataclasses.dataclass(frozen=True)
class ToolSpec:
  name: str
  doc: str
  args: tuple[Arg, ...] = ()

  def arg(self, name: str) -> Arg | None:
    return next((a for a in self.args if a.name == name), None)


@dataclasses.dataclass
class ToolCall:
  name: str
  args: dict
  raw: str = ""


@dataclasses.dataclass
class ParseError:
  message: str
  tool: str = "?"
  raw: str = ""


@dataclasses.dataclass
class ParseResult:
  """Calls and errors in the order they appear in the message."""
  items: list  # of ToolCall | ParseError

  @property
  def calls(self) -> list[ToolCall]:
    return [i for i in self.items if isinstance(i, ToolCall)]

  @property
  def errors(self) -> list[ParseError]:
    return [i for i in self.items if isinstance(i, ParseError)]


def _strip_one_newline(value: str) -> str:
  if value.startswith("\r\n"):
    value = value[2:]
  elif value.startswith("\n"):
    value = value[1:]
  if value.endswith("\r\n"):
    value = value[:-2]
  elif value.endswith("\n"):
    value = value[:-1]
  return value


def _parse_args(text: str, pos: int):
  """Read ``<arg>value</arg>`` pairs from ``pos`` up to ``</tool_call>``.

  Returns (args, end_position, error message or None).
  """
  args: dict = {}
  while True:
    pos = _SPACE.match(text, pos).end()
    if text.startswith(CALL_CLOSE, pos):
      return args, pos + len(CALL_CLOSE), None
    if pos >= len(text) or text.startswith("<tool_call", pos):
      return args, pos, "the call is not closed: end it with </tool_call>"
    m = ARG_OPEN.match(text, pos)
    if not m:
      snippet = text[pos:pos + 30].split("\n")[0]
      return args, _skip_call(text, pos), \
          f"expected an argument tag like <path> or </tool_call>, found {snippet!r}"
    name = m.group(1)
    close_tag = f"</{name}>"
    end = text.find(close_tag, m.end())
    nxt = text.find("<tool_call", m.end())
    if end < 0 or 0 <= nxt < end:
      return args, _skip_call(text, m.end()), f"argument <{name}> is not closed: end it with {close_tag}"
    if name in args:
      return args, _skip_call(text, end), f"argument <{name}> is given twice"
    args[name] = _strip_one_newline(text[m.end():end])
    pos = end + len(close_tag)


def _skip_call(text: str, pos: int) -> int:
  """Past this call's close, but never past the opening of the next call."""
  close = text.find(CALL_CLOSE, pos)
  nxt = text.find("<tool_call", pos)
  end = len(text) if close < 0 else close + len(CALL_CLOSE)
  return nxt if 0 <= nxt < end else end


def _check_args(spec: ToolSpec, args: dict) -> tuple[dict, str | None]:
  out = {}
  for key, value in args.items():
    a = spec.arg(key)
    if a is None:
      allowed = ", ".join(x.name for x in spec.args) or "none"
      return out, f"{spec.name} has no argument <{key}> (arguments: {allowed})"
    if a.kind == "int":
      try:
        value = int(value.strip())
      except ValueError:
        return out, f"argument <{key}> of {spec.name} must be an integer, got {value.strip()[:20]!r}"
    out[key] = value
  missing = [a.name for a in spec.args if a.required and a.name not in out]
  if missing:
    return out, f"{spec.name} needs argument(s) {', '.join('<' + m + '>' for m in missing)}"
  return out, None


def parse(text: str, specs: dict[str, ToolSpec]) -> ParseResult:
  """All tool calls in an assistant message; never raises."""
  items: list = []
  pos = 0
  while True:
    loose = CALL_OPEN_LOOSE.search(text, pos)
    if not loose:
      break
    start = loose.start()
    m = CALL_OPEN.match(text, start)
    if not m:
      end = _skip_call(text, loose.end())
      items.append(ParseError('malformed call opening: write <tool_call name="TOOL">',
                              raw=text[start:end]))
      pos = end
      continue
    name = m.group(1).strip()
    spec = specs.get(name)
    args, end, err = _parse_args(text, m.end())
    raw = text[start:end]
    pos = max(end, m.end())
    if err:
      items.append(ParseError(err, tool=name or "?", raw=raw))
      continue
    if spec is None:
      known = ", ".join(sorted(specs))
      items.append(ParseError(f"unknown tool {name!r}; the tools are: {known}", tool=name, raw=raw))
      continue
    checked, err = _check_args(spec, args)
    if err:
      items.append(ParseError(err, tool=name, raw=raw))
    else:
      items.append(ToolCall(name, checked, raw))
  return ParseResult(items)


def format_call(name: str, args: dict) -> str:
  """The canonical text of one call (scripted policies and SFT data write calls with this)."""
  parts = [f'<tool_call name="{name}">']
  for key, value in args.items():
    value = str(value)
    parts.append(f"<{key}>\n{value}\n</{key}>" if "\n" in value else f"<{key}>{value}</{key}>")
  parts.append(CALL_CLOSE)
  return "\n".join(parts)


def tag_tokens(specs: dict[str, ToolSpec]) -> list[str]:
  """The fixed strings of every call to ``specs``: one opener per tool, the closer, and each argument's
  open and close tags. A trained tokenizer holds each as one token (``data/tokenizer.py``)."""
  tags = [f'<tool_call name="{name}">' for name in specs] + [CALL_CLOSE]
  for spec in specs.values():
    tags += [t for a in spec.args for t in (f"<{a.name}>", f"</{a.name}>")]
  return list(dict.fromkeys(tags))


def format_observation(tool: str, text: str, ok: bool = True) -> str:
  status = "ok" if ok else "error"
  return f'<observation tool="{tool}" status="{status}">\n{text}\n</observation>'


OBSERVATION = re.compile(r'<observation tool="([^"]*)" status="(ok|error)">\n(.*?)\n</observation>',
                         re.DOTALL)


def parse_observations(text: str) -> list[tuple[str, bool, str]]:
  """(tool, ok, text) for each observation in a tool message (the inverse of format_observation)."""
  return [(m.group(1), m.group(2) == "ok", m.group(3)) for m in OBSERVATION.finditer(text)]


def describe_tools(specs: dict[str, ToolSpec], brief: bool = False, signatures_only: bool = False) -> str:
  """The tool list for the system prompt; ``brief`` is one line per tool (small models, short
  contexts: ``env.tool_docs=brief``); ``signatures_only`` is one line in all, the call format and
  each tool's arguments (the tiny config: ``env.tool_docs=signatures``)."""
  if signatures_only:
    sigs = "; ".join(f"{s.name}({', '.join(a.name + ('' if a.required else '?') for a in s.args)})"
                     for s in specs.values())
    return f'Call tools as <tool_call name="TOOL"><arg>value</arg></tool_call>. Tools: {sigs}.'
  if brief:
    lines = ['Call tools as <tool_call name="TOOL"><arg>value</arg></tool_call> (raw text). Tools:']
    for spec in specs.values():
      args = ", ".join(a.name + ("" if a.required else "?") for a in spec.args)
      lines.append(f"- {spec.name}({args}): {spec.doc}")
    return "\n".join(lines)
  lines = ["Call tools with this format (argument text is raw; no escaping):",
           '<tool_call name="TOOL">\n<arg_name>value</arg_name>\n</tool_call>', "", "Tools:"]
  for spec in specs.values():
    lines.append(f"- {spec.name}: {spec.doc}")
    for a in spec.args:
      opt = "" if a.required else ", optional"
      lines.append(f"    <{a.name}> ({a.kind}{opt}) {a.doc}")
  return "\n".join(lines)
