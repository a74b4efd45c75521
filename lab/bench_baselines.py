"""
lab/bench_baselines.py: the Hugging Face baselines of lab.bench, on the same dialogues as the engine.

  hf generate        model.generate on left-padded batches of each side's whole history, run again
                     every turn: the same ids as the engine's contexts (the sampled ids, closed and
                     framed by the same chat edge, rollout.prompt_ids / persuadee_heard /
                     persuader_heard and models.closing_ids), so only the caching differs; probes
                     as full forwards of history + question, batched over dialogues (last-position
                     logits)
  hf generate_batch  model.generate_batch (continuous batching) on the same histories, probes as
                     above. Knobs: warmup=False (its warm-up captures CUDA graphs only) and
                     ContinuousBatchingConfig(num_blocks=) sized to the call's prompts + new tokens
                     (PAGE_SIZE tokens a block): by default it sizes its KV cache to ~90% of free
                     memory (of all RAM on a CPU) and allocates it on every call, which is the
                     ~12 s a call on a CPU. Its other per-call set-up and tear-down (threads, gc)
                     is timed.

Both play as sides of the one episode loop (HistorySide: rollout.rollout_episodes plays them, as
it plays the engine's), so the dialogue logic is the engine's own. A conversation's tokens fed
through the model are counted (fed) so that lab.bench can report what was prefilled twice: every
turn, each side's whole history again.

    PYTHONPATH=. python -m lab.bench --dialogues 2 --turns 1 --max-new-tokens 8   # engine and baselines
"""
import dataclasses
import time

import torch

from persuarena import arena
from persuarena import engine
from persuarena import models
from persuarena import probes
from persuarena import rollout
from lab import bench_workload as workload

PAGE_SIZE = 256     # tokens a continuous-batching block holds (ContinuousBatchingConfig default)


def left_padded(prompts, pad, device):
    """Token-id prompts of unequal length as one left-padded batch: (ids, attention mask)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def hf_generate(model, prompts, cfg, stop, pad, batch_api=False):
    """Transformers' own generation on token-id prompts, each output cut after its first stop id:
    model.generate on a left-padded batch, or generate_batch (continuous batching, its KV pages
    sized to the prompts plus cfg.max_new_tokens each)."""
    if batch_api:
        from transformers import ContinuousBatchingConfig
        tokens = sum(len(q) + cfg.max_new_tokens for q in prompts)
        pages = engine.blocks_for(tokens, PAGE_SIZE) + len(prompts)
        res = list(model.generate_batch(
            inputs=prompts, generation_config=cfg, warmup=False,
            continuous_batching_config=ContinuousBatchingConfig(num_blocks=pages)).values())
        if len(res) != len(prompts) or any(r.error for r in res):
            raise RuntimeError(f"generate_batch failed: {[r.error for r in res]}")
        return [list(r.generated_tokens) for r in res]
    ids, mask = left_padded(prompts, pad, next(model.parameters()).device)
    new = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)[:, ids.shape[1]:]
    return [next((ids[:i + 1] for i, t in enumerate(ids) if t in stop), ids) for ids in new.tolist()]


@dataclasses.dataclass
class History:
    """One episode's context on one side of a baseline: its ids so far, and how many of them have
    gone through the model at most (fed)."""
    ids: list[int]
    fed: int = 0


def fed(st, h, n):
    """n conversation tokens of history h went through the model (run_hf)."""
    workload.add(st, conv=n)
    h.fed = max(h.fed, n)


def hf_read_probes(model, tok, histories, questions, pad, st):
    """The probes of each persuadee history, read by the plain model (one left-padded forward a
    question, no cache): the values of each history."""
    t, values = time.perf_counter(), []
    for q in questions:
        ids, mask = left_padded([h.ids + q for h in histories], pad,
                                next(model.parameters()).device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding shifts positions
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                       logits_to_keep=1).logits[:, -1]
        values.append(probes.values_from_logits(logits, tok).cpu())
        for h in histories:
            fed(st, h, len(h.ids))
            workload.add(st, probe_tokens=len(q))
    workload.add(st, probe=time.perf_counter() - t)
    return torch.stack(values, 1).tolist()


@torch.no_grad()
def run_hf(model, tok, instances, turns, max_new, sync, batch_api=False):
    """The same dialogues with no cache kept between calls: every turn, each side's whole history
    runs through the model again (play_dialogues), by model.generate or generate_batch."""
    from transformers import GenerationConfig
    stop = engine.stop_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=stop,
                           pad_token_id=pad)
    questions, _ = probes.probe_ids(tok)
    st = new_stats()

    def generate(histories):
        prompts = [h.ids for h in histories]
        outs = hf_generate(model, prompts, cfg, stop, pad, batch_api)
        for h, p, ids in zip(histories, prompts, outs):
            fed(st, h, len(p) + len(ids) - 1)  # the last sampled token is never fed
            workload.add(st, gen=len(ids))
        return outs

    def read_probes(histories):
        return hf_read_probes(model, tok, histories, questions, pad, st)
    return play_dialogues(tok, instances, turns, st, generate, read_probes, sync, stop)


def new_stats():
    """A baseline's counters: seconds in persuadee replies and probe reads, message tokens,
    conversation and probe-question tokens through the model, the torch threads it runs on (the
    cores free at its start: lab.bench runs it under engine.cpu_threads)."""
    return dict(reply=0.0, probe=0.0, gen=0, conv=0, probe_tokens=0, threads=[torch.get_num_threads()])


class HistorySide:
    """One role of a baseline that keeps no cache of its own between calls, as a side of the one
    episode loop (rollout.Side): each episode's context is a History of the engine's own ids
    (rollout.prompt_ids, persuadee_heard, persuader_heard, models.closing_ids) around the ids
    the role generated, so that every implementation sees identical contexts and greedy
    decoding must give identical messages. generate(histories) -> the new ids of each (its whole
    history through the model again); a persuadee's read_probes(histories) -> the probe values
    of each, read after b_0's prompt and each reply. The persuadee's replies are timed under
    st["reply"], synced; `played` keeps every episode's history (the roots aside)."""
    max_len = eng = None  # no context check: the workload fits

    def __init__(self, tok, role, stop, generate, read_probes, st, sync):
        self.tokenizer, self.persuadee, self.stop = tok, role == "persuadee", set(stop)
        self.generate, self.read_probes, self.st, self.sync = generate, read_probes, st, sync
        self.histories, self.last, self.played, self.next_sid = {}, {}, [], 0

    def _new(self, history):
        self.next_sid += 1
        self.histories[self.next_sid] = history
        return self.next_sid

    def _said(self, ids):  # (text, how it ended) of generated ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True).strip()
        return text, "stop" if ids and ids[-1] in self.stop else "length"

    def prompt(self, instance):
        return rollout.prompt_ids(self.tokenizer, self.tokenizer, instance)[self.persuadee]

    def room(self, instance, n):
        return True

    def prefill(self, instance):
        return self._new(History(list(self.prompt(instance))))

    def start(self, roots, counts):
        reads = [None] * len(roots)
        if self.persuadee:  # b_0
            reads = [(v, None) for v in self.read_probes([self.histories[r] for r in roots])]
        sids = []
        for r, n in zip(roots, counts):
            root = self.histories.pop(r)
            forks = [History(list(root.ids), root.fed) for _ in range(n)]
            self.played += forks
            sids.append([self._new(h) for h in forks])
        return sids, reads

    def ready(self, sids):
        return list(sids)

    def speak(self, sids, keys):
        said = []
        for s, ids in zip(sids, self.generate([self.histories[s] for s in sids])):
            self.last[s] = ids
            said.append(arena.Message(*self._said(ids), ids))
        return said

    def hear(self, sid, text, final_turn=False, shown=None):
        h = self.histories[sid]
        if self.persuadee:
            h.ids += rollout.persuadee_heard(self.tokenizer, text, final_turn)
            return [], None
        said = self.last.pop(sid)
        heard = rollout.persuader_heard(self.tokenizer, said, text)
        h.ids += said + heard
        return heard, None

    def reply(self, sids, keys, timings=None):
        histories = [self.histories[s] for s in sids]
        t = time.perf_counter()
        outs = self.generate(histories)
        self.sync()
        workload.add(self.st, reply=time.perf_counter() - t)
        replies = []
        for h, ids in zip(histories, outs):
            h.ids += ids + models.closing_ids(self.tokenizer, ids)
            text, reason = self._said(ids)
            replies.append(arena.Reply(text, arena.parse_decision(text), reason))
        for reply, values in zip(replies, self.read_probes(histories)):
            reply.probes = values
        return replies

    def free(self, sid):
        self.histories.pop(sid, None)
        self.last.pop(sid, None)


def play_dialogues(tok, instances, turns, st, generate, read_probes, sync, stop):
    """The dialogues of a baseline, played by rollout.rollout_episodes on two HistorySides
    (generate and read_probes as HistorySide takes them; stop: the ids that end a message).
    Returns st (new_stats) with the wall time, the tokens prefilled twice, the message texts and
    the probe values of each dialogue."""
    persuader, persuadee = (HistorySide(tok, role, stop, generate, read_probes, st, sync)
                            for role in ("persuader", "persuadee"))
    t0 = time.perf_counter()
    episodes = rollout.rollout_episodes(persuader, persuadee, instances, turns, decision="tag")
    st["wall"] = time.perf_counter() - t0
    st["twice"] = st["conv"] - sum(h.fed for side in (persuader, persuadee) for h in side.played)
    st["dialogues"] = [[m["text"] for m in e.transcript] for e in episodes]
    st["probes"] = [e.probes for e in episodes]
    return st
