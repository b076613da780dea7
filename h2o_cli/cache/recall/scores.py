"""Page scoring of the `recall` archive: the score each choice ranks ring pages by (`PageScoring.bounds`), over
an `ArchiveStore`'s key summaries and keys.

A page's score is Quest's bound of a query's best logit over its keys, from the per-block min/max summaries,
`sum_i max(q_i * max_i, q_i * min_i) >= q . k` for every key `k` of the block (a page's bound is the best of
its blocks'); or, with `attention`, the attention mass its keys get, over a shortlist of the pages the bounds
rank best (`shortlisted`) and with scores carried from one choice to the next (`carry`). A long archive's
shortlist has a coarser level too: sections of `SECTION_TOKENS` tokens, each with the min/max of its blocks',
so a step bounds the sections and then the blocks of the best ones only.

One rule, one body: `bounds` is every choice's score; `step_bounds` is `bounds` over the pages written so far
(a one-token step, and the C step's input) and the fixed step calls `bounds` with `fixed` (every section folded
afresh, no held keys); `order_key` is the page order (archive.c's `order_key` its C twin,
tests/test_recall_step.py::test_order_key_orders_pages_as_rank_key) and archive.c's `archive_step_scores` the C
twin of a step's `bounds` over the carried shortlist
(tests/test_native_recall.py::test_c_step_scores_are_the_torch_step_bounds).
"""

from __future__ import annotations

import torch

from h2o_cli.cache.kvquant import dequantize
from h2o_cli.cache.recall.limits import step_pages
from h2o_cli.cache.recall.store import NOTHING, ArchiveStore

SECTION_TOKENS = 256  # the coarse level of a shortlist: sections of this many tokens (whole pages) rank first
MASS_LOGITS = 2**26  # the most logits (n_kv_heads x queries x tokens) one block of `attention_mass` makes
HALF_MAX = 65504.0  # float16's largest finite value: a held key is clamped to it, never inf


def page_bound(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of `q . k` over a page's keys, for each (query, page).

    query: [n_kv_heads, m, head_dim] (float32); low, high: [n_kv_heads, pages, head_dim] per-channel min and
    max of each page's keys. Returns [n_kv_heads, m, pages]: `sum_i max(q_i * high_i, q_i * low_i)`.
    """
    # max(q*hi, q*lo) = q+ * hi + q- * lo (q+ = max(q, 0), q- = min(q, 0)): two matmuls, no [m, pages, d].
    positive, negative = query.clamp_min(0), query.clamp_max(0)
    return torch.bmm(positive, high.transpose(1, 2)) + torch.bmm(negative, low.transpose(1, 2))


def best_page_bound(query: torch.Tensor, summary: torch.Tensor, block: int = 128) -> torch.Tensor:
    """`page_bound(...).amax(dim=1)` — each page's bound under the best of the `m` queries — computed as one
    matmul per block of queries: `summary` [n_kv_heads, pages, 2 * head_dim] holds `[high, low]` side by side,
    so `[high, low] . [q+, q-]` is the bound, and a block's [pages, block] result is folded into a running max
    (no [m, pages] tensor for a chunk of hundreds of queries). Returns [n_kv_heads, pages]."""
    signed = torch.cat([query.clamp_min(0), query.clamp_max(0)], dim=2)  # [n_kv, m, 2d]
    best = None
    for start in range(0, signed.shape[1], block):
        bounds = torch.bmm(summary, signed[:, start : start + block].transpose(1, 2)).amax(dim=2)
        best = bounds if best is None else torch.maximum(best, bounds)
    return best


def as_held(keys: torch.Tensor) -> torch.Tensor:
    """Keys as a one-token step's page mass takes them (docs/spec.md): clamped to float16's finite range and
    rounded to it (nearest, ties to even), as float16. Holding the step's shortlist so halves what it reads."""
    return keys.clamp(-HALF_MAX, HALF_MAX).to(torch.float16)


def order_key(bound: torch.Tensor, page_start: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """The page order of a recall step as one int64 per (KV head, page), so one `topk` ranks the pages: larger
    bound first, then the older page; pages without a candidate (`candidate` False) last. archive.c's
    `order_key` is its C twin.

    bound: [n_kv_heads, pages] float32 (any value where `candidate` is False); page_start: [pages] token index
    of each page's first token (below 2**31). The float's bits, made monotone in its value (negative floats
    have their magnitude bits flipped; -0.0 is first made +0.0, equal to it as a float), fill the high 32
    bits, and minus the page's start the low ones."""
    bits = (bound + 0.0).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # finite and ±inf: |.| < 2**31 - 2**23
    return torch.where(candidate, ordered * 2**32 - page_start, torch.iinfo(torch.int64).min)


class PageScoring(ArchiveStore):
    """An `ArchiveStore` whose pages are scored for a query, as its `settings` say: `attention` (pages scored
    by attention mass, `attention_mass`, not by the summaries), `shortlist` (with `attention`: only the pages
    the summaries bound best; 0: all), `carry` (with `attention`: the share of a page's last score added to the next),
    `chunk_weight` (with `carry`: a chunk of c > 1 tokens starts the carried scores at min(c, this) steps'
    weight) and `step_shortlist` (with `carry` and a shortlist: a one-token step scores the pages its carried
    scores rank best, this many; 0: `shortlist`). Built as an `ArchiveStore`.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)  # `ArchiveStore`'s arguments
        settings, n_kv_heads, device = self.settings, self.n_kv_heads, self.token_index.device
        self.attention, self.shortlist = settings.attention, settings.shortlist
        self.step_shortlist = step_pages(settings.shortlist, settings.step_shortlist)
        self.carry, self.chunk_weight = settings.carry, settings.chunk_weight
        # With `carry`: each ring page's last score and the first token of the page it was given to (a ring
        # page that holds another page since starts again from 0).
        self.carried = torch.zeros(n_kv_heads, self.pages, dtype=torch.float32, device=device)
        self.carried_start = torch.full((self.pages,), NOTHING, dtype=torch.int64, device=device)
        self.scored = 0  # how many times the carried scores were written (`LeadRanking.ranked` keys on it)
        # Sections (a shortlist's first level): `section_pages` ring pages each (the last one maybe fewer); their
        # [high, low] summaries are folded from the blocks' and refreshed when read (`_section_summaries`).
        self.section_pages = max(1, SECTION_TOKENS // self.page_size)
        sections = -(-self.pages // self.section_pages)
        self.section_summary = torch.zeros(
            n_kv_heads, sections, 2 * self.head_dim, dtype=torch.float32, device=device
        )
        self._sections_at = None  # `tokens` when the section summaries were last refreshed (None: never)
        self._held_keys = None  # (pages, their keys, `tokens` then): `held_page_keys`' last result

    def reset(self) -> None:
        """`ArchiveStore.reset` (every token forgotten), and the scores carried so far."""
        self._forget_scores()
        super().reset()

    def rewind(self, tokens: int) -> None:
        """`ArchiveStore.rewind` (the tokens from `tokens` on forgotten), and the scores carried so far."""
        self._forget_scores()
        super().rewind(tokens)

    def _forget_scores(self) -> None:
        self.carried_start.fill_(NOTHING)  # no ring page holds the page its carried score was given to
        self._sections_at = self._held_keys = None  # the section summaries and held keys are read again

    def choice_bytes(self) -> int:
        """Bytes the page choice keeps beside the archive, in RAM: the carried scores, the section summaries
        and the shortlist's keys `held_page_keys` holds (the C step's are `StepScores.nbytes`)."""
        kept = [self.carried, self.carried_start, self.section_summary]
        if self._held_keys is not None:
            kept.append(self._held_keys[1])
        return sum(tensor.nbytes for tensor in kept)

    def steps_score_carried_shortlist(self) -> bool:
        """Whether a one-token step's `step_bounds` scores the `step_shortlist` pages its carried scores rank
        best, or every written page when there are no more (the case archive.c's `archive_step_scores` computes):
        attention mass, carried scores, a shortlist, and a page written."""
        return self.attention and bool(self.carry) and self.shortlist > 0 and self.span > 0

    def step_bounds(self, query: torch.Tensor) -> torch.Tensor:
        """The page bounds `choose_one` ranks by, for the ring pages written so far: query [n_kv_heads, group,
        head_dim] (unrotated). Returns [n_kv_heads, span // page_size] float32 (the C step's input)."""
        return self.bounds(query, self.span // self.page_size)

    def bounds(
        self, query: torch.Tensor, pages: int, chunk: int = 1, fixed: bool = False, question: bool = False
    ) -> torch.Tensor:
        """The score every choice ranks the first `pages` ring pages by: the bound under the best of the `m`
        queries, the best of its blocks' `best_page_bound`; with `attention`, `attention_mass` instead, over
        every page for a `question` or up to `shortlist` pages, else over the `shortlist` pages the summaries
        bound best (`shortlisted`) — or, on a one-token step with `carry`, the `step_shortlist` pages the
        carried scores rank best (what the question and the steps since found; every page up to that many).
        With `carry` the score adds `carry` times the page's last score on a one-token step; a chunk of `chunk`
        > 1 tokens starts afresh, its mass times min(chunk, `chunk_weight`). query: [n_kv_heads, m, head_dim].
        Returns [n_kv_heads, pages] float32."""
        if not self.attention:
            bound = self.summary_bounds(query, pages)
            self.release()  # a file's summaries leave the process (the attention mass releases its own reads)
            return bound
        page_start = self.token_index.view(self.pages, self.page_size)[:pages, 0]
        step = self.carry and chunk == 1
        if step:  # the scores carried from the last choice, for the pages that still hold the same page
            same = (self.carried_start[:pages] == page_start) & (page_start != NOTHING)
            last = torch.where(same, self.carried[:, :pages], 0.0)
        if question or not self.shortlist or pages <= (self.step_shortlist if step else self.shortlist):
            scores = self.attention_mass(query, pages, held=bool(step))
        else:
            keys = None
            if step:
                # The carried scores' best (ties: the older page), in one order: their keys are kept between
                # steps (not in fixed shapes).
                key = order_key(last, page_start, page_start != NOTHING)
                picked = torch.topk(key, self.step_shortlist, dim=1, sorted=False).indices.sort(dim=1).values
                keys = None if fixed else self.held_page_keys(picked)
            else:  # the summaries pick the `shortlist` pages (sections first)
                picked = self.shortlisted(query, pages, page_start, fixed)  # [n_kv, shortlist]
            scores = torch.zeros(self.n_kv_heads, pages, device=query.device)
            scores.scatter_(1, picked, self.attention_mass(query, pages, picked, keys=keys, held=bool(step)))
        if self.carry:
            if step:
                scores += self.carry * last
            else:  # a new text or turn starts afresh, weighing min(chunk, chunk_weight) one-token steps
                scores *= min(chunk, self.chunk_weight)
            self.carried[:, :pages] = scores
            self.carried_start[:pages] = page_start
            if not fixed:  # the fixed step changes no Python value (a captured graph); it takes no lead
                self.scored += 1
        return scores

    def shortlisted(
        self, query: torch.Tensor, pages: int, page_start: torch.Tensor, fixed: bool = False
    ) -> torch.Tensor:
        """The `shortlist` pages (of the first `pages`) whose summary bound under the best of the `m` queries is
        highest, per KV head (ties: the older page). With sections (`section_pages` ring pages each, when the
        shortlist is at least one, and `keep = ceil(2 * shortlist / section_pages)`
        sections hold at most a quarter of the pages), two levels: the sections ranked by the bound of their
        own summary (the min/max over their pages' keys; ties: the older section), then the pages of the best
        `keep` sections only, so a step bounds every section and a fixed number of blocks however long the
        archive. `fixed`: every section's summary is folded afresh
        (fixed shapes, the fixed step). query: [n_kv_heads, m, head_dim]; page_start: [pages] first token
        index of each ring page (NOTHING: empty). Returns ring pages [n_kv_heads, shortlist]."""
        size = self.section_pages
        sections, keep = -(-pages // size), -(-2 * self.shortlist // size)
        if sections < 4 * keep or self.shortlist < size:  # the flat bound is as cheap
            key = order_key(self.summary_bounds(query, pages), page_start, page_start != NOTHING)
            return torch.topk(key, self.shortlist, dim=1, sorted=False).indices
        starts = page_start.new_full((sections * size,), NOTHING)
        starts[:pages] = page_start
        summary = self._section_summaries(starts, fixed)[:, :sections]
        section_start = starts.view(sections, size)[:, 0]
        key = order_key(best_page_bound(query.float(), summary), section_start, section_start != NOTHING)
        best = torch.topk(key, keep, dim=1, sorted=False).indices  # [n_kv, keep]
        chosen = (best.unsqueeze(-1) * size + torch.arange(size, device=best.device)).flatten(1)  # ring pages
        blocks = (chosen.unsqueeze(-1) * self.blocks_per_page + self._block_offsets).flatten(1)
        # A short last section's pages past the ring read some block (clamped); they rank last below.
        blocks.clamp_max_(self.summary.shape[1] - 1)
        rows = (
            blocks + torch.arange(self.n_kv_heads, device=blocks.device).unsqueeze(1) * self.summary.shape[1]
        )
        summaries = self.summary.view(-1, 2 * self.head_dim).index_select(0, rows.view(-1))
        per_block = best_page_bound(query.float(), summaries.view(self.n_kv_heads, -1, 2 * self.head_dim))
        per_block.masked_fill_(summaries.view(self.n_kv_heads, -1, 2 * self.head_dim)[..., 0] == float("-inf"),
                               float("-inf"))  # fmt: skip
        bound = per_block.view(self.n_kv_heads, -1, self.blocks_per_page).amax(dim=2)
        start = starts.take(chosen)  # NOTHING past `pages`: ranked last (the shortlist is at least a section)
        key = order_key(bound, start, start != NOTHING)
        return chosen.gather(1, torch.topk(key, self.shortlist, dim=1, sorted=False).indices)

    def _section_summaries(self, starts: torch.Tensor, fixed: bool) -> torch.Tensor:
        """The sections' [high, low] summaries [n_kv_heads, sections, 2 * head_dim], folded from the blocks of
        the ring pages that hold a page (`starts` [>= pages]: each ring page's first token index, NOTHING when
        empty or not scored; such a page adds nothing): every section when `fixed` or after a reset or rewind,
        else only those written since the last fold."""
        size, sections = self.section_pages, self.section_summary.shape[1]
        if fixed or self._sections_at is None or self.tokens - self._sections_at >= self.capacity:
            # Every section (fixed shapes), else those the ring has written: the rest hold no page, and a long
            # reach's unwritten summaries stay unread (in a file, they take no memory).
            written = sections if fixed else min(sections, -(-self.span // (size * self.page_size)))
            touched = torch.arange(written, device=self.summary.device)
        else:
            slots = torch.arange(self._sections_at, self.tokens, device=self.summary.device) % self.capacity
            touched = torch.unique(slots // (size * self.page_size))
        if touched.numel():
            per = size * self.blocks_per_page
            blocks = (touched.unsqueeze(-1) * per + torch.arange(per, device=touched.device)).flatten()
            total = self.summary.shape[1]  # a short last section's blocks past the ring add nothing
            folded = self.summary.index_select(1, blocks.clamp_max(total - 1))
            folded = folded.view(self.n_kv_heads, -1, per, 2 * self.head_dim)
            held = starts.take((blocks // self.blocks_per_page).clamp_max(starts.numel() - 1)) != NOTHING
            written = (held & (blocks < min(total, starts.numel() * self.blocks_per_page))).view(
                1, -1, per, 1
            )
            high, low = folded[..., : self.head_dim], folded[..., self.head_dim :]
            high = high.masked_fill(~written, float("-inf")).amax(dim=2)
            low = low.masked_fill(~written, float("inf")).amin(dim=2)
            self.section_summary.index_copy_(1, touched, torch.cat([high, low], dim=2))
        if not fixed:
            self._sections_at = self.tokens
        return self.section_summary

    def summary_bounds(self, query: torch.Tensor, pages: int) -> torch.Tensor:
        """The bound of each of the first `pages` ring pages under the best of the `m` queries: the best of its
        blocks' `best_page_bound`. query: [n_kv_heads, m, head_dim]. Returns [n_kv_heads, pages] float32."""
        blocks = pages * self.blocks_per_page
        per_block = best_page_bound(query.float(), self.summary[:, :blocks])
        if self.blocks_per_page == 1:
            return per_block
        # A block not yet written (the newest page's later ones) bounds nothing: -inf, not the NaN of 0 * inf.
        per_block.masked_fill_(self.high[:, :blocks, 0] == float("-inf"), float("-inf"))
        return per_block.view(self.n_kv_heads, pages, self.blocks_per_page).amax(dim=2)

    def attention_mass(
        self,
        query: torch.Tensor,
        pages: int,
        picked: torch.Tensor | None = None,
        block: int = 32,
        keys: torch.Tensor | None = None,
        held: bool = False,
    ) -> torch.Tensor:
        """The attention the `m` queries put on each of the first `pages` ring pages (or on the pages `picked`
        [n_kv_heads, k] of each KV head), each query's softmax taken over every token those pages hold
        (`head_dim ** -0.5` scaling, as the model's attention): the sum over the queries and the page's tokens
        (docs/spec.md, recall: `--page-score attention`). Reads those pages' keys (dequantised when int8), or
        takes them as `keys` (`page_keys(picked)`), in blocks of `block` queries so no [m, tokens] tensor is
        made; `held`: over the keys rounded to half precision (`as_held`), as a one-token step scores.
        query: [n_kv_heads, m, head_dim].
        Returns [n_kv_heads, pages] (or [n_kv_heads, k], in `picked`'s order) float32."""
        n_kv, size = self.n_kv_heads, self.page_size
        if picked is None:
            self.read_ahead()  # every page in order, until `release`
            slots = torch.arange(pages * size, device=query.device).expand(n_kv, -1)
            keys, scales = self.keys[:, : pages * size], None if not self.quantized else self.key_scales
            if self.quantized:
                keys = dequantize(keys, scales[:, : pages * size], torch.float32)
        else:
            slots = (picked.unsqueeze(-1) * size + self._page_offsets).flatten(1)  # [n_kv, k * size]
            if keys is None:
                keys = self.page_keys(picked)
        if held and keys.dtype != torch.float16:
            keys = as_held(keys)
        keys = keys.float().transpose(1, 2)  # [n_kv, head_dim, tokens]
        empty = (self.token_index.take(slots) == NOTHING).unsqueeze(1)  # [n_kv, 1, tokens]
        query = query.float() * self.head_dim**-0.5
        mass = torch.zeros(n_kv, slots.shape[1], device=query.device)
        # Fewer queries a block over a long archive (a question scores every page): its logits stay bounded.
        block = max(1, min(block, MASS_LOGITS // (n_kv * slots.shape[1])))
        for start in range(0, query.shape[1], block):
            logits = torch.bmm(query[:, start : start + block], keys).masked_fill_(empty, float("-inf"))
            mass += torch.softmax(logits, dim=-1).sum(dim=1)
        self.release()
        return mass.view(n_kv, -1, size).sum(dim=2) / query.shape[1]  # the mean over the queries

    def held_page_keys(self, picked: torch.Tensor) -> torch.Tensor:
        """`page_keys(picked)`, kept from one call to the next: an answer's steps score the same pages step
        after step (a page outside the carried ranking's best never gains on one inside it), so the keys are
        read again when the pages change, and otherwise only those of the pages written since; held in half
        precision (`as_held`), as the step scores them. picked: [n_kv_heads, k] ring pages.
        Returns [n_kv_heads, k * page_size, head_dim] float16."""
        held = self._held_keys
        if held is None or held[2] > self.tokens or not torch.equal(held[0], picked):
            keys = as_held(self.page_keys(picked))
        else:
            keys, since = held[1], held[2]
            if since < self.tokens:  # pages written since hold new keys (or another page, the ring wrapped)
                written = torch.arange(since // self.page_size, (self.tokens - 1) // self.page_size + 1)
                stale = torch.isin(picked, written.to(picked.device) % self.pages)
                heads, columns = stale.nonzero(as_tuple=True)
                if heads.numel():
                    pages = keys.view(self.n_kv_heads, picked.shape[1], self.page_size, self.head_dim)
                    pages[heads, columns] = as_held(
                        self._page_rows(picked[heads, columns] + heads * self.pages)
                    )
        self._held_keys = (picked, keys, self.tokens)
        return keys


def choosing_tokens(
    chunk: int, asks: int, limit: int, device: torch.device
) -> tuple[int, torch.Tensor, bool]:
    """Which of a chunk's `chunk` tokens choose what it recalls, and how many tokens their choice weighs: a
    question of `asks` >= 2 tokens ending the chunk (`H2OCache.asking`), all of its tokens, weighing `asks`;
    else at most `limit` (0: every one) of the chunk's tokens, evenly spaced and its last among them (every
    ceil(chunk / limit)-th, counted back from the last), weighing `chunk`. Returns (weight, the tokens' offsets
    in the chunk [picked], ascending, whether they are a question's)."""
    if 1 < asks <= chunk:
        return asks, torch.arange(chunk - asks, chunk, device=device), True
    if not limit or chunk <= limit:
        return chunk, torch.arange(chunk, device=device), False
    return chunk, torch.arange(chunk - 1, -1, -chunk // limit, device=device).flip(0), False
