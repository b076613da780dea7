"""An independent, deliberately naive simulation of SPEC.md, for tests only.

Full K/V history is kept; evictions are per-KV-head masks; every rule is applied literally, one entry at a
time, with Python loops over heads. It imports nothing from h2o_cli (tests/test_naive.py checks): rotary
frequencies come from the model config, the slot split (heavy, recent, recall) is the contract's arithmetic
written out here from the settings' plain fields, and attention and eviction are written out here too. The
settings object is only read as data (`budget` in tokens, `policy`, `heavy_ratio`, ...), never asked to
compute anything.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch


def inv_freq_of(config, head_dim: int) -> torch.Tensor:
    params = getattr(config, "rope_parameters", None) or {}
    assert params.get("rope_type", "default") == "default", "naive reference covers default RoPE only"
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def rope(x: torch.Tensor, position: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., n, d] at integer positions [n] (rotate-half convention), in float64."""
    angles = position.double()[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x.double() * cos + rotated.double() * sin


class NaiveHeadState:
    """One KV head: every token ever seen, with an alive mask and accumulated scores."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []  # unrotated
        self.values: list[torch.Tensor] = []
        self.alive: list[bool] = []
        self.score: list[float] = []
        self.seen: list[int] = []
        self.last: list[float] = []
        self.carried: dict[int, float] = {}  # recall, attention score: each page's last score

    def alive_indices(self) -> list[int]:
        return [t for t, a in enumerate(self.alive) if a]


def recall_slots(settings) -> int:
    """r: slots per KV head refilled from the archive for `recall`, `round(k × recall_ratio)` but never more than
    `k − 2` (docs/spec.md)."""
    if settings.policy != "recall":
        return 0
    return max(0, min(round(settings.budget * settings.recall_ratio), settings.budget - 2))


def resident_budget(settings) -> int:
    """Entries a head keeps after a step: the budget `k`, less the recall slots for `recall` (|S| = k − r)."""
    return settings.budget - recall_slots(settings)


def heavy_slots(settings) -> int:
    """Slots kept for what the entries are: `round(|S| × heavy_ratio)` for h2o, recall (of its resident set)
    and tova; the first `sinks` tokens for sink; none for the window policies (SPEC.md, docs/spec.md)."""
    if settings.policy in ("h2o", "recall", "tova"):
        return round(resident_budget(settings) * settings.heavy_ratio)
    if settings.policy == "sink":
        return settings.sinks
    return 0


def recent_slots(settings) -> int:
    """Slots for the newest entries: `recent = |S| − heavy`."""
    return resident_budget(settings) - heavy_slots(settings)


def choose_victim(head: NaiveHeadState, settings) -> int:
    """SPEC step 4, literally: one entry to evict from this head."""
    alive = head.alive_indices()  # token order
    policy = settings.policy
    if policy == "local":
        return alive[0]
    if policy == "sink":
        return next(t for t in alive if t >= settings.sinks)
    recent = recent_slots(settings)
    candidates = alive[: len(alive) - recent] if recent else alive
    if policy in ("h2o", "recall"):  # recall manages its resident set exactly as h2o
        candidates = [t for t in candidates if t >= settings.h2o_sinks]  # explicit sinks stay
        if settings.score_norm == "mean":
            key = {t: head.score[t] / max(head.seen[t], 1) for t in candidates}
        else:
            key = {t: head.score[t] for t in candidates}
    elif policy == "tova":
        key = {t: head.last[t] for t in candidates}
    else:
        raise AssertionError(policy)
    best = min(key.values())
    return min(t for t in candidates if key[t] == best)  # ties go to the oldest


def choose_victim_pinned(head: NaiveHeadState, settings, pinned: frozenset) -> int:
    """SPEC step 4 with pinned tokens (docs/spec.md, pinned tokens), literally: the policy's candidates as
    `choose_victim` finds them, less the pinned tokens, by the same key; when pins leave none, the oldest
    unpinned entry."""
    alive = head.alive_indices()
    free = [t for t in alive if t not in pinned]
    policy = settings.policy
    if policy == "local":
        return free[0]
    if policy == "sink":
        return next((t for t in free if t >= settings.sinks), free[0])
    recent = recent_slots(settings)
    candidates = [t for t in (alive[: len(alive) - recent] if recent else alive) if t not in pinned]
    if policy in ("h2o", "recall"):
        candidates = [t for t in candidates if t >= settings.h2o_sinks]
        seen = {t: max(head.seen[t], 1) if settings.score_norm == "mean" else 1 for t in candidates}
        key = {t: head.score[t] / seen[t] for t in candidates}
    elif policy == "tova":
        key = {t: head.last[t] for t in candidates}
    else:
        raise AssertionError(policy)
    if not candidates:
        return free[0]
    best = min(key.values())
    return min(t for t in candidates if key[t] == best)


def naive_recall(
    head: NaiveHeadState,
    queries: torch.Tensor,
    first_token: int,
    chunk: int,
    settings,
    inv_freq,
    weighed: int = 0,
    question: bool = False,
) -> list[int]:
    """R of one KV head for a chunk (docs/spec.md, recall pass 1), literally; no archive cap.

    queries: [m, d] unrotated, the chunk's queries of the head's query heads. `head` already holds the chunk.
    A page's bound comes from every key archived so far (up to the chunk's last token): the best of its blocks'
    (`block_size` tokens each, the page by default). With the positional
    page score (and the attention score) each query is first replaced by the mean of its rotations over the
    distances from the recent slots of S up to the most E_q entries (rolling) or the tokens seen (original).
    The attention score ranks a page by the softmax mass the queries put on its keys (their mean), over every archived key
    (with a shortlist: over the keys of the pages whose summary bound is highest, or on a one-token step with
    `page_carry` of the `step_shortlist` (0: `shortlist`) whose last score is; the others score 0; a `question` scores every page), plus
    `page_carry` times the page's score at the head's last choice when the chunk is one token (whose mass is over
    the keys rounded to float16); a chunk of c > 1 tokens starts afresh, its mass times min(c, `chunk_weight`).
    """
    size = settings.page_size
    candidates = [t for t in range(first_token) if not head.alive[t]]
    if settings.page_score in ("positional", "attention"):
        high = settings.budget + chunk if settings.positions == "rolling" else first_token + chunk
        distances = range(min(recent_slots(settings), high - 1), high)
        queries = torch.stack([rope(queries, torch.tensor([d] * len(queries)), inv_freq) for d in distances])
        queries = queries.mean(dim=0)

    block = getattr(settings, "block_size", None) or size

    def block_bound(start: int) -> float:
        keys = torch.stack(head.keys[start : start + block]).double()
        low, high = keys.min(dim=0).values, keys.max(dim=0).values
        return max(float(torch.maximum(q * high, q * low).sum()) for q in queries.double())

    def bound(page: int) -> float:  # the best of the page's blocks that hold a key
        starts = range(page * size, (page + 1) * size, block)
        return max(block_bound(start) for start in starts if start < len(head.keys))

    if settings.page_score == "attention":  # each query's softmax over the scored pages' keys, summed
        written = range(-(-len(head.keys) // size))
        scored = list(written)
        shortlist = getattr(settings, "shortlist", 0)
        carry = getattr(settings, "page_carry", 0.0)
        stepping = bool(carry) and chunk == 1
        if stepping and shortlist:  # a step's own shortlist (0: the chunks')
            shortlist = getattr(settings, "step_shortlist", 0) or shortlist
        if question or not shortlist or len(scored) <= shortlist:
            pass  # a question scores every page
        elif stepping:  # a step: the pages its last scores rank best (ties: the older)
            scored = sorted(scored, key=lambda page: (-head.carried.get(page, 0.0), page))[:shortlist]
        else:  # the pages the summaries bound best (ties: the older)
            scored = sorted(scored, key=lambda page: (-bound(page), page))[:shortlist]
        tokens = [t for page in scored for t in range(page * size, min((page + 1) * size, len(head.keys)))]
        keys = torch.stack([head.keys[t] for t in tokens]).double()
        if stepping:  # a one-token step scores its pages' keys rounded to float16 (clamped to its range)
            keys = keys.clamp(-65504.0, 65504.0).half().double()
        probs = torch.softmax(queries.double() @ keys.T * queries.shape[-1] ** -0.5, dim=-1).mean(dim=0)
        mass = dict.fromkeys(written, 0.0)  # pages outside the shortlist: 0
        for t, p in zip(tokens, probs.tolist(), strict=True):
            mass[t // size] += p
        # The last score's share, page by page; a chunk of more than one token starts afresh, weighing
        last = head.carried if chunk == 1 else {}
        weight = (
            1.0 if chunk == 1 else min(weighed or chunk, getattr(settings, "chunk_weight", 1.0))
        )  # min(c, N)
        mass = {page: weight * score + carry * last.get(page, 0.0) for page, score in mass.items()}
        head.carried = mass

        def bound(page: int) -> float:  # noqa: F811 - the attention mass replaces the bound
            return mass[page]

    order = sorted({t // size for t in candidates}, key=lambda page: (-bound(page), page))
    return [t for page in order for t in candidates if t // size == page][: recall_slots(settings)]


def naive_attend_chunk(
    heads, queries, keys, values, first_token, settings, inv_freq, scaling, asks: int = 0, pinned=frozenset()
):
    """One chunk through one layer. queries [n_heads, c, d], keys/values [n_kv, c, d] unrotated. `asks`: the
    chunk's last `asks` tokens are a question, whose queries alone choose R (recall), weighed as `asks` tokens;
    without one, at most `choice_tokens` of the chunk's tokens choose (evenly spaced, its last among them).
    `pinned`: token indices never evicted (`choose_victim_pinned`).

    Returns the output [n_heads, c, d] (float64) and evicts after the chunk.
    """
    n_heads, chunk, head_dim = queries.shape
    n_kv = len(heads)
    group = n_heads // n_kv
    output = torch.zeros(n_heads, chunk, head_dim, dtype=torch.float64)
    decay = settings.score_decay if settings.policy in ("h2o", "recall") else 1.0
    for j, head in enumerate(heads):
        old = head.alive_indices()
        for i in range(chunk):
            head.keys.append(keys[j, i])
            head.values.append(values[j, i])
            head.alive.append(True)
            head.score.append(0.0)
            head.seen.append(0)
            head.last.append(0.0)
        recalled = []
        if recall_slots(settings):
            # A question's tokens choose; else a chunk's tokens, every ceil(c / choice_tokens)-th from its last
            limit = getattr(settings, "choice_tokens", 0)
            if 1 < asks <= chunk:
                picks, weighed = list(range(chunk - asks, chunk)), asks
            else:
                every = -(-chunk // limit) if limit else 1
                picks, weighed = [i for i in range(chunk) if (chunk - 1 - i) % every == 0], chunk
            group_queries = queries[j * group : (j + 1) * group, picks].reshape(-1, head_dim)
            recalled = naive_recall(
                head, group_queries, first_token, chunk, settings, inv_freq, weighed, 1 < asks <= chunk
            )
        before = sorted(old + recalled)  # E_q's entries older than the chunk, in token order
        if recalled and getattr(settings, "recall_place", "index") == "contiguous":
            # R as one block between S's older entries and its newest max(recent, 1) tokens up to the chunk
            recent_from = first_token - max(recent_slots(settings), 1) + 1
            before = (
                [t for t in old if t < recent_from] + sorted(recalled) + [t for t in old if t >= recent_from]
            )
        for i in range(chunk):
            query_token = first_token + i
            visible = before + list(range(first_token, query_token + 1))  # E_q in placement order
            if settings.positions == "rolling" and settings.policy != "full":
                key_pos = torch.arange(len(visible))
                query_pos = torch.tensor([len(visible) - 1])
            else:
                key_pos = torch.tensor(visible)
                query_pos = torch.tensor([query_token])
            k = rope(torch.stack([head.keys[t] for t in visible]), key_pos, inv_freq)
            v = torch.stack([head.values[t] for t in visible]).double()
            total = torch.zeros(len(visible), dtype=torch.float64)
            for h in range(j * group, (j + 1) * group):
                q = rope(queries[h, i : i + 1], query_pos, inv_freq)
                p = torch.softmax((q @ k.T)[0] * scaling, dim=-1)
                output[h, i] = p @ v
                total += p
            for t in head.alive_indices():  # docs/spec.md: each query token decays every score first
                head.score[t] *= decay
            for position, t in enumerate(visible):
                if t in recalled:  # recall: only the resident set accumulates scores
                    continue
                head.score[t] += float(total[position])
                head.seen[t] += 1
                if i == chunk - 1:
                    head.last[t] = float(total[position])
        if settings.policy != "full":
            while len(head.alive_indices()) > resident_budget(settings):
                victim = (
                    choose_victim_pinned(head, settings, pinned) if pinned else choose_victim(head, settings)
                )
                head.alive[victim] = False
    return output


def layer_settings(settings, number: int):
    """Layer `number`'s contract: under `recall_layers` (docs/spec.md, recall: layers) a layer not named holds
    S alone, as `h2o` on the resident budget k − r; every other case is `settings` itself."""
    named = getattr(settings, "recall_layers", "all")
    if settings.policy != "recall" or named == "all":
        return settings
    layers = set()
    for part in named.split(","):
        low, _, high = part.partition("-")
        layers.update(range(int(low), int(high or low) + 1))
    if number in layers:
        return settings
    return dataclasses.replace(settings, policy="h2o", budget=resident_budget(settings))


def naive_model_nll(
    model,
    ids: list[int],
    settings,
    chunk: int = 1,
    sizes: list[int] | None = None,
    pinned=frozenset(),
    states: list | None = None,
) -> list[float]:
    """Per-prediction NLL of `ids` under SPEC.md, running the decoder by hand over naive head states
    (Llama layout; Mistral and Qwen2 share it, Qwen3 adds its q/k norms).

    Chunks of `chunk` tokens, or of the given `sizes` (summing to len(ids)). `pinned`: token indices never
    evicted; `states`: a list the layers' head states are appended to (for their kept tokens).
    """
    config = model.config
    n_heads = config.num_attention_heads
    n_kv = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    inv_freq = inv_freq_of(config, head_dim)
    scaling = head_dim**-0.5
    layers = model.model.layers
    states = states if states is not None else []
    states.extend([NaiveHeadState() for _ in range(n_kv)] for _ in layers)
    nlls: list[float] = []
    previous = None
    with torch.no_grad():
        sizes = sizes or [min(chunk, len(ids) - start) for start in range(0, len(ids), chunk)]
        assert sum(sizes) == len(ids)
        for start, size in zip(itertools.accumulate([0] + sizes[:-1]), sizes, strict=True):
            piece = ids[start : start + size]
            c = len(piece)
            hidden = model.model.embed_tokens(torch.tensor(piece))  # [c, hidden]
            for number, (layer, heads) in enumerate(zip(layers, states, strict=True)):
                attn = layer.self_attn
                x = layer.input_layernorm(hidden)
                q = attn.q_proj(x).view(c, n_heads, head_dim)
                k = attn.k_proj(x).view(c, n_kv, head_dim)
                if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm of q and k before RoPE
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q, k = q.transpose(0, 1), k.transpose(0, 1)
                v = attn.v_proj(x).view(c, n_kv, head_dim).transpose(0, 1)
                out = naive_attend_chunk(
                    heads, q, k, v, start, layer_settings(settings, number), inv_freq, scaling, pinned=pinned
                )
                out = out.to(hidden.dtype).transpose(0, 1).reshape(c, n_heads * head_dim)
                hidden = hidden + attn.o_proj(out)
                hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            logprobs = torch.log_softmax(model.lm_head(model.model.norm(hidden)).double(), dim=-1)
            previous = add_nlls(nlls, previous, logprobs, piece)
    return nlls


def add_nlls(nlls: list[float], previous, logprobs: torch.Tensor, piece: list[int]) -> torch.Tensor:
    """Append the NLL of a chunk's tokens: its first from the previous chunk's last log-probabilities
    (`previous`, None for the first chunk), the others from its own [c, vocab]. Returns its last row."""
    if previous is not None:
        nlls.append(-float(previous[piece[0]]))
    nlls.extend(-float(logprobs[i, piece[i + 1]]) for i in range(len(piece) - 1))
    return logprobs[-1]


def naive_window_chunk(heads, queries, keys, values, first_token, window, inv_freq, scaling):
    """One chunk through a sliding-window layer, as the model defines it: query token q attends to the tokens
    t with q - window < t <= q, rotated at their token indices (no budget, no scores, no eviction).
    queries [n_heads, c, d], keys/values [n_kv, c, d] unrotated. Returns the output [n_heads, c, d] float64."""
    n_heads, chunk, head_dim = queries.shape
    group = n_heads // len(heads)
    output = torch.zeros(n_heads, chunk, head_dim, dtype=torch.float64)
    for j, head in enumerate(heads):
        head.keys.extend(keys[j])
        head.values.extend(values[j])
        for i in range(chunk):
            query_token = first_token + i
            visible = list(range(max(0, query_token - window + 1), query_token + 1))
            k = rope(torch.stack([head.keys[t] for t in visible]), torch.tensor(visible), inv_freq)
            v = torch.stack([head.values[t] for t in visible]).double()
            for h in range(j * group, (j + 1) * group):
                q = rope(queries[h, i : i + 1], torch.tensor([query_token]), inv_freq)
                output[h, i] = torch.softmax((q @ k.T)[0] * scaling, dim=-1) @ v
    return output


def naive_gemma3_nll(model, ids: list[int], settings, chunk: int = 1) -> list[float]:
    """Per-prediction NLL of `ids` through a Gemma 3 text decoder run by hand: scaled embeddings, q/k norms,
    scaling `query_pre_attn_scalar ** -0.5`, norms after attention and around the MLP; a
    `sliding_attention` layer attends over its window (`naive_window_chunk`, its own RoPE base), a
    `full_attention` layer follows SPEC.md (`naive_attend_chunk`, the global base)."""
    config = model.config
    n_heads, n_kv, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    inv_freq = {}
    for kind, params in config.rope_parameters.items():
        assert params.get("rope_type", "default") == "default", "naive reference covers default RoPE only"
        inv_freq[kind] = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2).double() / head_dim))
    scaling = config.query_pre_attn_scalar**-0.5
    layers = model.model.layers
    states = [[NaiveHeadState() for _ in range(n_kv)] for _ in layers]
    nlls: list[float] = []
    previous = None
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            piece = ids[start : start + chunk]
            c = len(piece)
            hidden = model.model.embed_tokens(torch.tensor(piece))  # scaled by sqrt(hidden) inside
            for number, (layer, heads) in enumerate(zip(layers, states, strict=True)):
                attn, kind = layer.self_attn, config.layer_types[number]
                x = layer.input_layernorm(hidden)
                q = attn.q_norm(attn.q_proj(x).view(c, n_heads, head_dim)).transpose(0, 1)
                k = attn.k_norm(attn.k_proj(x).view(c, n_kv, head_dim)).transpose(0, 1)
                v = attn.v_proj(x).view(c, n_kv, head_dim).transpose(0, 1)
                if kind == "sliding_attention":
                    out = naive_window_chunk(
                        heads, q, k, v, start, config.sliding_window, inv_freq[kind], scaling
                    )
                else:
                    own = layer_settings(settings, number)
                    out = naive_attend_chunk(heads, q, k, v, start, own, inv_freq[kind], scaling)
                out = out.to(hidden.dtype).transpose(0, 1).reshape(c, n_heads * head_dim)
                hidden = hidden + layer.post_attention_layernorm(attn.o_proj(out))
                mlp = layer.mlp(layer.pre_feedforward_layernorm(hidden))
                hidden = hidden + layer.post_feedforward_layernorm(mlp)
            logits = model.lm_head(model.model.norm(hidden)).double()
            if config.final_logit_softcapping:
                logits = torch.tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping
            previous = add_nlls(nlls, previous, torch.log_softmax(logits, dim=-1), piece)
    return nlls


def ppl(nlls: list[float]) -> float:
    return math.exp(sum(nlls) / len(nlls))
