"""The run loop shared by every stage: set up, restore, step, log, evaluate, checkpoint, plot.

A run directory holds:
  config.yaml        the resolved config
  tokenizer.json     the tokenizer (trained here, or copied from --init / data.tokenizer)
  metrics.jsonl      one JSON object per logged step (step, loss, ce, grad_norm, lr, tokens_per_s,
                     model_flops_per_s, expert_max_violation, ...) and eval lines (eval_bpb)
  tb/                TensorBoard events
  checkpoints/<step> Orbax checkpoints (params, optimizer, router bias, RNG, step, data state, meta)
  plots/*.png        loss / grad-norm / lr / throughput / eval curves
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.config import Config, ConfigError, dump_config
from composer_jax.data import pipeline, sources
from composer_jax.data.tokenizer import Tokenizer, load_tokenizer, min_trained_vocab, train_bpe
from composer_jax.parallel.multihost import (
  barrier,
  gather_state,
  is_primary,
  local_state,
)
from composer_jax.train import checkpoint as ckpt_lib
from composer_jax.train import fit
from composer_jax.train import optim
from composer_jax.train.step import (
  make_eval_step,
  make_train_step,
  param_axes,
  split_model,
)


def _items(state: dict) -> dict:
  """Checkpoint items (Orbax saves pytrees, not bare scalars: step and RNG travel together)."""
  return {"params": state["params"], "rest": state["rest"], "opt_state": state["opt_state"],
          "misc": {"step": state["step"], "rng": state["rng"]}}


def _from_items(items: dict) -> dict:
  return {"params": items["params"], "rest": items["rest"], "opt_state": items["opt_state"],
          **items["misc"]}


def _log(msg: str) -> None:
  print(msg, flush=True)


# --------------------------------------------------------------------------------------------------
# Tokenizer and data
# --------------------------------------------------------------------------------------------------


def _training_sample(texts: list[str], max_bytes: int) -> list[str]:
  out, total = [], 0
  for t in texts:
    out.append(t)
    total += len(t)
    if total >= max_bytes:
      break
  return out


def get_tokenizer(cfg: Config, out_dir: str, corpus_texts: Callable[[], list[str]],
                  init_dir: str | None = None) -> Tokenizer:
  """The run's tokenizer: reuse the run dir's, else --init's, else data.tokenizer (train or load)."""
  path = os.path.join(out_dir, "tokenizer.json")
  init_tok = os.path.join(init_dir, "tokenizer.json") if init_dir else None
  if os.path.exists(path):
    tok = load_tokenizer(path)
  elif init_tok and os.path.exists(init_tok):
    tok = load_tokenizer(init_tok)
  elif cfg.data.tokenizer == "train" and not is_primary():  # process 0 trains it; read its file
    barrier("tokenizer")
    tok = load_tokenizer(path)
  elif cfg.data.tokenizer == "train":
    size = cfg.data.tokenizer_vocab_size or cfg.model.vocab_size
    if size < min_trained_vocab():  # a model this small may load a tokenizer, but not train one
      raise ConfigError(f"model.vocab_size={size} is too small to train a tokenizer: give at least "
                        f"{min_trained_vocab()}, or a tokenizer file in data.tokenizer")
    t0 = time.perf_counter()
    tok = train_bpe(_training_sample(corpus_texts(), int(cfg.data.tokenizer_train_mb * 2**20)), size)
    _log(f"trained a {tok.vocab_size}-token BPE in {time.perf_counter() - t0:.1f}s")
    tok.save(path)
    barrier("tokenizer")
  else:
    if not os.path.exists(cfg.data.tokenizer):
      raise ConfigError(f"data.tokenizer={cfg.data.tokenizer!r} does not exist: give 'train', a "
                        "tokenizer.json or a tiktoken model file")
    tok = load_tokenizer(cfg.data.tokenizer)
  if tok.vocab_size > cfg.model.vocab_size:
    raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                      f"{tok.vocab_size} tokens: raise model.vocab_size")
  if is_primary() and not os.path.exists(path):
    tok.save(path)
  return tok


@dataclass
class Data:
  train: Any  # grain IterDataset of batches
  eval: list  # fixed held-out batches (may be empty)
  tokenizer: Tokenizer


def build_data(cfg: Config, out_dir: str, stage: str, init_dir: str | None = None) -> Data:
  d = cfg.data
  corpus = sources.load_corpus(d.sources, d.weights, heldout_fraction=d.heldout_fraction,
                               max_files=d.max_files, text_field=d.text_field)
  tok = get_tokenizer(cfg, out_dir, lambda: corpus.train[0], init_dir)
  pi, pc = jax.process_index(), jax.process_count()
  if stage == "sft":
    from composer_jax.data.sft import encode_chat, read_trajectories, with_drills
    trajs = with_drills(read_trajectories(d.sft_path), d.sft_copy_share, corpus.train[0], d.seed,
                        d.sft_spec_share, d.sft_word_share, spec_levels=tuple(d.sft_spec_levels))
    train = pipeline.records_dataset(trajs, lambda m: encode_chat(m, tok), seq_len=d.seq_len,
                                     batch_size=d.batch_size, seed=d.seed, process_index=pi,
                                     process_count=pc)
  else:
    train = pipeline.pretrain_dataset(corpus.train, corpus.weights, tok, seq_len=d.seq_len,
                                      batch_size=d.batch_size, seed=d.seed, process_index=pi,
                                      process_count=pc)
  local_bs = pipeline.local_batch_size(d.batch_size, pc)
  evals = pipeline.eval_batches(corpus.heldout[pi::pc], tok, seq_len=d.seq_len,
                                batch_size=local_bs, n_batches=cfg.train.eval_batches)
  if pc > 1 and corpus.heldout:  # every process must run the same number of eval steps
    empty = {k: np.zeros((local_bs, d.seq_len), np.int32) for k in pipeline.FEATURES}
    evals += [empty] * (cfg.train.eval_batches - len(evals))
  return Data(train, evals, tok)


# --------------------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------------------


@dataclass
class Trainer:
  cfg: Config
  mesh: Any
  graphdef: Any
  state: dict
  state_shardings: dict
  batch_sharding: Any
  tx: Any
  lr_fn: Callable
  step_fn: Callable
  eval_fn: Callable


def _activate(mesh, rules, cfg: Config):
  """The mesh/rules context for the model's activation constraints (none needed on one device)."""
  import contextlib

  from composer_jax.parallel.rules import activate
  if mesh.size == 1:
    return contextlib.nullcontext()
  return activate(mesh, rules, ep_strategy=cfg.mesh.ep_strategy)


def build_trainer(cfg: Config, mesh=None, loss_fn: Callable | None = None,
                  batch_keys: tuple[str, ...] | None = None, materialize: bool = True) -> Trainer:
  """Model on its shardings, optimizer state sharded like the params, the jitted step.

  ``loss_fn`` replaces the LM loss (contract in ``step.lm_loss_fn``), e.g. the RL policy loss; the
  step (sharding, optimizer, accumulation, router bias, QK-clip) is the same. Every batch leaf is
  sharded on its leading (batch) dim whatever its rank; ``batch_keys``, when given, fixes the batch
  dict's keys (the jitted step then rejects a batch with other keys).

  ``materialize=False`` leaves ``state`` abstract (ShapeDtypeStructs on their shardings) for a
  checkpoint restore; ``init_state`` fills it otherwise. Nothing random is built before then.
  """
  from composer_jax.model import abstract_model
  from composer_jax.parallel.mesh import build_mesh
  from composer_jax.parallel.rules import context_jit, make_rules, state_shardings
  mesh = mesh if mesh is not None else build_mesh(cfg.mesh)
  rules = make_rules(cfg.mesh.rules)
  graphdef, params, rest = split_model(abstract_model(cfg))
  lr_fn = optim.schedule(cfg.optim, cfg.train.steps)
  tx = optim.build_optimizer(cfg.optim, cfg.train.steps, params, param_axes(params))
  repl = NamedSharding(mesh, P())
  p_sh = state_shardings(params, mesh, rules)
  r_sh = state_shardings(rest, mesh, rules)
  o_sh = optim.state_shardings(tx, params, p_sh, repl)
  shardings = {"params": p_sh, "rest": r_sh, "opt_state": o_sh, "step": repl, "rng": repl}
  rng = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
  state = {"params": params, "rest": rest, "opt_state": jax.eval_shape(tx.init, params),
           "step": jax.ShapeDtypeStruct((), jnp.int32), "rng": rng}
  state = {k: _on(v, shardings[k]) for k, v in state.items()}
  batch_axes = tuple(a for a in ("data", "fsdp", "expert") if mesh.shape[a] > 1)
  # One spec for every rank: the leading dim is the batch, the rest replicated.
  batch_sharding = NamedSharding(mesh, P(batch_axes or None))
  batch_in = {k: batch_sharding for k in batch_keys} if batch_keys else batch_sharding
  # The mesh context (for the model's activation constraints) must wrap the jitted call: it is read
  # while tracing, and jax.set_mesh may not be entered inside jit.
  # context_jit: one trace per active (mesh, rules, EP strategy), which jax.jit's key does not see.
  jit_step = context_jit(make_train_step(graphdef, cfg, tx, lr_fn, loss_fn),
                         in_shardings=(shardings, batch_in),
                         out_shardings=(shardings, None), donate_argnums=(0,))
  jit_eval = context_jit(make_eval_step(graphdef), in_shardings=(p_sh, r_sh, batch_sharding, repl))

  def step_fn(state, batch):
    with _activate(mesh, rules, cfg):
      return jit_step(state, batch)

  def eval_fn(params, rest, batch, byte_lengths):
    with _activate(mesh, rules, cfg):
      return jit_eval(params, rest, batch, byte_lengths)

  tr = Trainer(cfg, mesh, graphdef, state, shardings, batch_sharding, tx, lr_fn, step_fn, eval_fn)
  if materialize:
    init_state(tr)
  return tr


def _on(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying their shardings (``shardings`` may stop at nnx.Variable nodes)."""
  is_sh = lambda x: isinstance(x, jax.sharding.Sharding)
  sh = jax.tree.leaves(shardings, is_leaf=is_sh)
  leaves = jax.tree.leaves(abstract)
  return jax.tree.unflatten(jax.tree.structure(abstract), [
      jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(leaves, sh)])


def init_state(tr: Trainer, params: Any = None, rest: Any = None) -> None:
  """Fill ``tr.state``: the model's seeded random init (or the given weights), a fresh optimizer
  state initialised from them (its float32 master copy included), step 0, the seed's RNG."""
  from composer_jax.model import build_model
  from composer_jax.parallel.rules import make_rules
  cfg = tr.cfg
  if params is None:
    rules = make_rules(cfg.mesh.rules)
    with _activate(tr.mesh, rules, cfg):
      model = build_model(cfg, tr.mesh, seed=cfg.train.seed, rules=rules)
    _, params, rest = split_model(model)
  sh = tr.state_shardings
  params, rest = jax.device_put(params, sh["params"]), jax.device_put(rest, sh["rest"])
  opt_state = jax.jit(tr.tx.init, out_shardings=sh["opt_state"])(params)
  rng = jax.random.key_data(jax.random.key(cfg.train.seed))
  tr.state = {"params": params, "rest": rest, "opt_state": opt_state,
              "step": jax.device_put(jnp.zeros((), jnp.int32), sh["step"]),
              "rng": jax.device_put(rng, sh["rng"])}


def check_batch(cfg: Config, tr: Trainer) -> None:
  """data.batch_size must split over the batch-sharded mesh axes, once per accumulation step."""
  lead = tr.batch_sharding.spec[0] if len(tr.batch_sharding.spec) else None
  names = (lead,) if isinstance(lead, str) else tuple(lead or ())  # one axis is a bare name
  shards = int(np.prod([tr.mesh.shape[a] for a in names]))
  micro = cfg.data.batch_size // cfg.train.grad_accum
  if micro % shards:
    axes = " x ".join(f"mesh.{a}={tr.mesh.shape[a]}" for a in names)
    raise ConfigError(f"data.batch_size={cfg.data.batch_size} (/ train.grad_accum="
                      f"{cfg.train.grad_accum}) does not split over the batch axes {axes}: make "
                      f"each accumulation step's batch a multiple of {shards}")


def put_batch(tr: Trainer, batch: dict) -> dict:
  """Every leaf (any rank, leading dim = batch) onto the batch sharding."""
  if jax.process_count() > 1:
    return jax.tree.map(lambda v: jax.make_array_from_process_local_data(tr.batch_sharding, v), batch)
  return jax.device_put(batch, tr.batch_sharding)


def evaluate(tr: Trainer, batches: list, byte_lengths) -> float:
  """Held-out bits per byte over the fixed evaluation batches."""
  bits = nbytes = 0.0
  for b in batches:
    x, n = tr.eval_fn(tr.state["params"], tr.state["rest"], put_batch(tr, b), byte_lengths)
    bits += float(x)
    nbytes += float(n)
  return bits / max(nbytes, 1.0)


# --------------------------------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------------------------------


class MetricsLog:
  """metrics.jsonl + TensorBoard. On resume, lines past the restored step are dropped. Only process
  0 writes (every process holds the same global metrics)."""

  def __init__(self, out_dir: str, start_step: int):
    self.path = os.path.join(out_dir, "metrics.jsonl")
    self.file = self.tb = None
    if not is_primary():
      return
    kept = []
    if os.path.exists(self.path):
      with open(self.path) as f:
        for line in f:
          try:
            rec = json.loads(line)
          except json.JSONDecodeError:  # a line cut short by a kill
            continue
          if rec.get("step", 0) <= start_step:
            kept.append(line if line.endswith("\n") else line + "\n")
    with open(self.path, "w") as f:
      f.writelines(kept)
    self.file = open(self.path, "a")  # noqa: SIM115 -- held open for the run, closed in close()
    from tensorboardX import SummaryWriter
    self.tb = SummaryWriter(os.path.join(out_dir, "tb"), purge_step=start_step + 1)

  def write(self, record: dict) -> None:
    if self.file is None:
      return
    self.file.write(json.dumps(record) + "\n")
    self.file.flush()
    for k, v in record.items():
      if k != "step" and isinstance(v, (int, float)):
        self.tb.add_scalar(k, v, record["step"])

  def close(self) -> None:
    if self.file is not None:
      self.file.close()
      self.tb.close()


PLOT_KEYS = ("loss", "ce", "mtp_ce", "eval_bpb", "grad_norm", "lr", "tokens_per_s",
             "expert_max_violation")


def plot_metrics(out_dir: str, keys: tuple = PLOT_KEYS) -> list[str]:
  """PNG curves from metrics.jsonl, one file per metric (written under plots/)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  path = os.path.join(out_dir, "metrics.jsonl")
  if not is_primary() or not os.path.exists(path):
    return []
  with open(path) as f:
    recs = [json.loads(line) for line in f if line.strip()]
  series: dict[str, tuple[list, list]] = {}
  for r in recs:
    for k, v in r.items():
      if k != "step" and isinstance(v, (int, float)):
        series.setdefault(k, ([], []))
        series[k][0].append(r["step"])
        series[k][1].append(v)
  os.makedirs(os.path.join(out_dir, "plots"), exist_ok=True)
  written = []
  for k in keys:
    if k not in series:
      continue
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(*series[k], marker="o" if k == "eval_bpb" else None, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(k)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = os.path.join(out_dir, "plots", f"{k}.png")
    fig.savefig(out, dpi=80)
    plt.close(fig)
    written.append(out)
  return written


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def _meta(cfg: Config, step: int, stage: str) -> dict:
  return {"step": step, "stage": stage, "config": cfg.to_dict()}


def run(cfg: Config, out_dir: str, *, stage: str = "pretrain", resume: bool = False,
        init: str | None = None) -> dict:
  """Train ``cfg.train.steps`` steps into ``out_dir``; returns the final metrics."""
  from composer_jax.model import flops_per_token
  os.makedirs(out_dir, exist_ok=True)
  from composer_jax.train import init as init_lib
  kind = init_lib.init_kind(init) if init else None
  init_dir = None
  if kind == "run":
    init_ckpt_dir, _ = ckpt_lib.find_checkpoint(init)
    if not os.path.isdir(init_ckpt_dir):
      raise ConfigError(f"--init {init!r} is not a run, checkpoint, converted or HF directory")
    init_dir = os.path.dirname(init_ckpt_dir)
  elif kind:
    init_dir = init
  tr = build_trainer(cfg, materialize=False)  # abstract: nothing compiled or allocated yet
  check_batch(cfg, tr)
  fit.check_training(cfg)  # before the data and the weights
  data = build_data(cfg, out_dir, stage, init_dir)
  byte_lengths = jax.device_put(data.tokenizer.byte_lengths(), NamedSharding(tr.mesh, P()))
  ck = ckpt_lib.Checkpointer(os.path.join(out_dir, "checkpoints"), keep=cfg.checkpoint.keep,
                             every=cfg.checkpoint.every, async_save=cfg.checkpoint.async_save)
  it = iter(data.train)
  start = 0
  # Restored straight into the abstract state: a corrupt step falls back (one line), an
  # incompatible one stops (IncompatibleCheckpoint, one line naming the array and config fields).
  restored = (ck.restore_latest(_items(tr.state), log=_log, config=cfg.to_dict())
              if resume else None)
  if restored is not None:
    start, items = restored
    tr.state = _from_items(items)
    it.set_state(local_state(items["data"], "data iterator state"))
    _log(f"resumed from {ck.directory}/{start}")
  elif init:
    from composer_jax.parallel.rules import make_rules
    abstract = {"params": tr.state["params"], "rest": tr.state["rest"]}
    params, rest, src = init_lib.load_weights(init, kind, cfg, tr.graphdef, abstract, tr.mesh,
                                              make_rules(cfg.mesh.rules), log=_log)
    init_state(tr, params, rest)
    _log(f"initialised weights from {src}" + (" (resume found no checkpoint)" if resume else ""))
  else:
    if resume:
      _log(f"--resume: no checkpoint in {ck.directory} yet; starting from step 0")
    init_state(tr)
  # Only now: a resume that stopped on an incompatible checkpoint leaves the old config in place.
  if is_primary():
    dump_config(cfg, os.path.join(out_dir, "config.yaml"))
  log = MetricsLog(out_dir, start)
  total = cfg.train.steps
  tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
  fpt = flops_per_token(cfg, cfg.data.seq_len)
  eval_every = cfg.train.eval_every
  last: dict = {}
  if start == 0 and data.eval:
    bpb = evaluate(tr, data.eval, byte_lengths)
    log.write({"step": 0, "eval_bpb": bpb})
    _log(f"step 0: held-out {bpb:.4f} bits/byte")
  from tqdm import tqdm
  bar = tqdm(total=total, initial=start, disable=not cfg.train.progress or not is_primary(),
             unit="step", dynamic_ncols=True)
  t_last = time.perf_counter()
  for step in range(start + 1, total + 1):
    batch = put_batch(tr, next(it))
    tr.state, metrics = tr.step_fn(tr.state, batch)
    if step % cfg.train.log_every == 0 or step == total:
      rec = {"step": step, **{k: float(v) for k, v in metrics.items()}}
      now = time.perf_counter()
      dt = (now - t_last) / (cfg.train.log_every if step % cfg.train.log_every == 0 else 1)
      t_last = now
      rec["tokens_per_s"] = tokens_per_step / dt
      rec["model_flops_per_s"] = fpt * tokens_per_step / dt
      log.write(rec)
      last = rec
      bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
    bar.update(1)
    if data.eval and ((eval_every > 0 and step % eval_every == 0) or step == total):
      bpb = evaluate(tr, data.eval, byte_lengths)
      log.write({"step": step, "eval_bpb": bpb})
      last["eval_bpb"] = bpb
      bar.write(f"step {step}: held-out {bpb:.4f} bits/byte")
      t_last = time.perf_counter()
    if ck.should_save(step, total):
      ck.save(step, _items(tr.state), gather_state(it.get_state()), _meta(cfg, step, stage))
  bar.close()
  ck.close()
  log.close()
  plots = plot_metrics(out_dir)
  _log(f"done: {total} steps in {out_dir} (metrics.jsonl, {len(plots)} plots, checkpoints "
       f"{ck.steps()})")
  return last


def heldout_bpb(tr: Trainer, data: Data) -> float:
  byte_lengths = jax.device_put(data.tokenizer.byte_lengths(), NamedSharding(tr.mesh, P()))
  return evaluate(tr, data.eval, byte_lengths)
