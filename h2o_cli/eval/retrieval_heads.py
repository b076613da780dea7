"""Which attention heads copy a planted fact? The retrieval score of every (layer, KV head): what `--recall-lead
auto` names a model's lead head from (`h2o_cli.models.calibration` caches it per weights).

Each probe (`eval/probes.py`: a filler, a needle, a value, a question) short enough for the model's window is
read with a plain full cache and answered greedily. At every answer step that writes the next piece of the
value (matched by characters, so a value the answer tokenizes unlike the needle still counts), each query
head's attention is looked at: its *copy mass* is the attention probability on the needle's tokens. A KV
head's score is its group's copy mass (summed over the query heads that share it: GQA, a KV head recalls for
its whole group), averaged over the pieces of the probes the full cache answers. Only a global layer can
lead (a sliding-window layer keeps no archive); `h2o calibrate` prints the ranking.

Two other scores are kept beside it, for comparison (docs/results.md, "Which head leads"): the copy-paste
score of Wu et al. 2024 ("Retrieval Head Mechanistically Explains Long-Context Factuality": the share of
pieces whose strongest key is a needle token holding that piece, best query head of the group), which a
head that puts its top weight on a sink while it copies never scores; and the question's mass (the group's
attention on the needle from the prompt's last token, over every probe, answered or not).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from h2o_cli.eval.probes import Probe

PROBE = "copy_probe"  # the attention implementation's name while a calibration runs
MAX_NEW_TOKENS = 24  # a UUID takes about 20 tokens


class CopyProbe:
    """Causal attention over one unpadded sequence, registered as a transformers attention function (the
    model's own mask where it passes one: a sliding window's). At a one-token step of a global layer each
    head's strongest key goes to `top` and its attention mass on the `needle` keys to `mass`; a prompt's
    pass puts its last query's mass on them in `asked`. A sliding-window layer attends through sdpa alone
    (its keys are a window, not the stream) and records -1 and 0: every list holds one entry per layer."""

    def __init__(self) -> None:
        self.top: list[torch.Tensor] = []  # per layer call of a one-token step: [n_heads] index of the key
        self.mass: list[torch.Tensor] = []  # per layer call of a one-token step: [n_heads] mass on `needle`
        self.asked: list[torch.Tensor] = []  # per layer call of a prompt: [n_heads] its last query's mass
        self.needle = torch.empty(0, dtype=torch.int64)  # stream indices of the needle's tokens

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from transformers.integrations.sdpa_attention import repeat_kv

        group = query.shape[1] // key.shape[1]
        key, value = repeat_kv(key, group), repeat_kv(value, group)
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        q, k = query.shape[2], key.shape[2]  # causal: the queries are the last q of the k positions
        allowed = torch.ones(q, k, dtype=torch.bool).tril(k - q)
        if attention_mask is not None and attention_mask.dim() == 4:
            mask = attention_mask[..., -q:, :k]
            allowed = allowed & (mask if mask.dtype == torch.bool else mask == 0)
        allowed = allowed.reshape(q, k)  # one sequence, one mask for every head
        heads, windowed = query.shape[1], getattr(module, "is_sliding", False)
        if q > 1 or windowed:  # a prompt's pass (its last query's mass alone), or a window's step
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling)
            if windowed:
                (self.asked if q > 1 else self.mass).append(torch.zeros(heads))
                if q == 1:
                    self.top.append(torch.full((heads,), -1))
            else:
                last = torch.matmul(query[0, :, -1:], key[0].transpose(1, 2)).float() * scaling  # [H, 1, k]
                weights = torch.softmax(last.masked_fill(~allowed[-1:], float("-inf")), dim=-1)
                self.asked.append(weights[:, 0, self.needle].sum(-1))
            return out.transpose(1, 2).contiguous(), None
        logits = (torch.matmul(query, key.transpose(2, 3)) * scaling).float()
        weights = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)  # [1, H, 1, k]
        self.top.append(weights[0, :, 0].argmax(-1))
        self.mass.append(weights[0, :, 0, self.needle].sum(-1))
        out = torch.matmul(weights.to(query.dtype), value)
        return out.transpose(1, 2).contiguous(), None


def value_spans(tokenizer, probe: Probe, head: int) -> list[tuple[int, int, int]]:
    """(stream index, first, end) of every token of `probe.text` that holds characters of a mention of the
    value inside the needle: `first`, `end` the value characters it holds (`head`: tokens read before the
    text)."""
    text, value = probe.text, probe.value
    start = text.index(probe.needle)
    mentions, at = [], probe.needle.find(value)
    while at >= 0:
        mentions.append(start + at)
        at = probe.needle.find(value, at + len(value))
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    spans = []
    for index, (a, b) in enumerate(offsets):
        for mention in mentions:
            first, end = max(a, mention) - mention, min(b, mention + len(value)) - mention
            if first < end:
                spans.append((head + index, first, end))
    return spans


def copy_hits(model, tokenizer, ids: list[int], value: str, spans, probe: CopyProbe):
    """Greedy answer of `ids` with a full cache (the model attending through `probe`, its `needle` set):
    per (layer, query head) how many pieces of `value` the head copied (its top key is a needle token
    holding characters of the piece being written) and its summed attention mass on the needle at those
    steps, each `[n_layers, n_heads]`; the pieces scored; the answer. A piece is an answer token that
    continues the value's characters in order; the prompt's pass writes the first token, unscored. Returns
    (hits, mass, scored, answer)."""
    from transformers import DynamicCache

    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    hits = torch.zeros(layers, heads)
    mass = torch.zeros(layers, heads)
    cache = DynamicCache(config=model.config)
    written, scored, answer = 0, 0, []

    def advance(token: int) -> tuple[int, int] | None:  # the value characters `token` writes next, if any
        piece = tokenizer.decode([token])
        piece = piece.lstrip() if written == 0 else piece
        if piece and value.startswith(piece, written):
            return written, written + len(piece)
        return None

    with torch.no_grad():
        out = model(torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
        token = int(out.logits[0, -1].argmax())
        first = advance(token)
        written = first[1] if first else 0
        for _ in range(MAX_NEW_TOKENS):
            answer.append(token)
            if token == tokenizer.eos_token_id or written >= len(value):  # answered, or done
                break
            probe.top.clear()
            probe.mass.clear()
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            following = int(out.logits[0, -1].argmax())
            piece = advance(following) if written < len(value) else None
            if piece is not None:  # this step's queries chose a piece of the value: a copy from the needle?
                sources = torch.tensor([at for at, a, b in spans if a < piece[1] and b > piece[0]])
                if len(sources):
                    hits += torch.isin(torch.stack(probe.top), sources).float()  # [layers, heads]
                    mass += torch.stack(probe.mass)  # [layers, heads]
                    scored += 1
                written = piece[1]
            token = following
    return hits, mass, scored, tokenizer.decode(answer)


def rank(kv_score: torch.Tensor, candidates: list[bool] | None = None) -> list[dict]:
    """KV heads by score, best first (ties: the later layer, then the later head first):
    `[{"layer", "kv_head", "score"}]` from `kv_score` `[n_layers, n_kv_heads]`, of the layers `candidates`
    marks (default every layer)."""
    layers = range(kv_score.shape[0])
    ranked = sorted(
        ((float(kv_score[layer, head]), layer, head) for layer in layers if candidates is None or candidates[layer]
         for head in range(kv_score.shape[1])), reverse=True,
    )  # fmt: skip
    return [{"layer": layer, "kv_head": head, "score": round(s, 4)} for s, layer, head in ranked]


def calibrate(
    model, tokenizer, probes: Iterable[Probe], progress: Callable[[dict], None] | None = None
) -> dict:
    """The retrieval scores of `model`'s KV heads over `probes` (each inside the model's window).

    Returns {"copied" (pieces scored), "runs": [{filler, kind, depth, value, answer, correct}], "score": per
    layer a list of per-KV-head copy masses `[n_layers][n_kv_heads]` (0 in a sliding-window layer),
    "ranked": [{layer, kv_head, score}] of the global layers, best first, "lead": `lead_of` the ranking,
    "others": the rankings of the other two scores, "argmax" and "question", their best five}. `progress`
    is called with each run's row. The model attends through `CopyProbe` meanwhile, and through its own
    attention again afterwards."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from h2o_cli.cache.families import text_config, windowed_layers

    config = model.config
    layers, heads, kv = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    probe = CopyProbe()
    AttentionInterface.register(PROBE, probe)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE, sdpa_mask)  # the masks sdpa gets: a sliding window's too
    before = config._attn_implementation
    model.set_attn_implementation(PROBE)
    hits, mass, asked = (torch.zeros(layers, heads) for _ in range(3))  # summed over the probes
    copied, runs = 0, []
    try:
        for item in probes:
            ids, head, _ = framed(tokenizer, item)
            spans = value_spans(tokenizer, item, head)
            probe.needle, probe.asked = needle_tokens(tokenizer, item, head), []
            run_hits, run_mass, scored, answer = copy_hits(model, tokenizer, ids, item.value, spans, probe)
            correct = item.value.lower() in answer.lower()
            runs.append(
                {"filler": item.filler, "kind": item.kind, "depth": item.depth, "value": item.value}
                | {"answer": answer, "correct": correct}
            )
            if progress is not None:
                progress(runs[-1])
            asked += torch.stack(probe.asked[:layers])  # the prompt's pass: one entry per layer
            if correct:  # a wrong answer's pieces are not a copy of the needle
                hits, mass, copied = hits + run_hits, mass + run_mass, copied + scored
    finally:
        model.set_attn_implementation(before)
    candidates = [not sliding for sliding in windowed_layers(text_config(model))]
    scores = {
        "copy_mass": (mass / max(1, copied)).view(layers, kv, -1).sum(-1),  # [layers, kv heads]
        "argmax": (hits / max(1, copied)).view(layers, kv, -1).max(-1).values,
        "question": (asked / max(1, len(runs))).view(layers, kv, -1).sum(-1),
    }
    for score in scores.values():
        score[~torch.tensor(candidates)] = 0.0  # a windowed layer's cache keeps its window: no stream index
    ranked = rank(scores["copy_mass"], candidates)
    return {
        "copied": copied,
        "runs": runs,
        "score": [[round(float(s), 4) for s in row] for row in scores["copy_mass"]],
        "ranked": ranked,
        "lead": lead_of(ranked),
        "others": {name: rank(scores[name], candidates)[:5] for name in ("argmax", "question")},
    }


def framed(tokenizer, probe: Probe) -> tuple[list[int], int, int]:
    """`probe` as the model reads it (`read_then_answer`: the frame's head, the text, the question and the
    answer cue): (token ids, tokens before the text, tokens of the question's chunk). A model without a chat
    template has no head: its text comes first, after the BOS token its tokenizer puts before plain text
    (as `h2o chat` does; the base Gemma 3 answers 5 of the 12 tuning probes with it, 2 without)."""
    from h2o_cli.prompting import read_then_answer

    text_ids = tokenizer(probe.text, add_special_tokens=False)["input_ids"]
    pieces = list(read_then_answer(tokenizer, [text_ids], probe.question))
    ids = [token for piece in pieces for token in piece]
    head = len(ids) - len(text_ids) - len(pieces[-1])
    first = tokenizer(probe.question)["input_ids"][:1]
    if not head and first and first[0] == tokenizer.bos_token_id:
        ids, head = first + ids, 1
    return ids, head, len(pieces[-1])


def needle_tokens(tokenizer, probe: Probe, head: int) -> torch.Tensor:
    """Stream indices of the tokens of `probe.text` holding characters of the needle."""
    start = probe.text.index(probe.needle)
    end = start + len(probe.needle)
    offsets = tokenizer(probe.text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return torch.tensor([head + i for i, (a, b) in enumerate(offsets) if a < end and b > start])


def lead_of(ranked: list[dict]) -> list[int] | None:
    """The lead of a ranking: its first head as [layer, kv_head], or None when its score is 0 (no probe
    answered, so no piece was scored; or no layer that can lead attended to the needle)."""
    return [ranked[0]["layer"], ranked[0]["kv_head"]] if ranked and ranked[0]["score"] > 0 else None
