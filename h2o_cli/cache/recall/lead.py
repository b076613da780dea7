"""`--recall-lead`: after a question, every recalling head recalls the pages one head ranks best (docs/spec.md,
recall: lead head).

Past the model's window each head's own page choice mostly brings back digits and footnote marks, and the
answer copies them; one retrieval head's ranking, given to every head, finds the fact (docs/results.md).
`LeadRanking` is that ranking, shared by every `RecallLayer` of a cache: the lead layer updates its carried
page scores at its own call, and every layer reads them when it chooses.
"""

from __future__ import annotations

import torch

from h2o_cli.cache.recall.archive import NOTHING, PageArchive, order_key


class LeadRanking:
    """The lead head's page ranking: KV head `head` of the layer whose archive is `archive` ranks ring pages
    by its carried attention scores (`PageArchive.carried`), each page followed by the `follow` pages after
    it, and every recalling head takes its candidates of the best `count` = `pages` · (1 + `follow`) of them,
    or of every page whose score is an outlier (`outliers`, `--lead-outliers`) where there are more (`pages`
    None, `--lead-pages fill`: of as many as fill its recall slots); `layer` is that layer's number.

    A layer below the lead reads the ranking of the lead layer's latest call (the question's first read, or
    the answer step before); `ready` is False from a new question until the lead layer has read it, and a
    layer recalls nothing while it is."""

    def __init__(
        self,
        archive: PageArchive,
        head: int,
        pages: int | None,
        layer: int = 0,
        follow: int = 0,
        outliers: float = 0.0,
    ) -> None:
        self.archive, self.head, self.pages, self.layer, self.follow = archive, head, pages, layer, follow
        self.outliers = outliers
        self.outlying = 0  # the latest question's outlier pages (`asked`)
        self.ready = False
        self._ranked: tuple[tuple[int, int, int], torch.Tensor] | None = None  # (the lead's state, `ranked`)
        self._key: tuple[tuple, torch.Tensor] | None = None  # ((the lead's state, used, device), `key`)

    @property
    def count(self) -> int | None:
        """Pages every head takes its candidates from after a question: `pages` · (1 + `follow`), or the
        question's outlier pages where they are more (`outliers` > 0, `asked`); None (`fill`) for as many as
        fill its recall slots."""
        if self.pages is None:
            return None
        return max(self.pages * (1 + self.follow), self.outlying)

    def asked(self, used: int) -> None:
        """The lead layer has read a question (its carried scores hold the question's scores of every page of
        the first `used` ring pages): the ranking is `ready`, and with `outliers` > 0, `outlying` counts the
        ranked pages (as `key` scores and ranks them) whose score is at least `outliers` times the median
        ranked page's (the lower middle one of an even count) for the question and its answer. Counted here,
        not at each answer step: a step carries scores on only for the pages it scores, and the bulk it
        leaves fades, which would make every page an outlier."""
        self.ready = True
        self.outlying = 0
        if self.outliers:
            score, page_start = self._scores(used)
            scores = score[(page_start != NOTHING) & (score > 0)]
            if len(scores):
                self.outlying = int((scores >= self.outliers * scores.median()).sum())

    def taken(self, ranked: torch.Tensor, fill: bool) -> int:
        """How many pages of `ranked` (best first) a C choice may take its candidates from: `count`, or all of
        them to fill the recall slots (`fill`: text and the steps that continue it; or `--lead-pages fill`)."""
        return len(ranked) if fill or self.count is None else self.count

    def key(self, used: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The ranking as one int64 for each of the first `used` ring pages (`order_key`: larger first; pages
        out of it last).

        A page's score is the larger of its carried score and 0.999^k times that of the page k ≤ `follow`
        pages before it in the text (the ring page before it, holding the tokens just before its own), so a
        page follows the page before it, and the tokens a page boundary cut from a line come with it. A page
        is ranked if its first slot is written and that score is positive. Computed once per state of the
        lead's archive, so the layers that read one ranking share it."""
        lead = self.archive
        state = (lead.epoch, lead.tokens, lead.scored, used, str(device))
        if self._key is not None and self._key[0] == state:
            return self._key[1]
        score, page_start = self._scores(used, device)
        key = order_key(score, page_start, (page_start != NOTHING) & (score > 0))
        self._key = (state, key)
        return key

    def _scores(self, used: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """`key`'s page scores and each page's first token index (NOTHING: not written) of the first `used`
        ring pages: [used] float32, [used] int64."""
        lead = self.archive
        page_start = lead.token_index.view(lead.pages, lead.page_size)[:used, 0].to(device)
        own = lead.carried[self.head, :used].to(device)
        score = own
        for back in range(1, min(self.follow, used - 1) + 1):
            earlier = page_start.roll(back)  # ring page j - back: the text's page `back` before j if it joins
            joined = (earlier != NOTHING) & (earlier + back * lead.page_size == page_start)
            score = torch.where(joined, torch.maximum(score, own.roll(back) * 0.999**back), score)
        return score, page_start

    def ranked(self) -> torch.Tensor:
        """The lead's ring pages `key` ranks, best first (the larger score; ties: the older page): [n] int64,
        empty while the ranking is not `ready`. Sorted once per state of the lead's archive (tokens written,
        scores carried, epoch), so one sort serves every layer: the C step's `RecallCStep.lead_choose` takes
        the first of them that hold a candidate, as `choose` does."""
        lead = self.archive
        if not self.ready:
            return torch.empty(0, dtype=torch.int64)
        state = (lead.epoch, lead.tokens, lead.scored)
        if self._ranked is None or self._ranked[0] != state:
            values, pages = torch.sort(self.key(lead.span // lead.page_size), descending=True)
            self._ranked = (state, pages[values > torch.iinfo(torch.int64).min].contiguous())
        return self._ranked[1]

    def choose(
        self, archive: PageArchive, resident: torch.Tensor, before: int, slots: int, fill: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pass 1 of a recall step under the lead: up to `slots` archived tokens per KV head of one layer.

        archive: the layer's own (its ring holds the same tokens in the same slots as the lead's); resident:
        [n_kv_heads, n] token indices of S (-1 = empty); `before`: the call's first token. A candidate is an
        archived token older than `before` not in the head's S. The lead's best `pages` ring pages (larger
        carried score first, ties the older page) among those with a positive score and a candidate in some
        head, or with `fill` (`--lead-text`: text and the steps that continue it) as many of them as it takes
        to fill every head's slots; each head's first `slots` candidates of them in that order, oldest first
        inside a page (`pages` None: always as with `fill`). With `fill` and room for every candidate, every
        head recalls all of its candidates.
        Returns archive slots [n_kv_heads, slots] and which of them hold a chosen token, as `PageArchive.choose`
        (all invalid while the ranking is not `ready`)."""
        n_kv, size, device = archive.n_kv_heads, archive.page_size, resident.device
        fill = fill or self.count is None
        want = -(-slots // size) if fill else self.count
        chosen = torch.zeros(n_kv, slots, dtype=torch.int64, device=device)
        valid = torch.zeros(n_kv, slots, dtype=torch.bool, device=device)
        used = archive.span // size
        if not self.ready or not used or not slots:
            return chosen, valid
        key = self.key(used, device)
        held = resident.sort(dim=1).values
        offsets = torch.arange(size, device=device)
        # The best pages rarely lack a candidate (the recent window, held by every head): look at a few more
        # than `want`, and at twice as many until enough have one (with `fill`: until every head's slots
        # are full) or every page is looked at.
        look = min(used, 2 * want + 16)
        while True:
            ranked = torch.topk(key, look, sorted=True)
            pages = ranked.indices[ranked.values > torch.iinfo(torch.int64).min]
            in_order = (pages.unsqueeze(1) * size + offsets).flatten()  # [pages * size] ring slots
            tokens = archive.token_index[in_order].to(device)
            place = torch.searchsorted(held, tokens.expand(n_kv, -1).contiguous())
            in_s = held.gather(1, place.clamp_max_(held.shape[1] - 1)) == tokens
            usable = (tokens >= 0) & (tokens < before) & ~in_s  # [n_kv, pages * size]
            per_page = usable.view(n_kv, -1, size).sum(dim=2)  # [n_kv, pages]: each head's candidates
            with_candidate = per_page.any(dim=0)  # [pages]
            if fill:  # the first page by which every head has `slots` candidates, if any
                enough = int((per_page.cumsum(dim=1).min(dim=0).values < slots).sum())
                keep = with_candidate[: enough + 1].nonzero().flatten()
                if enough < len(pages) or look == used:
                    break
            else:
                keep = with_candidate.nonzero().flatten()[:want]
                if len(keep) == want or look == used:
                    break
            look = min(used, 2 * look)
        columns = (keep.unsqueeze(1) * size + offsets).flatten()
        in_order, usable = in_order[columns], usable[:, columns]
        # Each head's usable slots first, in reading order (a stable sort of "not usable").
        order = torch.sort((~usable).to(torch.int8), dim=1, stable=True).indices[:, :slots]
        count = order.shape[1]
        chosen[:, :count] = in_order[order]
        valid[:, :count] = usable.gather(1, order)
        return chosen, valid
