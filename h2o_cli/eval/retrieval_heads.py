"""Which attention heads copy a passkey? The retrieval score of every (layer, KV head): what `--recall-lead
auto` names a model's lead head from.

For each passkey haystack (`eval/passkey.py`) short enough for the model's window, the prompt is read with a
plain full cache and the answer generated greedily. At every answer step that writes the next digit of the
passkey, each query head's strongest key is looked up: a head *copies* that step when its top key is a token
of the needle sentence holding the digit being written (Wu et al. 2024, "Retrieval Head Mechanistically
Explains Long-Context Factuality": the copy-paste score). A head's score is the share of copied digits over
the runs the full cache answers; a KV head's is the best of its query heads (GQA: a KV head recalls for its
whole group). `h2o calibrate` prints the ranking.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from h2o_cli.eval import passkey

PROBE = "copy_probe"  # the attention implementation's name while a calibration runs


class CopyProbe:
    """Plain causal attention over one unpadded sequence (`attention_mask` is not needed), registered as a
    transformers attention function; when one token queries, each head's strongest key goes to `top`."""

    def __init__(self) -> None:
        self.top: list[torch.Tensor] = []  # per layer call of a one-token step: [n_heads] index of the key

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from transformers.integrations.sdpa_attention import repeat_kv

        group = query.shape[1] // key.shape[1]
        key, value = repeat_kv(key, group), repeat_kv(value, group)
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        logits = torch.matmul(query, key.transpose(2, 3)) * scaling
        q, k = query.shape[2], key.shape[2]  # causal: the queries are the last q of the k positions
        later = torch.ones(q, k, dtype=torch.bool).triu(k - q + 1)
        logits = logits.masked_fill(later, float("-inf"))
        weights = torch.softmax(logits.float(), dim=-1).to(query.dtype)
        if query.shape[2] == 1:
            self.top.append(weights[0, :, 0].argmax(-1))
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), None


def copy_hits(model, tokenizer, ids: list[int], key: str, needle: list[int], probe: CopyProbe):
    """Greedy answer of `ids` with a full cache (the model attending through `probe`): per (layer, query head)
    how many of the passkey's digits the head copied (its top key is a needle token equal to the digit
    written), `[n_layers, n_heads]`; the digits scored (each written in order by an answer step); the answer."""
    from transformers import DynamicCache

    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    hits = torch.zeros(layers, heads)
    digits = [tokenizer.convert_tokens_to_ids(d) for d in key]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(torch.tensor([ids]), cache=cache, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        answer, scored = [], 0
        written = int(token == digits[0])  # a first digit written by the prompt's pass: not scored
        for _ in range(passkey.MAX_NEW_TOKENS):
            answer.append(token)
            probe.top.clear()
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            following = int(out.logits[0, -1].argmax())
            # this step's queries chose `following`: a copy when it is the next digit of the key
            if written < len(digits) and following == digits[written]:
                sources = torch.tensor([p for p in needle if ids[p] == following])
                top = torch.stack(probe.top)  # [layers, heads]
                hits += torch.isin(top, sources).float()
                written, scored = written + 1, scored + 1
            token = following
    return hits, scored, tokenizer.decode(answer + [token])


def rank(kv_score: torch.Tensor) -> list[dict]:
    """KV heads by score, best first (ties: the later layer, then the later head first):
    `[{"layer", "kv_head", "score"}]` from `kv_score` `[n_layers, n_kv_heads]`."""
    ranked = sorted(
        ((float(kv_score[layer, head]), layer, head) for layer in range(kv_score.shape[0])
         for head in range(kv_score.shape[1])), reverse=True,
    )  # fmt: skip
    return [{"layer": layer, "kv_head": head, "score": round(s, 4)} for s, layer, head in ranked]


def calibrate(
    model,
    tokenizer,
    essays: str,
    length: int = 2048,
    depths: int = 5,
    seeds: int = 3,
    seed_from: int = 100,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """The retrieval scores of `model`'s KV heads over `seeds` x `depths` passkey haystacks of `length` tokens
    cut from `essays` (depths from 5 % to 95 %; seeds from `seed_from`, apart from the grids' 0-2).

    Returns {"length", "copied_digits", "runs": [{seed, depth, key, answer, correct}], "score": per layer a
    list of per-KV-head scores `[n_layers][n_kv_heads]`, "ranked": [{layer, kv_head, score}] best first}.
    `progress` is called with each run's row. The model attends through `CopyProbe` meanwhile, and through
    its own attention again afterwards."""
    from transformers import AttentionInterface

    from h2o_cli.prompting import read_then_answer

    config = model.config
    group = config.num_attention_heads // config.num_key_value_heads
    probe = CopyProbe()
    AttentionInterface.register(PROBE, probe)
    before = config._attn_implementation
    model.set_attn_implementation(PROBE)
    spread = [round(5 + 90 * i / max(1, depths - 1)) for i in range(depths)]
    total, copied, runs = torch.zeros(config.num_hidden_layers, config.num_attention_heads), 0, []
    try:
        for seed in range(seed_from, seed_from + seeds):
            for depth, key, text in passkey.haystacks(tokenizer, essays, length, spread, seed):
                text_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                pieces = list(read_then_answer(tokenizer, [text_ids], passkey.QUESTION))
                ids = [token for piece in pieces for token in piece]
                needle, _ = passkey.needle_tokens(tokenizer, text, key, len(pieces[0]))
                hits, scored, answer = copy_hits(model, tokenizer, ids, key, needle, probe)
                correct = key in answer
                runs.append({"seed": seed, "depth": depth, "key": key, "answer": answer, "correct": correct})
                if progress is not None:
                    progress(runs[-1])
                if correct:  # a wrong answer's digits are not a copy of the needle
                    total, copied = total + hits, copied + scored
    finally:
        model.set_attn_implementation(before)
    score = (total / max(1, copied)).view(config.num_hidden_layers, config.num_key_value_heads, group)
    kv_score = score.max(-1).values  # [layers, kv heads]
    return {
        "length": length,
        "copied_digits": copied,
        "runs": runs,
        "score": [[round(float(s), 4) for s in row] for row in kv_score],
        "ranked": rank(kv_score),
    }
