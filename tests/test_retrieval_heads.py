"""`h2o_cli.eval.retrieval_heads` (what `h2o calibrate` finds): the heads' copy hits and copy masses against the
same attention written out by transformers' eager attention, the report's scores and ranking, a head built to
attend to the needle leading, the text's offset with and without a chat template, and the probes it reads."""

import pytest
import torch
from conftest import tiny_config

from h2o_cli.eval import probes as probe_sets
from h2o_cli.eval.probes import Probe
from h2o_cli.eval.retrieval_heads import (
    MAX_NEW_TOKENS,
    PROBE,
    CopyProbe,
    calibrate,
    copy_hits,
    framed,
    lead_of,
    needle_tokens,
    rank,
    value_spans,
)
from h2o_cli.prompting import read_then_answer

ESSAY = " ".join(
    f"In the year {1900 + n} the {thing} by the river was {color}, said essay {n}."
    for n, (thing, color) in enumerate(
        [("boat", "red"), ("house", "blue"), ("bridge", "grey"), ("mill", "white"), ("tree", "green")] * 12
    )
)


@pytest.fixture
def tiny_model(smollm):
    """A random-weight Llama (2 layers, 6 query heads over 2 KV heads) that speaks the embedded model's
    tokenizer, with a 512-token window."""
    from transformers import LlamaForCausalLM

    _, tokenizer = smollm
    torch.manual_seed(0)
    return LlamaForCausalLM(
        tiny_config(vocab_size=len(tokenizer), max_position_embeddings=512)
    ).eval(), tokenizer


def force_answers(model, answers: list[list[int]]):
    """Make the model's greedy choice each of `answers`' tokens in turn (one per forward pass), whatever its
    logits: the attention is untouched, only the output head's last row is raised at the forced token."""
    queue = [token for answer in answers for token in answer]

    def hook(module, inputs, output):
        output = output.clone()
        output[0, -1, queue.pop(0)] = output[0, -1].max() + 100.0
        return output

    return model.lm_head.register_forward_hook(hook)


def planted(value: str, at: int = 500) -> Probe:
    """ESSAY with a needle naming `value` twice planted at character `at`."""
    needle = f"\nThe code is {value}. Remember {value} well.\n"
    return Probe(
        ESSAY[:at] + needle + ESSAY[at:1400], "What is the code?", value, needle, 40, "essay", "number"
    )


def prompt_ids(tokenizer, probe: Probe) -> tuple[list[int], int]:
    pieces = list(read_then_answer(tokenizer, [tokenizer(probe.text, add_special_tokens=False)["input_ids"]],
                                   probe.question))  # fmt: skip
    return [token for piece in pieces for token in piece], len(pieces[0])


def eager_hits(model, tokenizer, probe: Probe, ids: list[int], head: int, answer: list[int]):
    """The copy hits and copy masses written out for an answer whose token j is the value's digit j (one digit
    a token): one eager forward over the prompt and the answer with the attention weights returned; the query
    of answer step j (at position len(ids) + j) writes digit j + 1, a head copies when its largest weight
    falls on a text token whose characters include that digit of either mention of the value, and its mass
    is its weights' sum over the text tokens holding characters of the needle. ([n_layers, n_heads] each)."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(torch.tensor([ids + answer]), output_attentions=True)
    model.set_attn_implementation(before)
    offsets = tokenizer(probe.text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    needle_at = probe.text.index(probe.needle)
    mentions = [needle_at + i for i in range(len(probe.needle)) if probe.needle.startswith(probe.value, i)]
    hits = torch.zeros(model.config.num_hidden_layers, model.config.num_attention_heads)
    mass = torch.zeros_like(hits)
    end = needle_at + len(probe.needle)
    needle = [head + i for i, (a, b) in enumerate(offsets) if a < end and b > needle_at]
    for step in range(len(probe.value) - 1):
        chars = [mention + step + 1 for mention in mentions]
        sources = [head + i for i, (a, b) in enumerate(offsets) if any(a <= c < b for c in chars)]
        for layer, weights in enumerate(out.attentions):
            top = weights[0, :, len(ids) + step, : len(ids) + step + 1].argmax(-1)  # [n_heads]
            hits[layer] += torch.tensor([float(int(t) in sources) for t in top])
            mass[layer] += weights[0, :, len(ids) + step, needle].sum(-1)
    return hits, mass


def with_probe(model):
    probe = CopyProbe()
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE, probe)
    model.set_attn_implementation(PROBE)
    return probe


def test_copy_hits_and_masses_are_those_of_the_eager_attention(tiny_model):
    """An answer forced to the value and then the end token: the hits (top key on the piece) and the masses
    (weights on the needle) per (layer, head) equal those of the eager attention's weights, four pieces are
    scored (the first digit is written by the prompt's pass), and some heads copied."""
    model, tokenizer = tiny_model
    probe = planted("19041")
    ids, head = prompt_ids(tokenizer, probe)
    digits = [tokenizer.convert_tokens_to_ids(d) for d in probe.value]
    copy = with_probe(model)
    copy.needle = needle_tokens(tokenizer, probe, head)
    handle = force_answers(model, [digits + [tokenizer.eos_token_id] * MAX_NEW_TOKENS])
    try:
        hits, mass, scored, said = copy_hits(
            model, tokenizer, ids, probe.value, value_spans(tokenizer, probe, head), copy
        )
    finally:
        handle.remove()
        model.set_attn_implementation("sdpa")
    assert scored == 4 and said.startswith(probe.value)
    want_hits, want_mass = eager_hits(model, tokenizer, probe, ids, head, digits[:-1])
    assert torch.equal(hits, want_hits) and hits.sum() > 0
    assert torch.allclose(mass, want_mass, atol=1e-5) and mass.min() > 0


def test_calibrate_scores_each_kv_head_by_its_groups_copy_mass_and_ranks_them(tiny_model):
    """Two probes, every answer forced to its value (an answer stops once the value is written): each counts,
    four pieces each; each KV head's score is its three query heads' summed mass on the needle per piece,
    from the eager attention (and the argmax score beside it, the best query head's share of copied
    pieces); the ranking lists every (layer, KV head) once, best first, at those scores; the lead is the
    first; the model attends as before afterwards."""
    model, tokenizer = tiny_model
    items = [planted("19041"), planted("27365", 1000)]
    answers = [[tokenizer.convert_tokens_to_ids(d) for d in item.value] for item in items]
    handle = force_answers(model, answers)
    try:
        report = calibrate(model, tokenizer, items)
    finally:
        handle.remove()
    assert model.config._attn_implementation != PROBE
    assert [(run["value"], run["correct"]) for run in report["runs"]] == [
        (item.value, True) for item in items
    ]
    assert report["copied"] == 8
    hits, mass = torch.zeros(2, 6), torch.zeros(2, 6)
    for item, digits in zip(items, answers, strict=True):
        ids, head = prompt_ids(tokenizer, item)
        item_hits, item_mass = eager_hits(model, tokenizer, item, ids, head, digits[:-1])
        hits, mass = hits + item_hits, mass + item_mass
    expected = (mass / 8).view(2, 2, 3).sum(-1)  # [layers, kv heads]
    assert torch.allclose(torch.tensor(report["score"]), expected, atol=1e-4)
    argmax = (hits / 8).view(2, 2, 3).max(-1).values
    assert argmax.sum() > 0  # some head copied: the comparison can fail
    assert all(abs(row["score"] - float(argmax[row["layer"], row["kv_head"]])) < 1e-4
               for row in report["others"]["argmax"])  # fmt: skip
    ranked = report["ranked"]
    assert sorted((row["layer"], row["kv_head"]) for row in ranked) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [row["score"] for row in ranked] == sorted((row["score"] for row in ranked), reverse=True)
    assert all(abs(row["score"] - float(expected[row["layer"], row["kv_head"]])) < 1e-4 for row in ranked)
    assert report["lead"] == [ranked[0]["layer"], ranked[0]["kv_head"]]


def test_a_head_built_to_attend_to_the_needle_leads(tiny_model):
    """KV head 1 of layer 0 is made a retrieval head: its keys are large on a marker dimension that only the
    needle's own tokens' embeddings carry, and its three query heads ask for that dimension from every token
    (through RoPE's slowest pair, which turns by under 0.2 rad over the probe). Every other weight stays
    random. Its group's mass on the needle at the copy steps is near 3 (each query head's near 1), and the
    calibration leads with it (its top keys are the needle's words, not the digit being written: the argmax
    score would not see it)."""
    model, tokenizer = tiny_model
    items = [planted("19041"), planted("27365", 1000)]
    answers = [[tokenizer.convert_tokens_to_ids(d) for d in item.value] for item in items]
    marked = set()
    for item in items:
        ids, head = prompt_ids(tokenizer, item)
        needle = set(needle_tokens(tokenizer, item, head).tolist())
        inside = {ids[at] for at in needle}
        marked |= (
            inside
            - {token for at, token in enumerate(ids) if at not in needle}
            - {t for a in answers for t in a}
        )
    assert len(marked) >= 3  # "code", "Remember", "well": tokens the needle alone holds
    d, slow = (
        model.config.head_dim,
        model.config.head_dim // 2 - 1,
    )  # RoPE pairs (i, i + d/2): the last turns least
    layer = model.model.layers[0].self_attn
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, 1] = 1.0  # every token: a constant the queries read
        embed[sorted(marked), 0] = 1.0  # the needle's own tokens: the marker the keys read
        layer.k_proj.weight[d : 2 * d] = 0.0
        layer.k_proj.weight[d + slow, 0] = 3.0
        for query_head in (3, 4, 5):  # the group of KV head 1
            layer.q_proj.weight[query_head * d : (query_head + 1) * d] = 0.0
            layer.q_proj.weight[query_head * d + slow, 1] = 3.0
    handle = force_answers(model, answers)
    try:
        report = calibrate(model, tokenizer, items)
    finally:
        handle.remove()
    assert report["lead"] == [0, 1] and report["score"][0][1] > 2.5
    assert max(score for layer in report["score"] for score in layer if score != report["score"][0][1]) < 1.5


class PlainWithBos:
    """A tokenizer without a chat template that puts its BOS token before plain text unless told not to (as
    Gemma's does; the embedded model's puts none)."""

    def __init__(self, inner) -> None:
        self.inner, self.chat_template, self.bos_token_id = inner, None, inner.bos_token_id

    def __call__(self, text, add_special_tokens: bool = True, **kwargs):
        out = self.inner(text, add_special_tokens=False, **kwargs)
        out["input_ids"] = [self.bos_token_id] * add_special_tokens + out["input_ids"]
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_the_text_starts_after_the_frames_head_or_at_0_without_a_chat_template(smollm):
    """`framed` counts the tokens before the text: the chat template's head, or for a base model (no template)
    the BOS token alone where its tokenizer puts one before plain text, else none; the needle's stream
    indices are its tokens in each frame."""
    import copy

    _, tokenizer = smollm
    base = copy.copy(tokenizer)
    base.chat_template = None
    with_bos = PlainWithBos(base)
    probe = planted("19041")
    text_ids = tokenizer(probe.text, add_special_tokens=False)["input_ids"]
    for which in (tokenizer, base, with_bos):
        ids, head, question = framed(which, probe)
        assert ids[head : head + len(text_ids)] == text_ids and len(ids) == head + len(text_ids) + question
        needle = needle_tokens(which, probe, head).tolist()
        assert probe.needle.strip() in which.decode([ids[at] for at in needle])
    assert framed(base, probe)[1] == 0 and framed(tokenizer, probe)[1] > 1
    assert framed(with_bos, probe)[0] == [with_bos.bos_token_id] + framed(base, probe)[0]


def test_only_a_candidate_layer_is_ranked_and_a_head_that_copied_nothing_does_not_lead():
    """A sliding-window layer cannot lead: `rank` leaves out the layers not marked, whatever their score; where
    every candidate scored 0 there is no lead."""
    assert lead_of(rank(torch.tensor([[0.9, 0.4], [0.0, 0.0]]), [False, True])) is None
    assert lead_of(rank(torch.tensor([[0.9, 0.4], [0.0, 0.1]]), [False, True])) == [1, 1]
    score = torch.tensor([[0.9, 0.1], [0.2, 0.3], [0.8, 0.0]])
    assert rank(score, [False, True, True]) == [
        {"layer": 2, "kv_head": 0, "score": 0.8}, {"layer": 1, "kv_head": 1, "score": 0.3},
        {"layer": 1, "kv_head": 0, "score": 0.2}, {"layer": 2, "kv_head": 1, "score": 0.0},
    ]  # fmt: skip


def test_a_value_tokenized_otherwise_in_the_answer_still_scores_by_its_characters(tiny_model):
    """A word value: the needle holds " lantern" (one token with its space), the answer writes it as pieces
    of its own ("lan", "tern" or whatever the tokenizer gives without the space): the first piece is the
    prompt's pass, every later piece is scored, and each step's sources are the needle tokens holding it."""
    model, tokenizer = tiny_model
    probe = planted("lanternfish")
    ids, head = prompt_ids(tokenizer, probe)
    pieces = tokenizer("lanternfish", add_special_tokens=False)["input_ids"]
    assert len(pieces) >= 2
    copy = with_probe(model)
    handle = force_answers(model, [pieces + [tokenizer.eos_token_id] * MAX_NEW_TOKENS])
    try:
        _, _, scored, said = copy_hits(
            model, tokenizer, ids, probe.value, value_spans(tokenizer, probe, head), copy
        )
    finally:
        handle.remove()
        model.set_attn_implementation("sdpa")
    assert said.startswith("lanternfish") and scored == len(pieces) - 1


def test_tuning_and_report_probes_share_no_filler_nor_wording(smollm, tmp_path):
    """The two sets are disjoint in novels, needle and question wordings; a probe holds its needle (with its
    value) at about the depth asked, is about the tokens asked, and its question names the value's kind;
    without a data folder the word lists stand in."""
    _, tokenizer = smollm
    tuning, report = probe_sets.TUNING, probe_sets.REPORT
    assert not set(tuning.books) & set(report.books)
    assert not set(tuning.needles) & set(report.needles) and not set(tuning.questions) & set(report.questions)
    assert probe_sets.fillers(tuning, None) == [(probe_sets.WORD_LIST, "")]
    made = list(probe_sets.probes(tokenizer, tuning, None, 300, 6, seed=3))
    assert {item.kind for item in made} <= set(tuning.kinds) and len(made) == 6
    for item in made:
        at = item.text.index(item.needle)
        assert item.value in item.needle and abs(at / len(item.text) - item.depth / 100) < 0.1
        assert abs(len(tokenizer(item.text)["input_ids"]) - 300) < 8
        assert probe_sets.KIND_NAMES[item.kind] in item.question


def test_the_probe_attends_as_the_models_own_attention_sliding_windows_too():
    """A random Gemma 3 (window 8; layers sliding, sliding, full, sliding) over 40 tokens and then one step:
    through `CopyProbe` its logits are sdpa's (so a windowed layer keeps its window while calibrating)."""
    import transformers
    from transformers import AttentionInterface, DynamicCache
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, 41))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            first = model(ids[:, :40], cache=cache, use_cache=True).logits
            step = model(ids[:, 40:], cache=cache, use_cache=True).logits
        return first, step

    model.set_attn_implementation("sdpa")
    want = run()
    probe = CopyProbe()
    AttentionInterface.register(PROBE, probe)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE, sdpa_mask)
    model.set_attn_implementation(PROBE)
    try:
        got = run()
    finally:
        model.set_attn_implementation("sdpa")
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want, strict=True))
    assert len(probe.top) == 4  # one step: a top key per layer
