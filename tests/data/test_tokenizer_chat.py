"""Tokenizer training/loading (incl. tiktoken conversion), byte lengths, chat format and SFT masks."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from composer_jax.data import chat, sources
from composer_jax.data.sft import encode_chat, read_trajectories
from composer_jax.data.tokenizer import (
  bytes_to_unicode,
  load_tokenizer,
  tool_tags,
  train_bpe,
)
from composer_jax.env import protocol


@pytest.fixture(scope="module")
def corpus():
  return [d.read() for d in sources.list_docs("stdlib", max_files=40)]


@pytest.fixture(scope="module")
def tok(corpus):
  return train_bpe(corpus, 400)


TEXT = "def f(x):\n    return x ** 2  # ünïcödé ✓\n"


def test_trained_bpe_round_trips_and_is_deterministic(tok, corpus):
  assert tok.vocab_size == 400
  assert tok.decode(tok.encode(TEXT)) == TEXT
  assert train_bpe(corpus, 400).tok.to_str() == tok.tok.to_str()
  # Special tokens are single ids at the start of the vocabulary.
  for i, s in enumerate(chat.SPECIAL_TOKENS):
    assert tok.token_id(s) == i and tok.encode(s) == [i]
  assert tok.eos_id == 0


def test_byte_lengths_sum_to_utf8_length(tok):
  lengths = tok.byte_lengths()
  ids = tok.encode(TEXT)
  assert int(lengths[ids].sum()) == len(TEXT.encode("utf-8"))
  assert lengths[tok.eos_id] == 0


def test_save_and_load(tok, tmp_path):
  p = str(tmp_path / "tokenizer.json")
  tok.save(p)
  again = load_tokenizer(p)
  assert again.encode(TEXT) == tok.encode(TEXT) and again.vocab_size == tok.vocab_size


def test_tiktoken_file_converts_to_an_equivalent_bpe(tok, tmp_path, corpus):
  # Export the trained byte-level BPE as a tiktoken rank file (rank = id order of byte tokens) and
  # check that the converted tokenizer splits text identically (same pieces, same byte strings).
  inv = {c: b for b, c in bytes_to_unicode().items()}
  special = set(chat.SPECIAL_TOKENS) | set(tool_tags())  # added tokens, not byte sequences
  vocab = sorted(((i, t) for t, i in tok.tok.get_vocab().items() if t not in special))
  lines = [f"{base64.b64encode(bytes(inv[c] for c in t)).decode()} {r}"
           for r, (_, t) in enumerate(vocab)]
  path = tmp_path / "tiktoken.model"
  path.write_text("\n".join(lines) + "\n")
  tt = load_tokenizer(str(path))
  assert tt.vocab_size == len(vocab) + len(chat.SPECIAL_TOKENS)
  offset = len(chat.SPECIAL_TOKENS)
  sample = corpus[0][:2000]
  # The regex pre-split differs from GPT-2's, so compare decoding and pieces of simple words.
  assert tt.decode(tt.encode(sample)) == sample
  for word in ["return", " self", "import", " def", "    "]:
    assert tt.encode(word) == [i - offset for i in tok.encode(word)]
  assert tt.encode(chat.IM_END) == [tt.token_id(chat.IM_END)]


TRAJ = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the bug in a.py"},
    {"role": "assistant", "content": "Let me look.",
     "tool_calls": [{"name": "view", "arguments": {"path": "a.py", "start": 1}}]},
    {"role": "tool", "content": '<observation tool="view" status="ok">\n1  x = 1/0\n</observation>'},
    {"role": "assistant", "content": "Fixed."},
]

CALL_TEXT = '<tool_call name="view">\n<path>a.py</path>\n<start>1</start>\n</tool_call>'


def test_tool_calls_render_as_protocol_xml():
  # Written out by hand: the adapter must produce protocol.py's XML, nothing of the old JSON format.
  assert chat.render_tool_calls(TRAJ[2]["tool_calls"]) == CALL_TEXT
  assert chat.assistant_text(TRAJ[2]) == "Let me look.\n" + CALL_TEXT
  body = "".join(t for t, _ in chat.render_segments(TRAJ))
  assert chat.CALLS_BEGIN not in body and chat.CALL_BEGIN not in body
  assert ("<|im_system|>tool<|im_middle|><observation tool=\"view\" status=\"ok\">\n1  x = 1/0\n"
          "</observation><|im_end|>") in body


def test_sft_mask_covers_exactly_the_assistant_tokens(tok):
  ex = encode_chat(TRAJ, tok)
  ids, mask = ex["tokens"], ex["loss_mask"]
  assert ids.shape == mask.shape and set(np.unique(mask)) == {0, 1}
  trained = tok.decode(ids[mask == 1])
  want = "Let me look.\n" + CALL_TEXT + chat.IM_END + "Fixed." + chat.IM_END
  assert trained == want
  assert tok.decode(ids) == "".join(t for t, _ in chat.render_segments(TRAJ))
  # Segment-wise encoding: a conversation's ids are its messages' ids concatenated (the RL agent
  # encodes one observation message at a time and must see the same tokens).
  ids2, mask2 = [], []
  for m in TRAJ:
    i, k = chat.encode_segments([m], tok)
    ids2 += i
    mask2 += k
  assert ids2 == ids.tolist() and mask2 == mask.tolist()
  # The sampler opens a turn with generation_prompt(): the very header SFT encodes for assistants.
  assert chat.render_segments([TRAJ[4]])[0] == (chat.generation_prompt(), False)


def test_tool_calls_parse_back():
  text = chat.assistant_text(TRAJ[2]) + chat.IM_END + "junk after the end"
  content, calls = chat.parse_tool_calls(text)
  assert content == "Let me look."
  assert calls == [{"name": "view", "arguments": {"path": "a.py", "start": 1}}]
  # A malformed call is left out of the calls (the episode reports it as an error observation).
  content, calls = chat.parse_tool_calls('hi <tool_call name="view"><path>a.py</tool_call>')
  assert calls == [] and content == "hi"


def test_sft_example_parses_into_the_calls_it_encodes(tok, tmp_path):
  # End to end: a JSONL record read by read_trajectories, encoded by encode_chat; the assistant
  # tokens of each turn decode to text that protocol.parse turns back into exactly those calls.
  from composer_jax.env import protocol
  from composer_jax.env.tools import SPECS
  calls = [{"name": "str_replace",
            "arguments": {"path": "pkg/m.py", "old": "    return a + b\n", "new": "    return a - b"}},
           {"name": "terminal", "arguments": {"command": "python -c 'print(1)'", "timeout": 5}},
           {"name": "submit", "arguments": {}}]
  traj = [TRAJ[0], TRAJ[1], {"role": "assistant", "content": "Edit then test.", "tool_calls": calls},
          {"role": "tool", "content": protocol.format_observation("str_replace", "ok")}]
  p = tmp_path / "t.jsonl"
  p.write_text(json.dumps({"messages": traj}) + "\n")
  (msgs,) = read_trajectories(str(p))
  ex = encode_chat(msgs, tok)
  ids, mask = ex["tokens"], ex["loss_mask"]
  text = tok.decode(ids[mask == 1])
  assert text.endswith(chat.IM_END)
  parsed = protocol.parse(text.split(chat.IM_END)[0], SPECS)
  assert not parsed.errors
  assert [(c.name, c.args) for c in parsed.calls] == [(c["name"], c["arguments"]) for c in calls]
  assert chat.parse_tool_calls(text)[1] == calls


def test_read_trajectories_reports_bad_lines(tmp_path):
  from composer_jax.config import ConfigError
  good = tmp_path / "t.jsonl"
  good.write_text(json.dumps({"messages": TRAJ}) + "\n")
  assert read_trajectories(str(good)) == [TRAJ]
  bad = tmp_path / "b.jsonl"
  bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
  with pytest.raises(ConfigError, match="line 1.*role"):
    read_trajectories(str(bad))
  with pytest.raises(ConfigError, match="data.sft_path"):
    read_trajectories(str(tmp_path / "none.jsonl"))


def test_tool_call_tags_are_one_token_each(tok):
  # Every fixed piece of a call is one id at the end of the vocabulary, and the requested size holds
  # them; the tags decode to their text and count their bytes in bits/byte.
  tags = tool_tags()
  assert len(tags) == len(set(tags)) == 35
  ids = [tok.encode(t) for t in tags]
  assert all(len(i) == 1 for i in ids)
  assert sorted(i[0] for i in ids) == list(range(tok.vocab_size - len(tags), tok.vocab_size))
  call = protocol.format_call("str_replace", {"path": "a.py", "old": "    return x<y", "new": "x\n</y>"})
  pieces = [tok.decode([i]) for i in tok.encode(call)]
  assert pieces[0] == '<tool_call name="str_replace">' and pieces[-1] == "</tool_call>"
  for tag in ("<path>", "</path>", "<old>", "</old>", "<new>", "</new>"):
    assert pieces.count(tag) == 1
  assert "".join(pieces) == tok.decode(tok.encode(call)) == call
  assert int(tok.byte_lengths()[tok.encode(call)].sum()) == len(call.encode("utf-8"))
  # Code that merely resembles a tag keeps its ordinary pieces.
  assert tok.decode(tok.encode("if a <b> c: pass")) == "if a <b> c: pass"
